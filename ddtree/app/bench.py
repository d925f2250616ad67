"""``ddtree bench``: decode throughput of ``ar``, ``dflash`` and ``ddtree`` on the same prompts.

:func:`run_bench` loads the models once, runs warm-up generations (not counted), then every
prompt with every method (``ddtree`` once per budget; ``ar`` always first, so every run has a
``speedup_vs_ar`` measured in the same process on the same prompts), prints a table and writes
a ``ddtree.stats/1`` document (``docs/stats-schema.md``). With ``tp > 1`` the warm-up and timed
generations run as one job list on one set of tensor-parallel
workers (``ddtree.parallel.tp.run_generate_tp_jobs``: the shards load once). Ctrl-C keeps every finished
run, and the finished prompts of the run in progress, in the table and the document.

The model set-up it shares with ``ddtree generate`` is in ``ddtree.app.setup``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Callable

from loguru import logger

from ddtree.app import setup as S
from ddtree.app.options import BY_NAME
from ddtree.app.prompts import load_prompts
from ddtree.errors import DDTreeError
from ddtree.options import DEFAULT_BUDGET
from ddtree.stats import aggregate, is_auto, make_run_document, tokens_per_forward

# the shared set-up, under the names older callers import from here
from ddtree.app.setup import (  # noqa: F401
    AUTO_BUDGET_ROOM, LENGTH_SLACK, ModelSpec, check_length, encode_prompt, fit_prompt, inspect_models,
    load_models,
    model_metadata, parse_budget, parse_budgets, parse_method, parse_methods, positive_int, tree_room,
)

def _label(method: str, budget) -> str:
    return f"ddtree {budget}" if method == "ddtree" else method


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def format_table(doc: dict) -> str:
    """One row per run. `tok/fwd`: committed tokens per target forward over all rounds (plain
    steps included), the figure to compare methods by; `accept len`: the mean acceptance length
    over the drafted rounds only (vLLM's 1 + accepted / drafts)."""
    head = ["method", "budget", "decode tok/s", "e2e tok/s", "TTFT ms", "tok/fwd", "accept len (drafted)", "speedup", "exact"]
    rows = []
    for run in doc["runs"]:
        a = run["aggregate"]
        sp = run.get("speedup_vs_ar")
        ex = run.get("exact_match_vs_ar")
        budget = "auto" if is_auto(run) else (str(run["budget"]) if run.get("budget") is not None else "-")
        rows.append([
            run["method"] + ("*" if run.get("interrupted") else ""),
            budget,
            f"{a['decode_tok_s']:.1f}",
            f"{a['e2e_tok_s']:.1f}",
            f"{a['mean_ttft_s'] * 1e3:.1f}",
            _fmt(tokens_per_forward(a), ".2f"),
            "-" if run["method"] == "ar" else f"{a['mean_acceptance_length']:.2f}",
            "-" if sp is None else f"{sp:.2f}x",
            "-" if ex is None else ("yes" if ex else "NO"),
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    notes = []
    for run in doc["runs"]:  # --budget auto: which budgets it chose, and how often (0: a plain step)
        hist = run["aggregate"].get("tree_size", {}).get("histogram") or {}
        if is_auto(run) and hist:
            n = sum(hist.values())
            D = (run["aggregate"].get("block_size") or 0) - 1  # the chain arm's rounds: a path of D nodes
            chains = sum(1 for p in run.get("prompts", []) for size, depth in
                         zip(p["rounds"]["tree_size"], p["rounds"]["tree_depth"]) if size == depth == D > 0)
            notes.append("ddtree auto chose " + ", ".join(f"{b} ({100 * c / n:.0f}%)" for b, c in
                                                          sorted(hist.items(), key=lambda kv: int(kv[0])))
                         + (f"; the chain in {100 * chains / n:.0f}%" if chains else ""))
    for run in doc["runs"]:
        if run.get("interrupted"):
            notes.append(f"* {_label(run['method'], 'auto' if is_auto(run) else run.get('budget'))}: interrupted, "
                         f"{_count(run['aggregate']['num_prompts'], 'prompt')} finished")
    return "\n".join([line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in rows] + notes)


def _count(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def divergence(dec, prompt_ids: list[int], ar: list[int], other: list[int]) -> dict:
    """Where a greedy output first leaves ar's, and how close the target's two candidates were there:
    the logits of ar's token and of the other token after the common prefix (one eager prefill in
    the run's dtype), with the spacing of representable values at that magnitude (one "ulp").
    Without a local decoder (tensor parallel) only the index."""
    i = next((j for j, (a, b) in enumerate(zip(ar, other)) if a != b), min(len(ar), len(other)))
    out = {"index": i, "ar_token": ar[i] if i < len(ar) else None, "other_token": other[i] if i < len(other) else None}
    if dec is None or out["ar_token"] is None or out["other_token"] is None:  # one stopped earlier: no logit question
        return {**out, "logit_gap": None, "logit_ulp": None}
    import torch

    tgt = dec.target
    tgt.reset()
    logits, _ = tgt.prefill(torch.tensor(prompt_ids + ar[:i], device=tgt.device), want_taps=False)
    a, b = float(logits[out["ar_token"]]), float(logits[out["other_token"]])
    ulp = float(torch.finfo(tgt.dtype).eps) * 2 ** math.floor(math.log2(max(abs(a), 1e-30)))
    return {**out, "logit_gap": a - b, "logit_ulp": ulp}


def warmup_jobs(plan: list, encoded: list, warmup: int, n_new: int) -> list[tuple]:
    """(method, budget, prompt, ids, max_new_tokens) of the uncounted generations.

    The shortest and the longest prompt at full length: every context bucket the timed runs reach
    gets its graphs captured (and compiled) here, not in the first timed prompt. Prefill runs
    eagerly, outside the graphs: each method also prefills every distinct prompt length once.
    Without that, on the H200 the first method timed (ar) had ~150 ms TTFT on half the codepair
    prompts (15 ms on the rest), which skewed its TTFT and e2e figures.

    --budget auto's graph keys depend on what it chooses (the budgets, the builds, the prefix
    copies, its probes), so its first warm-up round goes over every prompt: otherwise its timed
    prompts capture graphs the fixed methods captured in their warm-up (19 captures in 464 ms of
    timed decoding on the H200 with the distilled codepair drafter in float32).
    Where rounds are graphed, settle_auto then repeats that pass until one captures nothing new;
    what auto learnt meanwhile is dropped before the timed prompts (auto.forget). Last,
    capture_ahead captures whatever piece the timed prompts could still meet."""
    if not warmup:
        return []
    by_len = sorted(encoded, key=lambda e: len(e[1]))
    warm = [by_len[0], by_len[-1]] if len(by_len) > 1 else by_len
    jobs = []
    for method, budget in plan:
        for i in range(warmup):
            first = list(encoded) if budget == "auto" else warm
            for p, ids in first if i == 0 else warm[:1]:
                jobs.append((method, budget, p, ids, n_new))
    for method, budget in {m: (m, b) for m, b in plan}.values():
        for p, ids in {len(ids): (p, ids) for p, ids in encoded}.values():
            jobs.append((method, budget, p, ids, 1))
    return jobs


def capture_ahead(dec, plan: list, encoded: list, sampling, n_new: int, top1_first: bool = False) -> int:
    """The warm-up's last part: every graph piece the timed prompts can run, captured directly
    (ddtree.decode.auto.capture_ahead after one prefill per run and distinct prompt length:
    context buckets follow the length alone). Generations alone miss (verify, drafter context)
    pairs at a bucket's edge that last one token, and --budget auto's choices. -> pieces captured."""
    from ddtree.decode import auto as auto_budget

    n = 0
    if not getattr(dec, "use_graphs", False):
        return n
    one_per_length = {len(ids): ids for _, ids in encoded}.values()
    for method, budget in plan:
        for ids in one_per_length:
            job = dec.job(method, budget if budget is not None else DEFAULT_BUDGET, sampling, n_new, 0, top1_first, len(ids))
            dec.prefill(ids, job)
            n += auto_budget.capture_ahead(dec, job, len(ids))
    auto_budget.forget(dec)  # (auto's calibrations: the timed prompts start from what a fresh process knows)
    return n


AUTO_SETTLE_PASSES = 3  # most extra warm-up passes of --budget auto over every prompt


def settle_auto(dec, gen, plan: list, encoded: list, n_new: int, passes: int = AUTO_SETTLE_PASSES) -> int:
    """Warm --budget auto up until a pass over every prompt captures or compiles nothing new.

    Its choices follow round times, and round times jitter: a pass from the same forgotten start
    can choose another build and meet a graph key the pass before did not (on the H200, one
    drafter's timed prompts captured 8 pieces, one of them 2.1 s for a new drafter top-k, after a
    first warm-up pass over every prompt). Each pass starts from what a fresh process knows
    (auto.forget), as the timed prompts do; at most `passes` of them, after warmup_jobs' own.
    gen(method, budget, ids, prompt_id, n_new) runs one generation. -> the passes run."""
    from ddtree.decode.auto import forget

    graphs = getattr(dec, "graphs", None)
    runs = [(m, b) for m, b in plan if b == "auto"]
    done = 0
    if runs and graphs is not None and getattr(dec, "use_graphs", False):
        for method, budget in runs:
            for _ in range(passes):
                forget(dec)
                before = graphs.new_keys
                for p, ids in encoded:
                    gen(method, budget, ids, p.id, n_new)
                done += 1
                if graphs.new_keys == before:
                    break
    forget(dec)  # the graphs stay; what auto learnt on these prompts goes
    return done


def run_bench(
    target: str | None,
    drafter: str | None = None,
    prompts: str = "code",
    methods: str | list = "ar,dflash,ddtree",
    budgets: str | list | int = "8,15,31,63",
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = 0,
    dtype: str | None = None,
    devices: str | list | None = "auto",
    max_length: int | None = None,
    raw: bool = False,
    thinking: bool = True,
    limit: int | None = None,
    warmup: int = 1,
    interleave: bool = False,
    out: str | Path | None = "results/bench.json",
    top1_first: bool = False,
    tp: int = 1,
    progress: bool = True,
    print_table: bool = True,
    stage: Callable[[str], None] | None = None,
    prompt_tokens: int | None = None,
    given: frozenset = frozenset(),
) -> dict:
    """Benchmark the methods on a prompt set; returns the (validated) result document and writes it
    to ``out`` (unless ``out`` is None). Problems raise one-line :class:`DDTreeError`; Ctrl-C
    writes what finished, then re-raises. ``given``: the options named on the command line (an
    option that has no effect in the combination given gets one warning line)."""
    stage = stage or (lambda s: None)
    opts = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_new_tokens=max_new_tokens,
                raw=raw, thinking=thinking, tp=tp, top1_first=top1_first, prompt_tokens=prompt_tokens)
    # ---- every check that needs no torch
    meths = parse_methods(methods)
    buds = parse_budgets(budgets) if "ddtree" in meths else []
    max_new_tokens = positive_int(max_new_tokens, "--max-new-tokens")
    tp = _check_bench(opts, dtype, devices, max_length, warmup, "auto" in buds)
    out_path = S.check_output(out, "--out") if out is not None else None
    need_drafter = any(m != "ar" for m in meths)
    S.precheck_model(target, "target")
    if need_drafter:
        S.precheck_model(drafter, "drafter")
    plist = load_prompts(str(prompts), limit)
    _warn_bench(given, meths, temperature)

    # ---- configs, tokenizer, prompts
    spec = inspect_models(target, drafter, devices, dtype, need_drafter)
    S.warn_template(spec, dict(raw=raw, thinking=thinking), given)
    if prompt_tokens is None:
        encoded = [(p, encode_prompt(spec, p, raw, thinking)) for p in plist]
    else:
        encoded = [(p, fit_prompt(spec, p, raw, thinking, prompt_tokens)) for p in plist]
    longest = max(len(ids) for _, ids in encoded)
    plan = [(m, b) for m in meths for b in (buds if m == "ddtree" else [None])]
    room = max(tree_room(m, b, spec.block_size) for m, b in plan)
    max_len = check_length(longest, max_new_tokens, room, max_length, what="the longest prompt")
    sp = S.sampling_params(opts)
    logger.info(
        f"bench: {len(encoded)} prompts x {len(plan)} runs ({', '.join(_label(m, b) for m, b in plan)}), "
        f"{max_new_tokens} new tokens, {'greedy' if sp.greedy else f'temperature {sp.temperature}'}"
        + (f", tensor parallel over {tp} ranks" if tp > 1 else "")
    )
    bench = _Bench(spec, encoded, plan, sp, max_new_tokens, seed, top1_first, progress, stage, bool(interleave))
    try:
        if tp > 1:
            bench.run_tp(S.tp_args(spec, opts, max_len, tp), warmup)
        else:
            bench.run_local(max_len, need_drafter, warmup, room)
    except KeyboardInterrupt:
        bench.keep_partial()
        if bench.results:
            doc = bench.document(opts, prompts, meths, buds, warmup, limit, max_len, interrupted=True)
            if out_path is not None:
                S.write_document(doc, out_path, "--out")
            if print_table:
                print(format_table(doc), flush=True)
        elif out_path is not None:
            logger.warning("interrupted: under --tp no record comes back before the last generation, --out not written"
                           if tp > 1 else "no prompt finished before the interrupt: --out not written")
        raise
    doc = bench.document(opts, prompts, meths, buds, warmup, limit, max_len)
    if out_path is not None:
        S.write_document(doc, out_path, "--out")
    if print_table:
        print(format_table(doc), flush=True)
    return doc


def _check_bench(opts: dict, dtype, devices, max_length, warmup, auto: bool) -> int:
    """bench's value checks that need no torch (one error line each), in the order of the
    options; opts: run_bench's. -> --tp as an int."""
    if max_length is not None:
        positive_int(max_length, "--max-length")
    if opts["prompt_tokens"] is not None:
        positive_int(opts["prompt_tokens"], "--prompt-tokens")
    tp = positive_int(opts["tp"], "--tp")
    if warmup is None or isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise DDTreeError(f"--warmup {warmup!r} must be 0 or a positive integer")
    S.check_sampling(float(opts["temperature"]), float(opts["top_p"]), int(opts["top_k"]))
    S.check_dtype(dtype)
    S.check_devices(devices)
    if tp > 1 and auto:
        raise DDTreeError("--budgets auto is not supported with --tp yet: pass numbers, e.g. --budgets 16,32")
    return tp


def _warn_bench(given: frozenset, meths: list, temperature) -> None:
    """One warning line per option named on the command line that has no effect here."""
    if "budgets" in given and "ddtree" not in meths:
        S.warn_ignored("--budgets", "--methods has no ddtree")
    if "top1_first" in given and "ddtree" not in meths:
        S.warn_ignored("--top1-first", "it shapes ddtree's trees, and --methods has no ddtree")
    if float(temperature) == 0:
        for name in ("top_p", "top_k", "seed"):
            if name in given:
                S.warn_ignored(BY_NAME[name].flag, "--temperature 0 is greedy")


class _Bench:
    """The runs of one bench: finished ones in `results`, those in progress in `partial`."""

    def __init__(self, spec, encoded, plan, sp, max_new_tokens, seed, top1_first, progress, stage, interleave=False):
        self.spec, self.encoded, self.plan, self.sp = spec, encoded, plan, sp
        self.max_new, self.seed, self.top1_first, self.progress, self.stage = max_new_tokens, seed, top1_first, progress, stage
        self.interleave = interleave
        self.results: list[dict] = []
        self.partial: dict = {}  # (method, budget) -> records of each run in progress
        self.dec = None
        self.paths: dict = {}
        self.ar_tokens: dict[str, list[int]] = {}

    # ---------------------------------------------------------------- one process
    def run_local(self, max_len: int, need_drafter: bool, warmup: int, room: int | None = None) -> None:
        from tqdm import tqdm

        from ddtree.decode.startup import heap_frozen

        loaded = load_models(self.spec, max_len, need_drafter, self.stage, room=room,
                             auto=any(b == "auto" for _, b in self.plan))
        S.flush_notices()  # after the last thing that can fail on bad input
        self.dec = loaded.decoder
        self.paths = S.decoder_paths(self.dec)
        decode_text = S.decode_text_fn(self.spec.tokenizer)

        def gen(method, budget, ids, pid, n_new):
            return self.dec.generate(
                ids, method=method, budget=budget if budget is not None else DEFAULT_BUDGET, sampling=self.sp, max_new_tokens=n_new,
                stop_ids=self.spec.stop_ids, seed=self.seed, top1_first=self.top1_first, prompt_id=pid,
                decode_text=decode_text,
            )

        jobs = warmup_jobs(self.plan, self.encoded, warmup, self.max_new)
        if jobs:
            self.stage("warming up")
            for method, budget, p, ids, n_new in jobs:
                gen(method, budget, ids, p.id, n_new)
            settled = settle_auto(self.dec, gen, self.plan, self.encoded, self.max_new)
            ahead = capture_ahead(self.dec, self.plan, self.encoded, self.sp, self.max_new, self.top1_first)
            logger.debug(f"warm-up done ({warmup} round(s) over the shortest and longest prompts per run, every "
                         f"prompt for auto and {settled} more pass(es) until one captured nothing, then one prefill "
                         f"per prompt length and method; {ahead} graph pieces the timed prompts can reach captured directly)")
        # one group of runs at a time: each run over every prompt, or (--interleave) every run together, prompt by
        # prompt; on a frozen heap, so no full collection of the compile's objects lands inside a timed prompt
        with heap_frozen():
            for group in [self.plan] if self.interleave else [[run] for run in self.plan]:
                label = "every run, prompt by prompt" if self.interleave else _label(*group[0])
                self.stage(f"running {label}")
                self.partial = {run: [] for run in group}
                bar = tqdm(self.encoded, desc=f"{'all' if self.interleave else label:>10}", unit="prompt", file=sys.stderr,
                           disable=not self.progress, leave=True, dynamic_ncols=True)
                for p, ids in bar:
                    for (method, budget), records in self.partial.items():
                        records.append(gen(method, budget, ids, p.id, self.max_new))
                    if self.progress and not self.interleave:
                        a = aggregate(records)
                        bar.set_postfix_str(f"{a['decode_tok_s']:.1f} tok/s, {a['tokens_per_target_forward']:.2f} tok/fwd")
                bar.close()
                finished, self.partial = self.partial, {}
                for (method, budget), records in finished.items():
                    self.finish_run(method, budget, records)

    # ---------------------------------------------------------------- tensor parallel
    def run_tp(self, args: dict, warmup: int) -> None:
        """Warm-up and timed generations as one job list for one set of tensor-parallel workers:
        the shards load once, and rank 0's records come back with their timings."""
        tp = S.tp_module()
        S.flush_notices()
        warm = warmup_jobs(self.plan, self.encoded, warmup, self.max_new)
        timed = ([(m, b, p, ids, self.max_new) for p, ids in self.encoded for m, b in self.plan] if self.interleave
                 else [(m, b, p, ids, self.max_new) for m, b in self.plan for p, ids in self.encoded])
        jobs = [dict(method=m, budget=b if b is not None else DEFAULT_BUDGET, prompt_ids=ids, prompt_id=p.id, max_new_tokens=n)
                for m, b, p, ids, n in warm + timed]
        self.stage(f"running {len(jobs)} generations under tensor parallelism")
        logger.info(f"tensor parallel: {len(warm)} warm-up and {len(timed)} timed generations on one set of workers")
        records = tp.run_generate_tp_jobs(args, jobs, decode_text=S.decode_text_fn(self.spec.tokenizer))[len(warm):]
        n, k = len(self.encoded), len(self.plan)
        for i, (method, budget) in enumerate(self.plan):
            self.finish_run(method, budget, list(records[i::k] if self.interleave else records[i * n:(i + 1) * n]))

    # ---------------------------------------------------------------- bookkeeping
    def keep_partial(self) -> None:
        for (method, budget), records in self.partial.items():
            if records:
                self.finish_run(method, budget, list(records), interrupted=True)
        self.partial = {}

    def finish_run(self, method: str, budget, records: list, interrupted: bool = False) -> None:
        block = self.spec.block_size if method != "ar" else None
        if method == "ar":
            self.ar_tokens = {r.prompt_id: list(r.token_ids) for r in records}
        mismatched: list[str] = []
        diverged: list[dict] = []
        exact = None
        if self.sp.greedy and method != "ar":
            ids_of = {p.id: ids for p, ids in self.encoded}
            mismatched = [r.prompt_id for r in records if list(r.token_ids) != self.ar_tokens.get(r.prompt_id)]
            exact = not mismatched
            if mismatched:
                diverged = [{"prompt_id": r.prompt_id, **divergence(self.dec, ids_of[r.prompt_id], self.ar_tokens[r.prompt_id],
                                                                     list(r.token_ids))}
                            for r in records if r.prompt_id in mismatched]
                gaps = ", ".join(f"{d['prompt_id']}@{d['index']}: logit gap {d['logit_gap']:.3g} (ulp {d['logit_ulp']:.3g})"
                                 if d["logit_gap"] is not None else f"{d['prompt_id']}@{d['index']}"
                                 for d in diverged[:5])
                logger.warning(
                    f"EXACTNESS: {_label(method, budget)} differs from ar's greedy output on {len(mismatched)} of "
                    f"{len(records)} prompts ({gaps}); in float32 this is a bug, in bf16/fp16 a gap of a few "
                    "logit ulps is a near-tie that the tree's and the step's different rounding broke apart"
                )
        if captures := sum(r.captures for r in records):  # compile and capture time inside the timed decode
            logger.warning(f"{_label(method, budget)}: {captures} graph piece(s) captured or compiled inside timed "
                           "prompts; their time is in the run's decode time (raise --warmup)")
        run_budget = budget
        if budget == "auto":  # the decoder picked per round: the run has no one budget
            run_budget = None
        self.results.append(dict(method=method, budget=run_budget if method == "ddtree" else None,
                                 budget_setting=budget if method == "ddtree" else None, records=records,
                                 block_size=block, exact=exact, mismatched=mismatched, diverged=diverged,
                                 interrupted=interrupted))

    def document(self, opts, prompts, meths, buds, warmup, limit, max_len, interrupted: bool = False) -> dict:
        rates = [aggregate(r["records"])["decode_tok_s"] for r in self.results]
        ar_rate = next((x for r, x in zip(self.results, rates) if r["method"] == "ar"), None) or None
        meta = model_metadata(self.spec, opts, prompts=str(prompts), methods=meths, budgets=buds, warmup=warmup,
                              limit=limit, max_length=max_len, top1_first=self.top1_first, interrupted=interrupted,
                              prompt_tokens=opts.get("prompt_tokens"), interleave=self.interleave,
                              **self.paths)
        keys = ("method", "budget", "budget_setting", "records", "block_size", "interrupted")
        doc = make_run_document(meta, [dict({k: r[k] for k in keys}, speedup_vs_ar=x / ar_rate if ar_rate else None)
                                       for r, x in zip(self.results, rates)])
        for run, r in zip(doc["runs"], self.results):
            run["exact_match_vs_ar"] = r["exact"]
            run["mismatched_prompts"] = r["mismatched"]
            run["first_divergences"] = r["diverged"]
            if r["exact"] is not None:
                bad = set(r["mismatched"])
                for pd in run["prompts"]:
                    pd["exact_match_vs_ar"] = pd["prompt_id"] not in bad
        return doc


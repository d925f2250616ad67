"""``ddtree bench``: decode throughput of ``ar``, ``dflash`` and ``ddtree`` on the same prompts.

:func:`run_bench` loads the models once, runs warm-up generations (not counted), then every
prompt with every method (``ddtree`` once per budget; ``ar`` always first, so every run has a
``speedup_vs_ar`` measured in the same process on the same prompts), prints a table and writes
a ``ddtree.stats/1`` document (``docs/stats-schema.md``).

The first half of this module is the model setup that ``ddtree generate`` shares: option
parsing, reading the configs before any weight is loaded (so bad input fails fast, in one
line), tokenizer, stop tokens, and loading the target (+ drafter).
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from loguru import logger

from ddtree.model.checkpoint import load_drafter, load_target, parse_devices, parse_dtype, resolve_model_dir
from ddtree.model.config import DrafterConfig, TargetConfig
from ddtree.errors import DDTreeError
from ddtree.app.prompts import Prompt, load_prompts, render_prompt
from ddtree.decode.sampling import SamplingParams
from ddtree.stats import GenerationRecord, aggregate, config_hash, make_run_document, run_metadata, validate_document, write_json

METHODS = ("ar", "dflash", "ddtree")
#: room kept past prompt + new tokens when --max-length is not given (plus the tree itself)
LENGTH_SLACK = 256
#: tree size assumed for the length budget when --budget is "auto"
AUTO_BUDGET_ROOM = 256

# ============================================================================================
# option parsing
# ============================================================================================


def parse_method(method: str | None, have_drafter: bool) -> str:
    if method is None:
        return "ddtree" if have_drafter else "ar"
    m = str(method).strip().lower()
    if m not in METHODS:
        raise DDTreeError(f"unknown --method {method!r}: use one of {', '.join(METHODS)}")
    return m


def parse_methods(spec: str | list | None) -> list[str]:
    """'ar,dflash,ddtree' -> ['ar', 'dflash', 'ddtree'] (ar first, added when missing; no duplicates)."""
    items = spec if isinstance(spec, list) else str(spec or "").split(",")
    out: list[str] = []
    for raw in items:
        m = str(raw).strip().lower()
        if not m:
            continue
        if m not in METHODS:
            raise DDTreeError(f"unknown method {raw!r} in --methods: use a comma-separated list of {', '.join(METHODS)}")
        if m not in out:
            out.append(m)
    if not out:
        raise DDTreeError("--methods is empty: pass e.g. --methods ar,dflash,ddtree")
    if "ar" in out:
        out.remove("ar")
    return ["ar"] + out


def parse_budget(value: Any, flag: str = "--budget") -> int | str:
    """An integer >= 1, or the string 'auto' (passed through to the decoder)."""
    if isinstance(value, bool):
        raise DDTreeError(f"{flag} {value!r} is not a number: pass a positive integer or auto")
    if isinstance(value, int):
        n = value
    else:
        s = str(value).strip().lower()
        if s == "auto":
            return "auto"
        try:
            n = int(s)
        except ValueError:
            raise DDTreeError(f"{flag} {value!r} is not a number: pass a positive integer (e.g. 32) or auto") from None
    if n < 1:
        raise DDTreeError(f"{flag} {n} must be at least 1: pass the number of draft nodes per round, e.g. 32")
    return n


def parse_budgets(spec: Any) -> list[int | str]:
    items = [spec] if isinstance(spec, int) else (spec if isinstance(spec, list) else str(spec or "").split(","))
    out: list[int | str] = []
    for raw in items:
        if isinstance(raw, str) and not raw.strip():
            continue
        b = parse_budget(raw, "--budgets entry")
        if b not in out:
            out.append(b)
    if not out:
        raise DDTreeError("--budgets is empty: pass e.g. --budgets 8,16,32,64")
    return out


def parse_device_list(devices: Any) -> list[torch.device]:
    devs = parse_devices(devices)
    for d in devs:
        if d.type not in ("cpu", "cuda"):
            raise DDTreeError(f"unsupported device {str(d)!r} in --devices: use cpu or cuda:N (e.g. cuda:0,cuda:1)")
    if len({d.type for d in devs}) > 1:  # repeats are stages on one device (cpu,cpu; cuda:0,cuda:0)
        raise DDTreeError("--devices mixes cpu with other devices: pass cpu alone, or cuda devices only")
    return devs


def resolve_dtype(dtype: Any, devices: list[torch.device]) -> torch.dtype:
    """--dtype, or bfloat16 on cuda / float32 on cpu."""
    if dtype is None or str(dtype).strip().lower() in ("", "auto"):
        return torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    return parse_dtype(str(dtype).strip().lower())


def positive_int(value: Any, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DDTreeError(f"{flag} {value!r} must be a positive integer")
    return value


def sampling_params(opts: dict) -> SamplingParams:
    return SamplingParams(temperature=float(opts["temperature"]), top_p=float(opts["top_p"]), top_k=int(opts["top_k"]))


def tree_room(method: str, budget: int | str, block_size: int | None) -> int:
    """Most tree nodes one round verifies (root included)."""
    if method == "ar":
        return 1
    if method == "dflash":
        return block_size or 16
    return AUTO_BUDGET_ROOM + 1 if budget == "auto" else int(budget) + 1


# ============================================================================================
# models: inspect (configs only), then load
# ============================================================================================


@dataclass
class ModelSpec:
    """What the configs say, read before any weight is loaded."""

    target_ref: str
    target_dir: Path
    target_cfg: TargetConfig
    drafter_ref: str | None = None
    drafter_dir: Path | None = None
    drafter_cfg: DrafterConfig | None = None
    devices: list[torch.device] = field(default_factory=list)
    dtype: torch.dtype = torch.float32
    tokenizer: Any = None
    stop_ids: frozenset = frozenset()

    @property
    def block_size(self) -> int | None:
        return self.drafter_cfg.block_size if self.drafter_cfg is not None else None


@dataclass
class Loaded:
    spec: ModelSpec
    decoder: Any  # ddtree.decode.decoder.Decoder
    max_len: int


def load_tokenizer(model_dir: Path):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # missing tokenizer files, unknown tokenizer class, ...
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise DDTreeError(
            f"cannot load the tokenizer from {model_dir} ({type(e).__name__}: {first}): "
            "the target directory needs the model's tokenizer files (tokenizer.json, tokenizer_config.json)"
        ) from None


def stop_token_ids(model_dir: Path, tokenizer: Any, cfg: TargetConfig) -> frozenset:
    """generation_config.json eos_token_id (int or list) | tokenizer.eos_token_id | config eos ids."""
    ids: set[int] = set()

    def add(v):
        if v is None:
            return
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(t, int) and not isinstance(t, bool):
                ids.add(t)

    gc = model_dir / "generation_config.json"
    if gc.is_file():
        try:
            add(json.loads(gc.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, OSError, AttributeError) as e:
            logger.warning(f"ignoring unreadable {gc} ({type(e).__name__}); stop tokens come from the tokenizer and config")
    add(getattr(tokenizer, "eos_token_id", None))
    add(cfg.eos_token_ids)
    return frozenset(ids)


def inspect_models(target: str | None, drafter: str | None, devices: Any, dtype: Any, need_drafter: bool) -> ModelSpec:
    """Resolve references, parse configs, devices, dtype and tokenizer; no weights yet."""
    if not target:
        raise DDTreeError("no target model: pass --target REF (a local directory or a repo id like Qwen/Qwen3.6-27B) or set target in --config")
    devs = parse_device_list(devices)
    dt = resolve_dtype(dtype, devs)
    if dt != torch.float32 and devs[0].type == "cpu":
        logger.debug(f"{dt} on cpu is slow; --dtype float32 is the usual choice there")
    tdir = resolve_model_dir(str(target), "target")
    tcfg = TargetConfig.from_file(tdir / "config.json")
    spec = ModelSpec(target_ref=str(target), target_dir=tdir, target_cfg=tcfg, devices=devs, dtype=dt)
    if need_drafter:
        if not drafter:
            raise DDTreeError("this method needs a drafter: pass --drafter REF (e.g. z-lab/Qwen3.6-27B-DFlash) or use --method ar")
        ddir = resolve_model_dir(str(drafter), "drafter")
        spec.drafter_ref, spec.drafter_dir = str(drafter), ddir
        spec.drafter_cfg = DrafterConfig.from_file(ddir / "config.json", tcfg.num_layers)
    spec.tokenizer = load_tokenizer(tdir)
    spec.stop_ids = stop_token_ids(tdir, spec.tokenizer, tcfg)
    return spec


def encode_prompt(spec: ModelSpec, prompt: Prompt, raw: bool, thinking: bool) -> list[int]:
    if prompt.messages is None and not (prompt.text or "").strip():
        where = "" if prompt.id == "cli" else f" (prompt {prompt.id!r})"
        raise DDTreeError(f"empty prompt{where}: pass a non-empty prompt (argument, '-' for stdin, or a prompt file)")
    tok = spec.tokenizer
    templated = not raw and bool(getattr(tok, "chat_template", None))
    text = render_prompt(prompt, tok, raw, thinking)
    ids = tok.encode(text, add_special_tokens=not templated)
    if not ids:
        raise DDTreeError(f"prompt {prompt.id!r} encodes to no tokens: pass a non-empty prompt")
    return [int(i) for i in ids]


def check_length(n_prompt: int, max_new_tokens: int, room: int, max_length: int | None, what: str = "prompt") -> int:
    """-> the state length to allocate (--max-length, or what the longest run needs plus slack)."""
    if max_length is None:
        return n_prompt + max_new_tokens + LENGTH_SLACK + room
    if n_prompt + max_new_tokens + room > max_length:
        raise DDTreeError(
            f"{what} ({n_prompt} tokens) + --max-new-tokens {max_new_tokens} + tree ({room}) exceeds "
            f"--max-length {max_length}: raise --max-length or shorten the prompt"
        )
    return max_length


def load_models(spec: ModelSpec, max_len: int, with_drafter: bool, stage: Callable[[str], None] | None = None,
                room: int | None = None) -> Loaded:
    from ddtree.app.plan import plan_for_devices
    from ddtree.decode.decoder import Decoder
    from ddtree.options import Options

    stage = stage or (lambda s: None)
    dev_names = ",".join(str(d) for d in spec.devices)
    stage("planning memory")  # before any weight is read: one error line naming what fits (None on CPU)
    split = plan_for_devices(spec.target_cfg, spec.drafter_cfg if with_drafter else None, spec.devices, max_len,
                             spec.dtype, room, name=spec.target_ref)
    stage("loading the target")
    logger.info(f"loading target {spec.target_ref} ({str(spec.dtype).replace('torch.', '')}, {dev_names}, max length {max_len})")
    target, _ = load_target(str(spec.target_dir), spec.devices, spec.dtype, max_len,
                            layer_stages=split.layer_stages if split else None)
    drafter = None
    if with_drafter and spec.drafter_dir is not None:
        stage("loading the drafter")
        logger.info(f"loading drafter {spec.drafter_ref} (block size {spec.block_size})")
        drafter, _ = load_drafter(str(spec.drafter_dir), target, spec.dtype, max_len,
                                  device=split.drafter_device if split else None,
                                  stage=split.drafter_stage if split else None)
    return Loaded(spec=spec, decoder=Decoder(target, drafter, max_len=max_len, options=Options.from_env()), max_len=max_len)


def model_metadata(spec: ModelSpec, opts: dict, **extra) -> dict:
    meta = dict(
        target=spec.target_ref,
        drafter=spec.drafter_ref,
        target_config_sha256=config_hash(spec.target_dir),
        drafter_config_sha256=config_hash(spec.drafter_dir) if spec.drafter_dir is not None else None,
        dtype=str(spec.dtype).replace("torch.", ""),
        devices=[str(d) for d in spec.devices],
        tp=opts.get("tp", 1),
        temperature=float(opts["temperature"]),
        top_p=float(opts["top_p"]),
        top_k=int(opts["top_k"]),
        seed=opts["seed"],
        max_new_tokens=opts["max_new_tokens"],
        raw=bool(opts["raw"]),
        thinking=bool(opts["thinking"]),
        block_size=spec.block_size,
    )
    meta.update(extra)
    return run_metadata(**meta)


def decode_text_fn(tokenizer) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


# ============================================================================================
# bench
# ============================================================================================

BENCH_DEFAULTS: dict[str, Any] = {
    "drafter": None,
    "prompts": "code",
    "methods": "ar,dflash,ddtree",
    "budgets": "8,16,32,64",
    "max_new_tokens": 256,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "seed": 0,
    "dtype": None,
    "devices": "auto",
    "max_length": None,
    "raw": False,
    "thinking": True,
    "limit": None,
    "warmup": 1,
    "out": "results/bench.json",
    "top1_first": False,
    "tp": 1,
}


def _label(method: str, budget) -> str:
    return f"ddtree {budget}" if method == "ddtree" else method


def format_table(doc: dict) -> str:
    head = ["method", "budget", "decode tok/s", "e2e tok/s", "TTFT ms", "accept len", "speedup", "exact"]
    rows = []
    for run in doc["runs"]:
        a = run["aggregate"]
        sp = run.get("speedup_vs_ar")
        ex = run.get("exact_match_vs_ar")
        rows.append([
            run["method"],
            str(run["budget"]) if run.get("budget") is not None else str(run.get("budget_setting") or "-"),
            f"{a['decode_tok_s']:.1f}",
            f"{a['e2e_tok_s']:.1f}",
            f"{a['mean_ttft_s'] * 1e3:.1f}",
            f"{a['mean_acceptance_length']:.2f}",
            "-" if sp is None else f"{sp:.2f}x",
            "-" if ex is None else ("yes" if ex else "NO"),
        ])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(head)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    notes = []
    for run in doc["runs"]:  # --budget auto: which budgets it chose, and how often
        hist = run["aggregate"].get("tree_size", {}).get("histogram") or {}
        if run["method"] == "ddtree" and run.get("budget") is None and hist:
            n = sum(hist.values())
            notes.append("ddtree auto chose " + ", ".join(f"{b} ({100 * c / n:.0f}%)" for b, c in
                                                          sorted(hist.items(), key=lambda kv: int(kv[0]))))
    return "\n".join([line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in rows] + notes)


def divergence(dec, prompt_ids: list[int], ar: list[int], other: list[int]) -> dict:
    """Where a greedy output first leaves ar's, and how close the target's two candidates were there:
    the logits of ar's token and of the other token after the common prefix (one eager prefill in
    the run's dtype), with the spacing of representable values at that magnitude (one "ulp")."""
    i = next((j for j, (a, b) in enumerate(zip(ar, other)) if a != b), min(len(ar), len(other)))
    out = {"index": i, "ar_token": ar[i] if i < len(ar) else None, "other_token": other[i] if i < len(other) else None}
    if out["ar_token"] is None or out["other_token"] is None:  # one stopped earlier: no logit question
        return {**out, "logit_gap": None, "logit_ulp": None}
    tgt = dec.target
    tgt.reset()
    logits, _ = tgt.prefill(torch.tensor(prompt_ids + ar[:i], device=tgt.device), want_taps=False)
    a, b = float(logits[out["ar_token"]]), float(logits[out["other_token"]])
    ulp = float(torch.finfo(tgt.dtype).eps) * 2 ** math.floor(math.log2(max(abs(a), 1e-30)))
    return {**out, "logit_gap": a - b, "logit_ulp": ulp}


def run_bench(
    target: str | None,
    drafter: str | None = None,
    prompts: str = "code",
    methods: str | list = "ar,dflash,ddtree",
    budgets: str | list | int = "8,16,32,64",
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
    out: str | Path | None = "results/bench.json",
    top1_first: bool = False,
    tp: int = 1,
    progress: bool = True,
    print_table: bool = True,
    stage: Callable[[str], None] | None = None,
) -> dict:
    """Benchmark the methods on a prompt set; returns the (validated) result document and writes it
    to ``out`` (unless ``out`` is None). Problems raise one-line :class:`DDTreeError`."""
    from tqdm import tqdm

    stage = stage or (lambda s: None)
    opts = dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_new_tokens=max_new_tokens,
                raw=raw, thinking=thinking, tp=tp)
    if tp and int(tp) > 1:
        raise DDTreeError("--tp is not supported by ddtree bench yet: benchmark with --devices cuda:0,cuda:1 (layer split) instead")
    meths = parse_methods(methods)
    buds = parse_budgets(budgets) if "ddtree" in meths else []
    max_new_tokens = positive_int(max_new_tokens, "--max-new-tokens")
    if max_length is not None:
        positive_int(max_length, "--max-length")
    if warmup is None or isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise DDTreeError(f"--warmup {warmup!r} must be 0 or a positive integer")
    sp = sampling_params(opts)
    plist = load_prompts(str(prompts), limit)
    need_drafter = any(m != "ar" for m in meths)
    spec = inspect_models(target, drafter, devices, dtype, need_drafter)
    encoded = [(p, encode_prompt(spec, p, raw, thinking)) for p in plist]
    longest = max(len(ids) for _, ids in encoded)
    room = max(tree_room(m, b, spec.block_size) for m in meths for b in (buds if m == "ddtree" else [None]))
    max_len = check_length(longest, max_new_tokens, room, max_length, what="the longest prompt")
    loaded = load_models(spec, max_len, need_drafter, stage, room=room)
    dec = loaded.decoder
    decode_text = decode_text_fn(spec.tokenizer)
    plan = [(m, b) for m in meths for b in (buds if m == "ddtree" else [None])]
    logger.info(
        f"bench: {len(encoded)} prompts x {len(plan)} runs ({', '.join(_label(m, b) for m, b in plan)}), "
        f"{max_new_tokens} new tokens, {'greedy' if sp.greedy else f'temperature {sp.temperature}'}"
    )

    def gen(method, budget, ids, pid, n_new):
        return dec.generate(
            ids, method=method, budget=budget if budget is not None else 32, sampling=sp, max_new_tokens=n_new,
            stop_ids=spec.stop_ids, seed=seed, top1_first=top1_first, prompt_id=pid, decode_text=decode_text,
        )

    if warmup:
        stage("warming up")
        # the shortest and the longest prompt at full length: every context bucket the timed runs reach
        # gets its graphs captured (and compiled) here, not in the first timed prompt
        by_len = sorted(encoded, key=lambda e: len(e[1]))
        warm = [by_len[0], by_len[-1]] if len(by_len) > 1 else by_len
        for method, budget in plan:
            for i in range(warmup):
                for p, ids in warm if i == 0 else warm[:1]:
                    gen(method, budget, ids, p.id, max_new_tokens)
        # Prefill runs eagerly, outside the graphs: each method also prefills every distinct prompt length
        # once here. Without it, on the H200 the first method timed (ar) had ~150 ms TTFT on half the
        # codepair prompts (15 ms on the rest), which skewed its TTFT and e2e figures (sessions 5-7).
        for method, budget in {m: (m, b) for m, b in plan}.values():
            for p, ids in {len(ids): (p, ids) for p, ids in encoded}.values():
                gen(method, budget, ids, p.id, 1)
        logger.debug(f"warm-up done ({warmup} round(s) over the shortest and longest prompts per run, then one prefill per prompt length and method)")

    results: list[dict] = []
    ar_rate = None
    ar_tokens: dict[str, list[int]] = {}
    for method, budget in plan:
        stage(f"running {_label(method, budget)}")
        records: list[GenerationRecord] = []
        bar = tqdm(encoded, desc=f"{_label(method, budget):>10}", unit="prompt", file=sys.stderr,
                   disable=not progress, leave=True, dynamic_ncols=True)
        for p, ids in bar:
            rec = gen(method, budget, ids, p.id, max_new_tokens)
            records.append(rec)
            if progress:
                a = aggregate(records)
                bar.set_postfix_str(f"{a['decode_tok_s']:.1f} tok/s, accept {a['mean_acceptance_length']:.2f}")
        bar.close()
        block = spec.block_size if method != "ar" else None
        agg = aggregate(records, block_size=block)
        run_budget = budget
        if budget == "auto":  # the decoder resolved it: report what it used
            run_budget = next((r.budget for r in records if isinstance(r.budget, int)), None)
        if method == "ar":
            ar_rate = agg["decode_tok_s"] or None
            ar_tokens = {r.prompt_id: list(r.token_ids) for r in records}
        speedup = agg["decode_tok_s"] / ar_rate if ar_rate else None
        mismatched: list[str] = []
        exact = None
        if sp.greedy and method != "ar":
            mismatched = [r.prompt_id for r in records if list(r.token_ids) != ar_tokens.get(r.prompt_id)]
            exact = not mismatched
            if mismatched:
                diverged = [{"prompt_id": p.id, **divergence(dec, ids, ar_tokens[p.id], list(r.token_ids))}
                            for (p, ids), r in zip(encoded, records) if p.id in mismatched]
                gaps = ", ".join(f"{d['prompt_id']}@{d['index']}: logit gap {d['logit_gap']:.3g} (ulp {d['logit_ulp']:.3g})"
                                 if d["logit_gap"] is not None else f"{d['prompt_id']}@{d['index']}: length"
                                 for d in diverged[:5])
                logger.warning(
                    f"EXACTNESS: {_label(method, budget)} differs from ar's greedy output on {len(mismatched)} of "
                    f"{len(records)} prompts ({gaps}); in float32 this is a bug, in bf16/fp16 a gap of a few "
                    "logit ulps is a near-tie that the tree's and the step's different rounding broke apart"
                )
        results.append(dict(method=method, budget=run_budget if method == "ddtree" else None, records=records,
                            speedup_vs_ar=speedup, block_size=block, exact=exact, mismatched=mismatched,
                            diverged=diverged if mismatched else []))

    meta = model_metadata(spec, opts, prompts=str(prompts), methods=meths, budgets=buds, warmup=warmup, limit=limit,
                          max_length=max_len, top1_first=top1_first)
    meta["compiled_layers"] = bool(dec.compile)  # torch.compile'd layers (DDTREE_NO_COMPILE=1: eager)
    meta["options"] = dec.options.to_dict()  # every engine switch (ddtree.options)
    meta["kernels"] = dataclasses.asdict(dec.kernels)  # the fast paths they resolve to on the target's device
    doc = make_run_document(meta, [{k: r[k] for k in ("method", "budget", "records", "speedup_vs_ar", "block_size")}
                                   for r in results])
    for run, r, (_, b) in zip(doc["runs"], results, plan):
        if b == "auto":
            run["budget_setting"] = "auto"  # the decoder picked the budget per round
        run["exact_match_vs_ar"] = r["exact"]
        run["mismatched_prompts"] = r["mismatched"]
        run["first_divergences"] = r["diverged"]
        if r["exact"] is not None:
            bad = set(r["mismatched"])
            for pd in run["prompts"]:
                pd["exact_match_vs_ar"] = pd["prompt_id"] not in bad
    try:
        validate_document(doc)
    except ValueError as e:  # our own document: a bug, but say where
        raise DDTreeError(f"internal error: the bench document does not validate ({e}); please report it") from None
    if out is not None:
        path = write_json(doc, out)
        logger.info(f"wrote {path}")
    if print_table:
        print(format_table(doc), flush=True)
    return doc

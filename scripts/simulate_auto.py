#!/usr/bin/env python
"""--budget auto against every fixed method, replayed from acceptance traces at measured round costs.

    python scripts/simulate_auto.py --record        # traces of the codepair drafters (CPU float32), then replay
    python scripts/simulate_auto.py                 # replay results/auto-traces-cpu.json.gz
    python scripts/simulate_auto.py --bench DIR --out results/auto-sim-codepair-h100.json
                                                    # at the costs of bench_auto.py's documents in DIR
    python scripts/simulate_auto.py --bench DIR --trace-prompts 8:16 --out results/auto-sim-codepair-h100.json
                                                    # the same costs on other traced prompts (added to the file)
    python scripts/simulate_auto.py --check-live --limit 4 --tokens 128
                                                    # live auto (CPU float32) against the traces, round by round

Traces: a greedy round that starts at position t of the target's greedy continuation g (root g[t])
drafts the same block whatever came before it: the drafter's context is the target's tap rows of
the committed tokens, the prompt and g[:t] for every method. So one drafter forward per position
says what every arm would accept there. For each position t a trace holds:

    acc:<arm>  draft tokens the arm's tree accepts against g[t+1:] (chain: the block's top-1 chain;
               t<b>: the best-first tree of b draft nodes with b columns, as `--budget b` builds it;
               a<b>: auto's tree of b nodes, AUTO_TOPK columns)
    eq:<b>     E_q(b) of auto's tree (its first b path probabilities summed), b in AUTO_BUDGETS
    eq:c<b>    E_q of the drafter's top-1 chain cut to b nodes (its acceptance: acc:chain, at most b)

(float32 on the CPU; eos does not stop a continuation). Replay: each fixed method walks a trace
with its own acceptance at its round cost; auto runs the real policy (ddtree.decode.budget.Auto
and BudgetChooser) in the device pipeline's call order (round r + 1 planned before round r's
packet is read), its packets made from the trace, its clock the simulated device time (rounds
back to back: the 27B rounds are device-bound). Costs: results/engine-long-h200.json per context
(AR step, verify of T nodes interpolated linearly in T, dflash and ddtree 16 / 32 / 64 rounds;
a round's cost beyond its verify is the drafting round's, a plain step's is the AR step's).
Prompts of one drafter share one AutoMemory, as the generations of one decoder do.

Feeds docs/PERFORMANCE.md's "--budget auto at the 27B's costs" (results/auto-sim.json, on the
traces of results/auto-traces-cpu.json.gz) and the replayed column of "codepair on one GPU"
(results/auto-sim-codepair-h100.json).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddtree.decode.budget import AUTO_BUDGETS, AUTO_TOPK, CHAIN, Auto, AutoMemory, BudgetChooser  # noqa: E402
from ddtree.decode.buffers import RoundOut  # noqa: E402
from ddtree.ops.tree import build_tree  # noqa: E402
from ddtree.options import Options  # noqa: E402

FIXTURE = ROOT.parent / "shared" / "fixtures" / "codepair"
TRACES = ROOT / "results" / "auto-traces-cpu.json.gz"
ENGINE = ROOT / "results" / "engine-long-h200.json"
DRAFTERS = ("drafter", "drafter-distilled", "drafter-large")
BLOCK = 16

FIXED_BUDGETS = (8, 15, 16, 31, 32, 63, 64)  # both sides of each tile edge (bench_auto.py's default too)
FIXED = ("ar", "dflash") + tuple(f"ddtree-{b}" for b in FIXED_BUDGETS)


def accepted(tree, cont: list[int]) -> int:
    """Draft tokens the walk accepts when the target's tokens after the root are cont."""
    children: dict[int, dict[int, int]] = {}
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    for i in range(1, len(toks)):
        children.setdefault(parents[i], {})[toks[i]] = i
    node, n = 0, 0
    for t in cont:
        node = children.get(node, {}).get(t)
        if node is None:
            return n
        n += 1
    return n


def position_trace(root: int, lp: np.ndarray, ids: np.ndarray, cont: list[int]) -> dict:
    """One position's outcomes: lp, ids [D, K] (K >= 64) sorted descending; cont: g[t+1 : t+1+D]."""
    chain = 0
    for d in range(len(cont)):
        if ids[d, 0] != cont[d]:
            break
        chain += 1
    acc = {"chain": chain}
    for b in FIXED_BUDGETS:
        acc[f"t{b}"] = accepted(build_tree(root, lp[:, :b], ids[:, :b], b), cont)
    auto = build_tree(root, lp[:, :AUTO_TOPK], ids[:, :AUTO_TOPK], max(AUTO_BUDGETS))
    probs = [math.exp(s) for s in auto.scores[1:]]
    for b in AUTO_BUDGETS:
        acc[f"a{b}"] = accepted(auto.truncate(b + 1), cont)
    eq = {str(b): round(sum(probs[:b]), 4) for b in AUTO_BUDGETS}
    chain_eq = np.cumsum(np.exp(np.cumsum(lp[:, 0].astype(np.float64))))  # the top-1 chain's E_q per length
    eq.update({f"c{b}": round(float(chain_eq[b - 1]), 4) for b in AUTO_BUDGETS if b <= len(chain_eq)})
    return {"acc": acc, "eq": eq}


@torch.no_grad()
def record(fixture: Path, drafters: list[str], limit: int, tokens: int, log=print) -> dict:
    """{drafter: [{prompt, positions: {field: [per position]}}]} for the first `limit` prompts."""
    from ddtree.app.setup import load_tokenizer
    from ddtree.decode.decoder import Decoder
    from ddtree.model.checkpoint import load_drafter, load_target

    prompts = [json.loads(x) for x in (fixture / "prompts.jsonl").read_text().splitlines() if x.strip()][:limit]
    tok = load_tokenizer(fixture / "target")  # as `ddtree bench --raw` tokenizes (the checkpoint's tokenizer.json)
    encoded = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    D = 16  # the drafters' block less its root (checked below)
    max_len = -(-(max(map(len, encoded)) + tokens + 2 * D + 8) // 256) * 256
    target, _ = load_target(str(fixture / "target"), [torch.device("cpu")], torch.float32, max_len)
    out: dict = {}
    conts: dict[str, list[int]] = {}
    for name in drafters:
        drafter, _ = load_drafter(str(fixture / name), target, torch.float32, max_len)
        dec = Decoder(target, drafter, options=Options.from_env())
        assert drafter.cfg.block_size == D, drafter.cfg.block_size
        runs = []
        for p, ids in zip(prompts, encoded):
            t0 = time.perf_counter()
            if p["id"] not in conts:  # the target's greedy continuation, D past the traced length
                conts[p["id"]] = dec.generate(ids, "ar", max_new_tokens=tokens + D).token_ids
            g = conts[p["id"]]
            L = len(ids)
            target.reset()
            _, taps = target.prefill(torch.tensor(ids + g[: tokens - 1]), want_taps=True)  # [L + tokens - 1, W]
            drafter.reset()
            drafter.add_context(taps[:L])
            fields: dict[str, list] = {}
            for t in range(tokens):  # the round whose root is g[t]: the context holds prompt + g[:t]
                lp, top = drafter.draft_topk(torch.tensor(g[t]), dec.kv_len(L + t + D), 64)
                rec = position_trace(g[t], lp.numpy(), top.numpy(), g[t + 1 : t + D])
                for group in ("acc", "eq"):
                    for k, v in rec[group].items():
                        fields.setdefault(f"{group}:{k}", []).append(v)
                if t + 1 < tokens:
                    drafter.add_context(taps[L + t : L + t + 1])
            runs.append({"prompt": p["id"], "positions": fields})
            log(f"{name} {p['id']}: {tokens} positions in {time.perf_counter() - t0:.1f}s; mean accepted "
                + ", ".join(f"{k[4:]} {np.mean(v):.2f}" for k, v in fields.items() if k.startswith("acc:")))
        out[name] = runs
    return out


# ------------------------------------------------------------------------------------ replay
@dataclass
class Costs:
    """Round costs in ms at one context: ar (an AR step), verify (T -> ms, measured sizes), rounds
    (dflash / ddtree-b -> a whole round), beyond (build budget -> a drafting round beyond its verify)."""

    ar: float
    verify: dict
    rounds: dict
    beyond: dict

    def verify_of(self, T: int) -> float:
        ts = sorted(self.verify)
        lo = max([t for t in ts if t <= T], default=ts[0])
        hi = min([t for t in ts if t >= T], default=ts[-1])
        if lo == hi:
            return self.verify[lo]
        return self.verify[lo] + (self.verify[hi] - self.verify[lo]) * (T - lo) / (hi - lo)

    def beyond_of(self, b: int) -> float:
        """A drafting round's cost past its verify when its step builds a tree of b draft nodes."""
        return self.beyond[min([x for x in self.beyond if x >= b], default=max(self.beyond))]

    def fixed_round(self, name: str) -> float:
        if name == "ar":
            return self.ar
        if name in self.rounds:
            return self.rounds[name]
        b = int(name.split("-")[1])  # ddtree-8: its verify and the smallest measured tree's rest
        return self.verify_of(b + 1) + self.beyond_of(b)

    def chain_beyond(self) -> float:
        """A chain round's cost past its verify (dflash's round less its verify)."""
        return self.rounds["dflash"] - self.verify_of(BLOCK)

    def auto_round(self, T: int, build) -> float:
        """A round of auto that verifies T nodes; its step builds `build` (None: a plain step's; "chain")."""
        if build is None:
            return self.verify_of(T) + self.ar - self.verify_of(1)
        return self.verify_of(T) + (self.chain_beyond() if build == "chain" else self.beyond_of(build))


def engine_costs(path: Path = ENGINE) -> dict[int, Costs]:
    """Costs per context from a bench_engine.py document (main.contexts.<L>)."""
    doc = json.loads(path.read_text())
    out = {}
    for L, c in doc["main"]["contexts"].items():
        verify = {int(t): ms for t, ms in c["verify_ms"].items()}
        rounds, beyond = {}, {}
        for key, rd in c["rounds"].items():
            method, b = key.split(":")
            name = "dflash" if method == "dflash" else f"ddtree-{b}"
            rounds[name] = rd["round_ms"]
            if method == "ddtree":
                beyond[int(b)] = rd["round_ms"] - rd["verify_ms"]
        out[int(L)] = Costs(c["ar_ms"], verify, rounds, beyond)
    return out


def bench_costs(doc: dict) -> tuple[Costs, dict[str, float]]:
    """Costs from a `ddtree bench` document with ar, dflash and ddtree 8 / 16 / 32 / 64 runs (as
    scripts/bench_auto.py writes them): a round's ms is the median over its prompts of each
    prompt's decode time over its rounds, a verify's the median of its rounds' verify stages, so one
    graph capture in a timed prompt (334 ms in one run's dflash, doubling its mean round) does not
    price the method. -> (costs, decode tok/s per run as measured, auto's too)."""
    from scripts.bench_auto import label

    runs, tok_s = {}, {}
    for r in doc["runs"]:
        name, a = label(r), r["aggregate"]
        per_prompt = [p["decode_s"] * 1e3 / p["num_rounds"] for p in r["prompts"] if p["num_rounds"]]
        verify = [ms for p in r["prompts"] for ms in p["rounds"]["times_ms"]["verify"]]
        runs[name] = (statistics.median(per_prompt), statistics.median(verify))
        tok_s[name] = a["decode_tok_s"]
    verify = {1: runs["ar"][1], 16: runs["dflash"][1]}
    rounds, beyond = {"dflash": runs["dflash"][0]}, {}
    for b in (b for b in FIXED_BUDGETS if f"ddtree-{b}" in runs):  # the budgets the bench ran
        rd, v = runs[f"ddtree-{b}"]
        verify[b + 1], rounds[f"ddtree-{b}"], beyond[b] = v, rd, rd - v
    return Costs(runs["ar"][0], verify, rounds, beyond), tok_s


def shown(path: Path) -> str:
    """path as the output files name it: relative to the repository where it lies inside it."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def replay_fixed(trace: dict, name: str, costs: Costs, n: int) -> tuple[int, float]:
    """(tokens, ms) of a fixed method over the first n positions of one prompt's trace."""
    field = None if name == "ar" else "acc:chain" if name == "dflash" else f"acc:t{name.split('-')[1]}"
    t = tokens = 0
    ms = 0.0
    while t < n:
        got = 0 if field is None else trace[field][t]
        tokens += min(got + 1, n - t)
        t += got + 1
        ms += costs.fixed_round(name)
    return tokens, ms


def _slot(T: int, chain: bool = False):
    return SimpleNamespace(T=T, ints=None, mask=None, ranks=None, chain=chain)


class SimDecoder:
    """What Auto.plan asks of a decoder: slots by size, and the staged chain's."""

    slot = staticmethod(_slot)

    @staticmethod
    def chain_stage(T: int):
        return _slot(T, chain=True)


def replay_auto(trace: dict, costs: Costs, n: int, memory: AutoMemory, sync: bool = False) -> tuple[int, float, dict]:
    """(tokens, ms, {arm: rounds}) of --budget auto over one prompt's trace, the real policy driven
    in the pipeline's order: plan(r + 1), then read(r). The clock: the device's (rounds back to
    back, each read when its round ends), or with sync a CPU's (a round runs when it is queued, so
    the span before read(r) holds round r + 1)."""
    verify_ms = {b: costs.verify_of(b + 1) for b in AUTO_BUDGETS}
    chain_key = f"eq:c{BLOCK - 1}"  # (a trace without the chain's fields: no chain arm)
    chooser = BudgetChooser(verify_ms, plain_ms=costs.verify_of(1), memory=memory,
                            chain=BLOCK - 1 if chain_key in trace else None)
    policy = Auto(chooser, BLOCK, AUTO_TOPK)
    clock = [0.0]
    policy.clock = lambda: clock[0] / 1e3
    nb = policy.nb

    def eq_at(t, cover):
        t = min(t, n - 1)
        return {b: trace[f"eq:{b}"][t] for b in AUTO_BUDGETS if b <= cover}

    policy.start(eq_at(0, nb), {b: 1 for b in AUTO_BUDGETS}, trace[chain_key][0] if chooser.chain else 0.0)
    dec = SimDecoder()

    def queue(r):
        plans[r] = plan = policy.plan(r, dec)
        if sync:
            clock[0] += costs.auto_round(plan.slot.T, plan.build)

    plans: dict = {}
    queue(0)
    t, r, tokens, arms = 0, 0, 0, {}
    while True:
        if t < n:  # queued ahead, as the pipeline does while it fits
            queue(r + 1)
        plan = plans.pop(r)
        T = plan.slot.T
        got = 0 if T == 1 else trace["acc:chain"][t] if plan.arm == CHAIN else trace[f"acc:a{T - 1}"][t]
        tokens += min(got + 1, n - t)
        t += got + 1
        if not sync:
            clock[0] += costs.auto_round(T, plan.build)
        extra = [0.0] * (2 * nb + 1)
        if plan.build is not None:  # its step drafted at the next position: E_q per covered budget, the chain's
            for b, e in ({} if plan.build == "chain" else eq_at(t, plan.build)).items():
                extra[b - 1] = e
                extra[nb + b - 1] = 1.0
            extra[nb] = 1.0
            extra[2 * nb] = trace[chain_key][min(t, n - 1)] if chooser.chain else 0.0
        policy.read(r, RoundOut(n=got + 1, bonus=0, tokens=[], ranks=[], extra=extra), T)
        arm = "chain" if plan.arm == CHAIN else T - 1
        arms[arm] = arms.get(arm, 0) + 1
        if t >= n:
            if sync and r + 1 in plans:  # the round queued past the end ran too: not the generation's
                clock[0] -= costs.auto_round(plans[r + 1].slot.T, plans[r + 1].build)
            return tokens, clock[0], arms
        r += 1


def simulate(traces: list[dict], costs: Costs, n: int | None = None, sync: bool = False,
             fixed: tuple[str, ...] = FIXED) -> dict:
    """tok/ms per fixed method (of `fixed`) and auto over a drafter's prompt traces (auto: one
    shared memory; sync: a CPU's clock, replay_auto)."""
    out = {}
    sizes = [n or len(tr["acc:chain"]) for tr in traces]
    for name in fixed:
        runs = [replay_fixed(tr, name, costs, m) for tr, m in zip(traces, sizes)]
        out[name] = sum(x for x, _ in runs) / sum(y for _, y in runs)
    memory, tok, ms, arms = AutoMemory(), 0, 0.0, {}
    for tr, m in zip(traces, sizes):
        a, b, c = replay_auto(tr, costs, m, memory, sync)
        tok, ms = tok + a, ms + b
        for k, v in c.items():
            arms[k] = arms.get(k, 0) + v
    out["auto"] = tok / ms
    best = max(fixed, key=out.get)
    return {"tok_per_ms": out, "best_fixed": best, "auto_vs_best": out["auto"] / out[best],
            "auto_arms": {str(k): v for k, v in sorted(arms.items(), key=lambda kv: (str(kv[0]).isalpha(), str(kv[0]).zfill(3)))}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help="record the traces first (CPU float32, a few minutes)")
    ap.add_argument("--fixture", type=Path, default=FIXTURE)
    ap.add_argument("--limit", type=int, default=16, help="prompts to trace")
    ap.add_argument("--tokens", type=int, default=192, help="positions per prompt")
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--costs", type=Path, default=ENGINE)
    ap.add_argument("--bench", type=Path, default=None,
                    help="replay at the costs of bench_auto.py's documents in this folder (codepair-<drafter>-<dtype>.json), "
                         "each row beside what the live run measured")
    ap.add_argument("--trace-prompts", default=None, metavar="START:STOP",
                    help="--bench: replay these traced prompts (a Python slice of the 16) instead of the bench's own "
                         "(the first ones): the same costs on other texts")
    ap.add_argument("--tokens-per-prompt", type=int, default=192,
                    help="--bench: at most this many positions replayed per prompt (the bench's new tokens, if fewer)")
    ap.add_argument("--check-live", action="store_true",
                    help="decode the first --limit prompts with --budget auto (CPU float32) and check every tree "
                         "round's accepted draft tokens against the traces at its position; writes nothing")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "auto-sim.json")
    args = ap.parse_args(argv)
    from loguru import logger

    logger.remove()  # auto's per-round debug lines
    logger.add(sys.stderr, level="INFO")
    if args.record:
        import torch

        torch.set_num_threads(1)
        runs = record(args.fixture, list(DRAFTERS), args.limit, args.tokens, log=lambda m: print(m, file=sys.stderr))
        doc = {"what": "per-position acceptance traces (scripts/simulate_auto.py)", "device": "cpu",
               "dtype": "float32", "torch": torch.__version__, "prompts": args.limit, "tokens": args.tokens,
               "drafters": runs}
        with gzip.open(args.traces, "wt") as f:
            f.write(json.dumps(doc, separators=(",", ":")))
    traces = json.loads(gzip.open(args.traces, "rt").read())
    if args.check_live:
        return check_live(traces, args.fixture, args.limit, min(args.tokens, traces["tokens"]))
    if args.bench:
        return replay_bench(traces, args)
    costs = engine_costs(args.costs)
    result = {"traces": shown(args.traces), "costs": shown(args.costs), "rows": []}
    head = ["drafter", "context"] + list(FIXED) + ["auto", "best fixed", "auto / best", "auto's arms (0: plain)"]
    print("  ".join(head))
    for name, runs in traces["drafters"].items():
        for L, c in sorted(costs.items()):
            row = simulate([x["positions"] for x in runs], c)
            row.update(drafter=name, context=L)
            result["rows"].append(row)
            tpm = row["tok_per_ms"]
            print("  ".join([name, str(L)] + [f"{tpm[k]:.4f}" for k in list(FIXED) + ["auto"]]
                            + [row["best_fixed"], f"{row['auto_vs_best']:.3f}",
                               ", ".join(f"{k}: {v}" for k, v in row["auto_arms"].items())]))
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def drafting_rounds(sizes: list[int], accepted: list[int], n: int):
    """(t, tree size, accepted) of each drafting round (tree size > 0) of a generation, t the
    continuation's token that is its root (the tokens the rounds before it committed, accepted + 1
    each), while t < n (the traced positions)."""
    t = 0
    for size, acc in zip(sizes, accepted):
        if t >= n:
            return
        if size:
            yield t, size, acc
        t += acc + 1


@torch.no_grad()
def check_live(traces: dict, fixture: Path, limit: int, tokens: int) -> int:
    """The replay's premise, checked: a live --budget auto generation (CPU float32, the device
    pipeline with its plain steps, deferred context rows and prefix copies) accepts in each tree
    round exactly what the trace says the same tree accepts at that position. -> 1 on a mismatch."""
    from ddtree.app.setup import load_tokenizer
    from ddtree.decode.decoder import Decoder
    from ddtree.model.checkpoint import load_drafter, load_target

    torch.set_num_threads(1)
    prompts = [json.loads(x) for x in (fixture / "prompts.jsonl").read_text().splitlines() if x.strip()][:limit]
    tok = load_tokenizer(fixture / "target")
    target, _ = load_target(str(fixture / "target"), [torch.device("cpu")], torch.float32, 1024)
    checked = wrong = 0
    for name, runs in traces["drafters"].items():
        drafter, _ = load_drafter(str(fixture / name), target, torch.float32, 1024)
        dec = Decoder(target, drafter, options=Options.from_env())
        by_prompt = {r["prompt"]: r["positions"] for r in runs}
        for p in prompts:
            ids = tok(p["prompt"], add_special_tokens=False)["input_ids"]
            rec = dec.generate(ids, "ddtree", budget="auto", max_new_tokens=tokens)
            pos, n, bad = by_prompt[p["id"]], 0, []
            for t, size, acc in drafting_rounds([r.tree_size for r in rec.rounds], [r.accepted for r in rec.rounds],
                                                len(pos["acc:chain"])):
                n += 1
                if pos[f"acc:a{size}"][t] != acc:
                    bad.append((t, size, pos[f"acc:a{size}"][t], acc))
            checked, wrong = checked + n, wrong + len(bad)
            print(f"{name} {p['id']}: {n} tree rounds of {len(rec.rounds)}, "
                  + (f"mismatched (position, budget, traced, live): {bad[:5]}" if bad else "each as traced"))
    print(f"{checked} tree rounds checked, {wrong} mismatched")
    return 1 if wrong else 0


def rounds_against_traces(doc: dict, positions: dict[str, dict]) -> dict:
    """Each timed round of a bench document's runs against the traces at its position (a round's
    root is the continuation's token t): -> {method: {rounds, equal, accepted_live, accepted_traced}}
    (means of draft tokens accepted per drafting round; positions past the traces are left out). In
    float32 every round equals its trace; where the live continuation leaves the traced one (bf16)
    the rest of that prompt compares other texts."""
    from scripts.bench_auto import label

    out = {}
    for run in doc["runs"]:
        name = label(run)
        if name == "ar":
            continue
        n = equal = live = traced = 0
        for p in run["prompts"]:
            pos = positions[p["prompt_id"]]
            for t, size, acc in drafting_rounds(p["rounds"]["tree_size"], p["rounds"]["accepted"], len(pos["acc:chain"])):
                field = "acc:chain" if name == "dflash" else f"acc:a{size}" if name == "ddtree-auto" else f"acc:t{size}"
                if field not in pos:  # an arm the traces do not hold (a live run of other auto budgets)
                    continue
                want = pos[field][t]
                n, equal, live, traced = n + 1, equal + (want == acc), live + acc, traced + want
        out[name] = {"rounds": n, "equal": equal, "accepted_live": live / max(n, 1), "accepted_traced": traced / max(n, 1)}
    return out


def replay_bench(traces: dict, args) -> int:
    """Every bench document in args.bench replayed: the simulation's tok/ms per method against the
    live run's decode tok/s, auto's ratio to the best fixed method in both."""
    rows = []
    header = None
    for path in sorted(args.bench.glob("codepair-*.json")):
        stem = path.stem[len("codepair-"):]
        name, dtype = stem.rsplit("-", 1)
        if name not in traces["drafters"]:
            continue
        doc = json.loads(path.read_text())
        costs, live = bench_costs(doc)
        fixed = tuple(k for k in FIXED if k in live)  # this bench's methods (an older bench_auto.py's: ddtree 8 / 16 / 32 / 64)
        if fixed != header:
            header = fixed
            print("drafter  dtype  | simulated: " + "  ".join(fixed) + "  auto  auto/best | live: auto  auto/best")
        ar = next(r for r in doc["runs"] if r["method"] == "ar")
        prompts = ar["aggregate"]["num_prompts"]  # the bench's own prompts: the first ones of the traces
        picked = slice(0, prompts) if args.trace_prompts is None else slice(*(int(v) for v in args.trace_prompts.split(":")))
        tokens = min(args.tokens_per_prompt, max(p["new_tokens"] for p in ar["prompts"]))
        devices = doc["metadata"].get("devices") or []
        cpu = bool(devices) and all(str(d).startswith("cpu") for d in devices)  # a round runs as it is queued
        row = simulate([x["positions"] for x in traces["drafters"][name]][picked], costs, n=tokens, sync=cpu, fixed=fixed)
        best_live = max(fixed, key=live.get)
        row.update(drafter=name, dtype=dtype, clock="cpu" if cpu else "device", prompts=prompts, trace_prompts=[picked.start, picked.stop], tokens=tokens, live_tok_s=live, live_best_fixed=best_live,
                   live_auto_vs_best=live.get("ddtree-auto", 0.0) / live[best_live],
                   costs={"ar": costs.ar, "verify": costs.verify, "rounds": costs.rounds, "beyond": costs.beyond},
                   rounds_vs_traces=rounds_against_traces(doc, {x["prompt"]: x["positions"] for x in traces["drafters"][name]}))
        rows.append(row)
        tpm = row["tok_per_ms"]
        print(f"{name} {dtype} | " + "  ".join(f"{tpm[k] * 1e3:.0f}" for k in list(fixed) + ["auto"])
              + f"  {row['auto_vs_best']:.3f} ({row['best_fixed']}) | {live.get('ddtree-auto', 0):.0f}  "
              f"{row['live_auto_vs_best']:.3f} ({best_live})")
    doc = {"traces": shown(args.traces), "bench": shown(args.bench), "rows": rows}
    if args.out.exists() and args.trace_prompts is not None:  # other texts beside the bench's own
        prev = json.loads(args.out.read_text())
        doc = dict(prev, **{f"rows_trace_prompts_{args.trace_prompts.replace(':', '_')}": rows})
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

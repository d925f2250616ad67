#!/usr/bin/env python3
"""PROJECT Qwen3.6-27B decode speed on 2x RTX A6000 (48 GB, 768 GB/s each, PCIe) from H200 measurements.

Nothing here is measured on an A6000: the script turns measured H200 times into A6000 times with
stated assumptions, and prints them as a labelled projection. It runs on CPU from JSON files:

    python scripts/project_a6000.py results/engine-long-h200.json results/multigpu-h200x2.json \
        [results/tp-rank-h200.json] --out results/projection-2xa6000.json

Inputs (recognised by their content; any subset, the engine results are needed):
  * scripts/bench_engine.py (has "main"): copy_GBps; main.preset; main.contexts.N.ar_ms (or, in
    older files, main.ctxN.ar_ms_per_token); its rounds["dflash:15"].round_ms and ["ddtree:B"].round_ms (B = --budget);
    codepair.dflash.accept and codepair["ddtree:B"].accept (the measured acceptance, if present).
  * scripts/bench_tp_rank.py ("kind": "tp_rank"): copy_GBps; world; budget; preset;
    shard.ctxN.{ar_ms_per_token, dflash_round_ms, ddtree_round_ms}; full.ctxN.ar_ms_per_token.
  * scripts/bench_multigpu.py (has results["layer split"]): copy_GBps; ctx (1024 when absent);
    results["layer split"].{ar_ms_per_token, ddtree32_round_ms}; results["TP=2"].ar_ms_per_token
    (a cross-check only).

Model. A unit of work (an AR step, a dflash round, a ddtree round) measured on the H200 in t ms
reads B bytes (from the configs: target weights, K/V at the context, GDN states; rounds add the
drafter's weights and K/V and a second read of the lm_head for the drafter's logits). It reached
the efficiency e = B / (t x copy bandwidth of that run). On the A6000 the same unit takes
B' / (768 GB/s x copy_fraction x e), B' its bytes there (another context: the same e; marked).
  * layer split: the whole unit's bytes through one card at a time (the one-GPU efficiency), or
    the H200 layer-split time where that is longer (the split runs eagerly: it is bound by the
    host issuing kernels, which an A6000 does not speed up);
  * TP=2: the rank's bytes at the efficiency bench_tp_rank.py measured for the shard (without that
    file: the one-GPU efficiency, optimistic as a shard runs as many kernels for half the bytes),
    plus per forward 2 x layers all-reduces of T x hidden and one all-gather of T x V/2 logits
    (a round also gathers the drafter's 15 rows): each a published per-collective cost plus its
    bytes over the PCIe link.
Speculative tok/s = acceptance length (tokens committed per round) / round time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.model.config import DrafterConfig, TargetConfig  # noqa: E402
from ddtree.model.presets import PRESETS  # noqa: E402
from ddtree.parallel.sharding import rank_bytes_per_token  # noqa: E402

UNITS = ("ar", "dflash", "ddtree")
# Published figures (../shared/notes/anchors.md), not measurements of ours.
PUBLISHED = {
    "allreduce_us": {"nccl-pcie": 20.0, "oneshot-pcie": 5.0},  # ~8-10 KB all-reduce inside CUDA graphs, PCIe
    "chain_accept": 5.5,  # real Qwen3.6-27B DFlash drafter: about 5-6 tokens per round
    "tree_gain": 0.04,  # branching adds only 3.5-4% acceptance on the real pair (vLLM DDTree fork, 2x A6000)
    "users_mtp_tok_s": 73.5,  # users' serving stack with MTP on 2x A6000
}
A6000_GBPS = 768.0  # datasheet


def load(path: Path) -> dict:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(raw)


def engine_contexts(main: dict):
    """(\"ctxN\", figures) per context of a bench_engine "main" part, in either of its layouts
    (main.contexts.N, or main.ctxN of older files)."""
    if isinstance(main.get("contexts"), dict):
        return [(f"ctx{int(k)}", r) for k, r in main["contexts"].items() if isinstance(r, dict)]
    return [(k, r) for k, r in main.items() if k.startswith("ctx") and isinstance(r, dict)]


def kind_of(doc: dict) -> str | None:
    if doc.get("kind") == "tp_rank":
        return "tp_rank"
    if isinstance(doc.get("main"), dict) and (any(k.startswith("ctx") for k in doc["main"]) or "contexts" in doc["main"]):
        return "engine"
    if isinstance(doc.get("results"), dict) and "layer split" in doc["results"]:
        return "split"
    return None


class Bytes:
    """Bytes one unit reads, per GPU, from the configs (bf16 weights, fp32 GDN states)."""

    def __init__(self, raw_t: dict, raw_d: dict):
        import torch

        from ddtree.model.checkpoint import NoInit
        from ddtree.model.drafter import DFlashDrafter

        self.cfg = TargetConfig.from_dict(raw_t)
        self.dcfg = DrafterConfig.from_dict(raw_d, self.cfg.num_layers)
        with torch.device("meta"), NoInit():  # shapes only
            d = DFlashDrafter(self.dcfg)
        self.drafter_weights = 2 * sum(p.numel() for p in d.parameters())  # its embed / lm_head are the target's

    def drafter_kv(self, ctx: int) -> int:
        d = self.dcfg
        rows = sum(min(ctx, w) if w else ctx for w in d.sliding_window)
        return rows * d.num_kv_heads * d.head_dim * 2 * 2

    def unit(self, unit: str, world: int, ctx: int) -> int:
        b = rank_bytes_per_token(self.cfg, world, context=ctx)["step_bytes"]
        if unit != "ar":  # + the replicated drafter, its K/V, and this rank's lm_head block once more
            b += self.drafter_weights + self.drafter_kv(ctx) + 2 * self.cfg.vocab_size // world * self.cfg.hidden_size
        return b


def measurements(docs: dict[str, tuple[Path, dict]], budget: int, notes: list[str]) -> dict:
    """{(setup, unit): {ctx: (ms, copy_GBps, source)}} for setups '1gpu', 'shard', 'split'."""
    m: dict = {}

    def put(setup, unit, ctx, ms, copy, src):
        if isinstance(ms, (int, float)) and ms > 0 and copy:
            m.setdefault((setup, unit), {})[ctx] = (float(ms), float(copy), src)

    if "engine" in docs:
        path, e = docs["engine"]
        for key, r in engine_contexts(e["main"]):
            ctx, rounds = int(key[3:]), r.get("rounds", {})
            put("1gpu", "ar", ctx, r.get("ar_ms_per_token", r.get("ar_ms")), e.get("copy_GBps"), f"{path.name} {key}")
            df = next((v for k, v in rounds.items() if k.startswith("dflash")), {})
            put("1gpu", "dflash", ctx, df.get("round_ms"), e.get("copy_GBps"), f"{path.name} {key}")
            put("1gpu", "ddtree", ctx, rounds.get(f"ddtree:{budget}", {}).get("round_ms"), e.get("copy_GBps"),
                f"{path.name} {key}")
    if "tp_rank" in docs:
        path, t = docs["tp_rank"]
        if int(t.get("world", 2)) != 2:
            notes.append(f"{path.name} measured a rank of TP={t.get('world')}, not TP=2: its shard is not used")
        else:
            for key, s in (t.get("shard") or {}).items():
                ctx = int(key[3:])
                put("shard", "ar", ctx, s.get("ar_ms_per_token"), t.get("copy_GBps"), f"{path.name} {key}")
                put("shard", "dflash", ctx, s.get("dflash_round_ms"), t.get("copy_GBps"), f"{path.name} {key}")
                if int(t.get("budget", budget)) == budget:
                    put("shard", "ddtree", ctx, s.get("ddtree_round_ms"), t.get("copy_GBps"), f"{path.name} {key}")
            for key, f in (t.get("full") or {}).items():
                if int(key[3:]) not in m.get(("1gpu", "ar"), {}):  # the engine's figure first
                    put("1gpu", "ar", int(key[3:]), f.get("ar_ms_per_token"), t.get("copy_GBps"), f"{path.name} {key}")
    if "split" in docs:
        path, s = docs["split"]
        ctx = int(s.get("ctx", 1024))
        r = s["results"]["layer split"]
        put("split", "ar", ctx, r.get("ar_ms_per_token"), s.get("copy_GBps"), f"{path.name} layer split")
        if budget == 32:
            put("split", "ddtree", ctx, r.get("ddtree32_round_ms"), s.get("copy_GBps"), f"{path.name} layer split")
    return m


def nearest(points: dict, ctx: int):
    """The measurement at ctx, else the one at the nearest context (log scale). -> (ctx0, (ms, copy, src))."""
    c0 = min(points, key=lambda c: abs(math.log(c / ctx)))
    return c0, points[c0]


def collective_ms(cfg: TargetConfig, unit: str, T: int, drafter_rows: int, us: float, link_GBps: float,
                  world: int = 2) -> float:
    """One unit's collectives under TP: per forward 2 x layers all-reduces of [T, hidden] bf16 and a
    gather of this rank's [T, V/W] logits; a round adds the drafter's [rows, V/W] gather. Each costs
    the published latency plus its bytes over the link."""
    ar_bytes = T * cfg.hidden_size * 2
    gather = T * cfg.vocab_size // world * 2
    ms = 2 * cfg.num_layers * (us + ar_bytes / link_GBps * 1e-3) * 1e-3 + (us + gather / link_GBps * 1e-3) * 1e-3
    if unit != "ar":
        ms += (us + drafter_rows * cfg.vocab_size // world * 2 / link_GBps * 1e-3) * 1e-3
    return ms


def project(docs: dict, contexts: list[int], budget: int, bw: float, link_GBps: float, accept: dict,
            raw_t: dict, raw_d: dict) -> dict:
    notes: list[str] = []
    by = Bytes(raw_t, raw_d)
    cfg = by.cfg
    meas = measurements(docs, budget, notes)
    if not meas.get(("1gpu", "ar")):
        raise SystemExit("no one-GPU AR measurement: pass scripts/bench_engine.py's JSON (or bench_tp_rank.py --full)")
    T = {"ar": 1, "dflash": by.dcfg.block_size, "ddtree": budget + 1}  # verify nodes
    rows_d = by.dcfg.block_size - 1  # drafted rows whose logits a round gathers
    eff: dict = {}  # (setup, unit, ctx0) -> efficiency on the H200

    def a6000(source: str, unit: str, world: int, ctx: int):
        """A6000 ms of `unit` on a card holding 1/world of the target, at the efficiency the `source`
        ('1gpu' or 'shard') measurement reached on the H200 -> (ms, how); (None, None) if none."""
        pts = meas.get((source, unit))
        if not pts:
            return None, None
        c0, (ms, copy, src) = nearest(pts, ctx)
        e = by.unit(unit, 1 if source == "1gpu" else 2, c0) / (ms * 1e-3 * copy * 1e9)
        eff[(source, unit, c0)] = e
        how = src + (f", bytes-scaled to ctx {ctx}" if c0 != ctx else "")
        return by.unit(unit, world, ctx) / (bw * 1e9 * e) * 1e3, how

    setups = [("layer split", None)] + [(f"TP=2, {name} {us:g}us", us) for name, us in PUBLISHED["allreduce_us"].items()]
    rows = []
    for ctx in contexts:
        for setup, us in setups:
            row = {"setup": setup, "ctx": ctx}
            for u in UNITS:
                if us is None:  # layer split
                    ms, how = a6000("1gpu", u, 1, ctx)
                    floor = meas.get(("split", u), {}).get(ctx)
                    if ms is not None and floor and floor[0] > ms:
                        ms, how = floor[0], f"{floor[2]} (host-bound H200 split time, longer than the GPU-bound {ms:.1f} ms)"
                else:
                    ms, how = a6000("shard", u, 2, ctx)
                    if ms is None:  # no shard measured: the rank's bytes at the one-GPU efficiency
                        ms, how = a6000("1gpu", u, 2, ctx)
                        how = how and f"shard at the one-GPU efficiency ({how})"
                    if ms is not None:
                        c = collective_ms(cfg, u, T[u], rows_d, us, link_GBps)
                        row[f"{u}_collectives_ms"] = c
                        ms += c
                row[f"{u}_ms"] = ms
                row[f"{u}_source"] = how
            if row["ar_ms"]:
                row["ar_tok_s"] = 1e3 / row["ar_ms"]
            for name, acc in accept.items():
                for u in ("dflash", "ddtree"):
                    if row.get(f"{u}_ms") and acc.get(u):
                        row[f"{u}_tok_s_{name}"] = acc[u] * 1e3 / row[f"{u}_ms"]
            rows.append(row)
    return {"rows": rows, "eff": eff, "notes": notes, "meas": meas, "T": T, "bytes": by}


def split_floors(meas: dict) -> str:
    got = [f"{u} {ms:.1f} ms at ctx {c}" for u in UNITS for c, (ms, _, _) in sorted(meas.get(("split", u), {}).items())]
    return f" (H200 split: {', '.join(got)})" if got else " (no H200 split time given)"


def cross_check(docs: dict, res: dict, cfg: TargetConfig) -> dict | None:
    """The H200 TP=2 AR step bench_multigpu.py measured against the shard time this model uses:
    the difference, spread over the collectives, should be near a published NCCL figure."""
    if "split" not in docs or "TP=2" not in docs["split"][1]["results"]:
        return None
    path, s = docs["split"]
    ctx = int(s.get("ctx", 1024))
    tp_ms = s["results"]["TP=2"]["ar_ms_per_token"]
    shard = res["meas"].get(("shard", "ar"), {}).get(ctx)
    if shard:
        est, how = shard[0], "measured by bench_tp_rank.py"
    else:
        one = res["meas"].get(("1gpu", "ar"), {}).get(ctx)
        if not one:
            return None
        b1 = rank_bytes_per_token(cfg, 1, context=ctx)["step_bytes"]
        b2 = rank_bytes_per_token(cfg, 2, context=ctx)["step_bytes"]
        est, how = one[0] * b2 / b1, "the one-GPU step x rank bytes / all bytes"
    n = 2 * cfg.num_layers + 1
    us = (tp_ms - est) / n * 1e3
    return {"tp2_h200_ms": tp_ms, "shard_h200_ms": est, "implied_us_per_collective": us,
            "text": f"on the H200 pair (NVLink, NCCL) {path.name} measured TP=2 at {tp_ms:.2f} ms/token; the shard "
                    f"alone {est:.2f} ms ({how}) leaves {us:.0f} us for each of the {n} collectives "
                    "(published NCCL figure: ~20 us)"}


def judge(rows: list[dict], contexts: list[int], B: int, accept: dict, tree_gain: float, cfg: TargetConfig) -> dict:
    """Is ddtree on TP=2 (NCCL, what the code uses today) at the first context above the users' MTP figure?"""
    target = PUBLISHED["users_mtp_tok_s"]
    ctx = contexts[0]
    bytes_rank = rank_bytes_per_token(cfg, 2, context=ctx)["step_bytes"]
    r = next((x for x in rows if x["ctx"] == ctx and x["setup"].startswith("TP=2, nccl")), None)
    if r is None or not r.get("ddtree_ms"):
        return {"text": f"verdict: no TP=2 ddtree-{B} projection at ctx {ctx}", "above": None}
    tok = r["ddtree_tok_s_published"]
    need = target * r["ddtree_ms"] / 1e3  # acceptance that would reach the target
    lo, hi = 5.0 * (1 + tree_gain) * 1e3 / r["ddtree_ms"], 6.0 * (1 + tree_gain) * 1e3 / r["ddtree_ms"]
    one = next((x for x in rows if x["ctx"] == ctx and x["setup"].startswith("TP=2, oneshot")), {})
    lines = [f"verdict: ddtree-{B} on TP=2 (NCCL over PCIe, today's code) at ctx {ctx}: {tok:.1f} tok/s with the "
             f"published acceptance {accept['published']['ddtree']:.2f} ({lo:.0f}-{hi:.0f} for a chain of 5-6), "
             f"{'ABOVE' if tok > target else 'BELOW'} the {target} tok/s users measured with a serving stack's MTP on "
             f"2x A6000; it needs an acceptance of {need:.2f} tokens per round to reach it."]
    blockers = []
    if r.get("ddtree_collectives_ms"):
        blockers.append(f"the collectives cost {r['ddtree_collectives_ms']:.1f} ms of the {r['ddtree_ms']:.1f} ms round"
                        + (f" (a one-shot all-reduce: {one['ddtree_collectives_ms']:.1f} ms -> "
                           f"{one.get('ddtree_tok_s_published', 0):.1f} tok/s)" if one.get("ddtree_collectives_ms") else ""))
    if r.get("dflash_tok_s_published") and r["dflash_tok_s_published"] > tok:
        blockers.append(f"dflash (the chain) projects {r['dflash_tok_s_published']:.1f} tok/s: a {B}-node tree costs "
                        f"{r['ddtree_ms'] / r['dflash_ms'] - 1:.0%} more per round for {tree_gain:.0%} more tokens")
    if "codepair" in accept and r.get("ddtree_tok_s_codepair"):
        blockers.append(f"with the codepair acceptance ({accept['codepair']['ddtree']:.2f}) it is "
                        f"{r['ddtree_tok_s_codepair']:.1f} tok/s: the real drafter's acceptance is the premise")
    blockers.append(f"bf16 weights: each card streams {bytes_rank / 1e9:.1f} GB per step, at {A6000_GBPS:.0f} GB/s no "
                    f"faster than {bytes_rank / A6000_GBPS / 1e6:.1f} ms; the weight format behind the users' "
                    f"{target} tok/s is not in our notes")
    lines += ["what it rests on, and what stands in the way:"] + [f"  - {b}" for b in blockers]
    return {"text": "\n".join(lines), "above": tok > target, "ddtree_tok_s": tok, "accept_needed": need,
            "range_tok_s": [lo, hi], "blockers": blockers}


def read_inputs(paths: list[Path], preset: str) -> dict:
    """{kind: (path, doc)} for the result files, each recognised by its content."""
    docs: dict = {}
    for p in paths:
        doc = load(p)
        k = kind_of(doc)
        if k is None:
            raise SystemExit(f"{p}: not a bench_engine / bench_tp_rank / bench_multigpu result")
        if k in docs:
            raise SystemExit(f"{p}: a second {k} result ({docs[k][0]} given too)")
        got = doc.get("preset") or (doc.get("main") or {}).get("preset")
        if got and got != preset:
            raise SystemExit(f"{p} measured {got}, not {preset}: pass --preset {got}")
        docs[k] = (p, doc)
    if "engine" not in docs and "tp_rank" not in docs:
        raise SystemExit("pass at least scripts/bench_engine.py's JSON")
    return docs


def table_lines(rows: list[dict], title: str, B: int, codepair: bool) -> list[str]:
    def f(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(int(spec.split(".")[0]))

    lines = [title,
             f"{'':24s} {'':>5s} | {'ms per step / round':^26s} | {'tok/s, published accept.':^27s}"
             + (f" | {'tok/s, codepair':^19s}" if codepair else ""),
             f"{'setup':24s} {'ctx':>5s} | {'AR':>7s} {'dflash':>8s} {f'ddtree-{B}':>9s} | {'AR':>7s} {'dflash':>8s} "
             f"{f'ddtree-{B}':>10s}" + (f" | {'dflash':>8s} {f'ddtree-{B}':>10s}" if codepair else "")]
    for r in rows:
        ctx = f"{r['ctx'] // 1024}K" if r["ctx"] % 1024 == 0 else str(r["ctx"])
        lines.append(f"{r['setup']:24s} {ctx:>5s} | {f(r.get('ar_ms'), '7.1f')} {f(r.get('dflash_ms'), '8.1f')} "
                     f"{f(r.get('ddtree_ms'), '9.1f')} | {f(r.get('ar_tok_s'), '7.1f')} "
                     f"{f(r.get('dflash_tok_s_published'), '8.1f')} {f(r.get('ddtree_tok_s_published'), '10.1f')}"
                     + (f" | {f(r.get('dflash_tok_s_codepair'), '8.1f')} {f(r.get('ddtree_tok_s_codepair'), '10.1f')}"
                        if codepair else ""))
    return lines


def assumption_lines(a, res: dict, docs: dict, accept: dict, bw: float) -> list[str]:
    """Every assumption behind the table; lines starting with four spaces belong to the one above."""
    by, B = res["bytes"], a.budget
    cfg, acc_p, acc_c = by.cfg, accept["published"], accept.get("codepair")
    out = [f"A6000 bandwidth {a.a6000_GBps:.0f} GB/s (datasheet) x {a.copy_fraction:g} = {bw:.0f} GB/s, derated by "
           "the efficiency each unit reached on the H200 (bytes from the configs / time / copy bandwidth of that run):"]
    names = {"1gpu": "one GPU", "shard": "TP=2 rank (bench_tp_rank.py)"}
    for (src, u, c0), e in sorted(res["eff"].items(), key=lambda x: (x[0][0], UNITS.index(x[0][1]), x[0][2])):
        out.append(f"    {names[src]} {u if u == 'ar' else u + ' round'} at ctx {c0}: efficiency {e:.2f}")
    if not res["meas"].get(("shard", "ar")):
        out.append("no bench_tp_rank.py result: a TP=2 rank is assumed to reach the ONE-GPU efficiency "
                   "(optimistic: a rank runs every kernel for half the bytes)")
    T = res["T"]
    out += [
        f"TP=2 collectives per forward: {2 * cfg.num_layers} all-reduces of T x {cfg.hidden_size} bf16 + 1 logits "
        f"all-gather of T x {cfg.vocab_size // 2} bf16 per rank (T = {T['dflash']} dflash, {T['ddtree']} ddtree-{B}); "
        f"a round also gathers the drafter's {T['dflash'] - 1} rows; each at a PUBLISHED latency (NCCL ~20 us, "
        f"one-shot ~5 us over PCIe, for ~8-10 KB inside CUDA graphs) + bytes / {a.link_GBps:g} GB/s (assumed PCIe "
        "peer-to-peer bandwidth)",
        "layer split: the GPU-bound time of all bytes through one card at a time, or the H200's host-bound (eager) "
        "split time where that is longer" + split_floors(res["meas"]) + "; the activation hop between the cards is "
        "left out",
        f"acceptance (tokens per round), published for the real Qwen3.6-27B DFlash drafter: chain {acc_p['dflash']:.2f} "
        f"(about 5-6), tree +{a.tree_gain:.0%} = {acc_p['ddtree']:.2f} (a few percent; one figure for every budget "
        "and context)",
    ]
    if acc_c:
        out.append(f"codepair acceptance measured on the H200 ({docs['engine'][0].name} codepair): dflash "
                   f"{acc_c['dflash']:.2f}, ddtree-{B} {acc_c.get('ddtree') or float('nan'):.2f} (a 27.6M-parameter "
                   "trained pair: far below the real drafter)")
    embed = 2 * cfg.vocab_size * cfg.hidden_size
    w1, w2 = (rank_bytes_per_token(cfg, w)["weight_bytes"] for w in (1, 2))
    out.append(f"bf16 weights ({w1 / 1e9:.1f} GB + {embed / 1e9:.1f} GB embedding, drafter {by.drafter_weights / 1e9:.1f} "
               f"GB): a TP=2 card holds {(w2 + embed + by.drafter_weights) / 1e9:.1f} GB, a layer-split card "
               f"~{(w1 + embed + by.drafter_weights) / 2e9:.1f} GB, of 48 (+ K/V); the H200 timings are of random "
               "weights (cost does not depend on the values)")
    extrap = [f"{r['setup'].split(',')[0]} {u} ctx {r['ctx']}" for r in res["rows"] for u in UNITS
              if "bytes-scaled" in (r.get(f"{u}_source") or "") and not r["setup"].startswith("TP=2, oneshot")]
    if extrap:
        out.append("extrapolated to another context by bytes at the measured efficiency (no measurement at that "
                   "context): " + ", ".join(extrap))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", type=Path, help="JSON files of bench_engine / bench_tp_rank / bench_multigpu")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--budget", type=int, default=32, help="the ddtree budget projected")
    ap.add_argument("--a6000-GBps", type=float, default=A6000_GBPS, help="datasheet bandwidth of one card")
    ap.add_argument("--copy-fraction", type=float, default=1.0,
                    help="A6000 copy bandwidth / datasheet (the H200 copies at ~0.88 of its 4.8 TB/s)")
    ap.add_argument("--link-GBps", type=float, default=20.0, help="assumed PCIe peer-to-peer bandwidth per direction")
    ap.add_argument("--accept-chain", type=float, default=PUBLISHED["chain_accept"],
                    help="published chain acceptance of the real drafter (tokens per round)")
    ap.add_argument("--tree-gain", type=float, default=PUBLISHED["tree_gain"],
                    help="published extra acceptance of a tree over the chain (fraction)")
    ap.add_argument("--preset", default="qwen3.6-27b", choices=sorted(PRESETS))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    docs = read_inputs(a.inputs, a.preset)
    contexts = [int(x) for x in a.contexts.split(",")]
    bw = a.a6000_GBps * a.copy_fraction
    accept = {"published": {"dflash": a.accept_chain, "ddtree": a.accept_chain * (1 + a.tree_gain)}}
    cp = docs.get("engine", (None, {}))[1].get("codepair") or {}
    if cp and "dflash" not in cp:  # per drafter and dtype: the first one's
        cp = next(iter(cp.values()))
    cp_accept = lambda x: x.get("accept", x.get("tokens_per_forward"))  # noqa: E731 (older files: accept)
    if cp_accept(cp.get("dflash", {})):
        accept["codepair"] = {"dflash": cp_accept(cp["dflash"]), "ddtree": cp_accept(cp.get(f"ddtree:{a.budget}", {}))}
    mk_t, mk_d = PRESETS[a.preset]
    res = project(docs, contexts, a.budget, bw, a.link_GBps, accept, mk_t(), mk_d())
    cfg = res["bytes"].cfg

    title = (f"\n== PROJECTION, not a measurement: {a.preset} bf16 on 2x RTX A6000 (48 GB, {a.a6000_GBps:.0f} GB/s "
             "each, PCIe), batch 1, greedy, from H200 measurements")
    print("\n".join(table_lines(res["rows"], title, a.budget, "codepair" in accept)))
    assumptions = assumption_lines(a, res, docs, accept, bw)
    print("assumptions:")
    i = 0
    for s in assumptions:
        if s.startswith("    "):  # a sub-item of the one above
            print(f"  {s}")
        else:
            i += 1
            print(f"  {i}. {s}")
    for n in res["notes"]:
        print(f"  note: {n}")
    cross = cross_check(docs, res, cfg)
    if cross:
        print(f"cross-check: {cross['text']}")
    verdict = judge(res["rows"], contexts, a.budget, accept, a.tree_gain, cfg)
    print(verdict["text"])
    doc = {"kind": "projection_2xA6000", "preset": a.preset, "budget": a.budget,
           "inputs": {k: str(p) for k, (p, _) in docs.items()}, "a6000_GBps": a.a6000_GBps,
           "copy_fraction": a.copy_fraction, "link_GBps": a.link_GBps, "accept": accept, "published": PUBLISHED,
           "rows": res["rows"], "assumptions": [s.strip() for s in assumptions], "notes": res["notes"],
           "efficiency_h200": {f"{s}:{u}:ctx{c}": e for (s, u, c), e in res["eff"].items()}, "cross_check": cross,
           "verdict": verdict}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()

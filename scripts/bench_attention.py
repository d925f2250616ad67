"""Benchmark the attention ops of ddtree.ops.attention on one GPU (Qwen3.6-27B shapes, bf16).

* tree verify / AR step: H=24, KVH=4, D=256 at prefixes 1K, 8K, 32K, 128K and T = 1, 16, 32, 64,
  128 nodes: the dense-mask SDPA twin (today's call), `tree_attention`, and FlexAttention with a
  block mask (a few shapes; skipped where unavailable). ms per layer call, GB/s of K/V read (and
  as a fraction of a measured device copy), max relative error against the twin.
* drafter block: H=32, KVH=8, D=128, B=16 at the same contexts, sliding window 2048 (causal) and
  full (non-causal).
* prefill chunks of 2048 and 4096 tokens at prefixes 0, 32K, 128K through each backend of
  `prefill_attention`, TFLOP/s.
* the split count at 32K (the rule against fixed counts).

Timings: CUDA events around replays of a CUDA graph that calls the op once per cache layer
(several layers, rotated, so that L2 does not hold the K/V of the next call); the median over
replays, divided by the layers. Each measurement is guarded: an error is printed and the run goes
on. Everything is written to --out (JSON); a compact table is printed last.

    python scripts/bench_attention.py --out results/bench_attention.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's ddtree

from ddtree.ops import attention as A  # noqa: E402
from ddtree.ops.tree import ancestor_mask_from_parents  # noqa: E402

DEV = torch.device("cuda:0")
DT = torch.bfloat16
T_START = time.time()
RESULTS: list[dict] = []


def log(msg: str) -> None:
    print(f"[{time.time() - T_START:6.1f}s] {msg}", flush=True)


def over_budget(args) -> bool:
    return time.time() - T_START > args.budget_s


def record(**kw) -> dict:
    RESULTS.append(kw)
    return kw


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.float(), ref.float()
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ----------------------------------------------------------------------------- timing
def time_per_call(launch, layers: int, target_s: float = 0.25, graph: bool = True) -> tuple[float, str]:
    """Median ms of one launch(i) (i = layer), launches rotated over `layers` cache layers inside a
    captured CUDA graph (eager when capture fails). -> (ms, "graph" | "eager")."""
    for i in range(layers):  # warm-up: compiles, autotunes, allocations
        launch(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(layers):
        launch(i)
    torch.cuda.synchronize()
    est = max((time.perf_counter() - t0), 1e-5)
    mode, g = "eager", None
    if graph:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for i in range(layers):
                    launch(i)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(layers):
                    launch(i)
            g.replay()
            torch.cuda.synchronize()
            mode = "graph"
        except Exception as e:  # capture not possible for this op: time it eagerly
            log(f"  (graph capture failed, eager timing: {type(e).__name__}: {str(e)[:120]})")
            g = None
            torch.cuda.synchronize()
    reps = int(max(5, min(200, target_s / est)))
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record()
        if g is not None:
            g.replay()
        else:
            for i in range(layers):
                launch(i)
        b.record()
    torch.cuda.synchronize()
    ms = statistics.median(a.elapsed_time(b) for a, b in ev) / layers
    del g
    return ms, mode


def layers_for(layer_bytes: int) -> int:
    """Enough cache layers that their K/V exceed L2 four times over (2..32)."""
    l2 = getattr(torch.cuda.get_device_properties(DEV), "L2_cache_size", 50 << 20) or (50 << 20)
    return int(max(2, min(32, math.ceil(4 * l2 / max(layer_bytes, 1)))))


def bucket(n: int, b: int = 256) -> int:
    return -(-n // b) * b


def random_tree_mask(T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, i - 4) if i % 3 else 0, i, (), generator=g)) for i in range(1, T)]
    return ancestor_mask_from_parents(parents)


# ----------------------------------------------------------------------------- tree / block
class Cache:
    """`layers` K/V caches [N, KVH, D] (one allocation) with random contents."""

    def __init__(self, layers: int, N: int, KVH: int, D: int):
        self.k = torch.randn(layers, N, KVH, D, device=DEV, dtype=DT)
        self.v = torch.randn(layers, N, KVH, D, device=DEV, dtype=DT)
        self.layers = layers


def flex_fn():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception:
        return None
    return create_block_mask, torch.compile(flex_attention, dynamic=False)


def bench_tree(args, kind, ctx, T, H, KVH, D, tree_mask, window, causal, bw, flex=None, splits_list=(None,),
               time_twin=True, runs=None, target_s=0.25):
    """At one shape: the twin (timed, or only run for the reference), tree_attention for each split
    count in splits_list (None: the rule) or each (tiles, splits) of runs (None: the default's),
    and FlexAttention when flex is given."""
    kv_len = bucket(ctx + T)
    read_rows = (ctx if window is None else min(ctx, window)) + T
    kv_bytes = read_rows * KVH * D * 2 * 2  # K and V, bf16
    layer_bytes = kv_len * KVH * D * 2 * 2
    L = layers_for(layer_bytes)
    base = dict(kind=kind, ctx=ctx, T=T, H=H, KVH=KVH, D=D, kv_len=kv_len, window=window, causal=causal, layers=L,
                kv_bytes=kv_bytes)
    try:
        cache = Cache(L, kv_len, KVH, D)
    except Exception as e:
        log(f"{kind} ctx={ctx} T={T}: cache allocation failed: {e}")
        record(**base, impl="all", error=f"alloc: {e}")
        return
    q = torch.randn(T, H, D, device=DEV, dtype=DT)
    st = torch.tensor(ctx, device=DEV)
    tm = tree_mask if isinstance(tree_mask, str) else tree_mask.to(DEV)
    ref = None
    # ---- the twin: SDPA with the dense [T, kv_len] mask (built once, as make_step does for all layers)
    try:
        vis = A._visible(T, kv_len, st, tree_mask if isinstance(tree_mask, str) else tm, None, window, causal, DEV)
        q4 = q.transpose(0, 1)[None]
        outs = [None] * L

        def twin(i):
            kk = cache.k[i].transpose(0, 1)[None]
            vv = cache.v[i].transpose(0, 1)[None]
            outs[i] = F.scaled_dot_product_attention(q4, kk, vv, attn_mask=vis[None, None], enable_gqa=H != KVH)

        if time_twin:
            ms, mode = time_per_call(twin, L)
            r = record(**base, impl="twin", ms=ms, mode=mode, gbps=kv_bytes / (ms * 1e-3) / 1e9)
            r["frac_copy_bw"] = r["gbps"] / bw
            log(f"{kind} ctx={ctx} T={T} twin: {ms:.3f} ms ({mode})")
        twin(0)
        ref = outs[0][0].transpose(0, 1).clone()
        del outs, vis
    except Exception as e:
        log(f"{kind} ctx={ctx} T={T} twin FAILED: {type(e).__name__}: {str(e)[:200]}")
        record(**base, impl="twin", error=f"{type(e).__name__}: {e}")
    # ---- the fast op
    for tt, splits in runs or [(None, s) for s in splits_list]:
        name = ("tree_attention" if splits is None and tt is None else f"tree_attention[splits={splits}]" if tt is None
                else f"tree_attention[{tt.bm},{tt.bn},{tt.warps},{tt.stages}|{splits}]")
        try:
            out = torch.empty(L, T, H, D, device=DEV, dtype=DT)

            def fast(i, splits=splits, tt=tt):
                A.tree_attention(q, cache.k[i], cache.v[i], st, tm, kv_len, window=window, causal=causal, out=out[i],
                                 splits=splits, tiles=tt)

            ms, mode = time_per_call(fast, L, target_s=target_s)
            rows = T * (H // KVH)
            read_len = kv_len if window is None else min(kv_len, window)
            tiles = tt or [c for c in A.candidate_tiles(D, rows, DT, DEV, read_len) if (c, (DEV.index, D, DT)) not in A._BAD][0]
            ns = A.num_splits(read_len, rows, KVH, tiles.bm,
                              torch.cuda.get_device_properties(DEV).multi_processor_count) if splits is None else splits
            err = rel_err(out[0], ref) if ref is not None else None
            r = record(**base, impl=name, ms=ms, mode=mode, gbps=kv_bytes / (ms * 1e-3) / 1e9, rel_err=err,
                       splits=ns, tiles=vars(tiles))
            r["frac_copy_bw"] = r["gbps"] / bw
            log(f"{kind} ctx={ctx} T={T} {name}: {ms:.4f} ms, {r['gbps']:.0f} GB/s ({r['frac_copy_bw']:.0%} of copy), "
                f"splits={ns} tiles={tiles}, rel err {err if err is None else f'{err:.2e}'} ({mode})")
            del out
        except Exception as e:
            log(f"{kind} ctx={ctx} T={T} {name} FAILED: {type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=3)
            record(**base, impl=name, error=f"{type(e).__name__}: {e}")
    # ---- FlexAttention with a block mask
    if flex is not None:
        try:
            create_block_mask, flex_attention = flex
            dense = A._dense_tree_mask(tree_mask, T, DEV)

            def mask_mod(b, h, qi, kv):
                j = (kv - ctx).clamp(0, T - 1)
                vis = (kv < ctx) | ((kv >= ctx) & (kv < ctx + T) & dense[qi, j])
                if window is not None:
                    vis = vis & (ctx + qi - kv < window)
                return vis

            bm = create_block_mask(mask_mod, None, None, T, kv_len, device=DEV)
            q4 = q.transpose(0, 1)[None]
            outs = [None] * L

            def fx(i):
                outs[i] = flex_attention(q4, cache.k[i].transpose(0, 1)[None], cache.v[i].transpose(0, 1)[None],
                                         block_mask=bm, enable_gqa=H != KVH)

            ms, mode = time_per_call(fx, L)
            fx(0)
            err = rel_err(outs[0][0].transpose(0, 1), ref) if ref is not None else None
            r = record(**base, impl="flex", ms=ms, mode=mode, gbps=kv_bytes / (ms * 1e-3) / 1e9, rel_err=err)
            r["frac_copy_bw"] = r["gbps"] / bw
            log(f"{kind} ctx={ctx} T={T} flex: {ms:.4f} ms ({mode}), rel err {err}")
            del outs
        except Exception as e:
            log(f"{kind} ctx={ctx} T={T} flex FAILED: {type(e).__name__}: {str(e)[:200]}")
            record(**base, impl="flex", error=f"{type(e).__name__}: {e}")
    del cache
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- tiles and FA2
# Row tile x key tile x warps x stages tried by --tile-sweep on the target's head dim (256); each
# is compiled only where its shared-memory estimate fits the device (A._smem_estimate).
SWEEP_TILES = [A.Tiles(*t) for t in (
    (16, 32, 4, 3), (16, 32, 4, 4), (16, 64, 4, 2), (16, 64, 4, 3), (16, 64, 8, 3), (16, 128, 4, 2), (16, 128, 8, 2),
    (32, 32, 4, 3), (32, 64, 4, 3), (32, 64, 8, 3), (64, 32, 4, 3), (64, 32, 8, 3), (64, 64, 4, 2), (64, 64, 8, 2),
    (128, 32, 8, 2), (128, 32, 8, 3))]


def bench_tiles(args, ctx, T, bw, sms):
    """tree_attention at one (context, tree) over SWEEP_TILES, each with the split counts that fill
    1, 2 and 3 programs per SM (A.num_splits with per_sm), against the default (rule) choice; and
    the prefix alone through SDPA's FlashAttention-2 (varlen, seqused_k) for comparison."""
    H, KVH, D = 24, 4, 256
    rows = T * (H // KVH)
    kv_len = bucket(ctx + T)
    hopper = torch.cuda.get_device_capability(DEV)[0] >= 9
    limit = A._smem_limit(DEV) - A._SMEM_RESERVE
    runs = [(None, None)]
    tiles = [A.Tiles(*map(int, x.split(","))) for x in args.sweep_tiles] if args.sweep_tiles else SWEEP_TILES
    for t in tiles:
        if t.bm > max(16, A._pow2(rows)) or A._smem_estimate(t, D, 2, hopper) > limit:
            continue
        for per_sm in args.per_sm:
            ns = A.num_splits(kv_len, rows, KVH, t.bm, sms, per_sm)
            if (t, ns) not in runs:
                runs.append((t, ns))
    bench_tree(args, "tile-sweep", ctx, T, H, KVH, D, random_tree_mask(T, T), None, True, bw, runs=runs,
               time_twin=False, target_s=0.1)
    L = layers_for(kv_len * KVH * D * 4)
    cache = Cache(L, kv_len, KVH, D)
    base = dict(kind="tile-sweep", ctx=ctx, T=T, H=H, KVH=KVH, D=D, kv_len=kv_len, window=None, causal=True, layers=L,
                kv_bytes=ctx * KVH * D * 4)
    q = torch.randn(T, H, D, device=DEV, dtype=DT)
    # the committed prefix alone through FA2 varlen: q packed as [T*G, KVH, D], keys [0, start)
    qp = q.view(T, KVH, H // KVH, D).transpose(1, 2).reshape(rows, KVH, D).contiguous()
    cu_q = torch.tensor([0, rows], device=DEV, dtype=torch.int32)
    cu_k = torch.tensor([0, kv_len], device=DEV, dtype=torch.int32)
    used = torch.tensor([ctx], device=DEV, dtype=torch.int32)
    for nsp in (None,) if args.no_fa2 else (None, 0, 8, 16, 32, 64, 128):
        name = f"fa2-prefix[num_splits={nsp}]"
        try:
            kw = {} if nsp is None else {"num_splits": nsp}

            def fa(i, kw=kw):
                torch.ops.aten._flash_attention_forward(qp, cache.k[i], cache.v[i], cu_q, cu_k, rows, kv_len, 0.0,
                                                        False, False, seqused_k=used, **kw)

            ms, mode = time_per_call(fa, L, target_s=0.1)
            r = record(**base, impl=name, ms=ms, mode=mode, gbps=ctx * KVH * D * 4 / (ms * 1e-3) / 1e9)
            r["frac_copy_bw"] = r["gbps"] / bw
            log(f"tiles ctx={ctx} T={T} {name}: {ms:.4f} ms ({r['frac_copy_bw']:.0%} of copy)")
        except Exception as e:
            log(f"tiles ctx={ctx} T={T} {name} FAILED: {type(e).__name__}: {str(e)[:200]}")
            record(**base, impl=name, error=f"{type(e).__name__}: {e}")
    del cache
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- prefill
def bench_prefill(args, T, start, backends):
    H, KVH, D = 24, 4, 256
    S = start + T
    flops = 4 * H * D * (T * start + T * (T + 1) / 2)  # QK^T and PV over the visible keys
    base = dict(kind="prefill", T=T, ctx=start, H=H, KVH=KVH, D=D, flops=flops)
    try:
        k = torch.randn(S, KVH, D, device=DEV, dtype=DT)
        v = torch.randn(S, KVH, D, device=DEV, dtype=DT)
        q = torch.randn(T, H, D, device=DEV, dtype=DT)
    except Exception as e:
        record(**base, impl="all", error=f"alloc: {e}")
        return
    ref = None
    if T * S * H * 4 <= 8e9:  # the dense twin's fp32 scores fit comfortably
        try:
            ref = A.prefill_attention_reference(q.float(), k.float(), v.float(), start)
        except Exception as e:
            log(f"prefill T={T} start={start} twin FAILED: {type(e).__name__}: {str(e)[:120]}")
        torch.cuda.empty_cache()
    first = None
    for be in backends:
        if over_budget(args):
            break
        try:
            o = A.prefill_attention(q, k, v, start, backend=be)
            ms, mode = time_per_call(lambda i: A.prefill_attention(q, k, v, start, backend=be), 1, target_s=0.3, graph=False)
            err = rel_err(o, ref) if ref is not None else (rel_err(o, first) if first is not None else None)
            first = o if first is None else first
            r = record(**base, impl=be, ms=ms, mode=mode, tflops=flops / (ms * 1e-3) / 1e12, rel_err=err,
                       err_vs="twin" if ref is not None else "first backend")
            log(f"prefill T={T} start={start} {be}: {ms:.3f} ms, {r['tflops']:.0f} TFLOP/s, rel err {err}")
        except Exception as e:
            log(f"prefill T={T} start={start} {be} FAILED: {type(e).__name__}: {str(e)[:200]}")
            record(**base, impl=be, error=f"{type(e).__name__}: {e}")
    del k, v, q, ref, first
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- report
def table() -> str:
    lines = []
    by = {}
    for r in RESULTS:
        by.setdefault((r["kind"], r["ctx"], r.get("T"), r.get("window")), {})[r["impl"]] = r

    def ms(r):
        return "-" if r is None or "ms" not in r else f"{r['ms']:.3f}"

    lines.append("tree verify / AR step (H=24, KVH=4, D=256, bf16): ms per layer call")
    lines.append(f"{'ctx':>7} {'T':>4} {'twin':>9} {'fast':>9} {'x':>6} {'GB/s':>6} {'%copy':>6} {'flex':>9} {'rel err':>9} splits")
    for (kind, ctx, T, w), d in sorted(by.items(), key=lambda x: (x[0][0], x[0][1], x[0][2] or 0, str(x[0][3]))):
        if kind != "target":
            continue
        tw, fa, fx = d.get("twin"), d.get("tree_attention"), d.get("flex")
        sp = f"{tw['ms'] / fa['ms']:.1f}" if tw and fa and "ms" in tw and "ms" in fa else "-"
        gb = f"{fa['gbps']:.0f}" if fa and "gbps" in fa else "-"
        fr = f"{fa['frac_copy_bw']:.0%}" if fa and "frac_copy_bw" in fa else "-"
        er = f"{fa['rel_err']:.1e}" if fa and fa.get("rel_err") is not None else "-"
        lines.append(f"{ctx:>7} {T:>4} {ms(tw):>9} {ms(fa):>9} {sp:>6} {gb:>6} {fr:>6} {ms(fx):>9} {er:>9} "
                     f"{fa.get('splits', '-') if fa else '-'}")
    lines.append("")
    lines.append("drafter block (H=32, KVH=8, D=128, B=16, bf16)")
    lines.append(f"{'ctx':>7} {'layer':>12} {'twin':>9} {'fast':>9} {'x':>6} {'GB/s':>6} {'rel err':>9}")
    for (kind, ctx, T, w), d in sorted(by.items(), key=lambda x: (x[0][0], x[0][1], str(x[0][3]))):
        if kind != "drafter":
            continue
        tw, fa = d.get("twin"), d.get("tree_attention")
        sp = f"{tw['ms'] / fa['ms']:.1f}" if tw and fa and "ms" in tw and "ms" in fa else "-"
        gb = f"{fa['gbps']:.0f}" if fa and "gbps" in fa else "-"
        er = f"{fa['rel_err']:.1e}" if fa and fa.get("rel_err") is not None else "-"
        name = "full" if w is None else f"window {w}"
        lines.append(f"{ctx:>7} {name:>12} {ms(tw):>9} {ms(fa):>9} {sp:>6} {gb:>6} {er:>9}")
    lines.append("")
    lines.append("prefill chunk (H=24, KVH=4, D=256, bf16): ms / TFLOP/s")
    for (kind, ctx, T, w), d in sorted(by.items(), key=lambda x: (x[0][0], x[0][2] or 0, x[0][1])):
        if kind != "prefill":
            continue
        cells = []
        for be, r in d.items():
            cells.append(f"{be} " + (f"{r['ms']:.2f}/{r['tflops']:.0f}" if "ms" in r else "FAILED"))
        lines.append(f"T={T:>5} prefix={ctx:>7}: " + "  ".join(cells))
    tiles = [r for r in RESULTS if r["kind"] == "tile-sweep" and "ms" in r]
    if tiles:
        lines.append("")
        lines.append("tile sweep (target, ms per layer; rule: the default choice; fa2: the prefix alone):")
        for key in dict.fromkeys((r["ctx"], r["T"]) for r in tiles):
            rows = sorted((r for r in tiles if (r["ctx"], r["T"]) == key), key=lambda r: r["ms"])
            rule = [r for r in rows if r["impl"] == "tree_attention"]
            fa2 = [r for r in rows if r["impl"].startswith("fa2")]
            lines.append(f"  ctx={key[0]} T={key[1]}: rule {rule[0]['ms']:.4f} ({rule[0]['frac_copy_bw']:.0%})" if rule else
                         f"  ctx={key[0]} T={key[1]}:")
            for r in [r for r in rows if r["impl"].startswith("tree_attention[")][:5]:
                lines.append(f"      {r['impl']:40s} {r['ms']:.4f} ms {r['frac_copy_bw']:5.0%}")
            if fa2:
                lines.append(f"      best {fa2[0]['impl']:35s} {fa2[0]['ms']:.4f} ms {fa2[0]['frac_copy_bw']:5.0%}")
    sweep = [r for r in RESULTS if r["kind"] == "split-sweep" and r["impl"].startswith("tree_attention") and "ms" in r]
    if sweep:
        lines.append("")
        lines.append("split sweep (target; * the rule's choice):")
        for key in dict.fromkeys((r["ctx"], r["T"]) for r in sweep):
            rows = [r for r in sweep if (r["ctx"], r["T"]) == key]
            lines.append(f"  ctx={key[0]} T={key[1]}: " + "  ".join(
                f"{'*' if r['impl'] == 'tree_attention' else ''}{r['splits']}: {r['ms']:.4f}" for r in rows))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/bench_attention.json"))
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 8192, 32768, 131072])
    ap.add_argument("--trees", type=int, nargs="+", default=[1, 16, 32, 64, 128])
    ap.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--prefill-prefixes", type=int, nargs="+", default=[0, 32768, 131072])
    ap.add_argument("--sweep-ctx", type=int, nargs="*", default=[32768, 131072],
                    help="contexts of the split-count sweep (none: skip it)")
    ap.add_argument("--sweep-trees", type=int, nargs="+", default=[16, 32, 64], help="tree sizes of the sweep")
    ap.add_argument("--sweep-splits", type=int, nargs="+", default=[0, 4, 8, 12, 16, 17, 24, 32, 48, 64],
                    help="split counts the rule is compared with (0: one program per row tile)")
    ap.add_argument("--tile-ctx", type=int, nargs="*", default=[],
                    help="contexts of the tile sweep (SWEEP_TILES x split counts, and FA2 on the prefix; none: skip)")
    ap.add_argument("--tile-trees", type=int, nargs="+", default=[1, 16, 17, 32, 33, 64, 65],
                    help="tree sizes of the tile sweep (17 / 33 / 65: ddtree budgets 16 / 32 / 64 with their root)")
    ap.add_argument("--only-tiles", action="store_true", help="run only the tile sweep")
    ap.add_argument("--sweep-tiles", nargs="+", default=None, metavar="BM,BN,WARPS,STAGES",
                    help="tiles of the tile sweep instead of SWEEP_TILES, e.g. 64,32,4,3 128,32,8,3")
    ap.add_argument("--per-sm", type=int, nargs="+", default=[1, 2, 3],
                    help="programs per SM whose split counts the tile sweep times")
    ap.add_argument("--no-fa2", action="store_true", help="time FA2 on the prefix only unsplit in the tile sweep")
    ap.add_argument("--prefill-backends", nargs="+", default=["flash", "cudnn", "triton", "efficient"],
                    choices=[b for b in A.PREFILL_BACKENDS if b != "auto"], help="prefill_attention backends timed")
    ap.add_argument("--flex-contexts", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--budget-s", type=float, default=150.0, help="stop starting new measurements after this")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    props = torch.cuda.get_device_properties(DEV)
    meta = dict(device=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                smem_per_block=A._smem_limit(DEV), torch=torch.__version__, python=platform.python_version())
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception:
        meta["triton"] = None
    log(f"{meta}")
    from scripts.bench_engine import copy_bandwidth  # bytes read + written per second

    bw = copy_bandwidth() / 1e9
    meta["copy_gbps"] = bw
    log(f"device copy: {bw:.0f} GB/s (read + write)")
    flex = None if args.no_flex else flex_fn()
    torch.manual_seed(0)

    sms = props.multi_processor_count
    for ctx in args.tile_ctx:  # 0. tiles and split counts against FA2 (first: it decides the table)
        for T in args.tile_trees:
            bench_tiles(args, ctx, T, bw, sms)
    if args.only_tiles:
        args.contexts = args.sweep_ctx = args.chunks = []
        flex = None
    # 1. target tree verify / AR step
    for ctx in args.contexts:
        for T in args.trees:
            if over_budget(args):
                log("budget spent: skipping the rest of the target sweep")
                break
            bench_tree(args, "target", ctx, T, 24, 4, 256, random_tree_mask(T, T), None, True, bw)
    # 2. drafter block
    for ctx in args.contexts:
        for mask, window, causal in (("causal", 2048, True), ("full", None, False)):
            if over_budget(args):
                break
            bench_tree(args, "drafter", ctx, 16, 32, 8, 128, mask, window, causal, bw)
    # 3. prefill
    backends = args.prefill_backends
    for T in args.chunks:
        for start in args.prefill_prefixes:
            if over_budget(args):
                break
            bench_prefill(args, T, start, backends)
    # 4. the split rule against fixed counts, per context and tree size
    for ctx in args.sweep_ctx:
        for T in args.sweep_trees:
            if over_budget(args):
                break
            before = len(RESULTS)
            bench_tree(args, "split-sweep", ctx, T, 24, 4, 256, random_tree_mask(T, T), None, True, bw,
                       splits_list=(None, *args.sweep_splits), time_twin=False)
            for r in RESULTS[before:]:
                if r["impl"].startswith("tree_attention["):
                    r["splits"] = int(r["impl"].split("=")[1].rstrip("]"))
    # 5. FlexAttention (each shape a compile: last, and only with a minute of budget left)
    if flex is not None:
        for ctx in args.flex_contexts:
            for T in (t for t in (16, 128) if t in args.trees):
                if time.time() - T_START > args.budget_s - 60:
                    log("budget: skipping the remaining FlexAttention shapes")
                    break
                bench_tree(args, "target", ctx, T, 24, 4, 256, random_tree_mask(T, T), None, True, bw, flex=flex,
                           splits_list=(), time_twin=False)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(meta=meta, results=RESULTS), indent=1, default=str))
    log(f"wrote {args.out}")
    print()
    print(table())


if __name__ == "__main__":
    main()

"""The verify's attention by path, on one GPU (Qwen3.6-27B shapes: 24 / 4 heads x 256, bf16).

* `--parts splits`: `tree_attention` at short reads (1K, 8K) for T = 16..65 nodes with the prefix
  split into 0, 2, 4, ... ranges, against the split rule's choice (what a short verify waits on
  is the longest program's walk over the prefix, not the bytes).
* `--parts merge`: the split partials merged by the last split (one launch) or by a second
  kernel, AR step and trees at 1K and 128K at the engine's bound, the AR step's tiles and split
  counts at 128K, and its prefix through cuDNN.
* `--parts drafter`: the drafter's full layer (a 16-row block, 32 / 8 heads x 128) at 128K and
  32K: tiles x split counts, and its prefix through cuDNN.
* `--parts cudnn`: the committed prefix of a verify at long reads (32K, 128K) through cuDNN's
  fused attention (SDPA's cuDNN backend), the tree's rows of each KV head as one query block
  (rows = T * G, the GQA group folded into the rows), the prefix cut into S ranges that run as
  cuDNN batches: `batch` (fixed ranges of a host-known length), `ragged` (ranges from cumulative
  lengths computed on the device, the form a CUDA graph can replay at any context), and `gqa`
  (the same batches with the 24 query heads given natively); each against the split-KV Triton
  kernel's whole attention, with the error against an fp32 twin; and `tree_attention` itself with a
  floor 300 keys under the context (the engine's path: the fused prefix, the kernel's rest and
  tree, one merge) against the fp32 dense twin. In `ragged`, a graph captured at one context is
  replayed at another and checked.

Timings: CUDA events around replays of a CUDA graph calling the op once per cache layer (layers
rotated so L2 does not hold the next call's K/V); medians. A compact table is printed last and
everything goes to --out.

    python scripts/bench_verify_paths.py --out results/verify-paths-h200.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_attention as BA  # noqa: E402

from ddtree.ops import attention as A  # noqa: E402

DEV = BA.DEV
DT = torch.bfloat16
H, KVH, D = 24, 4, 256
G = H // KVH
SCALE = 1.0 / math.sqrt(D)
ROWS: list[dict] = []


def log(msg):
    BA.log(msg)


def rec(**kw):
    ROWS.append(kw)
    return kw


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def ref_prefix(q, k, v, start):
    """fp32 attention of q [T, H, D] over keys [0, start) of k, v [N, KVH, D] (no mask)."""
    qq = q.float().transpose(0, 1)[None]
    kk = k[:start].float().transpose(0, 1)[None]
    vv = v[:start].float().transpose(0, 1)[None]
    return F.scaled_dot_product_attention(qq, kk, vv, enable_gqa=True)[0].transpose(0, 1)


def unfold(o, T):
    """[KVH, T * G, D] -> [T, H, D]."""
    return o.reshape(KVH, T, G, D).permute(1, 0, 2, 3).reshape(T, H, D)


def merge(o, lse):
    """S partials o [S, KVH, rows, D] (normalized), lse [S, KVH, rows] (natural) -> [KVH, rows, D]."""
    m = lse.amax(0)
    w = (lse - m).exp()
    return (o.float() * w[..., None]).sum(0) / w.sum(0)[..., None]


# ----------------------------------------------------------------------------- the cuDNN forms
def cudnn_batch(qf, k, v, B, S):
    """prefix [0, B) in S fixed ranges of B // S keys as cuDNN batches: the library's call."""
    o, lse = A._fused_prefix_cudnn(qf, k, v, S, B // S, SCALE)
    return o, lse.reshape(S, KVH, -1)


def cudnn_batch_gqa(q, k, v, B, S):
    """the same with the 24 query heads given natively: q4 [S, H, T, D] over [S, KVH, C, D]."""
    C = B // S
    k4 = k[:B].view(S, C, KVH, D).permute(0, 2, 1, 3)
    v4 = v[:B].view(S, C, KVH, D).permute(0, 2, 1, 3)
    q4 = q.transpose(0, 1)[None].expand(S, -1, -1, -1).contiguous()
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, False, False,
                                                                scale=SCALE)[:2]
    return o, lse.reshape(S, H, -1)


class Ragged:
    """prefix [0, start) (start on the device) in S ranges of ceil(start / S) keys, cuDNN's ragged
    (THD) form: cumulative key lengths computed on the device each call."""

    def __init__(self, qf, S, kv_len):
        self.S = S
        rows = qf.shape[1]
        self.rows = rows
        self.q = qf.permute(1, 0, 2).repeat(S, 1, 1).contiguous()  # [S * rows, KVH, D]
        self.cum_q = (torch.arange(S + 1, device=DEV, dtype=torch.int32) * rows)
        self.ar = torch.arange(S + 1, device=DEV, dtype=torch.int64)
        self.max_k = -(-kv_len // S)

    def __call__(self, k, v, start_d):
        per = (start_d + self.S - 1) // self.S
        cum_k = torch.minimum(self.ar * per, start_d).to(torch.int32)
        res = torch.ops.aten._cudnn_attention_forward(self.q, k, v, None, self.cum_q, cum_k, self.rows, self.max_k,
                                                      True, 0.0, False, False, scale=SCALE)
        o, lse = res[0], res[1]
        return o.view(self.S, self.rows, KVH, D).permute(0, 2, 1, 3), lse.reshape(self.S, self.rows, KVH).permute(0, 2, 1)


# ----------------------------------------------------------------------------- parts
def part_splits(args, bw):
    for ctx in args.short_ctx:
        for T in args.trees:
            tm = BA.random_tree_mask(T, T)
            BA.bench_tree(args, "short-splits", ctx, T, H, KVH, D, tm, None, True, bw,
                          splits_list=[None] + [s for s in args.splits], time_twin=False, target_s=0.1)


def part_cudnn(args, bw):
    log(f"cudnn version {torch.backends.cudnn.version()}")
    for ctx in args.long_ctx:
        for T in args.trees_long:
            kv_len = pow2(ctx + T)
            rows = T * G
            L = BA.layers_for(kv_len * KVH * D * 4)
            base = dict(kind="cudnn-prefix", ctx=ctx, T=T, kv_len=kv_len, layers=L)
            try:
                cache = BA.Cache(L, kv_len, KVH, D)
            except Exception as e:
                rec(**base, impl="all", error=f"alloc: {e}")
                continue
            q = torch.randn(T, H, D, device=DEV, dtype=DT)
            qf = A.fold_rows(q, KVH)
            st = torch.tensor(ctx, device=DEV)
            ref = ref_prefix(q, cache.k[0], cache.v[0], ctx)
            flops = 4 * H * D * T * ctx

            def report(name, ms, mode, err, **kw):
                r = rec(**base, impl=name, ms=ms, mode=mode, rel_err=err, tflops=flops / (ms * 1e-3) / 1e12, **kw)
                log(f"ctx={ctx} T={T} {name}: {ms:.4f} ms, {r['tflops']:.0f} TFLOP/s useful, err {err} ({mode})")

            # the Triton kernel over the same prefix (the tree part empty: T keys past start are never
            # visible under a mask of zeros except the diagonal; use the full call as today)
            try:
                out = torch.empty(L, T, H, D, device=DEV, dtype=DT)
                tmask = BA.random_tree_mask(T, T).to(DEV)
                ms, mode = BA.time_per_call(lambda i: A.tree_attention(q, cache.k[i], cache.v[i], st, tmask, kv_len,
                                                                       out=out[i]), L, target_s=0.15)
                report("triton(verify)", ms, mode, None)
                floor = ctx - 300
                ms, mode = BA.time_per_call(lambda i: A.tree_attention(q, cache.k[i], cache.v[i], st, tmask, kv_len,
                                                                       out=out[i], floor=floor), L, target_s=0.15)
                want = A.tree_attention_reference(q.float(), cache.k[0].float(), cache.v[0].float(), st, tmask, kv_len)
                report(f"tree_attention(floor={floor})", ms, mode, BA.rel_err(out[0], want),
                       S=A.fused_prefix_plan(floor, rows, KVH, torch.cuda.get_device_properties(DEV).multi_processor_count)[0])
            except Exception as e:
                log(f"triton FAILED {type(e).__name__}: {str(e)[:300]}")
            for S in args.S:
                B = ctx - ctx % S
                for form in args.forms:
                    name = f"cudnn-{form}[S={S}]"
                    try:
                        if form == "batch":
                            def fn(i, S=S, B=B):
                                o, lse = cudnn_batch(qf, cache.k[i], cache.v[i], B, S)
                                return unfold(merge(o, lse), T)
                        elif form == "gqa":
                            def fn(i, S=S, B=B):
                                o, lse = cudnn_batch_gqa(q, cache.k[i], cache.v[i], B, S)
                                m = lse.amax(0)
                                w = (lse - m).exp()
                                oo = (o.float() * w[..., None]).sum(0) / w.sum(0)[..., None]  # [H, T, D]
                                return oo.transpose(0, 1)
                        else:
                            rg = Ragged(qf, S, kv_len)

                            def fn(i, rg=rg):
                                o, lse = rg(cache.k[i], cache.v[i], st)
                                return unfold(merge(o, lse), T)
                        got = fn(0)
                        refB = ref if B == ctx else ref_prefix(q, cache.k[0], cache.v[0], B)
                        err = BA.rel_err(got, refB)
                        ms, mode = BA.time_per_call(lambda i: fn(i), L, target_s=0.15)
                        extra = {}
                        if form == "ragged":  # a graph captured at ctx, replayed at another context
                            g = torch.cuda.CUDAGraph()
                            res = {}
                            s = torch.cuda.Stream()
                            s.wait_stream(torch.cuda.current_stream())
                            with torch.cuda.stream(s):
                                fn(0)
                            torch.cuda.current_stream().wait_stream(s)
                            with torch.cuda.graph(g):
                                res["o"] = fn(0)
                            other = ctx - ctx // 3 - 7
                            st.fill_(other)
                            g.replay()
                            torch.cuda.synchronize()
                            extra["replay_err_other_ctx"] = BA.rel_err(res["o"], ref_prefix(q, cache.k[0], cache.v[0], other))
                            st.fill_(ctx)
                            del g
                            log(f"  ragged graph replayed at {other}: err {extra['replay_err_other_ctx']:.2e}")
                        report(name, ms, mode, err, S=S, B=B, **extra)
                        # the cuDNN call alone (no merge)
                        if form != "ragged":
                            f2 = (lambda i, S=S, B=B: cudnn_batch(qf, cache.k[i], cache.v[i], B, S)) if form == "batch" else \
                                (lambda i, S=S, B=B: cudnn_batch_gqa(q, cache.k[i], cache.v[i], B, S))
                        else:
                            f2 = lambda i, rg=rg: rg(cache.k[i], cache.v[i], st)  # noqa: E731
                        ms2, mode2 = BA.time_per_call(f2, L, target_s=0.15)
                        report(name + " call only", ms2, mode2, None, S=S, B=B)
                    except Exception as e:
                        log(f"ctx={ctx} T={T} {name} FAILED: {type(e).__name__}: {str(e)[:400]}")
                        traceback.print_exc(limit=4)
                        rec(**base, impl=name, error=f"{type(e).__name__}: {e}")
            del cache
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the merge
MERGE_TILES = [A.Tiles(*t) for t in ((16, 32, 4, 4), (16, 64, 4, 3), (16, 64, 4, 4), (16, 64, 8, 4), (16, 32, 4, 5),
                                     (16, 32, 4, 3), (16, 32, 4, 2), (16, 64, 4, 2))]
DRAFT_TILES = [A.Tiles(*t) for t in ((64, 128, 8, 2), (64, 64, 4, 3), (64, 64, 8, 3), (64, 32, 4, 3), (64, 64, 4, 2),
                                     (64, 128, 8, 3), (64, 32, 4, 4), (32, 64, 4, 3))]


def time_runs(base, runs, call, want, read_bytes, bw):
    """Each run (name, kwargs, FUSED_MIN_ROWS for it or None): call(i, out, **kwargs) (the op on
    cache layer i) timed over base["layers"] layers, then its error against want; recorded and
    logged, the prefix's bytes read per second against the copy bandwidth."""
    L = base["layers"]
    for name, kw, min_rows in runs:
        saved = A.FUSED_MIN_ROWS
        try:
            if min_rows is not None:
                A.FUSED_MIN_ROWS = min_rows
            out = torch.empty(L, *want.shape, device=DEV, dtype=DT)
            ms, mode = BA.time_per_call(lambda i: call(i, out[i], **kw), L, target_s=0.12)
            call(0, out[0], **kw)
            err = BA.rel_err(out[0], want)
            gbps = read_bytes / (ms * 1e-3) / 1e9
            rec(**base, impl=name, ms=ms, mode=mode, rel_err=err, gbps=gbps, frac_copy_bw=gbps / bw,
                **{k: (vars(v) if isinstance(v, A.Tiles) else v) for k, v in kw.items()})
            log(f"{base['kind']} ctx={base['ctx']} T={base['T']} {name}: {ms:.4f} ms, {gbps:.0f} GB/s "
                f"({gbps / bw:.0%} of copy), err {err:.2e} ({mode})")
        except Exception as e:
            log(f"{base['kind']} ctx={base['ctx']} T={base['T']} {name} FAILED: {type(e).__name__}: {str(e)[:300]}")
            rec(**base, impl=name, error=f"{type(e).__name__}: {e}")
        finally:
            A.FUSED_MIN_ROWS = saved


def tile_runs(tiles, D, rows, kvh, kv_len, per_sm, **kw):
    """(name, kwargs, None) for each tile that fits this GPU's shared memory, at the split counts
    that fill 1..per_sm(tile) programs per SM."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    hopper = torch.cuda.get_device_capability(DEV)[0] >= 9
    limit = A._smem_limit(DEV) - A._SMEM_RESERVE
    runs = []
    for tt in tiles:
        smem = A._smem_estimate(tt, D, 2, hopper)
        if smem > limit:
            continue
        for p in range(1, per_sm(limit // smem) + 1):
            ns = A.num_splits(kv_len, rows, kvh, tt.bm, sms, p)
            runs.append((f"{kw.get('merge', '')}[{tt.bm},{tt.bn},{tt.warps},{tt.stages}|{ns}]",
                         dict(kw, tiles=tt, splits=ns), None))
    return runs


def part_merge(args, bw):
    """The split partials merged by the last split to finish (merge="last", one launch) against a
    second kernel (merge="kernel"), at the engine's bound (kv_len the next power of two) and floor
    (a few keys under the context: the fused prefix of the trees at long reads); at long reads the
    AR step (T = 1) also over tiles x split counts (programs per SM) with the last-split merge, and
    with its prefix through cuDNN (FUSED_MIN_ROWS lowered to 1 for it) under either merge."""
    for ctx in args.merge_ctx:
        for T in args.merge_trees:
            kv_len = pow2(ctx + T)
            base = dict(kind="merge", ctx=ctx, T=T, kv_len=kv_len, layers=BA.layers_for(kv_len * KVH * D * 4))
            cache = BA.Cache(base["layers"], kv_len, KVH, D)
            q = torch.randn(T, H, D, device=DEV, dtype=DT)
            st = torch.tensor(ctx, device=DEV)
            tm = BA.random_tree_mask(T, T).to(DEV)
            want = A.tree_attention_reference(q.float(), cache.k[0].float(), cache.v[0].float(), st, tm, kv_len)
            floor = ctx - T - 256 if ctx >= 16384 else 0  # the engine's: Decoder.start_floor just past a power of two
            runs = [(m, dict(merge=m, floor=floor), None) for m in ("last", "kernel")]
            if T == 1 and ctx >= 65536:
                runs += tile_runs(MERGE_TILES, D, G, KVH, kv_len, lambda fit: max(1, min(4, fit)), merge="last")
                runs += [(f"cudnn+{m}", dict(merge=m, floor=floor), 1) for m in ("last", "kernel")]
            time_runs(base, runs, lambda i, out, **kw: A.tree_attention(q, cache.k[i], cache.v[i], st, tm, kv_len,
                                                                         out=out, **kw),
                      want, ctx * KVH * D * 4, bw)
            del cache, want
            torch.cuda.empty_cache()


def part_drafter(args, bw):
    """The Qwen3.6-27B drafter's full (non-causal) layer over a long context: a block of 16 rows, 32
    / 8 heads x 128, through the split-KV kernel (its rule; tiles x split counts) and with the
    prefix through cuDNN (a floor a few keys under the context), at the engine's bound."""
    Hd, KVHd, Dd, B = 32, 8, 128, 16
    for ctx in args.drafter_ctx:
        kv_len = ctx + 2048 + B  # bench_engine's max_len caps the power of two
        base = dict(kind="drafter-full", ctx=ctx, T=B, kv_len=kv_len, layers=BA.layers_for(kv_len * KVHd * Dd * 4))
        cache = BA.Cache(base["layers"], kv_len, KVHd, Dd)
        q = torch.randn(B, Hd, Dd, device=DEV, dtype=DT)
        st = torch.tensor(ctx, device=DEV)
        want = A.tree_attention_reference(q.float(), cache.k[0].float(), cache.v[0].float(), st, "full", kv_len,
                                          causal=False)
        runs = [("rule", {}, None)] + tile_runs(DRAFT_TILES, Dd, B * Hd // KVHd, KVHd, kv_len, lambda fit: 2)
        runs.append(("cudnn", dict(floor=ctx - B - 256), None))
        time_runs(base, runs, lambda i, out, **kw: A.tree_attention(q, cache.k[i], cache.v[i], st, "full", kv_len,
                                                                     causal=False, out=out, **kw),
                  want, ctx * KVHd * Dd * 4, bw)
        del cache, want
        torch.cuda.empty_cache()


def table() -> str:
    lines = ["", "kind | ctx | T | impl | ms | note", "---|---|---|---|---|---"]
    for r in BA.RESULTS + ROWS:
        if "ms" not in r:
            lines.append(f"{r.get('kind')} | {r.get('ctx')} | {r.get('T')} | {r.get('impl')} | ERR | {str(r.get('error'))[:80]}")
            continue
        note = f"splits={r.get('splits')}" if "splits" in r else f"{r.get('tflops', 0):.0f} TF/s err={r.get('rel_err')}"
        lines.append(f"{r['kind']} | {r['ctx']} | {r['T']} | {r['impl']} | {r['ms']:.4f} | {note}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("results/verify-paths.json"))
    ap.add_argument("--parts", default="splits,cudnn")
    ap.add_argument("--short-ctx", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--trees", type=int, nargs="+", default=[16, 17, 32, 33, 64, 65])
    ap.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--long-ctx", type=int, nargs="+", default=[131072, 32768])
    ap.add_argument("--trees-long", type=int, nargs="+", default=[33, 17, 65])
    ap.add_argument("--S", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--forms", nargs="+", default=["ragged", "batch", "gqa"])
    ap.add_argument("--merge-ctx", type=int, nargs="+", default=[1024, 131072])
    ap.add_argument("--merge-trees", type=int, nargs="+", default=[1, 16, 33, 65])
    ap.add_argument("--drafter-ctx", type=int, nargs="+", default=[131072, 32768])
    ap.add_argument("--budget-s", type=float, default=400.0)
    args = ap.parse_args()
    from bench_engine import copy_bandwidth  # bytes read + written per second

    bw = copy_bandwidth() / 1e9
    log(f"copy bandwidth {bw:.0f} GB/s")
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name(DEV)}")
    parts = args.parts.split(",")
    try:
        if "cudnn" in parts:
            part_cudnn(args, bw)
        if "splits" in parts:
            part_splits(args, bw)
        if "merge" in parts:
            part_merge(args, bw)
        if "drafter" in parts:
            part_drafter(args, bw)
    finally:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(dict(device=torch.cuda.get_device_name(DEV), torch=torch.__version__,
                                            cudnn=torch.backends.cudnn.version(), host=platform.node(),
                                            date=time.strftime("%Y-%m-%d"), argv=sys.argv,
                                            results=BA.RESULTS + ROWS), indent=1))
        print(table())


if __name__ == "__main__":
    main()

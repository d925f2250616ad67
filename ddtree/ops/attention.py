"""Attention of a few new tokens (a draft tree, a drafter block, a prefill chunk) over a KV cache,
without a dense mask, each with its SDPA twin.

Layout. One layer's cache: k_cache, v_cache [N, KVH, D], rows contiguous, row r holds the key of
position r. The call's own keys are ALREADY written at rows start..start+T-1. q [T, H, D] with
H = KVH * G: query head h reads KV head h // G (SDPA's enable_gqa). Key row r is visible to
query t when

* r < start (the committed prefix: no mask), or start <= r < start + T and tree_mask[t, r - start]
  (the tree's ancestor-or-self mask, or a causal / all-ones block);
* r < kv_len (the caller's bucketed upper bound on start + T; it sizes the grid);
* with a window W: q_pos[t] - r < W (and, not causal, r - q_pos[t] < W).

`tree_attention` (Triton). Per KV head, the G query heads of all T nodes are M = T * G rows of one
matrix (row m = t * G + g), so a tile of K/V read once serves every node and query head of its
group. Grid (m-tiles, splits, KVH):

* split s < NS: the prefix keys [lo, hi) of the s-th of NS equal ranges of [p0, start)
  (p0 = max(0, start - W + 1) with a window, else 0), computed on the device from `start`:
  no mask but the range's end (and the window). Flash-decoding: each program keeps the
  online-softmax state (running max m, sum l, unnormalized acc [BM, D], fp32) of its rows.
* the last split (s = NS - 1) then also reads the tree keys start..start+T-1 under the ancestor
  mask: no program of its own, so the grid is exactly m-tiles x NS x KVH (a program more per
  (m-tile, KV head) would start a second, nearly empty wave).
* each writes (acc, m, l) to a workspace [NS, KVH, M, D]; the partials of every row are merged
  by log-sum-exp into o [T, H, D] in q's dtype, either by the last split of each (m-tile, KV
  head) to finish (it counts arrivals on a per-device counter: one launch, for narrow m-tiles
  such as an AR step's) or by a second kernel of 16-row programs (wide m-tiles, a tree's).

The fused prefix (`floor`, a host lower bound on start from the caller's graph key): on a long
prefix the keys [0, B), B <= floor, run first through cuDNN's fused attention as S ranges in one
batched call (the query block folded as above, broadcast over the ranges); the kernel then reads
[B, start) and the tree into its partials, and the merge takes cuDNN's (o, lse) partials too.

When one split suffices (short contexts, or enough m-tiles to fill the GPU) a single program per
(m-tile, KV head) walks the prefix and then the tree and writes o itself (no workspace, no merge).
Nothing depends on a host read of `start`: the grid and workspace come from host ints (T, kv_len,
the window), so the op can be captured in a CUDA graph. Nothing of size [T, kv_len] is built and
a windowed call reads only the window's rows, so its cost does not grow with the context.

`prefill_attention`: a prefill chunk (T up to thousands) at a host-known offset, lower-right
causal over keys [0, start + T), through SDPA's cuDNN backend (the prefix and the chunk's own
block, merged by log-sum-exp), else its flash backend (native GQA, `causal_lower_right`), else
this module's kernel, else memory-efficient SDPA per KV head.

Twins: `tree_attention_reference`, `prefill_attention_reference` (SDPA with the dense mask).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree.ops.split_rule import FUSED_MIN_ROWS, MAX_SPLITS, MIN_SPLIT_KEYS, fused_prefix_plan, num_splits  # noqa: F401  (torch-free: the memory plan's too)
from ddtree.ops.triton_util import _kernel, _on_device_of, tl, triton

LOG2E = 1.4426950408889634
# fp32 calls split the prefix so that no program accumulates more than this many keys: one program
# over a 32K prefix (T = 128 leaves no room for splits by the occupancy rule) drifted 1.8e-5 from
# the fp32 twin on an H200; the twin itself sums in blocks.
FP32_SPLIT_KEYS = 4096


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# ----------------------------------------------------------------------------- twins
def _visible(T: int, kv_len: int, start, tree_mask, q_pos, window, causal: bool, device) -> torch.Tensor:
    """The dense [T, kv_len] bool mask of the semantics above (the twins')."""
    key = torch.arange(kv_len, device=device)
    start = torch.as_tensor(start, device=device)
    tm = _dense_tree_mask(tree_mask, T, device)
    local = key[None, :] - start  # [1, kv_len]: index inside the tree
    in_tree = (local >= 0) & (local < T)
    vis = (key[None, :] < start) | (tm.gather(1, local.clamp(0, T - 1).expand(T, -1)) & in_tree)
    if window is not None:
        qp = start + torch.arange(T, device=device) if q_pos is None else q_pos
        vis = vis & (qp[:, None] - key[None, :] < window)
        if not causal:
            vis = vis & (key[None, :] - qp[:, None] < window)
    return vis


def _dense_tree_mask(tree_mask, T: int, device) -> torch.Tensor:
    if isinstance(tree_mask, str):
        ones = torch.ones(T, T, dtype=torch.bool, device=device)
        return {"causal": ones.tril(), "full": ones}[tree_mask]
    return tree_mask.to(device=device, dtype=torch.bool)


def tree_attention_reference(q, k_cache, v_cache, start, tree_mask, kv_len: int, q_pos=None, window=None,
                             causal: bool = True, scale=None) -> torch.Tensor:
    """Twin of `tree_attention`: SDPA over k_cache[:kv_len] with the dense [T, kv_len] mask, as
    the model calls it today. -> [T, H, D] in q's dtype."""
    T, H, _ = q.shape
    vis = _visible(T, kv_len, start, tree_mask, q_pos, window, causal, q.device)
    kk = k_cache[:kv_len].transpose(0, 1)[None]  # [1, KVH, kv_len, D]
    vv = v_cache[:kv_len].transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk, vv, attn_mask=vis[None, None],
                                       scale=scale, enable_gqa=H != k_cache.shape[1])  # [1, H, T, D]
    return o[0].transpose(0, 1)


def prefill_attention_reference(q, k_cache, v_cache, start: int, scale=None) -> torch.Tensor:
    """Twin of `prefill_attention`: SDPA with the dense lower-right causal mask [T, start + T]."""
    T = q.shape[0]
    return tree_attention_reference(q, k_cache, v_cache, start, "causal", start + T, scale=scale)


# ----------------------------------------------------------------------------- tiles
@dataclass(frozen=True)
class Tiles:
    bm: int  # query rows (node x query head) per program
    bn: int  # keys per step
    warps: int
    stages: int


# Per (GPU generation, head dim): (most query rows, tile) pairs; a call takes the first pair whose
# bound covers its rows = T * G (node x query head rows per KV head), its bm capped by the rows.
# Hopper, D = 256: measured by `scripts/bench_attention.py` (e462150) `--only-tiles --tile-ctx 131072 32768`
# (082b8a3:results/tiles-h200.json.gz) over 16 tiles and 1-3 programs per SM: 4 warps at bm 64 beat 8
# (T = 16 at 32K: 0.086 against 0.20 ms), bm 128 with 8 warps wins at 64 nodes (T = 64 at 128K:
# 0.50 against 0.65 ms), and bn 32 beats 64 and 128 everywhere (D = 256 tiles are big).
# Long reads (_LONG_TABLE, kv_len above LONG_READ_KEYS) favour one 128-row tile over two 64-row
# ones when both pad to the same rows (082b8a3:results/tiles-long-h200.json.gz, 128K, one program per SM):
# T = 16 / 17 (96 / 102 rows) 0.222 / 0.223 against 0.245 / 0.283 ms, T = 33 (198 rows: a
# 32-node budget with its root) 0.362 against 0.518 ms; where 64-row tiles fit the rows exactly
# they still win (T = 32, 192 rows: 0.333 against 0.357 ms). Just past 64K the 128-row tile wins
# at T = 17 / 33 (0.137 / 0.203 against 0.157 / 0.273 ms) and ties at T = 16 (0.140 both;
# 082b8a3:results/tiles-switch-h200.json). Between 16K and 64K (_MID_TABLE) it wins only at T = 33
# (0.079 / 0.120 against 0.088 / 0.149 ms at 16.6K / 33K reads), ties at T = 17 and loses at
# T = 16 and 32 (33K: 0.099 against 0.086, 0.116 against 0.101); at 8K it loses by 3% at T = 33
# (082b8a3:results/tiles-short-h200.json).
# The others: from ptxas reports of this kernel for sm_90 and sm_86 (no register spills; shared
# memory in the comments). A tile whose shared-memory estimate exceeds the device's per-block
# limit (Hopper 227 KB, A100 163 KB, sm_86/89 99 KB), or that Triton reports OutOfResources for,
# is passed over for the next.
_ANY = 1 << 30
_TABLE = {
    ("hopper", 256): [(16, Tiles(16, 32, 4, 4)), (256, Tiles(64, 32, 4, 3)), (_ANY, Tiles(128, 32, 8, 3))],  # 106, 139, 180 KB
    ("hopper", 128): [(16, Tiles(16, 64, 4, 3)), (32, Tiles(32, 64, 8, 3)), (_ANY, Tiles(64, 128, 8, 2))],  # 72, -, 160 KB
    ("hopper", 64): [(16, Tiles(16, 64, 4, 3)), (32, Tiles(32, 64, 4, 3)), (64, Tiles(64, 64, 4, 3)), (_ANY, Tiles(128, 64, 8, 3))],
    # Ampere (mma.sync; sm_86 has 99 KB a block)
    ("ampere", 256): [(16, Tiles(16, 32, 4, 3)), (32, Tiles(32, 32, 8, 3)), (_ANY, Tiles(64, 32, 8, 2))],  # 74, 84, 68 KB
    ("ampere", 128): [(16, Tiles(16, 64, 4, 2)), (32, Tiles(32, 64, 8, 2)), (_ANY, Tiles(64, 64, 8, 2))],  # 40, -, 56 KB
    ("ampere", 64): [(16, Tiles(16, 64, 4, 2)), (32, Tiles(32, 64, 4, 2)), (64, Tiles(64, 64, 4, 2)), (_ANY, Tiles(128, 64, 8, 2))],
}
MID_READ_KEYS = 16384  # kv_len above this (and up to LONG_READ_KEYS) reads with _MID_TABLE
_MID_TABLE = {  # a 33-node tree (198 rows): one 128-row tile (at 16.6K / 33K reads 0.079 / 0.120 against 0.088 / 0.149 ms)
    ("hopper", 256): [(16, Tiles(16, 32, 4, 4)), (192, Tiles(64, 32, 4, 3)), (_ANY, Tiles(128, 32, 8, 3))],
    # the drafter's full layer (a 16-row block x 4 query heads a KV head = 64 rows): 64-key tiles,
    # 3 stages, at 32K 0.052 ms against 0.075 for _TABLE's (64, 128, 8, 2) (082b8a3:results/verify-drafter-h200.json)
    ("hopper", 128): [(16, Tiles(16, 64, 4, 3)), (32, Tiles(32, 64, 8, 3)), (64, Tiles(64, 64, 4, 3)), (_ANY, Tiles(64, 128, 8, 2))],
}
LONG_READ_KEYS = 65536  # kv_len above this reads with _LONG_TABLE where it has the head dim
_LONG_TABLE = {  # an AR step (6 rows) at 128K: 64-key tiles 0.141 ms a layer against 0.154 for 32 (082b8a3:results/verify-merge-h200.json)
    ("hopper", 256): [(16, Tiles(16, 64, 4, 3)), (64, Tiles(64, 32, 4, 3)), (128, Tiles(128, 32, 8, 3)),
                      (192, Tiles(64, 32, 4, 3)), (_ANY, Tiles(128, 32, 8, 3))],
    # the drafter's full layer at 128K: 0.144 ms against 0.224 (88% of copy against 57%)
    ("hopper", 128): [(16, Tiles(16, 64, 4, 3)), (32, Tiles(32, 64, 8, 3)), (64, Tiles(64, 64, 4, 3)), (_ANY, Tiles(64, 128, 8, 2))],
}
_FALLBACK = [Tiles(32, 32, 4, 2), Tiles(16, 32, 4, 2), Tiles(16, 32, 4, 1), Tiles(16, 16, 4, 1)]
# fp32 (tests, the twin's precision): FMA dots (ieee); larger tiles spill kilobytes and take a minute to compile.
_FP32 = Tiles(16, 16, 4, 1)
_CPU_TILES = Tiles(128, 64, 1, 1)  # the interpreter: big tiles, fewer interpreted steps
_SMEM_RESERVE = 1024  # bytes kept free for Triton's own scratch (barriers)
_BAD: set = set()  # (Tiles, key) that failed to compile on a device: OutOfResources


def _smem_limit(device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    for name in ("shared_memory_per_block_optin", "shared_memory_per_block"):
        v = getattr(props, name, None)
        if v:
            return int(v)
    return {(9, 0): 232448, (8, 0): 166912, (8, 6): 101376, (8, 9): 101376}.get((props.major, props.minor), 49152)


def _smem_estimate(t: Tiles, d: int, elt: int, hopper: bool) -> int:
    """Shared memory of the kernel, bytes: Q tile + buffers x (K + V tiles) + P twice. Triton
    keeps `stages` K/V buffers for wgmma (Hopper, bm >= 64) and stages - 1 for mma.sync; this
    matches (or exceeds) what it allocated for every tile of _TABLE on sm_90 and sm_86."""
    buffers = t.stages if hopper and t.bm >= 64 else max(1, t.stages - 1)
    return elt * (t.bm * d + buffers * 2 * t.bn * d + 2 * t.bm * t.bn)


def _rows_tile(bm: int, rows: int) -> int:
    return max(16, min(bm, _pow2(rows)))


def pick_tiles(d: int, rows: int, elt: int, smem_limit: int, hopper: bool, read_len: int = 0) -> list[Tiles]:
    """The tiles to try for head dim d, `rows` = T * G query rows per KV head, elt-byte elements
    and read_len keys at most (the bucketed kv_len, or the window) on a GPU with smem_limit bytes
    of shared memory per block, best first."""
    key = ("hopper" if hopper else "ampere", 64 if d <= 64 else 128 if d <= 128 else 256)
    table = _TABLE[key]
    if read_len > LONG_READ_KEYS:
        table = _LONG_TABLE.get(key, table)
    elif read_len > MID_READ_KEYS:
        table = _MID_TABLE.get(key, table)
    if elt > 2:
        return [_FP32]
    best = next(t for upto, t in table if rows <= upto)
    out = []
    for t in [best] + _FALLBACK:
        t = Tiles(_rows_tile(t.bm, rows), t.bn, t.warps, t.stages)
        if _smem_estimate(t, d, elt, hopper) <= smem_limit - _SMEM_RESERVE and t not in out:
            out.append(t)
    return out or [Tiles(16, 16, 4, 1)]


def candidate_tiles(d: int, rows: int, dtype: torch.dtype, device: torch.device, read_len: int = 0) -> list[Tiles]:
    if device.type != "cuda":
        return [Tiles(_rows_tile(_CPU_TILES.bm, rows), _CPU_TILES.bn, 1, 1)]
    major = torch.cuda.get_device_capability(device)[0]
    return pick_tiles(d, rows, torch.empty((), dtype=dtype).element_size(), _smem_limit(device), major >= 9, read_len)


# ----------------------------------------------------------------------------- splits


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so that the merge is what the tests exercise
    return torch.cuda.get_device_properties(device).multi_processor_count


# ----------------------------------------------------------------------------- kernels
def _attn_fwd_kernel(
    q, kc, vc, start_ptr, tm, qpos, o, ws_acc, ws_ml, cnt,
    T, kv_len, W, LO, NS, qk_scale,  # qk_scale = scale * log2(e): the softmax runs in base 2; LO: first prefix key
    s_qt, s_qh, s_kn, s_kh, s_vn, s_vh, s_ot, s_oh,
    xo, xl, NX, s_xs, s_xh, s_xr, s_ls, s_lh, s_lr,  # the fused prefix's partials (MERGE_LAST)
    G: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    TREE: tl.constexpr,  # 0: tree_mask [T, T] int8; 1: causal (tril); 2: all visible
    WINDOW: tl.constexpr, TWO_SIDED: tl.constexpr, FUSED: tl.constexpr, IEEE: tl.constexpr,
    MERGE_LAST: tl.constexpr,  # the last split of each (m-tile, KV head) to finish merges (cnt: arrivals)
    FENCE: tl.constexpr,  # gpu-scope fences around the arrival (CUDA; the interpreter runs programs in turn)
):
    pid_m = tl.program_id(0)
    split = tl.program_id(1)
    kvh = tl.program_id(2)
    KVH = tl.num_programs(2)
    MP = T * G  # query rows of this KV head
    om = pid_m * BM + tl.arange(0, BM)
    row_ok = om < MP
    t = om // G  # node
    h = kvh * G + om % G  # query head
    od = tl.arange(0, D)
    qt = tl.load(q + t[:, None] * s_qt + h[:, None] * s_qh + od[None, :], mask=row_ok[:, None], other=0.0)  # [BM, D]
    start = tl.load(start_ptr).to(tl.int32)
    if WINDOW:
        qp = tl.load(qpos + t, mask=row_ok, other=0).to(tl.int32)  # [BM]
    end = tl.minimum(start, kv_len)  # prefix keys [p0, end)
    p0 = 0
    if WINDOW:
        p0 = tl.maximum(start - W + 1, 0)  # older keys are out of every query's window (q_pos >= start)
    p0 = tl.maximum(p0, LO)  # keys below LO: the fused prefix's (merged with these partials)
    if FUSED:
        lo = p0
        hi = end
    else:
        chunk = tl.cdiv(tl.cdiv(tl.maximum(end - p0, 0), NS), BN) * BN
        lo = p0 + split * chunk
        hi = tl.minimum(lo + chunk, end)
    kb = kc + kvh * s_kh
    vb = vc + kvh * s_vh
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, D], dtype=tl.float32)
    # ---- the prefix: no mask but the range's end (and the window)
    for n0 in range(lo, hi, BN):
        on = n0 + tl.arange(0, BN)
        n_ok = on < hi
        rows = on.to(tl.int64)
        k = tl.load(kb + rows[None, :] * s_kn + od[:, None], mask=n_ok[None, :], other=0.0)  # [D, BN]
        v = tl.load(vb + rows[:, None] * s_vn + od[None, :], mask=n_ok[:, None], other=0.0)  # [BN, D]
        if IEEE:
            s = tl.dot(qt, k, input_precision="ieee")
        else:
            s = tl.dot(qt, k)
        vis = n_ok[None, :]
        if WINDOW:
            vis = vis & (qp[:, None] - on[None, :] < W)
            if TWO_SIDED:
                vis = vis & (on[None, :] - qp[:, None] < W)
        s = tl.where(vis, s * qk_scale, float("-inf"))  # [BM, BN]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # ---- the tree (or block): keys start..start+T-1 under its mask
    if split == NS - 1:  # the last split (FUSED: NS == 1, the one program) reads the tree too
        t_hi = T
        if TREE == 1:  # causal: this tile's last node sees no key past itself
            t_hi = tl.minimum(T, (pid_m * BM + BM - 1) // G + 1)
        for j0 in range(0, t_hi, BN):
            oj = j0 + tl.arange(0, BN)
            on = start + oj
            n_ok = (oj < t_hi) & (on < kv_len)
            rows = on.to(tl.int64)
            k = tl.load(kb + rows[None, :] * s_kn + od[:, None], mask=n_ok[None, :], other=0.0)
            v = tl.load(vb + rows[:, None] * s_vn + od[None, :], mask=n_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(qt, k, input_precision="ieee")
            else:
                s = tl.dot(qt, k)
            vis = row_ok[:, None] & n_ok[None, :]
            if TREE == 0:
                vis = vis & (tl.load(tm + t[:, None] * T + oj[None, :], mask=vis, other=0) != 0)
            if TREE == 1:
                vis = vis & (oj[None, :] <= t[:, None])
            if WINDOW:
                vis = vis & (qp[:, None] - on[None, :] < W)
                if TWO_SIDED:
                    vis = vis & (on[None, :] - qp[:, None] < W)
            s = tl.where(vis, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
    if FUSED:
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]  # (padding rows: no 0 / 0)
        tl.store(o + t[:, None] * s_ot + h[:, None] * s_oh + od[None, :], out.to(o.dtype.element_ty), mask=row_ok[:, None])
    else:
        r = (split * KVH + kvh).to(tl.int64) * MP + om  # [BM] row of the workspace
        tl.store(ws_acc + r[:, None] * D + od[None, :], acc, mask=row_ok[:, None])
        tl.store(ws_ml + r, m_i, mask=row_ok)
        tl.store(ws_ml + NS * KVH * MP + r, l_i, mask=row_ok)
        if MERGE_LAST:
            # Flash-decoding without a second launch: each split counts itself in; the last to
            # arrive merges every split's partials of these rows, in split order (its own read back:
            # the same sums whichever split is last, so the same o as merge="kernel", bit for bit),
            # and the fused prefix's, writes o, and resets the counter for the next call.
            # The threadfence-reduction pattern: every thread fences its stores, the block syncs,
            # one atomic (acq_rel, gpu scope) arrives; the last block fences before reading.
            if FENCE:
                _fence_gpu(pid_m)
            tl.debug_barrier()
            c = cnt + pid_m * KVH + kvh
            arrived = tl.atomic_add(c, 1, sem="acq_rel", scope="gpu")
            if arrived == NS - 1:
                if FENCE:
                    _fence_gpu(pid_m)
                tl.store(c, 0)
                _merge_rows(om, kvh, KVH, MP, ws_acc, ws_ml, NS, o, s_ot, s_oh,
                            xo, xl, NX, s_xs, s_xh, s_xr, s_ls, s_lh, s_lr, G, D, BM)


def _merge_step(m_run, l_run, acc, m_s, l_s, a_s):
    # One partial (m_s, l_s, a_s) into a row's running (m, l, acc), base-2 log-sum-exp.
    m_new = tl.maximum(m_run, m_s)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_run - m_use)
    beta = tl.exp2(m_s - m_use)
    return m_new, l_run * alpha + l_s * beta, acc * alpha[:, None] + a_s * beta[:, None]


def _fence_gpu(x):
    # fence.acq_rel.gpu in every thread (x: any int32 scalar, so that the asm has an operand)
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


def _merge_rows(om, kvh, KVH, MP, ws_acc, ws_ml, NSP, o, s_ot, s_oh,
                xo, xl, NX, s_xs, s_xh, s_xr, s_ls, s_lh, s_lr, G: tl.constexpr, D: tl.constexpr, BMM: tl.constexpr):
    # Rows om [BMM] of KV head kvh: the NSP split partials of the workspace, in split order, and the
    # NX partials of the fused prefix (xo [NX, KVH, rows, D] normalized, xl its natural
    # log-sum-exp: in base 2, m = xl * log2(e) and l = 1) merged by log-sum-exp; o written in its
    # dtype. Workspace reads bypass L1 (.cg): other blocks wrote them.
    row_ok = om < MP
    od = tl.arange(0, D)
    m_run = tl.full([BMM], float("-inf"), tl.float32)
    l_run = tl.zeros([BMM], dtype=tl.float32)
    acc = tl.zeros([BMM, D], dtype=tl.float32)
    for s in range(0, NSP):
        r = (s * KVH + kvh).to(tl.int64) * MP + om
        m_s = tl.load(ws_ml + r, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(ws_ml + NSP * KVH * MP + r, mask=row_ok, other=0.0, cache_modifier=".cg")
        a_s = tl.load(ws_acc + r[:, None] * D + od[None, :], mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
        m_run, l_run, acc = _merge_step(m_run, l_run, acc, m_s, l_s, a_s)
    for s in range(0, NX):
        m_s = tl.load(xl + s * s_ls + kvh * s_lh + om * s_lr, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        a_s = tl.load(xo + s * s_xs + kvh * s_xh + om[:, None] * s_xr + od[None, :], mask=row_ok[:, None], other=0.0)
        m_run, l_run, acc = _merge_step(m_run, l_run, acc, m_s, 1.0, a_s.to(tl.float32))
    t = om // G
    h = kvh * G + om % G
    out = acc / tl.where(row_ok, l_run, 1.0)[:, None]
    tl.store(o + t[:, None] * s_ot + h[:, None] * s_oh + od[None, :], out.to(o.dtype.element_ty), mask=row_ok[:, None])


def _attn_merge_kernel(ws_acc, ws_ml, o, T, NSP, s_ot, s_oh,
                       xo, xl, NX, s_xs, s_xh, s_xr, s_ls, s_lh, s_lr,
                       G: tl.constexpr, D: tl.constexpr, BMM: tl.constexpr):
    # The merge as a kernel of its own (merge="kernel"): one program per BMM rows of one KV head.
    om = tl.program_id(0) * BMM + tl.arange(0, BMM)
    _merge_rows(om, tl.program_id(1), tl.num_programs(1), T * G, ws_acc, ws_ml, NSP, o, s_ot, s_oh,
                xo, xl, NX, s_xs, s_xh, s_xr, s_ls, s_lh, s_lr, G, D, BMM)


# ----------------------------------------------------------------------------- the op
def _workspace(numel: int, device: torch.device) -> torch.Tensor:
    """fp32 scratch for the partials (every element is written before it is read; tests poison it)."""
    return torch.empty(numel, dtype=torch.float32, device=device)


# The arrival counters of the merge by the last split (merge="last"): int32 zeros per device, one
# per (m-tile, KV head), each reset by the program that merges. Shared by every call on the
# device: calls on one device run in stream order (the engine's graphs and eager pieces alike).
COUNTER_SLOTS = 1 << 14
_COUNTERS: dict = {}
MERGES = ("auto", "last", "kernel")


def _counters(device: torch.device, n: int) -> torch.Tensor | None:
    """The device's counters if they hold n slots, made on first use (not during a graph capture,
    whose allocations would be the graph's: that call merges with the kernel)."""
    c = _COUNTERS.get(device)
    if c is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        c = _COUNTERS[device] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return c if n <= c.numel() else None


FUSED_BACKENDS = ("auto", "torch", "off")
# (backend, device, dtype, D) where a library kernel refused: auto skips it there. Backends: the
# prefill's "cudnn" / "flash", the verify's fused prefix "verify-cudnn".
_FUSED_FAILED: set = set()
_CUDNN_Q_STRIDE0: dict = {}  # device -> whether cuDNN took the query block broadcast over the ranges


def _ranges(cache, S: int, C: int):
    """S ranges of C rows from row 0 of a cache [N, KVH, D] as a batch of views: [S, KVH, C, D]."""
    return cache[:S * C].view(S, C, cache.shape[1], cache.shape[2]).permute(0, 2, 1, 3)


def fold_rows(q, kv_heads: int):
    """q [T, H, D] -> [KVH, T * G, D], row m = t * G + g: each KV head's query block (the kernel's row order)."""
    T, H, D = q.shape
    return q.view(T, kv_heads, H // kv_heads, D).permute(1, 0, 2, 3).reshape(kv_heads, T * (H // kv_heads), D)


def fused_prefix_reference(qf, k_cache, v_cache, S: int, C: int, scale: float):
    """Twin of the fused prefix: qf [KVH, rows, D] over S ranges of C keys from row 0 of k_cache,
    v_cache [N, KVH, D], each unmasked. -> (o [S, KVH, rows, D] normalized, lse [S, KVH, rows]
    natural log), fp32."""
    k4, v4 = _ranges(k_cache, S, C).float(), _ranges(v_cache, S, C).float()  # [S, KVH, C, D]
    sc = torch.einsum("hrd,shcd->shrc", qf.float(), k4) * scale
    lse = torch.logsumexp(sc, -1)
    return torch.einsum("shrc,shcd->shrd", (sc - lse[..., None]).exp(), v4), lse


def _fused_prefix_cudnn(qf, k_cache, v_cache, S: int, C: int, scale: float):
    """The same through cuDNN's fused attention (SDPA's cuDNN backend) in one batched call: the S
    ranges are a batch of strided views of the cache (no copy), the query block broadcast over
    them. -> (o [S, KVH, rows, D] in q's dtype, lse [S, KVH, rows(, 1)] fp32)."""
    k4, v4 = _ranges(k_cache, S, C), _ranges(v_cache, S, C)  # [S, KVH, C, D]
    q4 = qf[None].expand(S, *qf.shape)
    if not _CUDNN_Q_STRIDE0.get(qf.device, True):
        q4 = q4.contiguous()
    call = torch.ops.aten._scaled_dot_product_cudnn_attention
    try:
        o, lse = call(q4, k4, v4, None, True, 0.0, False, False, scale=scale)[:2]
        _CUDNN_Q_STRIDE0.setdefault(qf.device, q4.stride(0) == 0)
    except RuntimeError:
        if q4.stride(0) != 0:
            raise
        _CUDNN_Q_STRIDE0[qf.device] = False
        o, lse = call(q4.contiguous(), k4, v4, None, True, 0.0, False, False, scale=scale)[:2]
    return o, lse


def _cudnn_prefix_ok(q, D: int) -> bool:
    """Whether cuDNN's attention may take this call's prefix (CUDA, 16-bit, head dim <= 256, not refused before)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and D <= 256 and D % 8 == 0
            and ("verify-cudnn", q.device, q.dtype, D) not in _FUSED_FAILED)


def _fused_prefix(q, k_cache, v_cache, floor: int, fused: str, window, sc_nat: float):
    """The fused prefix of a call (see tree_attention), or None where it does not serve. ->
    (B, o, lse): the prefix [0, B) as partials o [S, KVH, rows, D], lse [S, KVH, rows(, 1)]."""
    T, H, D = q.shape
    KVH = k_cache.shape[1]
    rows = T * (H // KVH)
    if fused == "off" or floor <= 0 or window is not None or rows < FUSED_MIN_ROWS:
        return None
    if fused == "auto" and not _cudnn_prefix_ok(q, D):
        return None
    S, C = fused_prefix_plan(floor, rows, KVH, _sm_count(q.device))
    if not S:
        return None
    qf = fold_rows(q, KVH)
    if fused == "torch":
        return (S * C, *fused_prefix_reference(qf, k_cache, v_cache, S, C, sc_nat))
    try:
        return (S * C, *_fused_prefix_cudnn(qf, k_cache, v_cache, S, C, sc_nat))
    except RuntimeError:  # cuDNN not built for / not usable on this GPU or shape: the kernel alone
        _FUSED_FAILED.add(("verify-cudnn", q.device, q.dtype, D))
        return None


def tree_attention(q, k_cache, v_cache, start, tree_mask, kv_len: int, q_pos=None, window=None, scale=None,
                   *, causal: bool = True, out=None, splits: int | None = None, tiles: Tiles | None = None,
                   floor: int = 0, fused: str = "auto", merge: str = "auto") -> torch.Tensor:
    """Attention of T new tokens over a KV cache: the committed prefix [0, start) unmasked plus
    the tokens' own keys (rows start..start+T-1, already written) under tree_mask.

    q [T, H, D] (T = 1..128 tree nodes, or a block / chunk; D a power of two); k_cache, v_cache
    [N, KVH, D] one layer's cache, stride(-1) == 1; start: 0-dim int64 on q's device;
    tree_mask: [T, T] bool (node t sees node j iff tree_mask[t, j]: ancestor-or-self), or
    "causal" (tril) or "full" (all ones); kv_len: host int with start + T <= kv_len <= N (a
    bucketed bound: it sizes the grid and the workspace; rows >= kv_len are never read).
    window: keys with q_pos - key_pos >= window are not seen (and with causal=False also
    key_pos - q_pos >= window); key_pos = row; q_pos [T] long (default start + arange(T)) must be
    >= start: the prefix read begins at row start - window + 1. out: optional [T, H, D] to write.
    splits: prefix ranges (None: num_splits' rule; 0 or 1: none, one program per m-tile does all);
    tiles: override (benchmarks).

    floor: a host lower bound the caller guarantees on start (0: none). Where it is long
    (split_rule.fused_prefix_plan) and the rows are many (T * G >= FUSED_MIN_ROWS, no window),
    the prefix [0, B), B <= floor, runs as S ranges through cuDNN's fused attention in one
    batched call (fused="auto", where it runs: about 1.6x the split-KV kernel's tensor-core rate
    at head dim 256 on an H200) or its torch twin (fused="torch", tests); the kernel reads
    [B, start) and the tree, and the merge takes both sets of partials. A start below floor
    would read keys past it as prefix: the caller's bound must hold.

    merge: how split partials become o: "last" the last split of each (m-tile, KV head) to
    finish merges them (one launch; arrival counters per device), "kernel" a second kernel of
    16-row programs, "auto" last where its m-tiles are no wider than the merge kernel's programs
    (an AR step: one launch less, 0.157 against 0.164 ms a layer at 128K), else the kernel (a
    tree's 64- or 128-row tiles merge serially: a 16-node verify at 1K 0.025 against 0.018 ms;
    082b8a3:results/verify-merge-h200.json). Kernel, too, in a graph capture that would have to
    allocate the counters.
    -> o [T, H, D] in q's dtype (fp32 accumulation)."""
    T, H, D = q.shape
    KVH = k_cache.shape[1]
    q, start, mode, tm, q_pos, out = _tree_inputs(q, k_cache, v_cache, start, tree_mask, kv_len, q_pos, window, out,
                                                  fused, merge)
    G, dev = H // KVH, q.device
    rows = T * G  # query rows per KV head
    sc_nat = 1.0 / math.sqrt(D) if scale is None else float(scale)
    read_len = kv_len if window is None else min(kv_len, int(window))
    pre = _fused_prefix(q, k_cache, v_cache, min(int(floor), kv_len - T), fused, window, sc_nat)
    lo = 0
    if pre is not None:
        lo, xo, xl = pre
        xl3 = xl.reshape(xl.shape[0], KVH, rows)
        read_len = kv_len - lo
        x_args = (xo, xl3, xo.shape[0], xo.stride(0), xo.stride(1), xo.stride(2), xl3.stride(0), xl3.stride(1), xl3.stride(2))
    else:
        x_args = (out, out, 0, 0, 0, 0, 0, 0, 0)
    key = (dev.index, D, q.dtype)
    todo = [tiles] if tiles is not None else [c for c in candidate_tiles(D, rows, q.dtype, dev, read_len) if (c, key) not in _BAD]
    kern = _kernel(_attn_fwd_kernel, interpret=not q.is_cuda)
    merge_kern = _kernel(_attn_merge_kernel, interpret=not q.is_cuda)
    err = None
    for tt in todo or [Tiles(16, 16, 4, 1)]:
        ns = _split_count(read_len, rows, KVH, tt.bm, q, splits, pre is not None)
        ws_acc = ws_ml = out  # unused without splits
        cnt = None
        if ns:
            ws_acc = _workspace(ns * KVH * rows * D, dev)  # [NS, KVH, rows, D]
            ws_ml = _workspace(2 * ns * KVH * rows, dev)  # m then l: [2, NS, KVH, rows]
            bmm = max(2, min(4096 // D, _pow2(rows)))  # the merge kernel's rows a program
            cnt = _merge_counters(merge, rows, tt.bm, bmm, KVH, dev)
        try:
            with _on_device_of(q):
                kern[(_cdiv(rows, tt.bm), max(ns, 1), KVH)](
                    q, k_cache, v_cache, start, tm, start if q_pos is None else q_pos, out, ws_acc, ws_ml,
                    out if cnt is None else cnt,
                    T, kv_len, int(window or 0), lo, max(ns, 1), sc_nat * LOG2E,
                    q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                    v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), *x_args,
                    G=G, D=D, BM=tt.bm, BN=tt.bn, TREE=mode, WINDOW=window is not None, TWO_SIDED=not causal,
                    FUSED=ns == 0, IEEE=q.dtype == torch.float32, MERGE_LAST=cnt is not None, FENCE=q.device.type != "cpu",
                    num_warps=tt.warps, num_stages=tt.stages,
                )
                if ns and cnt is None:
                    merge_kern[(_cdiv(rows, bmm), KVH)](ws_acc, ws_ml, out, T, ns, out.stride(0), out.stride(1), *x_args,
                                                   G=G, D=D, BMM=bmm, num_warps=4)
            return out
        except Exception as e:  # a tile too big for this GPU's shared memory: the next one
            if tiles is not None or type(e).__name__ != "OutOfResources":
                raise
            _BAD.add((tt, key))
            err = e
    raise err


def _tree_inputs(q, k_cache, v_cache, start, tree_mask, kv_len: int, q_pos, window, out, fused: str, merge: str):
    """tree_attention's checks, and its inputs in the kernel's forms -> (q with unit last stride,
    start as a 0-dim device tensor, the mask mode (0 tree, 1 causal, 2 full) and its int8 [T, T]
    tensor (q where unused), q_pos [T] | None, out [T, H, D])."""
    T, H, D = q.shape
    N, KVH, _ = k_cache.shape
    assert H % KVH == 0 and k_cache.shape == v_cache.shape and k_cache.shape[-1] == D
    assert D >= 16 and D & (D - 1) == 0, f"head dim {D}: a power of two >= 16"
    assert T <= kv_len <= N, (T, kv_len, N)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert fused in FUSED_BACKENDS, fused
    assert merge in MERGES, merge
    dev = q.device
    q = q if q.stride(-1) == 1 else q.contiguous()
    if not torch.is_tensor(start):  # a host int (prefill): one small copy, not for graphed rounds
        start = torch.tensor(int(start), device=dev)
    assert start.device == dev and start.numel() == 1 and not start.is_floating_point()
    if isinstance(tree_mask, str):
        mode, tm = {"causal": 1, "full": 2}[tree_mask], q
    else:
        assert tree_mask.shape == (T, T) and tree_mask.device == dev, (tree_mask.shape, tree_mask.device)
        mode, tm = 0, tree_mask.to(torch.bool).contiguous().view(torch.int8)
    if window is not None:
        q_pos = start + torch.arange(T, device=dev) if q_pos is None else q_pos.contiguous()
        assert q_pos.shape == (T,) and q_pos.device == dev
    if out is None:
        out = torch.empty(T, H, D, dtype=q.dtype, device=dev)
    assert out.shape == (T, H, D) and out.stride(-1) == 1
    return q, start, mode, tm, q_pos, out


def _split_count(read_len: int, rows: int, KVH: int, bm: int, q: torch.Tensor, splits: int | None,
                 prefix: bool) -> int:
    """Programs the prefix read is split over for one m-tile and KV head (0: one program does all
    and writes o itself). splits: the caller's count, else num_splits' rule; prefix: a fused
    prefix's partials are merged in, so at least one split."""
    ns = num_splits(read_len, rows, KVH, bm, _sm_count(q.device)) if splits is None else int(splits)
    if splits is None and q.dtype == torch.float32:  # fp32: a program's online softmax over at most
        ns = max(ns, min(128, read_len // FP32_SPLIT_KEYS))  # FP32_SPLIT_KEYS keys keeps its rounding near the twin's
    ns = 0 if ns <= 1 else ns
    return max(ns, 1) if prefix else ns


def _merge_counters(merge: str, rows: int, bm: int, bmm: int, KVH: int, dev) -> torch.Tensor | None:
    """The arrival counters when the last split of each (m-tile, KV head) merges the partials
    (merge "last", or "auto" where the m-tiles are no wider than the merge kernel's bmm rows),
    else None: the merge kernel does it."""
    if not (merge == "last" or (merge == "auto" and _cdiv(rows, bm) >= _cdiv(rows, bmm))):
        return None
    cnt = _counters(dev, _cdiv(rows, bm) * KVH)
    assert cnt is not None or merge == "auto", "merge='last': no counters (grid too large, or first use in a capture)"
    return cnt


# ----------------------------------------------------------------------------- prefill
PREFILL_BACKENDS = ("auto", "flash", "cudnn", "triton", "efficient", "math")
# auto's order of the fused kernels for a chunk of T queries at prefix `start`: cuDNN first only
# where its speed pays for building its graph, which torch's SDPA does for every new shape (every
# new prefix length). An H200 measured cuDNN at twice FA2's TFLOP/s at D = 256 (4096-token chunks:
# 0.36 against 0.75 ms a layer at prefix 0, 5.7 against 11.1 at 32K; 082b8a3:results/attention-h200.json),
# and a chat turn's 200-token prefill over a new prefix of 17-18K about 45 ms above the same
# prefill over a prefix length seen before (results/chat-h200.json: turns 3-8 against turn 2),
# which is what cuDNN saves on 16 such layers at T (start + T/2) of about 2^26 (a 200-token chunk at
# 330K, an 8192-token chunk past 4K).
CUDNN_MIN_WORK = 1 << 26


def fused_prefill_order(T: int, start: int) -> tuple[str, str]:
    """auto's fused backends for a chunk, first choice first (CUDNN_MIN_WORK)."""
    return ("cudnn", "flash") if T * (start + T // 2) >= CUDNN_MIN_WORK else ("flash", "cudnn")


def _sdpa_backend(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([{"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                         "math": SDPBackend.MATH}[name]])


def _causal_sdpa(q4, k4, v4, start: int, scale, gqa: bool):
    """SDPA of q4 [1, h, T, D] over k4, v4 [1, kvh, start + T, D], lower-right causal."""
    if start == 0:
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q4.shape[-2], k4.shape[-2])
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=bias, scale=scale, enable_gqa=gqa)


_CUDNN_GQA: dict = {}  # device -> whether cuDNN took fewer K/V heads than query heads there


def _cudnn_call(q4, k4, v4, causal: bool, scale):
    o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q4, k4, v4, None, True, 0.0, causal, False,
                                                                 scale=scale)[:2]
    return o, lse.reshape(q4.shape[:3]).float()


def _cudnn(q4, k4, v4, causal: bool, scale):
    """cuDNN's fused attention (SDPA's cuDNN backend) of q4 [1, h, T, D] over k4, v4 [1, kvh, S, D]
    (top-left causal, or none) -> (o [1, h, T, D], natural-log lse [1, h, T] fp32). GQA: all
    heads in one call where cuDNN takes fewer K/V heads, else one call per KV head with its K/V
    broadcast over the group (no copy of the cache)."""
    kvh = k4.shape[1]
    if kvh == q4.shape[1] or _CUDNN_GQA.get(q4.device, True):
        try:
            out = _cudnn_call(q4, k4, v4, causal, scale)
            if kvh != q4.shape[1]:
                _CUDNN_GQA[q4.device] = True
            return out
        except RuntimeError:
            if kvh == q4.shape[1]:
                raise
            _CUDNN_GQA[q4.device] = False
    g = q4.shape[1] // kvh
    parts = [_cudnn_call(q4[:, j * g:(j + 1) * g], k4[:, j:j + 1].expand(-1, g, -1, -1),
                         v4[:, j:j + 1].expand(-1, g, -1, -1), causal, scale) for j in range(kvh)]
    return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def _cudnn_prefill(q4, k4, v4, start: int, scale):
    """A chunk at offset start through cuDNN: its prefix [0, start) unmasked and its own keys
    under the (square, so top-left = lower-right) causal mask, merged by log-sum-exp."""
    T = q4.shape[2]
    o2, l2 = _cudnn(q4, k4[:, :, start:start + T], v4[:, :, start:start + T], True, scale)
    if start == 0:
        return o2
    o1, l1 = _cudnn(q4, k4[:, :, :start], v4[:, :, :start], False, scale)
    lse = torch.logaddexp(l1, l2)
    o = o1.float().mul_((l1 - lse).exp_()[..., None])  # fp32 [1, h, T, D]: two of them at the peak
    return o.add_(o2 * (l2 - lse).exp_()[..., None]).to(q4.dtype)


def prefill_attention(q, k_cache, v_cache, start: int, scale=None, backend: str = "auto") -> torch.Tensor:
    """Attention of a prefill chunk q [T, H, D] at host offset `start` over keys [0, start + T)
    of k_cache, v_cache [N, KVH, D] (the chunk's own K/V already at rows start..start+T-1),
    lower-right causal. -> [T, H, D] in q's dtype.

    backend: "cudnn" cuDNN's fused attention (SDPA's cuDNN backend, called for the prefix and the
    chunk's own block separately and merged: its causal mask is top-left); "flash" SDPA's
    FlashAttention-2 (fp16/bf16, sm_80+, head_dim <= 256; the only fused
    SDPA backend that takes GQA, per torch's docs, and the one `causal_lower_right` dispatches to
    first); "triton" this module's kernel (prefix splits off, the chunk causal); "efficient"
    memory-efficient SDPA (lower-right causal but no GQA: one call per KV head, its K/V broadcast
    over the group's query heads); "math" the dense twin's path; "auto": cudnn and flash in
    fused_prefill_order's order (cuDNN is twice flash's TFLOP/s at D = 256 on an H200 but builds a
    graph for every new shape), the first that runs, else triton on CUDA, else efficient; math on
    CPU."""
    T, H, D = q.shape
    KVH = k_cache.shape[1]
    G = H // KVH
    S = start + T
    assert S <= k_cache.shape[0]
    if backend == "auto":
        if not q.is_cuda:
            backend = "math"
        else:
            for fused in fused_prefill_order(T, start):  # the fused kernels, cheapest first for this chunk
                if q.dtype in (torch.float16, torch.bfloat16) and (fused, q.device, q.dtype, D) not in _FUSED_FAILED:
                    try:
                        return prefill_attention(q, k_cache, v_cache, start, scale, fused)
                    except RuntimeError:  # not built for / not usable on this GPU or shape: do not ask again
                        _FUSED_FAILED.add((fused, q.device, q.dtype, D))
            backend = "triton" if triton is not None else "efficient"
    q4 = q.transpose(0, 1)[None]  # [1, H, T, D]
    k4 = k_cache[:S].transpose(0, 1)[None]  # [1, KVH, S, D]
    v4 = v_cache[:S].transpose(0, 1)[None]
    if backend == "flash":
        with _sdpa_backend("flash"):
            return _causal_sdpa(q4, k4, v4, start, scale, G > 1)[0].transpose(0, 1)
    if backend == "cudnn":
        return _cudnn_prefill(q4, k4, v4, start, scale)[0].transpose(0, 1)
    if backend == "triton":
        return tree_attention(q, k_cache, v_cache, start, "causal", S, scale=scale)
    if backend == "efficient":
        o = torch.empty_like(q)
        with _sdpa_backend("efficient"):
            for j in range(KVH):
                qj = q4[:, j * G:(j + 1) * G]  # [1, G, T, D]
                kj = k4[:, j:j + 1].expand(1, G, S, D)  # head stride 0: no copy of the cache
                vj = v4[:, j:j + 1].expand(1, G, S, D)
                try:
                    oj = _causal_sdpa(qj, kj, vj, start, scale, False)
                except RuntimeError:  # a kernel that wants real heads: this KV head's copy ([G, S, D])
                    oj = _causal_sdpa(qj, kj.contiguous(), vj.contiguous(), start, scale, False)
                o[:, j * G:(j + 1) * G] = oj[0].transpose(0, 1)
        return o
    if backend == "math":
        return prefill_attention_reference(q, k_cache, v_cache, start, scale)
    raise ValueError(f"backend must be one of {PREFILL_BACKENDS}, not {backend!r}")


if triton is not None:
    _merge_step = triton.jit(_merge_step)  # device functions of the kernels
    _merge_rows = triton.jit(_merge_rows)
    _fence_gpu = triton.jit(_fence_gpu)
    _kernel(_attn_fwd_kernel, interpret=False)
    _kernel(_attn_merge_kernel, interpret=False)

"""The attention ops (ddtree.ops.attention) against their SDPA twins with the dense mask: random
trees over random prefixes, the drafter's windowed blocks, prefill chunks. Compiled on a GPU;
without one under Triton's interpreter on CPU tensors (tests/conftest.py switches it on).

Every case poisons what the op must not touch or must write: cache rows it must not read hold NaN
(rows past the tree, rows older than a window), and the output and the split workspace start as
NaN."""

from __future__ import annotations

import ctypes
import glob
import os

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed (pip install triton): its interpreter runs these on CPU")

from ddtree.ops import attention as A  # noqa: E402
from ddtree.ops.tree import ancestor_mask_from_parents  # noqa: E402
from helpers import MaxErrors, assert_rel, kernel_device, tiny_cpu_each_test  # noqa: E402,F401

DEV = kernel_device()
ERR = MaxErrors()
TOL = 1e-5  # fp32: max |fast - twin| / max |twin|


def _one_blas_thread():
    """The interpreter's dots are numpy matmuls: on a small shared runner numpy's OpenBLAS threads
    spinning against torch's made them ~3x slower. One thread (best effort)."""
    import numpy as np

    for lib in glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "libscipy_openblas*.so")):
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            try:
                getattr(ctypes.CDLL(lib), name)(1)
                return
            except (OSError, AttributeError):
                pass


if DEV.type == "cpu":
    _one_blas_thread()


@pytest.fixture(autouse=True)
def nan_workspace(monkeypatch):
    """Split partials start as NaN: a partial row the kernel does not write poisons the merge."""
    monkeypatch.setattr(A, "_workspace", lambda n, device: torch.full((n,), float("nan"), device=device))


# ----------------------------------------------------------------------------- inputs
def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[T, T] bool, node i sees its ancestors and itself (the walk's and the verify's mask)."""
    return ancestor_mask_from_parents(parents)


def random_parents(T: int, kind: str, g: torch.Generator) -> list[int]:
    if kind == "chain":
        return [i - 1 for i in range(T)]
    if kind == "star":
        return [-1] + [0] * (T - 1)
    # bushy: a random earlier node, mostly a recent one (deep and wide at once)
    out = [-1]
    for i in range(1, T):
        lo = 0 if torch.rand((), generator=g) < 0.3 else max(0, i - 4)
        out.append(int(torch.randint(lo, i, (), generator=g)))
    return out


def make_cache(seed: int, N: int, KVH: int, D: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(N, KVH, D, generator=g, dtype=torch.float32) * 0.7
    v = torch.randn(N, KVH, D, generator=g, dtype=torch.float32)
    return k.to(dtype), v.to(dtype)


def poisoned(k, v, keep_lo: int, keep_hi: int):
    """Copies with NaN outside rows [keep_lo, keep_hi): rows the op must not read."""
    kp, vp = k.clone(), v.clone()
    for t in (kp, vp):
        t[:keep_lo] = float("nan")
        t[keep_hi:] = float("nan")
    return kp, vp


def check_tree(seed, T, H, KVH, D, start, kv_len, *, tree_mask=None, kind="bushy", splits=None, window=None,
               causal=True, q_pos=None, what="", scale=None, merge="auto"):
    """tree_attention against the twin on fresh inputs; cache rows it must not read are NaN."""
    g = torch.Generator().manual_seed(seed)
    N = kv_len + 5  # rows past kv_len exist (and are NaN): never read
    k, v = make_cache(seed, N, KVH, D)
    q = torch.randn(T, H, D, generator=g)
    if tree_mask is None:
        tree_mask = ancestor_mask(random_parents(T, kind, g))
    lo = 0 if window is None else max(0, start - window + 1)
    kp, vp = poisoned(k, v, lo, start + T)
    st = torch.tensor(start, device=DEV)
    qp = None if q_pos is None else q_pos.to(DEV)
    tm = tree_mask if isinstance(tree_mask, str) else tree_mask.to(DEV)
    out = torch.full((T, H, D), float("nan"), device=DEV)
    got = A.tree_attention(q.to(DEV), kp.to(DEV), vp.to(DEV), st, tm, kv_len, q_pos=qp, window=window,
                           scale=scale, causal=causal, out=out, splits=splits, merge=merge)
    assert got.data_ptr() == out.data_ptr()
    want = A.tree_attention_reference(q, k, v, torch.tensor(start), tree_mask, kv_len, q_pos=q_pos, window=window,
                                      causal=causal, scale=scale)
    assert torch.isfinite(want).all(), "the twin itself saw a poisoned row"
    e = assert_rel(got.cpu(), want, TOL, f"{what} seed={seed} T={T} H={H} KVH={KVH} D={D} start={start} kv_len={kv_len}")
    ERR.note(what or "tree", e)


# ----------------------------------------------------------------------------- trees
def _small_cases(n: int):
    g = torch.Generator().manual_seed(1234)
    heads = [(1, 1), (2, 1), (1, 4), (2, 4), (1, 6), (4, 6)]  # (KVH, G)
    Ts = [1, 2, 3, 5, 8, 13, 16, 17, 31, 33, 64, 100, 128]
    starts = [0, 1, 17, 64, 100, 333]
    kinds = ["chain", "star", "bushy"]
    splits = [None, 0, 2, 3, 7]
    out = []
    while len(out) < n:
        KVH, G = heads[int(torch.randint(len(heads), (), generator=g))]
        T = Ts[int(torch.randint(len(Ts), (), generator=g))]
        D = (64, 256)[int(torch.randint(2, (), generator=g))]
        start = starts[int(torch.randint(len(starts), (), generator=g))]
        if T * KVH * G * (start + T) * D > 3e6:  # interpreter time: the big ones have their own test
            continue
        slack = int(torch.randint(0, 40, (), generator=g))
        out.append((len(out), T, KVH * G, KVH, D, start, start + T + slack,
                    kinds[len(out) % 3], splits[int(torch.randint(len(splits), (), generator=g))]))
    return out


@pytest.mark.parametrize("case", _small_cases(30), ids=lambda c: f"T{c[1]}-H{c[2]}-KVH{c[3]}-D{c[4]}-s{c[5]}-{c[7]}-sp{c[8]}")
def test_random_trees_equal_twin(case):
    """Random trees (chains, stars, bushy) of 1..128 nodes over prefixes of 0..333 rows, GQA 1, 4
    and 6, head dims 64 and 256, kv_len buckets past start + T, no split / 2..7 splits."""
    seed, T, H, KVH, D, start, kv_len, kind, splits = case
    check_tree(seed, T, H, KVH, D, start, kv_len, kind=kind, splits=splits, what="tree small")


@pytest.mark.parametrize("seed,T,H,KVH,D,start,kv_len,splits", [
    (101, 16, 24, 4, 256, 3000, 3100, 6),  # the 27B layout, split over the context (one m-tile: 96 rows)
    (102, 1, 24, 4, 256, 2500, 4096, None),  # an autoregressive step: rows = G = 6
    (103, 128, 6, 1, 64, 1500, 1700, 3),  # the widest tree, 6 m-tiles of 128 rows
    (104, 32, 8, 2, 64, 4000, 4100, 12),  # a long prefix, many splits
    (105, 16, 12, 2, 256, 40, 1024, 9),  # short prefix, long bucket: most splits empty
])
@pytest.mark.parametrize("merge", ["last", "kernel"])
def test_big_cases_equal_twin(seed, T, H, KVH, D, start, kv_len, splits, merge):
    """Both merges of the split partials: by the last split to finish (its counters back at zero
    after the call) and by a second kernel."""
    check_tree(seed, T, H, KVH, D, start, kv_len, kind="bushy", splits=splits, what="tree big", merge=merge)
    if merge == "last":
        assert not A._COUNTERS[DEV].any(), "an arrival counter was left set: the next call would merge early"


def test_splits_do_not_change_the_result():
    """The same call unsplit, split in 3 and in 16 (empty splits past the prefix), each against the twin."""
    for splits in (0, 3, 16):
        check_tree(7, 9, 12, 2, 64, 400, 500, splits=splits, what="splits")


def test_custom_scale_and_a_noncontiguous_query():
    g = torch.Generator().manual_seed(8)
    T, H, KVH, D, start = 6, 8, 2, 64, 90
    k, v = make_cache(8, 128, KVH, D)
    q = torch.randn(H, T, D, generator=g).transpose(0, 1)  # [T, H, D] with stride(0) = D
    mask = ancestor_mask(random_parents(T, "bushy", g))
    got = A.tree_attention(q.to(DEV), k.to(DEV), v.to(DEV), torch.tensor(start, device=DEV), mask.to(DEV), 120, scale=0.3)
    want = A.tree_attention_reference(q, k, v, torch.tensor(start), mask, 120, scale=0.3)
    ERR.note("scale", assert_rel(got.cpu(), want, TOL, "scale"))


# ----------------------------------------------------------------------------- the drafter
WINDOW = 64  # small: the interpreter's time (the drafter's is 2048)


@pytest.mark.parametrize("ctx", [0, 10, 48, 63, 64, 65, 200, 1500])
def test_drafter_windowed_block(ctx):
    """A block of 16 queries at positions ctx..ctx+15 over the context plus its own keys, causal,
    sliding window: only keys with q_pos - key_pos < window; rows older than ctx - window + 1 are
    NaN (a windowed call reads only the window), at contexts shorter and longer than the window."""
    B = 16
    tril = torch.ones(B, B, dtype=torch.bool).tril()
    check_tree(200 + ctx, B, 8, 2, 128, ctx, ctx + B + 3, tree_mask=tril, window=WINDOW, what="drafter window")
    check_tree(300 + ctx, B, 8, 2, 128, ctx, ctx + B, tree_mask="causal", window=WINDOW, splits=3, what="drafter window")


@pytest.mark.parametrize("ctx", [0, 30, 700])
def test_drafter_full_and_two_sided_window(ctx):
    """The drafter's non-causal full layer (all-ones block, no window), and a non-causal windowed
    layer whose window (8) is smaller than the block, so the forward bound (key_pos - q_pos < window)
    bites inside the block."""
    B = 16
    ones = torch.ones(B, B, dtype=torch.bool)
    check_tree(400 + ctx, B, 8, 2, 128, ctx, ctx + B + 7, tree_mask=ones, what="drafter full")
    check_tree(500 + ctx, B, 8, 2, 128, ctx, ctx + B, tree_mask="full", causal=False, window=8, what="drafter 2-sided")
    check_tree(600 + ctx, B, 8, 2, 128, ctx, ctx + B, tree_mask="full", causal=False, window=WINDOW, splits=2,
               what="drafter 2-sided")


def test_windowed_tree_with_tree_positions():
    """A window with q_pos = start + depth (tree positions, not rows): the mask follows q_pos."""
    g = torch.Generator().manual_seed(9)
    T, start = 24, 150
    parents = random_parents(T, "bushy", g)
    depth = [0] * T
    for i in range(1, T):
        depth[i] = depth[parents[i]] + 1
    check_tree(9, T, 8, 2, 64, start, start + T + 4, tree_mask=ancestor_mask(parents), window=40,
               q_pos=start + torch.tensor(depth), what="window tree")


# ----------------------------------------------------------------------------- prefill
@pytest.mark.parametrize("T,start", [(1, 0), (7, 0), (64, 5), (200, 0), (130, 300), (48, 1000)])
def test_prefill_triton_equals_twin(T, start):
    """prefill_attention's kernel path (lower-right causal chunk at a host offset) against the dense twin."""
    g = torch.Generator().manual_seed(T * 7 + start)
    H, KVH, D = 6, 1, 64
    k, v = make_cache(T + start, start + T + 9, KVH, D)
    q = torch.randn(T, H, D, generator=g)
    kp, vp = poisoned(k, v, 0, start + T)
    got = A.prefill_attention(q.to(DEV), kp.to(DEV), vp.to(DEV), start, backend="triton")
    want = A.prefill_attention_reference(q, k, v, start)
    ERR.note("prefill triton", assert_rel(got.cpu(), want, TOL, f"prefill T={T} start={start}"))


def test_prefill_reference_is_the_lower_right_causal_mask():
    """The twin itself: query t of a chunk at offset s sees keys 0..s+t (its own row included)."""
    T, start, D = 5, 3, 16
    k, v = make_cache(1, start + T, 1, D)
    q = torch.randn(T, 1, D)
    o = A.prefill_attention_reference(q, k, v, start)
    for t in range(T):
        n = start + t + 1
        w = torch.softmax((k[:n, 0] @ q[t, 0]) / D ** 0.5, 0)
        torch.testing.assert_close(o[t, 0], w @ v[:n, 0], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- rules
def test_split_rule():
    """Few splits at 1K; at 128K as many programs as fill one wave of 132 SMs (x programs per SM)
    and not one more (a second wave for a few programs costs a whole split); none needed for a
    wide tree at a short context; windowed calls are sized by the window, not the context."""
    sms = 132
    for T in (1, 16, 32, 64):
        rows, bm = T * 6, min(64, max(16, 1 << (T * 6 - 1).bit_length()))
        units = -(-rows // bm) * 4
        assert A.num_splits(1024, rows, 4, bm, sms) <= 4
        for per_sm in (1, 2):
            ns = A.num_splits(131072, rows, 4, bm, sms, per_sm)
            assert sms * per_sm - units < ns * units <= sms * per_sm and ns <= A.MAX_SPLITS, (T, per_sm, ns)
        assert A.num_splits(2048, rows, 4, bm, sms) <= 8
    assert A.num_splits(1024, 768, 4, 64, sms) == 0  # 128 nodes: 48 programs already, 1K keys


def test_tiles_fit_the_shared_memory():
    """The chosen tiles' shared-memory estimate fits Ampere's 99 KB and Hopper's 227 KB a block,
    for the target's and the drafter's head dims, bf16 and fp32, every tree size."""
    for limit, hopper in ((101376, False), (166912, False), (232448, True)):
        for D, G in ((256, 6), (128, 4), (64, 1)):
            for T in (1, 2, 3, 16, 64, 128):
                for elt in (2, 4):
                    tiles = A.pick_tiles(D, T * G, elt, limit, hopper)
                    assert tiles and all(A._smem_estimate(t, D, elt, hopper) <= limit for t in tiles), (limit, D, T)
                    assert all(16 <= t.bm <= max(16, 1 << (T * G - 1).bit_length()) for t in tiles)


# ----------------------------------------------------------------------------- the fused prefix
@pytest.fixture
def small_fused_plan(monkeypatch):
    """The fused prefix's plan at test sizes (its thresholds are for 16K+ prefixes)."""
    from ddtree.ops import split_rule

    monkeypatch.setattr(split_rule, "FUSED_MIN_KEYS", 48)
    monkeypatch.setattr(split_rule, "FUSED_MIN_RANGE", 16)
    monkeypatch.setattr(split_rule, "FUSED_ALIGN", 8)


def _fused_cases(n: int):
    g = torch.Generator().manual_seed(77)
    out = []
    while len(out) < n:
        KVH, G = [(1, 6), (2, 4), (4, 6), (1, 1)][len(out) % 4]
        T = [11, 16, 17, 33, 64, 65, 100, 128][int(torch.randint(8, (), generator=g))]
        if T * G < A.FUSED_MIN_ROWS:
            continue
        D = (64, 256)[int(torch.randint(2, (), generator=g))]
        floor = int(torch.randint(48, 400, (), generator=g))
        start = floor + [0, 1, 9, 150][len(out) % 4]  # the bound exact, or below start
        if T * KVH * G * (start + T) * D > 6e6:
            continue
        out.append((len(out), T, KVH * G, KVH, D, start, floor, start + T + int(torch.randint(0, 40, (), generator=g)),
                    ["chain", "star", "bushy"][len(out) % 3]))
    return out


@pytest.mark.parametrize("case", _fused_cases(12), ids=lambda c: f"T{c[1]}-H{c[2]}-KVH{c[3]}-D{c[4]}-s{c[5]}-f{c[6]}-{c[8]}")
def test_fused_prefix_equals_twin(small_fused_plan, monkeypatch, case):
    """A verify whose prefix [0, B) goes through the fused part (its torch twin here: cuDNN's
    contract) and [B, start) plus the tree through the kernel, merged: equal to the dense twin in
    fp32 on random trees, GQA 1, 4 and 6, head dims 64 and 256, floors at and below start. The
    fused part is seen to run, over ranges that end at or below the floor."""
    seed, T, H, KVH, D, start, floor, kv_len, kind = case
    seen = []
    real = A.fused_prefix_reference

    def spy(qf, k, v, S, C, scale):
        seen.append(S * C)
        return real(qf, k, v, S, C, scale)

    monkeypatch.setattr(A, "fused_prefix_reference", spy)
    g = torch.Generator().manual_seed(seed)
    k, v = make_cache(seed, kv_len + 5, KVH, D)
    q = torch.randn(T, H, D, generator=g)
    mask = ancestor_mask(random_parents(T, kind, g))
    kp, vp = poisoned(k, v, 0, start + T)
    out = torch.full((T, H, D), float("nan"), device=DEV)
    got = A.tree_attention(q.to(DEV), kp.to(DEV), vp.to(DEV), torch.tensor(start, device=DEV), mask.to(DEV), kv_len,
                           out=out, floor=floor, fused="torch", merge=("last", "kernel")[seed % 2])
    want = A.tree_attention_reference(q, k, v, torch.tensor(start), mask, kv_len)
    assert len(seen) == 1 and 0 < seen[0] <= floor, (seen, floor)
    ERR.note("fused prefix", assert_rel(got.cpu(), want, TOL, f"fused T={T} H={H} KVH={KVH} D={D} start={start} floor={floor}"))


def test_fused_prefix_serves_only_where_it_should(small_fused_plan, monkeypatch):
    """No fused part without a floor, for few rows (an AR step), with a window, or off; cuDNN's
    backend (auto) only for CUDA bf16 / fp16."""
    calls = []
    monkeypatch.setattr(A, "fused_prefix_reference", lambda *a: calls.append(a))
    k, v = make_cache(5, 400, 1, 64)
    q = torch.randn(16, 6, 64)
    m = ancestor_mask(random_parents(16, "bushy", torch.Generator().manual_seed(5)))
    st = torch.tensor(300)
    for kw in (dict(floor=0, fused="torch"), dict(floor=250, fused="off"), dict(floor=250, fused="auto")):
        A.tree_attention(q.to(DEV), k.to(DEV), v.to(DEV), st.to(DEV), m.to(DEV), 330, **kw)  # fp32 (and CPU): no cuDNN
    A.tree_attention(q[:2].to(DEV), k.to(DEV), v.to(DEV), st.to(DEV), m[:2, :2].to(DEV), 330, floor=250, fused="torch")
    A.tree_attention(q.to(DEV), k.to(DEV), v.to(DEV), st.to(DEV), "causal", 330, window=64, floor=250, fused="torch")
    assert not calls


def test_fused_prefix_plan():
    """The fused ranges end at or below the floor, fill about one wave (S x KV heads x 128-row tiles
    <= SMs), keep ranges of at least FUSED_MIN_RANGE keys, and stay off below FUSED_MIN_KEYS."""
    from ddtree.ops.split_rule import FUSED_MIN_KEYS, FUSED_MIN_RANGE, fused_prefix_plan

    assert fused_prefix_plan(FUSED_MIN_KEYS - 1, 198, 4, 132) == (0, 0)
    for floor in (FUSED_MIN_KEYS, 32768 - 300, 131072 - 289, 262144 - 1000):
        for rows in (64, 96, 102, 198, 390, 768):
            S, C = fused_prefix_plan(floor, rows, 4, 132)
            assert S >= 1 and C >= FUSED_MIN_RANGE and S * C <= floor, (floor, rows, S, C)
            assert S * 4 * -(-rows // 128) <= 132 or S == 1
            assert floor - S * C < S * 1024, "little of the prefix left to the split-KV kernel"
    assert fused_prefix_plan(131072, 102, 4, 132)[0] == 33 and fused_prefix_plan(131072, 198, 4, 132)[0] == 16


def test_report_errors():
    ERR.report("attention")


# ----------------------------------------------------------------------------- GPU
def _gpu_case(seed, T, H, KVH, D, start, kv_len, dtype, tree_mask=None, window=None):
    g = torch.Generator().manual_seed(seed)
    k, v = make_cache(seed, kv_len, KVH, D, dtype)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    mask = ancestor_mask(random_parents(T, "bushy", g)) if tree_mask is None else tree_mask
    st = torch.tensor(start, device="cuda")
    args = (q.cuda(), k.cuda(), v.cuda(), st, mask if isinstance(mask, str) else mask.cuda(), kv_len)
    got = A.tree_attention(*args, window=window)
    f32 = [a.float() if a.is_floating_point() else a for a in args[:3]]
    want = A.tree_attention_reference(*f32, *args[3:], window=window)  # the twin in fp32
    return got, want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("T", [1, 16, 128])
def test_gpu_32k_target_shapes(dtype, tol, T):
    """The 27B's attention layer at a 32K prefix (the kernel as compiled for this GPU) against the
    fp32 twin: fp32 to 1e-5, bf16 to bf16's rounding."""
    got, want = _gpu_case(T, T, 24, 4, 256, 32768, 32768 + 256, dtype)
    assert got.dtype == dtype
    ERR.note(f"gpu 32K {dtype}", assert_rel(got.float().cpu(), want.cpu(), tol, f"32K T={T} {dtype}"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [1, 16, 17, 33])
def test_gpu_long_read_tiles(T):
    """Past LONG_READ_KEYS (a 128K prefix) the long-read table's tiles, bf16, against the fp32 twin."""
    start = 131072
    got, want = _gpu_case(T, T, 24, 4, 256, start, start + 2048, torch.bfloat16)
    ERR.note("gpu 128K bf16", assert_rel(got.float().cpu(), want.cpu(), 2e-2, f"128K T={T}"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL), (torch.bfloat16, 2e-2)])
def test_gpu_32k_drafter_shapes(dtype, tol):
    B = 16
    for mask, window in (("causal", 2048), ("full", None)):
        got, want = _gpu_case(5, B, 32, 8, 128, 32768, 32768 + 64, dtype, tree_mask=mask, window=window)
        ERR.note(f"gpu drafter {dtype}", assert_rel(got.float().cpu(), want.cpu(), tol, f"drafter {mask} {dtype}"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_cuda_graph_replays_follow_start():
    """Captured once, replayed with other prefix lengths written into `start` on the device: each
    replay equals the twin at that length (the split ranges follow the device's start)."""
    T, H, KVH, D, kv_len = 16, 24, 4, 256, 8192
    k, v = make_cache(3, kv_len, KVH, D, torch.bfloat16)
    k, v = k.cuda(), v.cuda()
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    mask = ancestor_mask(random_parents(T, "bushy", torch.Generator().manual_seed(3))).cuda()
    st = torch.tensor(100, device="cuda")
    out = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)
    A.tree_attention(q, k, v, st, mask, kv_len, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        A.tree_attention(q, k, v, st, mask, kv_len, out=out)
    for start in (0, 1000, 5000, kv_len - T):
        st.fill_(start)
        out.fill_(float("nan"))
        graph.replay()
        want = A.tree_attention_reference(q.float(), k.float(), v.float(), st, mask, kv_len)
        assert_rel(out.float(), want, 2e-2, f"graph start={start}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T,floor", [(1, 0), (16, 0), (65, 0), (16, 30000), (65, 30000)])
def test_gpu_merge_by_last_split(T, floor):
    """The merge by the last split to arrive (any of them may be last) is the merge kernel's bit for
    bit, on every one of 30 replays of a captured graph (a race would show as a difference or a
    stale counter), with and without the fused prefix's partials; the counters end at zero."""
    H, KVH, D, start, kv_len = 24, 4, 256, 32768, 65536
    k, v = make_cache(11, kv_len, KVH, D, torch.bfloat16)
    k, v = k.cuda(), v.cuda()
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    mask = ancestor_mask(random_parents(T, "bushy", torch.Generator().manual_seed(T))).cuda()
    st = torch.tensor(start, device="cuda")
    want = A.tree_attention(q, k, v, st, mask, kv_len, floor=floor, merge="kernel")
    out = torch.empty_like(want)
    A.tree_attention(q, k, v, st, mask, kv_len, out=out, floor=floor, merge="last")  # compile outside the capture
    assert torch.equal(out, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        A.tree_attention(q, k, v, st, mask, kv_len, out=out, floor=floor, merge="last")
    for _ in range(30):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert not A._COUNTERS[out.device].any()
    ref = A.tree_attention_reference(q.float(), k.float(), v.float(), st, mask, kv_len)
    assert_rel(out.float(), ref, 2e-2, f"merge last T={T} floor={floor}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["auto", "flash", "cudnn", "triton", "efficient"])
def test_gpu_prefill_backends(backend):
    H, KVH, D = 24, 4, 256
    for T, start in ((1024, 0), (512, 8192)):
        k, v = make_cache(T, start + T, KVH, D, torch.bfloat16)
        q = torch.randn(T, H, D, dtype=torch.bfloat16)
        try:
            got = A.prefill_attention(q.cuda(), k.cuda(), v.cuda(), start, backend=backend)
        except RuntimeError as e:
            if backend in ("flash", "cudnn", "efficient"):
                pytest.skip(f"SDPA {backend} not usable here: {e}")
            raise
        want = A.prefill_attention_reference(q.float().cuda(), k.float().cuda(), v.float().cuda(), start)
        assert_rel(got.float(), want, 2e-2, f"prefill {backend} T={T} start={start}")


def _math_cudnn(q4, k4, v4, causal, scale):
    """cuDNN's contract in plain torch: top-left causal (or none), GQA, natural-log lse."""
    g = q4.shape[1] // k4.shape[1]
    k4, v4 = k4.repeat_interleave(g, 1), v4.repeat_interleave(g, 1)
    s = (q4 @ k4.transpose(-1, -2)) * (scale or q4.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    lse = s.logsumexp(-1)
    return (s - lse[..., None]).exp() @ v4, lse


@pytest.mark.parametrize("start", [0, 7, 300])
def test_cudnn_prefill_split_and_merge(monkeypatch, start):
    """The cuDNN backend's decomposition (prefix unmasked + the chunk's own block causal, merged
    by log-sum-exp) equals the lower-right causal twin; cuDNN itself stands in as its contract."""
    monkeypatch.setattr(A, "_cudnn", _math_cudnn)
    T, H, KVH, D = 37, 12, 2, 64
    k, v = make_cache(11, start + T, KVH, D)
    q = torch.randn(T, H, D, generator=torch.Generator().manual_seed(start))
    got = A.prefill_attention(q, k, v, start, backend="cudnn")
    torch.testing.assert_close(got, A.prefill_attention_reference(q, k, v, start), rtol=1e-5, atol=1e-5)


def test_long_reads_take_the_long_table():
    """Hopper, D = 256, by read length: up to MID_READ_KEYS 64-row tiles up to 256 rows; past it a
    33-node tree (198 rows, which two 64-row tiles pad as much as one 128-row tile) takes the
    128-row tile; past LONG_READ_KEYS also T = 16 / 17 (96 / 102 rows); 192 rows keep 64-row tiles."""
    hop = 232448
    for rows, short_bm, mid_bm, long_bm in ((96, 64, 64, 128), (102, 64, 64, 128), (192, 64, 64, 64),
                                            (198, 64, 128, 128), (390, 128, 128, 128)):
        assert A.pick_tiles(256, rows, 2, hop, True, A.MID_READ_KEYS)[0].bm == short_bm, rows
        assert A.pick_tiles(256, rows, 2, hop, True, A.MID_READ_KEYS + 1)[0].bm == mid_bm, rows
        assert A.pick_tiles(256, rows, 2, hop, True, A.LONG_READ_KEYS)[0].bm == mid_bm, rows
        assert A.pick_tiles(256, rows, 2, hop, True, A.LONG_READ_KEYS + 1)[0].bm == long_bm, rows
    # Ampere has no mid or long table: the same tiles at any length
    assert A.pick_tiles(256, 198, 2, 101376, False, 1 << 20) == A.pick_tiles(256, 198, 2, 101376, False, 1024)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("T", [16, 33, 65])
def test_gpu_fused_prefix_cudnn(T):
    """The 27B's verify at a 32K prefix with a floor: cuDNN's partials against their torch twin,
    the whole call against the fp32 dense twin (bf16), and a CUDA graph captured once and replayed
    at other lengths above the floor."""
    H, KVH, D, floor = 24, 4, 256, 32768 - 300
    kv_len = 32768 + 512
    k, v = (t.cuda() for t in make_cache(9, kv_len, KVH, D, torch.bfloat16))
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    mask = ancestor_mask(random_parents(T, "bushy", torch.Generator().manual_seed(T))).cuda()
    S, C = A.fused_prefix_plan(floor, T * 6, KVH, torch.cuda.get_device_properties(0).multi_processor_count)
    qf = q.view(T, KVH, 6, D).permute(1, 0, 2, 3).reshape(KVH, T * 6, D)
    o, lse = A._fused_prefix_cudnn(qf, k, v, S, C, D ** -0.5)
    o_ref, lse_ref = A.fused_prefix_reference(qf, k, v, S, C, D ** -0.5)
    assert_rel(o.float(), o_ref, 2e-2, "cuDNN partials")
    torch.testing.assert_close(lse.reshape(S, KVH, -1).float(), lse_ref, rtol=1e-2, atol=1e-2)
    st = torch.tensor(32768, device="cuda")
    out = torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16)
    A.tree_attention(q, k, v, st, mask, kv_len, out=out, floor=floor)
    assert ("verify-cudnn", q.device, q.dtype, D) not in A._FUSED_FAILED, "cuDNN refused the fused prefix"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        A.tree_attention(q, k, v, st, mask, kv_len, out=out, floor=floor)
    for start in (floor, 32768, kv_len - T):
        st.fill_(start)
        out.fill_(float("nan"))
        graph.replay()
        want = A.tree_attention_reference(q.float(), k.float(), v.float(), st, mask, kv_len)
        ERR.note("gpu fused prefix bf16", assert_rel(out.float(), want, 2e-2, f"fused graph T={T} start={start}"))


@pytest.mark.slow
def test_greedy_decoding_through_the_fused_prefix_equals_ar(small_fused_plan, monkeypatch):
    """A hybrid pair decoding a 600-token prompt with the fused prefix on (its torch twin standing
    in for cuDNN): the floors the decoder derives from its graph keys hold at every verify (the
    fused part reads only committed keys), and ddtree / dflash tokens equal ar's."""
    from ddtree.decode.random_pair import build_random_pair
    from ddtree.ops import dispatch
    from ddtree.options import Options

    seen = []
    real = A.fused_prefix_reference
    monkeypatch.setattr(dispatch, "_fused_prefix", lambda options, dev, a: options.verify_fused != "off")
    monkeypatch.setattr(A, "_cudnn_prefix_ok", lambda q, D: True)
    monkeypatch.setattr(A, "FUSED_MIN_ROWS", 8)  # the tiny model's trees have few query rows
    monkeypatch.setattr(A, "_fused_prefix_cudnn", lambda qf, k, v, S, C, scale: seen.append(S * C) or real(qf, k, v, S, C, scale))
    prompt = torch.randint(0, 97, (600,), generator=torch.Generator().manual_seed(8)).tolist()
    toks = {}
    for name, method, kw in (("ar", "ar", {}), ("dflash", "dflash", {}), ("ddtree", "ddtree", dict(budget=12))):
        # the GDN tree verify through its torch twin (tree_kernel off: no tree kernel, no prologue
        # kernel): the interpreted tree kernels have their own whole-decoder tests
        # (tests/ops/test_gdn_kernels.py), and would double this test's time
        # ar, the reference, on the torch path throughout (every op its twin)
        opts = Options(triton=False) if name == "ar" else Options(triton_on_cpu=True, verify_fused="on", tree_kernel="off")
        dec, _ = build_random_pair("hybrid", seed=5, device=DEV, options=opts, max_len=1024)
        toks[name] = dec.generate(prompt, method, max_new_tokens=10, **kw).token_ids
    assert seen, "the fused prefix never ran"
    assert toks["dflash"] == toks["ar"] and toks["ddtree"] == toks["ar"]


def test_auto_prefill_takes_cudnn_only_where_its_graph_build_pays():
    """auto's fused prefill order: FA2 first for a chat turn's short chunk over a long prefix and
    for short fresh prompts (cuDNN builds a graph for every new shape), cuDNN first for the long
    prompt's chunks (twice FA2's speed there)."""
    assert A.fused_prefill_order(200, 17_000) == ("flash", "cudnn")  # a chat turn
    assert A.fused_prefill_order(1500, 0) == ("flash", "cudnn")  # a short prompt
    assert A.fused_prefill_order(8192, 0) == ("flash", "cudnn")
    assert A.fused_prefill_order(8192, 8192) == ("cudnn", "flash")  # the long prompt's later chunks
    assert A.fused_prefill_order(8192, 131072) == ("cudnn", "flash")
    assert A.fused_prefill_order(200, 400_000) == ("cudnn", "flash")

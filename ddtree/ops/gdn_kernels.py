"""Triton kernels for the two hot GDN pieces of a decode step, each with a torch twin.

* `gdn_step`: one new token through a GDN layer's mixer, between its two projections: the
  short convolution over [conv_state; new row] with SiLU, q/k l2 norms, gates, the recurrence
  read against the state (o = e^g S0^T q + (q.k) U), and the gated RMSNorm. The torch path is
  ~8 kernels and an fp32 batched GEMM per layer; this is one kernel, one program per value head.
  It writes what a commit needs into the group's scratch (k, U, c and the conv rows), exactly as
  `gdn.tree_wy` does for a one-node tree. Twin: `GatedDeltaNet.forward` on the torch path.
* `gdn_commit`: the state pass of a commit, in place and batched over layers: S <- e^{c_a} S +
  sum over the accepted path of e^{c_a - c_j} k_j U_j^T. The state (151 MB for Qwen3.6-27B) is
  read and written once; only the path's rows of k and U are read. Twin: `gdn.commit_states_`.

Used on CUDA when triton imports (DDTREE_NO_TRITON=1 turns them off). On CPU tensors the same
kernels run under Triton's interpreter (TRITON_INTERPRET=1 before triton's import, as
tests/conftest.py sets it on machines without a GPU): that is how the tests compare them with
their twins without a GPU.
"""

from __future__ import annotations

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # triton is optional: the torch paths are complete
    triton = tl = None


# Read once at import, not per call: the check runs inside compiled layers.
ENABLED = triton is not None and os.environ.get("DDTREE_NO_TRITON") != "1"
# Tests set it (or DDTREE_TRITON_ON_CPU=1, for worker processes): CPU forwards and commits then take
# these kernels too, under the interpreter.
INTERPRET_ON_CPU = os.environ.get("DDTREE_TRITON_ON_CPU") == "1"


def available(t: torch.Tensor) -> bool:
    """Fast path for tensors on this device? (CUDA, triton importable, not turned off)."""
    return ENABLED and (t.is_cuda or INTERPRET_ON_CPU)


_JIT: dict = {}  # (kernel, interpret) -> jitted; the CUDA ones are made at import (see the end)


def _on_device_of(t: torch.Tensor):
    """Triton launches on the current device's current stream: make it t's (layers split over
    GPUs run eagerly with another device current). Compiled code needs no guard: inductor sets it."""
    if t.is_cuda and not torch.compiler.is_compiling():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernel(fn, interpret: bool):
    """The jitted kernel for a CUDA launch, or the interpreted one for CPU tensors."""
    key = (fn.__name__, interpret)
    if key not in _JIT:
        if interpret:
            if not interpreter_on():
                raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
            from triton.runtime.interpreter import InterpretedFunction

            _JIT[key] = InterpretedFunction(fn)
        else:
            _JIT[key] = triton.jit(fn)
    return _JIT[key]


# ----------------------------------------------------------------------------- one-token step
def _gdn_step_kernel(
    proj, conv_state, conv_w, neg_a, dt_bias, S0, norm_w, out, ext, kbuf, ubuf, cbuf,
    C, HV, REP, eps_norm,
    s_kh, s_uh, s_ch,  # head strides of the k / U / c scratch views
    KD: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HIST: tl.constexpr,
):
    h = tl.program_id(0)  # value head
    kh = h // REP  # its key head
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BV)
    mk, mv = ok < DK, ov < DV
    f32 = tl.float32
    dt = out.dtype.element_ty  # the model dtype: its roundings are spelt out (rtne, as torch rounds)
    S = tl.load(S0 + h * DK * DV + ok[:, None] * DV + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)  # [DK, DV] fp32
    cq = kh * DK + ok  # channels of q, k, v in the conv input
    ck = KD + kh * DK + ok
    cv = 2 * KD + h * DV + ov
    # short conv over the last HIST committed rows and the new one, then SiLU, rounded to the model
    # dtype as the torch path rounds it; the rows also go to ext for the commit's conv update.
    wq = tl.load(conv_w + HIST * C + cq, mask=mk, other=0.0)
    wk = tl.load(conv_w + HIST * C + ck, mask=mk, other=0.0)
    wv = tl.load(conv_w + HIST * C + cv, mask=mv, other=0.0)
    xq = tl.load(proj + cq, mask=mk, other=0.0)
    xk = tl.load(proj + ck, mask=mk, other=0.0)
    xv = tl.load(proj + cv, mask=mv, other=0.0)
    own_qk = mk & (h % REP == 0)  # one of the REP value heads writes the shared q/k channels
    tl.store(ext + HIST * C + cq, xq, mask=own_qk)
    tl.store(ext + HIST * C + ck, xk, mask=own_qk)
    tl.store(ext + HIST * C + cv, xv, mask=mv)
    aq = wq * xq.to(f32)
    ak = wk * xk.to(f32)
    av = wv * xv.to(f32)
    for r in tl.static_range(HIST):
        rq = tl.load(conv_state + r * C + cq, mask=mk, other=0.0)
        rk = tl.load(conv_state + r * C + ck, mask=mk, other=0.0)
        rv = tl.load(conv_state + r * C + cv, mask=mv, other=0.0)
        tl.store(ext + r * C + cq, rq, mask=own_qk)
        tl.store(ext + r * C + ck, rk, mask=own_qk)
        tl.store(ext + r * C + cv, rv, mask=mv)
        aq += tl.load(conv_w + r * C + cq, mask=mk, other=0.0) * rq.to(f32)
        ak += tl.load(conv_w + r * C + ck, mask=mk, other=0.0) * rk.to(f32)
        av += tl.load(conv_w + r * C + cv, mask=mv, other=0.0) * rv.to(f32)
    q = (aq / (1.0 + tl.exp(-aq))).to(dt, fp_downcast_rounding="rtne").to(f32)
    k = (ak / (1.0 + tl.exp(-ak))).to(dt, fp_downcast_rounding="rtne").to(f32)
    v = (av / (1.0 + tl.exp(-av))).to(dt, fp_downcast_rounding="rtne").to(f32)
    # l2 norms (q also scaled by DK^-0.5) and gates
    q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6) * (1.0 / tl.sqrt(DK * 1.0))
    k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    zb = C + HV * DV
    b = tl.load(proj + zb + h).to(f32)
    a = tl.load(proj + zb + HV + h).to(f32) + tl.load(dt_bias + h).to(f32)
    g = tl.load(neg_a + h) * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))  # softplus, threshold 20
    beta = 1.0 / (1.0 + tl.exp(-b))
    # against the state (its tile loaded first thing: the load's latency hides behind the conv and norms)
    kS = tl.sum(k[:, None] * S, 0)  # [BV]
    qS = tl.sum(q[:, None] * S, 0)
    ec = tl.exp(g)
    U = beta * (v - ec * kS)
    o = ec * qS + tl.sum(q * k, 0) * U
    tl.store(kbuf + h * s_kh + ok, k, mask=mk)
    tl.store(ubuf + h * s_uh + ov, U, mask=mv)
    tl.store(cbuf + h * s_ch, g)
    # gated RMSNorm: w * norm(o) * silu(z), with the torch path's roundings to the model dtype
    o = tl.where(mv, o.to(dt, fp_downcast_rounding="rtne").to(f32), 0.0)
    xn = (o / tl.sqrt(tl.sum(o * o, 0) / DV + eps_norm)).to(dt, fp_downcast_rounding="rtne").to(f32)
    wxn = (tl.load(norm_w + ov, mask=mv, other=0.0).to(f32) * xn).to(dt, fp_downcast_rounding="rtne").to(f32)
    z = tl.load(proj + C + h * DV + ov, mask=mv, other=0.0).to(f32)
    tl.store(out + h * DV + ov, (wxn * (z / (1.0 + tl.exp(-z)))).to(dt, fp_downcast_rounding="rtne"), mask=mv)


def gdn_step(layer, proj: torch.Tensor) -> torch.Tensor:
    """One token through GDN layer `layer`'s mixer (see the module docstring).

    proj: [N] the fused input projection's row (qkv [C], z [hv*dv], b [hv], a [hv]) in the model
    dtype. Writes ext rows 0..width-1 and the layer's k/U/c scratch at node 0. -> [hv*dv]."""
    hv, dk, dv, C = layer.hv, layer.dk, layer.dv, layer.conv_dim
    w, neg_a = layer._consts()
    out = torch.empty(hv * dv, dtype=proj.dtype, device=proj.device)
    kb, ub, cb = layer.wy_bufs  # [hv, cap, dk], [hv, cap, dv], [hv, cap]
    assert kb.stride(-1) == ub.stride(-1) == 1 and proj.stride(-1) == 1
    kern = _kernel(_gdn_step_kernel, interpret=not proj.is_cuda)
    with _on_device_of(proj):
        kern[(hv,)](
            proj, layer.conv_state, w, neg_a, layer.dt_bias, layer.rec_state, layer.norm.weight, out,
            layer.ext_buf, kb, ub, cb,
            C, hv, hv // layer.hk, layer.norm.eps,
            kb.stride(0), ub.stride(0), cb.stride(0),
            KD=layer.hk * dk, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=triton.next_power_of_2(dv),
            HIST=layer.width - 1, num_warps=8 if dk * dv >= 8192 else 4,
        )
    return out


# ----------------------------------------------------------------------------- commit state pass
def _gdn_commit_kernel(
    S, kbuf, ubuf, cbuf, path, n_nodes,
    s_kh, s_kt, s_uh, s_ut, s_ch,  # strides (per layer*head row, per node) of the scratch
    DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, P: tl.constexpr,
):
    lh = tl.program_id(0)  # layer * H + head (the scratch's first two dims are flattened)
    vb = tl.program_id(1)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk, mv = ok < DK, ov < DV
    n = tl.load(n_nodes)
    last = tl.load(path + n - 1)
    c_a = tl.load(cbuf + lh * s_ch + last)
    ptr = S + lh * DK * DV + ok[:, None] * DV + ov[None, :]
    m2 = mk[:, None] & mv[None, :]
    acc = tl.load(ptr, mask=m2, other=0.0) * tl.exp(c_a)
    for i in tl.static_range(P):  # the path buffer's length (a block); nodes past n are padding
        on = i < n
        j = tl.load(path + i)
        w = tl.where(on, tl.exp(c_a - tl.load(cbuf + lh * s_ch + j)), 0.0)
        kj = tl.load(kbuf + lh * s_kh + j * s_kt + ok, mask=mk & on, other=0.0)
        uj = tl.load(ubuf + lh * s_uh + j * s_ut + ov, mask=mv & on, other=0.0)
        acc += (w * kj)[:, None] * uj[None, :]
    tl.store(ptr, acc, mask=m2)


def gdn_commit_(S: torch.Tensor, k: torch.Tensor, U: torch.Tensor, c: torch.Tensor,
                path_nodes: torch.Tensor, n_nodes: torch.Tensor) -> torch.Tensor:
    """In place: S [L, H, dk, dv] fp32 becomes the state after the path path_nodes[:n_nodes]
    (root first, 0-dim n_nodes on the device) of the last tree. k [L, H, T, dk], U [L, H, T, dv],
    c [L, H, T]: the scratch views tree_wy / gdn_step wrote (layer and head flatten into one stride;
    unit stride along a row, and along T for c)."""
    L, H, dk, dv = S.shape
    assert S.is_contiguous()
    for t in (k, U, c):  # layer and head must flatten into one stride; rows / nodes are unit-stride
        assert t.stride(0) == t.shape[1] * t.stride(1) and t.stride(-1) == 1
    BV = min(64, triton.next_power_of_2(dv))
    kern = _kernel(_gdn_commit_kernel, interpret=not S.is_cuda)
    with _on_device_of(S):
        kern[(L * H, triton.cdiv(dv, BV))](
            S, k, U, c, path_nodes, n_nodes,
            k.stride(1), k.stride(2), U.stride(1), U.stride(2), c.stride(1),
            DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=BV, P=path_nodes.shape[0], num_warps=4,
        )
    return S


# ----------------------------------------------------------------------------- commit conv pass
def _conv_commit_kernel(conv, ext, window, path, n_nodes, s_cl, s_el, s_w, C,
                        HIST: tl.constexpr, BC: tl.constexpr):
    lyr = tl.program_id(0)
    oc = tl.program_id(1) * BC + tl.arange(0, BC)
    mc = oc < C
    last = tl.load(path + tl.load(n_nodes) - 1)
    for r in tl.static_range(HIST):  # `last`'s window row is oldest first, itself last: keep its newest HIST
        row = tl.load(window + last * s_w + 1 + r)
        tl.store(conv + lyr * s_cl + r * C + oc, tl.load(ext + lyr * s_el + row * C + oc, mask=mc), mask=mc)


def conv_commit_(conv: torch.Tensor, ext: torch.Tensor, window: torch.Tensor, path_nodes: torch.Tensor,
                 n_nodes: torch.Tensor) -> torch.Tensor:
    """In place: conv [L, hist, C] becomes the conv inputs on the path of last = path_nodes[n_nodes - 1]:
    conv[:, r] = ext[:, window[last, 1 + r]] (one kernel for all layers). ext [L, hist + T, C] (the
    group's view), window [T, hist + 1] long. Twin: the index_selects in GDNGroup.commit."""
    L, hist, C = conv.shape
    assert conv.is_contiguous() and ext.stride(-1) == 1 and ext.stride(1) == C and window.stride(-1) == 1
    assert window.shape[1] == hist + 1
    BC = min(1024, triton.next_power_of_2(C))
    kern = _kernel(_conv_commit_kernel, interpret=not conv.is_cuda)
    with _on_device_of(conv):
        kern[(L, triton.cdiv(C, BC))](conv, ext, window, path_nodes, n_nodes, conv.stride(0), ext.stride(0),
                                      window.stride(0), C, HIST=hist, BC=BC, num_warps=4)
    return conv


# ----------------------------------------------------------------------------- tree verify
# A tree verify's GDN recurrence (gdn.tree_wy) in one kernel per layer instead of ~14 (batched GEMMs,
# a triangular solve, pointwise): on a small model every launch counts. On by default for trees of
# up to 32 nodes whose tiles stay small (TREE_TILE; bigger ones keep tree_wy's cuBLAS path);
# DDTREE_TRITON_TREE=1 takes it up to 128 nodes of any tile size, =0 turns it off.
_TREE_ENV = os.environ.get("DDTREE_TRITON_TREE")
TREE_MAX_NODES = 128 if _TREE_ENV == "1" else 0 if _TREE_ENV == "0" else 32
# padded nodes x key width of a program's tiles at most this (measured on an H200: 16 nodes at
# dk 128 and 32 at dk 64 beat tree_wy, 32 at dk 128 lost to it by ~70 us per layer)
TREE_TILE = 1 << 30 if _TREE_ENV == "1" else 2048
# Tile products on tensor cores as three TF32 products (about fp32's accuracy: tested against
# tree_wy at 1e-5 relative on the GPU); "ieee" is the FMA path, several times slower at 32 nodes.
TREE_PRECISION = os.environ.get("DDTREE_TREE_PRECISION", "tf32x3")
# DDTREE_TREE_PROLOGUE=1: the tree kernel also does the layer's prologue (the tree convolution + SiLU,
# q/k l2 norms, the head repeat, the gates) from the projection, ~5 kernels a layer fewer (twin: the
# torch prologue + gdn_tree). Opt-in: on an H200 it gained ~6% on codepair's 16-node chains and lost
# ~1.5% on its 17-node trees (docs/PERFORMANCE.md, session 7).
TREE_PROLOGUE = os.environ.get("DDTREE_TREE_PROLOGUE") == "1"


def _tile(n: int) -> int:
    """A tile side for n rows or channels: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (n - 1).bit_length())


def tree_available(t: torch.Tensor, T: int, dk: int = 0) -> bool:
    """The kernel for a T-node tree of key width dk? (see TREE_MAX_NODES and TREE_TILE)"""
    return available(t) and 1 < T <= TREE_MAX_NODES and _tile(T) * _tile(dk) <= TREE_TILE


def _gdn_tree_kernel(
    q, k, v, g, beta, S0, mask, o, kbuf, ubuf, cbuf,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh,
    s_kbh, s_kbt, s_ubh, s_ubt, s_cbh,
    ext, window, conv_w, proj, neg_a, dt_bias, s_pt, C, HV,  # PROLOGUE only (else unused)
    T: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NSQ: tl.constexpr, PREC: tl.constexpr,
    PROLOGUE: tl.constexpr, REP: tl.constexpr, KD: tl.constexpr, W: tl.constexpr,
):
    # One program per (value head, block of BV value channels): the solve is column-wise in v, so
    # the blocks are independent; each recomputes the [T, T] masks (cheap) and keeps few live tiles.
    h = tl.program_id(0)
    vb = tl.program_id(1)
    first = vb == 0  # writes the head's k and c scratch
    f32 = tl.float32
    ot = tl.arange(0, BT)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mt, mk, mv = ot < T, ok < DK, ov < DV
    mtk = mt[:, None] & mk[None, :]
    mtv = mt[:, None] & mv[None, :]
    if PROLOGUE:  # q, k, v, g, beta from the projection, as GatedDeltaNet.qkvgb computes them
        dt = ext.dtype.element_ty
        kh = h // REP  # the key head of this value head
        cq = kh * DK + ok  # conv channels of q, k and v
        ck = KD + kh * DK + ok
        cv = 2 * KD + h * DV + ov
        aq = tl.zeros([BT, BK], dtype=f32)
        ak = tl.zeros([BT, BK], dtype=f32)
        av = tl.zeros([BT, BV], dtype=f32)
        for j in tl.static_range(W):  # the tree convolution: each node's window rows of ext
            row = tl.load(window + ot * W + j, mask=mt, other=0)
            aq += tl.load(conv_w + j * C + cq, mask=mk, other=0.0)[None, :] * \
                tl.load(ext + row[:, None] * C + cq[None, :], mask=mtk, other=0.0).to(f32)
            ak += tl.load(conv_w + j * C + ck, mask=mk, other=0.0)[None, :] * \
                tl.load(ext + row[:, None] * C + ck[None, :], mask=mtk, other=0.0).to(f32)
            av += tl.load(conv_w + j * C + cv, mask=mv, other=0.0)[None, :] * \
                tl.load(ext + row[:, None] * C + cv[None, :], mask=mtv, other=0.0).to(f32)
        # SiLU, rounded to the model dtype as tree_conv's output is; then the l2 norms (q also * DK^-0.5)
        Q = (aq / (1.0 + tl.exp(-aq))).to(dt, fp_downcast_rounding="rtne").to(f32)
        K = (ak / (1.0 + tl.exp(-ak))).to(dt, fp_downcast_rounding="rtne").to(f32)
        V = (av / (1.0 + tl.exp(-av))).to(dt, fp_downcast_rounding="rtne").to(f32)
        Q = Q / tl.sqrt(tl.sum(Q * Q, 1) + 1e-6)[:, None] * (1.0 / tl.sqrt(DK * 1.0))
        K = K / tl.sqrt(tl.sum(K * K, 1) + 1e-6)[:, None]
        zb = C + HV * DV  # b, then a, after qkv and z in the projection row
        bb = tl.load(proj + ot * s_pt + zb + h, mask=mt, other=0.0).to(f32)
        aa = tl.load(proj + ot * s_pt + zb + HV + h, mask=mt, other=0.0).to(f32) + tl.load(dt_bias + h).to(f32)
        gg = tl.where(mt, tl.load(neg_a + h) * tl.where(aa > 20.0, aa, tl.log(1.0 + tl.exp(aa))), 0.0)
        bb = tl.where(mt, 1.0 / (1.0 + tl.exp(-bb)), 0.0)
    else:
        K = tl.load(k + ot[:, None] * s_kt + h * s_kh + ok[None, :], mask=mtk, other=0.0).to(f32)  # [BT, BK]
        gg = tl.load(g + ot * s_gt + h * s_gh, mask=mt, other=0.0).to(f32)
        bb = tl.load(beta + ot * s_bt + h * s_bh, mask=mt, other=0.0).to(f32)
    tl.store(kbuf + h * s_kbh + ot[:, None] * s_kbt + ok[None, :], K, mask=mtk & first)
    on_path = tl.load(mask + ot[:, None] * T + ot[None, :], mask=mt[:, None] & mt[None, :], other=0) != 0  # [BT, BT]
    c = tl.sum(tl.where(on_path, gg[None, :], 0.0), 1)  # [BT]: summed log-decay along each node's path
    tl.store(cbuf + h * s_cbh + ot, c, mask=mt & first)
    decay = tl.exp(tl.where(on_path, c[:, None] - c[None, :], float("-inf")))  # masked before exp: off-path may be large
    ec = tl.exp(c)
    S = tl.load(S0 + h * DK * DV + ok[:, None] * DV + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    if not PROLOGUE:
        V = tl.load(v + ot[:, None] * s_vt + h * s_vh + ov[None, :], mask=mtv, other=0.0).to(f32)  # [BT, BV]
    U = bb[:, None] * (V - ec[:, None] * tl.dot(K, S, input_precision=PREC))  # right-hand side, solved in place
    kk = tl.dot(K, tl.trans(K), input_precision=PREC)  # [BT, BT]
    A = tl.where(ot[None, :] < ot[:, None], bb[:, None] * decay * kk, 0.0)  # strictly lower (ancestors only)
    if not PROLOGUE:
        Q = tl.load(q + ot[:, None] * s_qt + h * s_qh + ok[None, :], mask=mtk, other=0.0).to(f32)
    O = ec[:, None] * tl.dot(Q, S, input_precision=PREC)
    Pm = decay * tl.dot(Q, tl.trans(K), input_precision=PREC)
    # (I + A) U = B without a serial substitution: A is strictly lower triangular, so A^T = 0 and
    # (I + A)^-1 = (I - A)(I + A^2)(I + A^4)...(I + A^(2^(NSQ))), 2^(NSQ+1) >= T: NSQ squarings and
    # NSQ + 1 products, all tile dots (a loop over the nodes costs a barrier-bound step per node).
    U -= tl.dot(A, U, input_precision=PREC)
    for _ in tl.static_range(NSQ):
        A = tl.dot(A, A, input_precision=PREC)
        U += tl.dot(A, U, input_precision=PREC)
    O += tl.dot(Pm, U, input_precision=PREC)
    tl.store(o + ot[:, None] * s_ot + h * s_oh + ov[None, :], O, mask=mtv)
    tl.store(ubuf + h * s_ubh + ot[:, None] * s_ubt + ov[None, :], U, mask=mtv)


@torch.compiler.disable  # the sizes are constexpr (T is dynamic in the compiled layer): run it between compiled pieces
def gdn_tree(q, k, v, g, beta, S0, path_mask, out):
    """`gdn.tree_wy` for T > 1 in one kernel (one program per value head and block of value
    channels), writing the commit scratch `out` = (k [H, T, dk], U [H, T, dv], c [H, T]) as tree_wy
    does. q, k [T, H, dk] fp32; v [T, H, dv]; g, beta [T, H] fp32; S0 [H, dk, dv] fp32;
    path_mask [T, T] bool. -> o [T, H, dv] fp32."""
    T, H, dk = q.shape
    for t in (q, k, v):
        assert t.stride(-1) == 1
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
               g.stride(0), g.stride(1), beta.stride(0), beta.stride(1))
    return _launch_tree(q, k, v, g, beta, strides, S0, path_mask, out, T, H, dk, v.shape[-1], None)


@torch.compiler.disable
def gdn_tree_prologue(layer, proj: torch.Tensor, ext: torch.Tensor, window: torch.Tensor, S0, path_mask, out):
    """The tree verify of GDN layer `layer` from its projection: the tree convolution + SiLU, q/k
    l2 norms, head repeat and gates (GatedDeltaNet.qkvgb) and then gdn_tree's recurrence, in one
    kernel. proj [T, N] the fused input projection (qkv | z | b | a); ext [hist + T, C] the conv
    inputs (state rows, then proj's qkv); window [T, width]. -> o [T, hv, dv] fp32, `out` written
    as gdn_tree writes it. Twin: qkvgb + gdn_tree (tests/test_triton_gdn.py)."""
    T = proj.shape[0]
    assert proj.stride(-1) == 1 and ext.stride(-1) == 1 and ext.stride(0) == layer.conv_dim and window.is_contiguous()
    w, neg_a = layer._consts()
    pro = (ext, window, w, proj, neg_a, layer.dt_bias, proj.stride(0), layer.conv_dim, layer.hv,
           layer.hv // layer.hk, layer.hk * layer.dk, window.shape[1])
    return _launch_tree(proj, proj, proj, proj, proj, (0,) * 10, S0, path_mask, out, T, layer.hv, layer.dk,
                        layer.dv, pro)


def _launch_tree(q, k, v, g, beta, strides, S0, path_mask, out, T, H, dk, dv, pro):
    kb, ub, cb = out
    for t in (kb, ub):
        assert t.stride(-1) == 1
    assert cb.stride(-1) == 1 and S0.is_contiguous()
    mask = path_mask.contiguous().view(torch.int8)
    o = torch.empty(T, H, dv, dtype=torch.float32, device=S0.device)
    BT = _tile(T)
    BV = min(32, _tile(dv))
    prologue = pro is not None
    if not prologue:  # the prologue's pointer / int arguments go unused
        pro = (S0, S0, S0, S0, S0, S0, 0, 0, 0, 1, 0, 1)
    kern = _kernel(_gdn_tree_kernel, interpret=not S0.is_cuda)
    with _on_device_of(S0):
        kern[(H, triton.cdiv(dv, BV))](
            q, k, v, g, beta, S0, mask, o, kb, ub, cb,
            *strides, o.stride(0), o.stride(1),
            kb.stride(0), kb.stride(1), ub.stride(0), ub.stride(1), cb.stride(0),
            *pro[:9],
            T=T, DK=dk, DV=dv, BT=BT, BK=_tile(dk), BV=BV,
            NSQ=max(0, (T - 1).bit_length() - 1), num_warps=8 if BT > 32 else 4,
            PREC=TREE_PRECISION if S0.is_cuda else "ieee",
            PROLOGUE=prologue, REP=pro[9], KD=pro[10], W=pro[11],
        )
    return o


# ----------------------------------------------------------------------------- attention K/V commit
def _kv_commit_kernel(kc, vc, path, start, s_l, W: tl.constexpr, P: tl.constexpr, PP: tl.constexpr,
                      BW: tl.constexpr):
    # One program per (layer, K or V, block of BW channels): it loads the P path rows, waits for the
    # whole block to have loaded (a destination row may be another node's source), then stores.
    lyr = tl.program_id(0)
    cache = tl.where(tl.program_id(1) == 0, kc, vc)
    ow = tl.program_id(2) * BW + tl.arange(0, BW)
    op = tl.arange(0, PP)  # P rows, padded to a power of two
    s0 = tl.load(start)
    src = s0 + tl.load(path + op, mask=op < P, other=0)
    m = (op[:, None] < P) & (ow[None, :] < W)
    base = cache + lyr * s_l
    rows = tl.load(base + src[:, None] * W + ow[None, :], mask=m)
    tl.debug_barrier()
    tl.store(base + (s0 + op)[:, None] * W + ow[None, :], rows, mask=m)


def kv_commit_(k_cache: torch.Tensor, v_cache: torch.Tensor, path_nodes: torch.Tensor, start: torch.Tensor):
    """In place: rows start + path_nodes[i] of every layer's K and V move to rows start + i (one
    kernel for all layers). k_cache, v_cache [L, max_len, kvh, hd] contiguous; path_nodes [P] long,
    start 0-dim long, on their device. Twin: index_select + index_copy_ (TargetModel.commit)."""
    L, _, kvh, hd = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    W, P = kvh * hd, path_nodes.shape[0]
    PP = triton.next_power_of_2(P)
    BW = min(triton.next_power_of_2(W), max(16, 4096 // PP))
    kern = _kernel(_kv_commit_kernel, interpret=not k_cache.is_cuda)
    with _on_device_of(k_cache):
        kern[(L, 2, triton.cdiv(W, BW))](k_cache, v_cache, path_nodes, start, k_cache.stride(0),
                                          W=W, P=P, PP=PP, BW=BW, num_warps=4)
    return k_cache, v_cache


if triton is not None:  # made here, so that a compiled layer only looks them up
    for _fn in (_gdn_step_kernel, _gdn_commit_kernel, _conv_commit_kernel, _gdn_tree_kernel, _kv_commit_kernel):
        _kernel(_fn, interpret=False)

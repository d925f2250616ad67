"""A tree verify's Gated DeltaNet recurrence in Triton (twin: `gdn.tree_wy`).

`gdn.tree_wy`'s math (path-summed log-decays, the q/k reads against the state, the
unit-lower-triangular solve over ancestors, the output) in one kernel instead of ~14 (batched
GEMMs, a triangular solve, pointwise): on a small model every launch counts. One program per
(value head, block of value channels): the solve is column-wise, so the blocks are independent.
`gdn_tree_prologue` also computes the layer's prologue (tree convolution + SiLU, q/k norms, head
repeat, gates) from the projection. `gdn_tree_blocked` takes larger trees in two passes: first
what does not depend on the values (the masks, the cross terms between blocks, each block's
inverse), in parallel over blocks or heads; then the blocks in order, two tile products each and
two per earlier block. Its prologue is one kernel ahead of it, `gdn_prologue`.
"""

from __future__ import annotations

import torch

from ddtree.ops import triton_util
from ddtree.ops.eager import eager
from ddtree.ops.triton_util import Arch, _kernel, _on_device_of, tl, triton
from ddtree.ops.triton_util import tile as _tile

MAX_NODES = 128  # one program holds a whole tree: [T, T] tiles
HEAD_BLOCK = 64  # gdn_tree_blocked's blocks of this many nodes or more: the first pass a program per head


def max_nodes(a: Arch | None) -> int:
    """The largest tree (a power of two <= MAX_NODES) whose kernel fits a block's shared memory on
    `a`. The recurrence stages both [BT, BT] fp32 operands of A @ A there: 8 BT^2 bytes, a lower
    bound of its need (dk 128: 48-56 KB at BT 64, 160 KB at 128 on sm_86; 224 KB at 128 on sm_90;
    the prologue adds up to 24 KB at BT 64 on sm_86, 64 KB at 128 on sm_90: past Hopper's 227).
    tests/ops/test_sm86.py compiles every tile this admits on sm_86, and the first it refuses."""
    if a is None:  # the interpreter: no limit but the kernel's own
        return MAX_NODES
    bt = MAX_NODES
    while bt > 16 and 8 * bt * bt > a.smem:
        bt //= 2
    return bt


def _conv_rows(ext, window, conv_w, C, cq, ck, cv, rows, mrow, mk, mv, W: tl.constexpr):
    """The depthwise tree convolution of nodes `rows` (mrow: valid) on conv channels cq, ck [BK]
    and cv [BV]: each node's window of conv inputs (rows of ext, through `window`). Loads and
    multiply-adds only, but for v's sum over the window. -> the pre-activations aq, ak [R, BK],
    av [R, BV] fp32 (_qkv_finish's input).
    Layouts (each conversion between two is a pass through shared memory and a barrier): Triton
    gives each load the layout its shape and dtype coalesce best, so the weights (conv_w in the
    model dtype, as ext) load broadcast to the tile's shape: a [BK] load took its own layout and a
    conversion a tap. The one-tile kernel uses v in its tile products' layout, and Triton moves
    that conversion up to every load feeding v (two a tap) unless a reduction stands between:
    v's taps are one [R, W, BV] product summed over the window (sm_86 and sm_90: 38 block barriers
    in the 16-node tile against 49, the prologue kernel 9 against 33; tests/ops/test_sm86.py)."""
    f32 = tl.float32
    mr = mrow[:, None]
    mrk = mr & mk[None, :]
    mrv = mr & mv[None, :]
    z = rows[:, None] * 0  # broadcasts the weights' pointers to the tile's shape
    wq, wk = conv_w + z + cq[None, :], conv_w + z + ck[None, :]
    aq = tl.zeros(mrk.shape, dtype=f32)
    ak = tl.zeros(mrk.shape, dtype=f32)
    for j in tl.static_range(W):  # each node's window
        row = tl.load(window + rows[:, None] * W + j, mask=mr, other=0)  # [R, 1]
        aq += tl.load(wq + j * C, mask=mrk, other=0.0).to(f32) * \
            tl.load(ext + row * C + cq[None, :], mask=mrk, other=0.0).to(f32)
        ak += tl.load(wk + j * C, mask=mrk, other=0.0).to(f32) * \
            tl.load(ext + row * C + ck[None, :], mask=mrk, other=0.0).to(f32)
    tj = tl.arange(0, triton.next_power_of_2(W))  # the window's taps (padded to a power of two, masked)
    mj = tj < W
    roww = tl.load(window + rows[:, None] * W + tj[None, :], mask=mr & mj[None, :], other=0)  # [R, WP]
    m3 = mrv[:, None, :] & mj[None, :, None]
    xw = tl.load(ext + roww[:, :, None] * C + cv[None, None, :], mask=m3, other=0.0).to(f32)  # [R, WP, BV]
    ww = tl.load(conv_w + z[:, :, None] + tj[None, :, None] * C + cv[None, None, :], mask=m3, other=0.0).to(f32)
    return aq, ak, tl.sum(ww * xw, 1)


def _qkv_finish(aq, ak, av, dt: tl.constexpr, DK: tl.constexpr):
    """_conv_rows' pre-activations to q, k, v as GatedDeltaNet.qkvgb computes them: SiLU rounded
    to the model dtype `dt` (as tree_conv's output is), then the l2 norms (q also * DK^-0.5).
    -> Q, K [R, BK], V [R, BV] fp32, 0 on invalid rows."""
    f32 = tl.float32
    Q = (aq / (1.0 + tl.exp(-aq))).to(dt, fp_downcast_rounding="rtne").to(f32)
    K = (ak / (1.0 + tl.exp(-ak))).to(dt, fp_downcast_rounding="rtne").to(f32)
    V = (av / (1.0 + tl.exp(-av))).to(dt, fp_downcast_rounding="rtne").to(f32)
    Q = Q / tl.sqrt(tl.sum(Q * Q, 1) + 1e-6)[:, None] * (1.0 / tl.sqrt(DK * 1.0))
    K = K / tl.sqrt(tl.sum(K * K, 1) + 1e-6)[:, None]
    return Q, K, V


def _qkv_rows(ext, window, conv_w, C, cq, ck, cv, rows, mrow, mk, mv, DK: tl.constexpr, W: tl.constexpr):
    """The prologue's q, k, v for tree nodes `rows` (mrow: valid): _conv_rows, then _qkv_finish.
    -> Q, K [R, BK], V [R, BV] fp32, 0 on invalid rows."""
    aq, ak, av = _conv_rows(ext, window, conv_w, C, cq, ck, cv, rows, mrow, mk, mv, W)
    return _qkv_finish(aq, ak, av, ext.dtype.element_ty, DK)


def _squarings(A, X, NSQ: tl.constexpr, PREC: tl.constexpr, LOOP: tl.constexpr):
    """The squarings of a unit-lower-triangular solve: X = (I - A) B in, (I - A)(I + A^2)(I + A^4)
    ...(I + A^(2^NSQ)) B out, which is (I + A)^-1 B where A is strictly lower triangular
    (nilpotent) and 2^(NSQ+1) >= its order. NSQ squarings and NSQ products, all
    tile dots (a loop over the nodes costs a barrier-bound step per node). LOOP: one copy of a
    step's code in a loop instead of NSQ unrolled copies (see HEAD_LOOP)."""
    if LOOP:
        for _ in range(NSQ):
            A = tl.dot(A, A, input_precision=PREC)
            X += tl.dot(A, X, input_precision=PREC)
    else:
        for _ in tl.static_range(NSQ):
            A = tl.dot(A, A, input_precision=PREC)
            X += tl.dot(A, X, input_precision=PREC)
    return X


def _gate_rows(proj, neg_a, dt_bias, s_pt, zb, HV, h, rows, mrow):
    """The prologue's gates of value head h for nodes `rows`: g = -exp(A_log) softplus(a +
    dt_bias), beta = sigmoid(b), from the projection's b and a columns (b at zb + h, a at zb +
    HV + h). -> g, beta [R] fp32, 0 on invalid rows."""
    f32 = tl.float32
    bb = tl.load(proj + rows * s_pt + zb + h, mask=mrow, other=0.0).to(f32)
    aa = tl.load(proj + rows * s_pt + zb + HV + h, mask=mrow, other=0.0).to(f32) + tl.load(dt_bias + h).to(f32)
    gg = tl.where(mrow, tl.load(neg_a + h) * tl.where(aa > 20.0, aa, tl.log(1.0 + tl.exp(aa))), 0.0)
    return gg, tl.where(mrow, 1.0 / (1.0 + tl.exp(-bb)), 0.0)


def _root_row(S, q0, k0, v0, c0, b0, o_row, u_row, k_row, c_row, mk, mv, first):
    """A tree's root (node 0, an ancestor of every node) as one delta-rule step on the state tile S
    [BK, BV]: writes its output and U rows, and (first value block) the commit scratch's k and c.
    -> u0, with S' = e^c0 S + k0 u0^T the state the other nodes read. S' is never formed: a node's
    reads K S' = e^c0 K S + (K k0) u0^T (_root_terms) need no product of the root's result, so the
    root's reductions run beside the tile's products instead of ahead of them."""
    e0 = tl.exp(c0)
    u0 = b0 * (v0 - e0 * tl.sum(k0[:, None] * S, 0))  # [BV]
    tl.store(o_row, e0 * tl.sum(q0[:, None] * S, 0) + tl.sum(q0 * k0, 0) * u0, mask=mv)
    tl.store(u_row, u0, mask=mv)
    tl.store(k_row, k0, mask=mk & first)
    tl.store(c_row, c0, mask=first)
    return u0


def _root_step(S, q0, k0, v0, c0, b0, o_row, u_row, k_row, c_row, mk, mv, first):
    """_root_row, then S' = e^c0 S + k0 u0^T formed: the blocked second pass reads it in every
    block (its rank-one terms there, from the first pass, took 24.2 against 22.4 us at 33 nodes
    on an H100: results/verify-tiles-h100.json). -> S'."""
    u0 = _root_row(S, q0, k0, v0, c0, b0, o_row, u_row, k_row, c_row, mk, mv, first)
    return tl.exp(c0) * S + k0[:, None] * u0[None, :]


def _root_terms(K, Q, k0, bb, c, c0):
    """Rows K, Q's rank-one terms from the root (_root_row): their reads against S' = e^c0 S + k0
    u0^T, relative to it, are e^(c - c0) K S' = e^c K S + e^(c - c0) (K k0) u0^T (c: each node's
    path sum, the root's c0 included), so with U = bb (V - e^c K S) and O = e^c Q S from S,
    U -= rk u0^T and O += rq u0^T. -> rk = bb e^(c - c0) K k0, rq = e^(c - c0) Q k0 [R]."""
    er = tl.exp(c - c0)
    return bb * er * tl.sum(K * k0[None, :], 1), er * tl.sum(Q * k0[None, :], 1)


def _gdn_tree_kernel(
    q, k, v, g, beta, S0, mask, o, kbuf, ubuf, cbuf,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh,
    s_kbh, s_kbt, s_ubh, s_ubt, s_cbh,
    ext, window, conv_w, proj, neg_a, dt_bias, s_pt, C, HV,  # PROLOGUE only (else unused)
    T: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NSQ: tl.constexpr, PREC: tl.constexpr,
    PROLOGUE: tl.constexpr, REP: tl.constexpr, KD: tl.constexpr, W: tl.constexpr, ROOT: tl.constexpr,
):
    # One program per (value head, block of BV value channels): the solve is column-wise in v, so
    # the blocks are independent; each recomputes the [T, T] masks (cheap) and keeps few live tiles.
    # ROOT: node 0 is an ancestor of every node (a verify tree's root). It is one delta-rule step,
    # S' = e^g0 S + k0 u0^T, and the tile takes nodes 1.. against S' (decays relative to it), S'
    # never formed (_root_row): a tree of 16m + 1 nodes fits the tile of 16m (as the solve's ROOT).
    h = tl.program_id(0)
    vb = tl.program_id(1)
    first = vb == 0  # writes the head's k and c scratch
    f32 = tl.float32
    ot = tl.arange(0, BT)
    rows = ROOT + ot  # the tile's nodes
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mt, mk, mv = rows < T, ok < DK, ov < DV
    mtk = mt[:, None] & mk[None, :]
    mtv = mt[:, None] & mv[None, :]
    if PROLOGUE:
        cq = h // REP * DK + ok  # conv channels of q, k (of this value head's key head) and v
        zb = C + HV * DV  # the projection's b, a columns come after qkv and z
    S = tl.load(S0 + h * DK * DV + ok[:, None] * DV + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    # Every load of the tile's inputs and the root's comes before the first reduction (a barrier):
    # the root's row then costs its arithmetic, not a second round of load latency.
    if PROLOGUE:  # q, k, v, g, beta from the projection, as GatedDeltaNet.qkvgb computes them
        cv = 2 * KD + h * DV + ov
        aq, ak, av = _conv_rows(ext, window, conv_w, C, cq, KD + cq, cv, rows, mt, mk, mv, W)
        gg, bb = _gate_rows(proj, neg_a, dt_bias, s_pt, zb, HV, h, rows, mt)
        if ROOT:  # row 0 as a 2-row tile (the other row masked to 0), summed down to vectors below
            r0 = tl.arange(0, 2)
            m0 = r0 < 1
            aq0, ak0, av0 = _conv_rows(ext, window, conv_w, C, cq, KD + cq, cv, r0, m0, mk, mv, W)
            g0, b0 = _gate_rows(proj, neg_a, dt_bias, s_pt, zb, HV, h, r0, m0)
    else:
        K = tl.load(k + rows[:, None] * s_kt + h * s_kh + ok[None, :], mask=mtk, other=0.0).to(f32)  # [BT, BK]
        gg = tl.load(g + rows * s_gt + h * s_gh, mask=mt, other=0.0).to(f32)
        bb = tl.load(beta + rows * s_bt + h * s_bh, mask=mt, other=0.0).to(f32)
        V = tl.load(v + rows[:, None] * s_vt + h * s_vh + ov[None, :], mask=mtv, other=0.0).to(f32)  # [BT, BV]
        Q = tl.load(q + rows[:, None] * s_qt + h * s_qh + ok[None, :], mask=mtk, other=0.0).to(f32)
        if ROOT:
            q0 = tl.load(q + h * s_qh + ok, mask=mk, other=0.0).to(f32)  # [BK]
            k0 = tl.load(k + h * s_kh + ok, mask=mk, other=0.0).to(f32)
            v0 = tl.load(v + h * s_vh + ov, mask=mv, other=0.0).to(f32)  # [BV]
            g0 = tl.load(g + h * s_gh).to(f32)
            b0 = tl.load(beta + h * s_bh).to(f32)
    on_path = tl.load(mask + rows[:, None] * T + rows[None, :], mask=mt[:, None] & mt[None, :], other=0) != 0  # [BT, BT]
    c0 = 0.0
    if ROOT:  # the root's row of every output, and its U (the state S' = e^c0 S + k0 u0^T, unformed)
        if PROLOGUE:
            Q0, K0, V0 = _qkv_finish(aq0, ak0, av0, ext.dtype.element_ty, DK)
            q0, k0, v0, c0, b0 = tl.sum(Q0, 0), tl.sum(K0, 0), tl.sum(V0, 0), tl.sum(g0, 0), tl.sum(b0, 0)
        else:
            c0 = g0
        u0 = _root_row(S, q0, k0, v0, c0, b0, o + h * s_oh + ov, ubuf + h * s_ubh + ov, kbuf + h * s_kbh + ok,
                       cbuf + h * s_cbh, mk, mv, first)
    if PROLOGUE:
        Q, K, V = _qkv_finish(aq, ak, av, ext.dtype.element_ty, DK)
    tl.store(kbuf + h * s_kbh + rows[:, None] * s_kbt + ok[None, :], K, mask=mtk & first)
    c = c0 + tl.sum(tl.where(on_path, gg[None, :], 0.0), 1)  # [BT]: summed log-decay along each node's path
    if ROOT:  # early: then k0 and q0 are dead
        rk, rq = _root_terms(K, Q, k0, bb, c, c0)
    tl.store(cbuf + h * s_cbh + rows, c, mask=mt & first)
    decay = tl.exp(tl.where(on_path, c[:, None] - c[None, :], float("-inf")))  # masked before exp: off-path may be large
    ec = tl.exp(c)  # against S, the state before the tree
    U = bb[:, None] * (V - ec[:, None] * tl.dot(K, S, input_precision=PREC))  # right-hand side, solved in place
    kk = tl.dot(K, tl.trans(K), input_precision=PREC)  # [BT, BT]
    A = tl.where(ot[None, :] < ot[:, None], bb[:, None] * decay * kk, 0.0)  # strictly lower (ancestors only)
    O = ec[:, None] * tl.dot(Q, S, input_precision=PREC)
    Pm = decay * tl.dot(Q, tl.trans(K), input_precision=PREC)
    if ROOT:  # against S' instead
        U -= rk[:, None] * u0[None, :]
        O += rq[:, None] * u0[None, :]
    # (I + A) U = B without a serial substitution: A is strictly lower triangular (_squarings)
    U = _squarings(A, U - tl.dot(A, U, input_precision=PREC), NSQ, PREC, False)
    O += tl.dot(Pm, U, input_precision=PREC)
    tl.store(o + rows[:, None] * s_ot + h * s_oh + ov[None, :], O, mask=mtv)
    tl.store(ubuf + h * s_ubh + rows[:, None] * s_ubt + ov[None, :], U, mask=mtv)


def _gdn_prologue_kernel(
    ext, window, conv_w, proj, neg_a, dt_bias, q, k, v, g, beta,
    s_pt, C, HV, s_qt, s_qh, s_vt, s_vh, s_gt,
    T: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    REP: tl.constexpr, KD: tl.constexpr, W: tl.constexpr,
):
    # GatedDeltaNet.qkvgb's tree convolution + SiLU, norms, head repeat and gates in one launch:
    # one program per (block of BR nodes, value head), its q / k recomputed per value head (REP
    # times, cheaper than a second launch). q, k [T, HV, DK], v [T, HV, DV], g, beta [T, HV] fp32.
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    h = tl.program_id(1)
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BV)
    mr, mk, mv = r < T, ok < DK, ov < DV
    cq = h // REP * DK + ok  # conv channels of q, k (of this value head's key head) and v
    Q, K, V = _qkv_rows(ext, window, conv_w, C, cq, KD + cq, 2 * KD + h * DV + ov, r, mr, mk, mv, DK, W)
    gg, bb = _gate_rows(proj, neg_a, dt_bias, s_pt, C + HV * DV, HV, h, r, mr)  # b, a after qkv and z
    mrk = mr[:, None] & mk[None, :]
    tl.store(q + r[:, None] * s_qt + h * s_qh + ok[None, :], Q, mask=mrk)
    tl.store(k + r[:, None] * s_qt + h * s_qh + ok[None, :], K, mask=mrk)  # (k is shaped and strided as q)
    tl.store(v + r[:, None] * s_vt + h * s_vh + ov[None, :], V, mask=mr[:, None] & mv[None, :])
    tl.store(g + r * s_gt + h, gg, mask=mr)
    tl.store(beta + r * s_gt + h, bb, mask=mr)


def _kdots(a, a_t, a2, a2_t, a_m, b, b_t, b_m, ra, rb, DK: tl.constexpr, BK: tl.constexpr, DC: tl.constexpr,
           PREC: tl.constexpr):
    """The [R, R] products of rows `ra` of a and of a2 with rows `rb` of b (fp32 rows of DK
    channels at a + row * a_t, a2 + row * a2_t, b + row * b_t, channel-contiguous; masks a_m,
    b_m) over the key width in chunks of DC channels read from memory: each chunk's operands are
    small, where whole [R, BK] tf32x3 operands split in two and copied to every warp spill (1 KB a
    thread on sm_90 at R = 16, BK = 128). The two products share b's chunk and its conversion to
    an operand (37 block barriers on sm_90 at 33 nodes against 45 as two loops). -> (a b^T, a2 b^T)."""
    od = tl.arange(0, DC)
    acc = tl.zeros([ra.shape[0], rb.shape[0]], dtype=tl.float32)
    acc2 = tl.zeros([ra.shape[0], rb.shape[0]], dtype=tl.float32)
    for d in range(0, BK, DC):
        md = (d + od) < DK
        x = tl.load(a + ra[:, None] * a_t + d + od[None, :], mask=a_m[:, None] & md[None, :], other=0.0)
        x2 = tl.load(a2 + ra[:, None] * a2_t + d + od[None, :], mask=a_m[:, None] & md[None, :], other=0.0)
        y = tl.load(b + rb[:, None] * b_t + d + od[None, :], mask=b_m[:, None] & md[None, :], other=0.0)
        yt = tl.trans(y.to(tl.float32))
        acc += tl.dot(x.to(tl.float32), yt, input_precision=PREC)
        acc2 += tl.dot(x2.to(tl.float32), yt, input_precision=PREC)
    return acc, acc2


def _gdn_tree_mats_kernel(
    q, k, g, beta, mask, wm, pm, kbuf, cbuf,
    s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh, s_kbh, s_kbt, s_cbh,
    T: tl.constexpr, DK: tl.constexpr, BT: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr,
    NSQ: tl.constexpr, PREC: tl.constexpr, ROOT: tl.constexpr, DC: tl.constexpr, LD: tl.constexpr,
):
    # The blocked recurrence's first pass: everything that does not depend on the values, one
    # program per (block b of SB nodes, value head). Row block b of the per-head matrices over the
    # nodes after the root ([LD, LD], rows padded to 16 elements: aligned loads and stores):
    # wm[b, c] = A[b, c] (c < b; A[i, j] = beta_i e^(c_i - c_j) k_i.k_j, j a strict ancestor of i)
    # and wm[b, b] = (I + A[b, b])^-1 (squarings, as _gdn_tree_kernel); pm[b, c] = e^(c_i - c_j)
    # q_i.k_j over ancestors and the node itself (c <= b). Also the commit scratch's k and c rows.
    # Blocks above the diagonal are never written nor read. The key products run in chunks of DC
    # channels (_kdots): whole [SB, BK] tiles held in registers spilled 0.9-1.3 KB a thread.
    b = tl.program_id(0)
    h = tl.program_id(1)
    f32 = tl.float32
    oa = tl.arange(0, BT)  # every node: the path mask's columns
    ma = oa < T
    g_all = tl.load(g + oa * s_gt + h * s_gh, mask=ma, other=0.0).to(f32)  # [BT]
    os_ = tl.arange(0, SB)
    ok = tl.arange(0, BK)
    mk = ok < DK
    rb = ROOT + b * SB + os_
    mb = rb < T
    on_b = tl.load(mask + rb[:, None] * T + oa[None, :], mask=mb[:, None] & ma[None, :], other=0) != 0  # [SB, BT]
    c_b = tl.sum(tl.where(on_b, g_all[None, :], 0.0), 1)  # [SB]: summed log-decay along each path
    tl.store(cbuf + h * s_cbh + rb, c_b, mask=mb)
    mbk = mb[:, None] & mk[None, :]
    Kb = tl.load(k + rb[:, None] * s_kt + h * s_kh + ok[None, :], mask=mbk, other=0.0).to(f32)  # [SB, BK]
    tl.store(kbuf + h * s_kbh + rb[:, None] * s_kbt + ok[None, :], Kb, mask=mbk)
    bb = tl.load(beta + rb * s_bt + h * s_bh, mask=mb, other=0.0).to(f32)
    base = h * LD * LD  # wm, pm [H, LD, LD]: the nodes after the root, rows of 16-aligned LD
    kh, qh = k + h * s_kh, q + h * s_qh
    for c in range(b):  # the earlier blocks: through the ancestor mask
        rc = ROOT + c * SB + os_
        on_c = tl.load(mask + rc[:, None] * T + oa[None, :], mask=ma[None, :], other=0) != 0
        c_c = tl.sum(tl.where(on_c, g_all[None, :], 0.0), 1)
        on_bc = tl.load(mask + rb[:, None] * T + rc[None, :], mask=mb[:, None], other=0) != 0  # [SB, SB]
        dec = tl.exp(tl.where(on_bc, c_b[:, None] - c_c[None, :], float("-inf")))  # masked before exp
        at = base + (rb - ROOT)[:, None] * LD + (rc - ROOT)[None, :]
        kk, qk = _kdots(kh, s_kt, qh, s_qt, mb, kh, s_kt, rc >= 0, rb, rc, DK, BK, DC, PREC)
        tl.store(wm + at, bb[:, None] * dec * kk, mask=mb[:, None])
        tl.store(pm + at, dec * qk, mask=mb[:, None])
    on_bb = tl.load(mask + rb[:, None] * T + rb[None, :], mask=mb[:, None] & mb[None, :], other=0) != 0
    dec = tl.exp(tl.where(on_bb, c_b[:, None] - c_b[None, :], float("-inf")))
    kk, qk = _kdots(kh, s_kt, qh, s_qt, mb, kh, s_kt, mb, rb, rb, DK, BK, DC, PREC)
    A = tl.where(os_[None, :] < os_[:, None], bb[:, None] * dec * kk, 0.0)
    E = _squarings(A, tl.where(os_[:, None] == os_[None, :], 1.0, 0.0) - A, NSQ, PREC, False)  # (I + A)^-1
    at = base + (rb - ROOT)[:, None] * LD + (rb - ROOT)[None, :]
    mbb = mb[:, None] & mb[None, :]
    tl.store(wm + at, E, mask=mbb)
    tl.store(pm + at, dec * qk, mask=mbb)


def _gdn_tree_mats_head_kernel(
    q, k, g, beta, mask, wm, pm, kbuf, cbuf,
    s_qt, s_qh, s_kt, s_kh, s_gt, s_gh, s_bt, s_bh, s_kbh, s_kbt, s_cbh,
    T: tl.constexpr, DK: tl.constexpr, BN: tl.constexpr, SB: tl.constexpr, BK: tl.constexpr,
    NSQ: tl.constexpr, PREC: tl.constexpr, ROOT: tl.constexpr, LD: tl.constexpr, LOOP: tl.constexpr,
):
    # _gdn_tree_mats_kernel's matrices for a whole head in one program: [BN, BN] tiles over the
    # nodes after the root (BN >= 64: the tile products are warp-group MMAs on Hopper, and no
    # operand is replicated across warps), every block's solve at once as squarings of the
    # block-diagonal part.
    # The tile holds every node after the root (BN >= T - ROOT), so each path sums over the tile's
    # [BN, BN] mask, plus the root's log-decay (an ancestor of every node).
    h = tl.program_id(0)
    f32 = tl.float32
    on = tl.arange(0, BN)
    r = ROOT + on
    mr = r < T
    ok = tl.arange(0, BK)
    mk = ok < DK
    mrr = mr[:, None] & mr[None, :]
    on_rr = tl.load(mask + r[:, None] * T + r[None, :], mask=mrr, other=0) != 0  # [BN, BN]
    g_r = tl.load(g + r * s_gt + h * s_gh, mask=mr, other=0.0).to(f32)  # [BN]
    c = tl.sum(tl.where(on_rr, g_r[None, :], 0.0), 1)  # [BN]
    if ROOT:
        c += tl.load(g + h * s_gh).to(f32)
    tl.store(cbuf + h * s_cbh + r, c, mask=mr)
    mrk = mr[:, None] & mk[None, :]
    K = tl.load(k + r[:, None] * s_kt + h * s_kh + ok[None, :], mask=mrk, other=0.0).to(f32)  # [BN, BK]
    tl.store(kbuf + h * s_kbh + r[:, None] * s_kbt + ok[None, :], K, mask=mrk)
    bb = tl.load(beta + r * s_bt + h * s_bh, mask=mr, other=0.0).to(f32)
    dec = tl.exp(tl.where(on_rr, c[:, None] - c[None, :], float("-inf")))  # masked before exp
    A = tl.where(on[None, :] < on[:, None], bb[:, None] * dec * tl.dot(K, tl.trans(K), input_precision=PREC), 0.0)
    Q = tl.load(q + r[:, None] * s_qt + h * s_qh + ok[None, :], mask=mrk, other=0.0).to(f32)
    at = h * LD * LD + on[:, None] * LD + on[None, :]  # wm, pm as _gdn_tree_mats_kernel's
    tl.store(pm + at, dec * tl.dot(Q, tl.trans(K), input_precision=PREC), mask=mrr)
    same = (on[:, None] // SB) == (on[None, :] // SB)  # the diagonal blocks
    Ad = tl.where(same, A, 0.0)
    E = _squarings(Ad, tl.where(on[:, None] == on[None, :], 1.0, 0.0) - Ad, NSQ, PREC, LOOP)  # each block's inverse
    tl.store(wm + at, tl.where(same, E, A), mask=mrr)


def _gdn_tree_solve_kernel(
    q, k, v, g, beta, S0, wm, pm, o, kbuf, ubuf, cbuf,
    s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_gt, s_gh, s_bt, s_bh, s_ot, s_oh,
    s_kbh, s_kbt, s_ubh, s_ubt, s_cbh,
    T: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, SB: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, ROOT: tl.constexpr, LD: tl.constexpr,
):
    # The blocked recurrence's second pass, one program per (value head, block of BV value
    # channels), the blocks in order (ancestors come first): U[b] = wm[b, b] (R[b] - sum_c<b
    # wm[b, c] U[c]), R[b] = beta (v - e^c k S), U[c] read back from the scratch this program
    # wrote; o[b] = e^c q S + sum_c<=b pm[b, c] U[c]. Two tile products a block and two per
    # earlier block: the solves and the masks are the first pass's, done for every block at once.
    # ROOT: node 0 is an ancestor of every node (a verify tree's root). It is one delta-rule step
    # first, S' = e^g0 S + k0 u0^T, and the blocks take nodes 1.. against S' with decays relative
    # to it (e^(c - g0)): a tree of 16m + 1 nodes is m whole blocks.
    h = tl.program_id(0)
    vb = tl.program_id(1)
    first = vb == 0
    f32 = tl.float32
    NB: tl.constexpr = (T - ROOT + SB - 1) // SB
    os_ = tl.arange(0, SB)
    ok = tl.arange(0, BK)
    ov = vb * BV + tl.arange(0, BV)
    mk, mv = ok < DK, ov < DV
    S = tl.load(S0 + h * DK * DV + ok[:, None] * DV + ov[None, :], mask=mk[:, None] & mv[None, :], other=0.0)
    c0 = 0.0
    if ROOT:
        c0 = tl.load(g + h * s_gh).to(f32)
        k0 = tl.load(k + h * s_kh + ok, mask=mk, other=0.0).to(f32)  # [BK]
        q0 = tl.load(q + h * s_qh + ok, mask=mk, other=0.0).to(f32)
        v0 = tl.load(v + h * s_vh + ov, mask=mv, other=0.0).to(f32)  # [BV]
        b0 = tl.load(beta + h * s_bh).to(f32)
        S = _root_step(S, q0, k0, v0, c0, b0, o + h * s_oh + ov, ubuf + h * s_ubh + ov, kbuf + h * s_kbh + ok,
                       cbuf + h * s_cbh, mk, mv, first)
    base = h * LD * LD  # wm, pm [H, LD, LD] over the nodes after the root (the first pass's)
    for b in range(NB):
        rb = ROOT + b * SB + os_
        mb = rb < T
        mbk = mb[:, None] & mk[None, :]
        mbv = mb[:, None] & mv[None, :]
        c_b = tl.load(cbuf + h * s_cbh + rb, mask=mb, other=0.0)  # the first pass's
        Kb = tl.load(k + rb[:, None] * s_kt + h * s_kh + ok[None, :], mask=mbk, other=0.0).to(f32)  # [SB, BK]
        Qb = tl.load(q + rb[:, None] * s_qt + h * s_qh + ok[None, :], mask=mbk, other=0.0).to(f32)
        Vb = tl.load(v + rb[:, None] * s_vt + h * s_vh + ov[None, :], mask=mbv, other=0.0).to(f32)  # [SB, BV]
        bb = tl.load(beta + rb * s_bt + h * s_bh, mask=mb, other=0.0).to(f32)
        ec = tl.exp(c_b - c0)  # (ROOT: against S', the root's decay taken out)
        R = bb[:, None] * (Vb - ec[:, None] * tl.dot(Kb, S, input_precision=PREC))  # right-hand side
        O = ec[:, None] * tl.dot(Qb, S, input_precision=PREC)
        for c in range(b):  # the earlier blocks' solved U
            rc = ROOT + c * SB + os_
            Uc = tl.load(ubuf + h * s_ubh + rc[:, None] * s_ubt + ov[None, :], mask=mv[None, :], other=0.0)
            at = base + (rb - ROOT)[:, None] * LD + (rc - ROOT)[None, :]
            R -= tl.dot(tl.load(wm + at, mask=mb[:, None], other=0.0), Uc, input_precision=PREC)
            O += tl.dot(tl.load(pm + at, mask=mb[:, None], other=0.0), Uc, input_precision=PREC)
        at = base + (rb - ROOT)[:, None] * LD + (rb - ROOT)[None, :]
        mbb = mb[:, None] & mb[None, :]
        U = tl.dot(tl.load(wm + at, mask=mbb, other=0.0), R, input_precision=PREC)
        O += tl.dot(tl.load(pm + at, mask=mbb, other=0.0), U, input_precision=PREC)
        tl.store(o + rb[:, None] * s_ot + h * s_oh + ov[None, :], O, mask=mbv)
        tl.store(ubuf + h * s_ubh + rb[:, None] * s_ubt + ov[None, :], U, mask=mbv)
        tl.debug_barrier()  # block b's U is read back by every later block


@eager
def gdn_tree_blocked(q, k, v, g, beta, S0, path_mask, out, precision: str = "ieee", tiles=None,
                     block: int | None = None, root: bool | None = None, chunk: int | None = None,
                     loop: bool | None = None):
    """gdn_tree by blocks of `block` nodes, for the trees the one-tile kernel does not take
    (ddtree.ops.dispatch), in two passes: the matrices that do not depend on the values (the
    masks, the cross terms, each block's inverse), then the blocks in order
    (_gdn_tree_solve_kernel). The first pass is a program per 16-node block and head
    (_gdn_tree_mats_kernel), or per head for blocks of 64 or more (_gdn_tree_mats_head_kernel:
    warp-group MMAs). Shapes and `out` as gdn_tree. tiles: (BV, warps) of the second pass
    instead of blocked_tiles'; block: None, block_nodes' rule; root: node 0 is an ancestor of
    every node (true of every verify tree; not checked), folded into the state first; None:
    where that saves a block (fold_root); chunk: the first pass's key products in chunks of this
    many channels (None: MATS_CHUNK); loop: the per-head first pass's squarings in a loop instead
    of unrolled (None: HEAD_LOOP)."""
    T, H, dk = q.shape
    dv = v.shape[-1]
    strides = _input_strides(q, k, v, g, beta)
    mask, o = _mask_and_output(path_mask, out, S0, T, H, dv)
    kb, ub, cb = out
    a = triton_util.arch(S0.device)
    block = block or block_nodes(T, a)
    root = fold_root(T, block) if root is None else bool(root)
    BV, warps = tiles or blocked_tiles(block, dv)
    prec = triton_util.dot_precision(precision, a)
    LD = max(16, -(-(T - root) // 16) * 16)  # the nodes after the root, rows aligned to 16 elements
    wm, pm = (torch.empty(H, LD, LD, dtype=torch.float32, device=S0.device) for _ in range(2))
    mat_args = (q, k, g, beta, mask, wm, pm, kb, cb, *strides[:4], *strides[6:], kb.stride(0), kb.stride(1), cb.stride(0))
    consts = dict(T=T, DK=dk, SB=block, BK=_tile(dk), PREC=prec, ROOT=int(root), LD=LD,
                  NSQ=max(0, (min(T - root, block) - 1).bit_length() - 1), num_warps=4)
    chunk = MATS_CHUNK if chunk is None else chunk
    solve = _kernel(_gdn_tree_solve_kernel, interpret=not S0.is_cuda)
    with _on_device_of(S0):
        if T > root and block >= HEAD_BLOCK:  # (T == root: the root alone, nothing to solve)
            _kernel(_gdn_tree_mats_head_kernel, interpret=not S0.is_cuda)[(H,)](
                *mat_args, BN=max(HEAD_BLOCK, _tile(T - root)), LOOP=HEAD_LOOP if loop is None else bool(loop), **consts)
        elif T > root:
            _kernel(_gdn_tree_mats_kernel, interpret=not S0.is_cuda)[(triton.cdiv(T - root, block), H)](
                *mat_args, BT=_tile(T), DC=min(chunk, _tile(dk)), **consts)  # (BT: the path mask's columns)
        solve[(H, triton.cdiv(dv, BV))](
            q, k, v, g, beta, S0, wm, pm, o, kb, ub, cb,
            *strides, o.stride(0), o.stride(1),
            kb.stride(0), kb.stride(1), ub.stride(0), ub.stride(1), cb.stride(0),
            T=T, DK=dk, DV=dv, SB=block, BK=_tile(dk), BV=BV, PREC=prec, ROOT=int(root), LD=LD, num_warps=warps,
        )
    return o


@eager
def gdn_prologue(layer, proj: torch.Tensor, ext: torch.Tensor, window: torch.Tensor):
    """GatedDeltaNet.qkvgb's q, k, v, g, beta for a tree from its projection in one kernel
    (_gdn_prologue_kernel), for the blocked recurrence (the one-tile kernel has it inside:
    gdn_tree_prologue). proj [T, N]; ext [hist + T, C]; window [T, width]. -> q, k [T, hv, dk],
    v [T, hv, dv], g, beta [T, hv], all fp32. Twin: qkvgb (tests/ops/test_gdn_kernels.py)."""
    T, dev = proj.shape[0], proj.device
    ext_, window_, w, proj_, neg_a, dt_bias, s_pt, C, hv, rep, kd, width = _prologue_args(layer, proj, ext, window)
    q, k = (torch.empty(T, hv, layer.dk, dtype=torch.float32, device=dev) for _ in range(2))
    v = torch.empty(T, hv, layer.dv, dtype=torch.float32, device=dev)
    g, beta = (torch.empty(T, hv, dtype=torch.float32, device=dev) for _ in range(2))
    kern = _kernel(_gdn_prologue_kernel, interpret=not proj.is_cuda)
    with _on_device_of(proj):
        kern[(triton.cdiv(T, 16), hv)](
            ext_, window_, w, proj_, neg_a, dt_bias, q, k, v, g, beta,
            s_pt, C, hv, q.stride(0), q.stride(1), v.stride(0), v.stride(1), g.stride(0),
            T=T, DK=layer.dk, DV=layer.dv, BR=16, BK=_tile(layer.dk), BV=_tile(layer.dv), REP=rep, KD=kd, W=width,
        )
    return q, k, v, g, beta


# The first pass by blocks: its key products in chunks of this many channels. An H100 measured the
# recurrence alone, dk = dv = 128, at 17 / 33 nodes: 16.1 / 28.3 us with whole [16, 128] tiles
# (0.9-1.3 KB a thread of spills), 16.0 / 27.8 in chunks of 16, 15.4 / 26.2 of 32, 15.0 / 24.7 of
# 64 (results/verify-chunks-h100.json, cc07260).
MATS_CHUNK = 64

# The per-head first pass's squarings (five at 64 nodes) in a loop rather than unrolled: 4,384
# against 8,184 SASS instructions on sm_90 (70 against 131 KB of code). In the engine the kernel
# runs right after the layer's projection GEMM has swept the L2, its code included, so code size is
# time: on an H100 the loop took 21.8 / 22.9 us (64 / 65 nodes) after the projection against the
# unrolled 38.8 / 41.2 (19.9 / 20.7 against 24.1 / 25.4 back to back), and a 65-node verify 22.55
# against 23.38 ms (results/verify-loop-h100.json, results/engine-1k-loop-h100.json, e8c6975).
# `python scripts/bench_verify.py --parts core --nodes 64,65 --kernels` (`blocked loop` / `unrolled`).
HEAD_LOOP = True


def block_nodes(T: int, a: Arch | None = None) -> int:
    """gdn_tree_blocked's block for a T-node tree on `a`: 16 nodes up to 33 (one or two blocks
    after the root); past that, on Hopper (and the interpreter), one block of 64: the per-head
    first pass inverts it whole on warp-group MMAs, and the second pass has no order to wait on.
    An H200 measured, dk = dv = 128, the recurrence alone: 17 / 29 us at 17 / 33 nodes in 16-node
    blocks against 25 / 33 in one, 36 us at 64 nodes in one against 54 in 16-node blocks and 62 in
    the one-pass kernel before (results/verify-core-2pass-h200.json). Below Hopper, 16: without
    warp-group MMAs the 64-node tiles' operands are copied to every warp, and ptxas spills 3.4 KB a
    thread there (sm_86, tf32x3) against 1 KB in 16-node blocks."""
    return 64 if T > 2 * 16 + 1 and (a is None or a.major >= 9) else 16


def fold_root(T: int, block: int = 16) -> bool:
    """Fold a T-node tree's root into the state before the blocks? Only where that saves a block
    (T = block m + 1): the fold is one more step ahead of them. An H200 measured, dk = dv = 128,
    with / without the fold: 17.0 / 23.1 us at 17 nodes and 28.9 / 43.1 at 33 in 16-node blocks,
    39.1 / 36.2 at 64 in one block (results/verify-core-2pass-h200.json)."""
    return T > 1 and (T - 1) % block == 0


def tile_nodes(T: int, root: bool | None = None) -> int:
    """The nodes the one-tile kernel holds in its tile for a T-node tree: T, or T - 1 with the
    root folded into the state first (root None: tile_root's rule)."""
    return T - int(tile_root(T) if root is None else root)


def tile_root(T: int) -> bool:
    """Fold a T-node tree's root into the state ahead of the one-tile kernel's tile? Where that
    halves the tile (T = 2^n + 1: a budget-16 tree's 17 nodes in a 16-node tile, as budget 15's
    16): the fold is the root's own row and its rank-one terms in the nodes' reads (_root_terms)."""
    return T > 2 and _tile(T - 1) < _tile(T)


@eager  # the sizes are constexpr (T is dynamic in the compiled layer): run it between compiled pieces
def gdn_tree(q, k, v, g, beta, S0, path_mask, out, precision: str = "ieee", tiles=None, root: bool | None = None):
    """`gdn.tree_wy` for T > 1 in one kernel (one program per value head and block of value
    channels), writing the commit scratch `out` = (k [H, T, dk], U [H, T, dv], c [H, T]) as tree_wy
    does. q, k [T, H, dk] fp32; v [T, H, dv]; g, beta [T, H] fp32; S0 [H, dk, dv] fp32;
    path_mask [T, T] bool; tiles: (BV, warps) instead of launch_tiles' (sweeps); root: node 0 is
    an ancestor of every node (true of every verify tree; not checked), folded into the state
    first; None: tile_root's rule. -> o [T, H, dv] fp32."""
    T, H, dk = q.shape
    strides = _input_strides(q, k, v, g, beta)
    return _launch_tree(q, k, v, g, beta, strides, S0, path_mask, out, T, H, dk, v.shape[-1], None, precision, tiles,
                        root)


@eager
def gdn_tree_prologue(layer, proj: torch.Tensor, ext: torch.Tensor, window: torch.Tensor, S0, path_mask, out,
                      precision: str = "ieee", tiles=None, root: bool | None = None):
    """The tree verify of GDN layer `layer` from its projection: the tree convolution + SiLU, q/k
    l2 norms, head repeat and gates (GatedDeltaNet.qkvgb) and then gdn_tree's recurrence, in one
    kernel. proj [T, N] the fused input projection (qkv | z | b | a); ext [hist + T, C] the conv
    inputs (state rows, then proj's qkv); window [T, width]. -> o [T, hv, dv] fp32, `out` written
    as gdn_tree writes it; root as gdn_tree's. Twin: qkvgb + gdn_tree (tests/ops/test_gdn_kernels.py)."""
    return _launch_tree(proj, proj, proj, proj, proj, (0,) * 10, S0, path_mask, out, proj.shape[0], layer.hv,
                        layer.dk, layer.dv, _prologue_args(layer, proj, ext, window), precision, tiles, root)


def _prologue_args(layer, proj, ext, window) -> tuple:
    """The prologue's kernel arguments for GDN layer `layer`: (ext, window, conv weight, proj,
    -exp(A_log), dt_bias, proj's row stride, C, hv, value heads per key head, q's channels, width)."""
    assert proj.stride(-1) == 1 and ext.stride(-1) == 1 and ext.stride(0) == layer.conv_dim and window.is_contiguous()
    _, neg_a, w = layer._consts()  # the conv weight in the model dtype: _conv_rows
    return (ext, window, w, proj, neg_a, layer.dt_bias, proj.stride(0), layer.conv_dim, layer.hv,
            layer.hv // layer.hk, layer.hk * layer.dk, window.shape[1])


def blocked_tiles(block: int, dv: int) -> tuple[int, int]:
    """(BV, warps) of gdn_tree_blocked's second pass: 32 value channels, 4 warps, for blocks of 16
    and of 64 nodes. An H100 measured the recurrence alone at 33 nodes, dk = dv = 128, in 16-node
    blocks with the root folded: 22.7 us at BV 32 / 4 warps against 24.6 at BV 64 / 4 (ptxas
    spills 192 bytes a thread there, none at BV 32), 24.0 at BV 64 / 8 and 32.2 at BV 32 / 8
    (results/verify-sweep33-h100.json); an H200 at 64 nodes in one block 36.2 us at BV 32 / 4
    against 46.7 at 8 warps, 37.6 / 40.7 at BV 64, 42.1 at BV 16
    (results/verify-core-2pass-h200.json)."""
    return min(32, _tile(dv)), 4


def launch_tiles(T: int, dv: int, prologue: bool = False) -> tuple[int, int]:
    """(BV value channels per program, warps) for a tile of T nodes, with the prologue inside or
    not. Every program recomputes the prologue's q and k, so with it a 16-node tile takes 64
    channels on 8 warps: an H100 measured the 27B's layer (dk = dv = 128, projection to mixer
    output) in 15.1 / 17.4 us at 16 / 17 nodes against 18.8 / 22.6 at 32 channels on 4 warps and
    24.5 / 29.2 on 8 (results/verify-tiles-h100.json; ptxas: 0 / 40 B of stack on sm_90)."""
    if prologue and _tile(T) <= 16:
        return min(64, _tile(dv)), 8
    return min(32, _tile(dv)), 8 if _tile(T) > 32 else 4


def _input_strides(q, k, v, g, beta) -> tuple:
    """Both tree kernels' (row, head) strides of ready inputs; their channels must be contiguous."""
    for t in (q, k, v):
        assert t.stride(-1) == 1
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            g.stride(0), g.stride(1), beta.stride(0), beta.stride(1))


def _mask_and_output(path_mask, out, S0, T: int, H: int, dv: int):
    """What both tree kernels' launchers check and make: the int8 path mask and o [T, H, dv] fp32."""
    kb, ub, cb = out
    for t in (kb, ub):
        assert t.stride(-1) == 1
    assert cb.stride(-1) == 1 and S0.is_contiguous()
    return path_mask.contiguous().view(torch.int8), torch.empty(T, H, dv, dtype=torch.float32, device=S0.device)


def _launch_tree(q, k, v, g, beta, strides, S0, path_mask, out, T, H, dk, dv, pro, precision, tiles=None,
                 root: bool | None = None):
    mask, o = _mask_and_output(path_mask, out, S0, T, H, dv)
    kb, ub, cb = out
    n = tile_nodes(T, root)  # the tile's nodes (after the root, folded)
    BT = _tile(n)
    prologue = pro is not None
    BV, warps = tiles or launch_tiles(n, dv, prologue)
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
            NSQ=max(0, (n - 1).bit_length() - 1), num_warps=warps, ROOT=T - n,
            PREC=triton_util.dot_precision(precision, triton_util.arch(S0.device)),
            PROLOGUE=prologue, REP=pro[9], KD=pro[10], W=pro[11],
        )
    return o


if triton is not None:
    # device functions: of the prologue kernel (_qkv_rows), of both prologues (the rest)
    _qkv_rows, _gate_rows = triton.jit(_qkv_rows), triton.jit(_gate_rows)
    _conv_rows, _qkv_finish = triton.jit(_conv_rows), triton.jit(_qkv_finish)
    _root_row, _root_step = triton.jit(_root_row), triton.jit(_root_step)  # of the one-tile kernel, of the solve
    _root_terms = triton.jit(_root_terms)  # of the one-tile kernel
    _squarings = triton.jit(_squarings)  # of the one-tile kernel and both first passes
    _kdots = triton.jit(_kdots)  # of the first pass by blocks
    _kernel(_gdn_tree_kernel, interpret=False)
    _kernel(_gdn_tree_mats_kernel, interpret=False)
    _kernel(_gdn_tree_mats_head_kernel, interpret=False)
    _kernel(_gdn_tree_solve_kernel, interpret=False)
    _kernel(_gdn_prologue_kernel, interpret=False)

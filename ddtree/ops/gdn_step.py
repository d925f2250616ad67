"""The fused one-token Gated DeltaNet step (Triton), twin of the torch path of
`GatedDeltaNet.forward`.

One new token through a GDN layer's mixer, between its two projections: the short convolution
over [conv_state; new row] with SiLU, q/k l2 norms, gates, the recurrence read against the state
(o = e^g S0^T q + (q.k) U), and the gated RMSNorm (gated_norm._gated_rms, as the tree verify's).
The torch path is ~8 kernels and an fp32 batched GEMM per layer; this is one kernel, one program
per value head. It writes what a commit needs into the group's scratch (k, U, c and the conv
rows), exactly as `gdn.tree_wy` does for a one-node tree.
"""

from __future__ import annotations

import torch

from ddtree.ops.gated_norm import _gated_rms
from ddtree.ops.triton_util import _kernel, _on_device_of, tl, triton


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
    z = tl.load(proj + C + h * DV + ov, mask=mv, other=0.0).to(f32)
    y = _gated_rms(tl.where(mv, o, 0.0), tl.load(norm_w + ov, mask=mv, other=0.0).to(f32), z, eps_norm, DV, dt)
    tl.store(out + h * DV + ov, y, mask=mv)


def gdn_step(layer, proj: torch.Tensor) -> torch.Tensor:
    """One token through GDN layer `layer`'s mixer (see the module docstring).

    proj: [N] the fused input projection's row (qkv [C], z [hv*dv], b [hv], a [hv]) in the model
    dtype. Writes ext rows 0..width-1 and the layer's k/U/c scratch at node 0. -> [hv*dv]."""
    hv, dk, dv, C = layer.hv, layer.dk, layer.dv, layer.conv_dim
    w, neg_a, _ = layer._consts()
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



if triton is not None:  # made here, so that a compiled layer only looks it up
    _kernel(_gdn_step_kernel, interpret=False)

"""The GDN output's gated RMSNorm for a tree verify (Triton), twin of
`ddtree.model.layers.GatedRMSNorm`: w * norm(o) * silu(z) over each (node, value head) row of dv
channels, with the torch path's roundings to the model dtype (as the step kernel's own norm,
ddtree.ops.gdn_step).

Why its own kernel: inside a compiled layer the norm follows the tree kernels' eager call, so
inductor compiled it in the resume frame after that call, static for the first tree size it met
and dynamic for the rest: the same norm took 2.0-2.2 or 3.7-4.4 us a layer on an H100 by that
shape class, not by size (results/engine-h100.json). Here it is one launch of fixed tiles inside
the same eager call (ddtree.model.target.tree_mixer): 1.7-2.2 us a layer at every size
(results/engine-1k-32k-h100.json).
"""

from __future__ import annotations

import torch

from ddtree.ops.triton_util import _kernel, _on_device_of, tl, triton

ROWS = 8  # (node, head) rows a program: 816 rows of a 17-node verify at the 27B's 48 heads in 102 programs


def _gated_rms(x, w, z, eps, DV: tl.constexpr, dt: tl.constexpr):
    """GatedRMSNorm of fp32 rows x over their last axis (DV channels; masked channels 0): w *
    norm(x) * silu(z), rounded to the model dtype `dt` where the torch path rounds (x first, the
    normalised x, w times it, the output). w, z fp32, broadcastable to x. Of this kernel and the
    step kernel's epilogue (ddtree.ops.gdn_step)."""
    f32 = tl.float32
    x = x.to(dt, fp_downcast_rounding="rtne").to(f32)  # o.to(model dtype) first, as the torch path
    xn = (x / tl.sqrt(tl.sum(x * x, -1, keep_dims=True) / DV + eps)).to(dt, fp_downcast_rounding="rtne").to(f32)
    wxn = (w * xn).to(dt, fp_downcast_rounding="rtne").to(f32)
    return (wxn * (z / (1.0 + tl.exp(-z)))).to(dt, fp_downcast_rounding="rtne")


def _gated_norm_kernel(o, z, w, out, n_rows, HV, s_ot, s_zt, s_outt, eps,
                       DV: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr):
    # One program per BR rows; row r is node r // HV, head r % HV, its channels contiguous.
    f32 = tl.float32
    dt = out.dtype.element_ty
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    ov = tl.arange(0, BV)
    mr, mv = r < n_rows, ov < DV
    m = mr[:, None] & mv[None, :]
    t, h = r // HV, r % HV
    x = tl.load(o + t[:, None] * s_ot + h[:, None] * DV + ov[None, :], mask=m, other=0.0).to(f32)
    zz = tl.load(z + t[:, None] * s_zt + h[:, None] * DV + ov[None, :], mask=m, other=0.0).to(f32)
    y = _gated_rms(x, tl.load(w + ov, mask=mv, other=0.0).to(f32)[None, :], zz, eps, DV, dt)
    tl.store(out + t[:, None] * s_outt + h[:, None] * DV + ov[None, :], y, mask=m)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """GatedRMSNorm(o.to(dtype), z) in one launch. o [T, hv, dv] (fp32 from the tree kernels;
    channels and heads contiguous); z [T, hv * dv] in `dtype` (a column slice of the projection:
    any row stride); weight [dv]. -> [T, hv * dv] in `dtype`."""
    T, hv, dv = o.shape
    assert o.stride(2) == 1 and o.stride(1) == dv and z.stride(1) == 1 and z.shape == (T, hv * dv)
    out = torch.empty(T, hv * dv, dtype=dtype, device=o.device)
    kern = _kernel(_gated_norm_kernel, interpret=not o.is_cuda)
    with _on_device_of(o):
        kern[(triton.cdiv(T * hv, ROWS),)](
            o, z, weight, out, T * hv, hv, o.stride(0), z.stride(0), out.stride(0), eps,
            DV=dv, BV=triton.next_power_of_2(dv), BR=ROWS, num_warps=4,
        )
    return out


if triton is not None:  # made here, so that a compiled layer only looks it up
    _gated_rms = triton.jit(_gated_rms)  # device function: of this kernel and gdn_step's
    _kernel(_gated_norm_kernel, interpret=False)

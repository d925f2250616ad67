"""The commit in three Triton kernels, each for all layers of a device at once (twins in
`ddtree.ops.gdn` and `ddtree.model.target`).

* `gdn_commit_`: the GDN state pass, in place: S <- e^{c_a} S + sum over the accepted path of
  e^{c_a - c_j} k_j U_j^T. The state (151 MB for Qwen3.6-27B) is read and written once; only the
  path's rows of k and U are read. Twin: `gdn.commit_states_`.
* `conv_commit_`: each layer's conv rows become the newest inputs on the accepted path. Twin: the
  index_selects in `GDNGroup.commit`.
* `kv_commit_`: the attention K/V moves (path rows to the committed slots). Twin: index_select +
  index_copy_ in `TargetModel.commit`.
"""

from __future__ import annotations

import torch

from ddtree.ops.triton_util import _kernel, _on_device_of, tl, triton


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




if triton is not None:
    for _fn in (_gdn_commit_kernel, _conv_commit_kernel, _kv_commit_kernel):
        _kernel(_fn, interpret=False)

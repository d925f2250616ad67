"""The walk: which nodes of a verified tree the target's own choices accept, as a path.

A node is accepted when every node on its path holds the token its parent's choice picked.
Siblings hold distinct tokens, so the accepted nodes form one path; its deepest node's choice is
the next bonus token. `walk` is the torch twin (~15 small kernels); `walk_kernel` does it in one
Triton program and can also write the host's packet header.
"""

from __future__ import annotations

import torch

from ddtree.ops.triton_util import _kernel, _on_device_of, tl, triton


def walk(tokens, parents, depths, path_mask, choice, P: int):
    """Accepted path of a verified tree, on the device (no host sync).

    tokens/parents/depths/choice [T]; path_mask [T, T]. A node is accepted when every node on its
    path holds the token its parent's choice picked. Siblings hold distinct tokens, so the
    accepted nodes form one path. Returns last accepted node (0-dim), its node count n (0-dim,
    root included) and path_nodes [P] (root first, padded with the last node).
    """
    T = tokens.shape[0]
    idx = torch.arange(T, device=tokens.device)
    match = (tokens == choice[parents.clamp(min=0)]) | (idx == 0)
    accepted = ~(path_mask & ~match[None, :]).any(1)
    last = torch.where(accepted, depths, -1).argmax()
    # gather/index_select, not tensor[last]: a 0-dim index would read `last` back to the host
    d_last = depths.gather(0, last.view(1))[0]
    d = torch.arange(P, device=tokens.device)
    on_path = path_mask.index_select(0, last.view(1)) & (depths[None, :] == d[:, None])  # [P, T]
    path_nodes = torch.where(d <= d_last, on_path.to(torch.int32).argmax(1), last)
    return last, d_last + 1, path_nodes


def _walk_kernel(tokens, parents, depths, mask, choice, path_out, n_out, bonus_out, ranks, pack_out,
                 T: tl.constexpr, P: tl.constexpr, TP: tl.constexpr, PP: tl.constexpr,
                 PACK: tl.constexpr, PK: tl.constexpr, PKP: tl.constexpr):
    # One program, the whole tree in registers: a node is accepted when every node on its path
    # holds the token its parent's choice picked; the deepest accepted node ends the path.
    ot = tl.arange(0, TP)
    mt = ot < T
    tok = tl.load(tokens + ot, mask=mt, other=0)
    par = tl.load(parents + ot, mask=mt, other=0)
    dep = tl.load(depths + ot, mask=mt, other=0)
    pick = tl.load(choice + tl.maximum(par, 0), mask=mt, other=0)
    match = (tok == pick) | (ot == 0)
    m2 = mt[:, None] & mt[None, :]
    on = tl.load(mask + ot[:, None] * T + ot[None, :], mask=m2, other=0) != 0  # [TP, TP]: j on path(i)
    bad = tl.sum((on & (match[None, :] == 0)).to(tl.int32), 1)  # [TP]: rejected nodes on each path
    accepted = mt & (bad == 0)
    key = tl.where(accepted, dep, -1)
    d_last = tl.max(key, 0)
    last = tl.min(tl.where(key == d_last, ot, TP), 0)  # the first node of the deepest accepted depth
    row = tl.sum(tl.where(ot[:, None] == last, on.to(tl.int32), 0), 0) != 0  # [TP]: path(last)
    od = tl.arange(0, PP)
    hit = row[None, :] & (dep[None, :] == od[:, None])  # [PP, TP]: the path's node at each depth
    node = tl.min(tl.where(hit, ot[None, :], TP), 1)
    node = tl.where(od <= d_last, node, last)
    tl.store(path_out + od, node.to(tl.int64), mask=od < P)
    tl.store(n_out, (d_last + 1).to(tl.int64))
    bonus = tl.load(choice + last)
    tl.store(bonus_out, bonus)
    if PACK:  # the host's header, fp32: [n, bonus, path tokens (PK), path ranks (PK)], zeros past P
        tl.store(pack_out, (d_last + 1).to(tl.float32))
        tl.store(pack_out + 1, bonus.to(tl.float32))
        mp = od < P
        tl.store(pack_out + 2 + od, tl.load(tokens + node, mask=mp, other=0).to(tl.float32), mask=mp)
        tl.store(pack_out + 2 + PK + od, tl.load(ranks + node, mask=mp, other=0).to(tl.float32), mask=mp)
        oq = tl.arange(0, PKP)
        pad = (oq >= P) & (oq < PK)
        tl.store(pack_out + 2 + oq, tl.zeros([PKP], dtype=tl.float32), mask=pad)
        tl.store(pack_out + 2 + PK + oq, tl.zeros([PKP], dtype=tl.float32), mask=pad)


def walk_kernel(tokens, parents, depths, path_mask, choice, P: int, out: tuple, ranks=None, pack=None):
    """`walk` in one kernel, written into out = (path_nodes [P], n 0-dim, bonus 0-dim)
    (long, on the tree's device). tokens/parents/depths/choice [T] long, path_mask [T, T] bool
    contiguous. With ranks [T] long and pack [2 + 2 PK] fp32 (PK >= P) it also writes the host's
    header: [n, bonus, tokens[path] (PK), ranks[path] (PK)], zeros past P (the torch twin:
    Decoder.walk's index_selects). -> out. Twin: walk (the path, n, and choice[last])."""
    T = tokens.shape[0]
    path, n, bonus = out
    for t in (tokens, parents, depths, choice, path):
        assert t.dtype == torch.long and t.stride(-1) == 1
    assert path_mask.is_contiguous()
    PK = 0 if pack is None else (pack.shape[0] - 2) // 2
    if pack is not None:
        assert ranks is not None and ranks.dtype == torch.long and pack.dtype == torch.float32 and PK >= P
    kern = _kernel(_walk_kernel, interpret=not tokens.is_cuda)
    with _on_device_of(tokens):
        kern[(1,)](tokens, parents, depths, path_mask.view(torch.int8), choice, path, n, bonus,
                   tokens if ranks is None else ranks, path if pack is None else pack,
                   T=T, P=P, TP=max(2, triton.next_power_of_2(T)), PP=max(2, triton.next_power_of_2(P)),
                   PACK=pack is not None, PK=PK, PKP=max(2, triton.next_power_of_2(max(PK, 1))), num_warps=4)
    return out



if triton is not None:
    _kernel(_walk_kernel, interpret=False)

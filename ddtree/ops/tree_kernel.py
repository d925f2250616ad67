"""One Triton kernel that builds a round's draft tree on the device (rounds ahead, CUDA graphs).

`tree.build_tree_device` in torch is ~170 small kernels (per depth: candidates, top-k, index
arithmetic; then a global sort, scatters and one ancestor-mask pass per level): 0.4 to 0.8 ms
of launch-bound work per round on an H200. This is the same algorithm in one program:

* depth 0: the drafter's top-Kb ranks, Kb = min(K, B).
* depth d: the candidates are (beam slot i of depth d - 1, rank j of depth d), score
  beam[i] + lp[d, j]. Both lists are sorted, so (i, j) has (i + 1)(j + 1) - 1 candidates at least
  as good and earlier in (i, j) order; with ties broken by that order, only pairs with
  (i + 1)(j + 1) <= B can be among the best B. Those (about B ln B) are compacted, ranked by
  counting who beats whom, and the best B written to depth d's slots in order.
* ties: on an equal score the lexicographically smaller rank prefix wins (a parent before its
  children), as in the host heap and the DDTree authors' build_ddtree_tree. Within depth d that is
  (lex of the parent slot, j), lex being a slot's index in rank-prefix order among its depth's;
  across depths it is the slots' preorder in the trie they form (subtree sizes bottom-up, then
  each slot's preorder = its parent's + 1 + the sizes of its elder siblings).
* global: every slot of every depth is ranked the same way (score, then preorder); the best B
  become nodes 1..B in that order.
* outputs: tokens, depths, parents, ranks, the ancestor mask (each node walks up its parents)
  and the tree's depth, written straight into the caller's buffers.

Cross-thread hand-offs go through a small global scratch with a CTA barrier between phases (one
program, so a barrier orders them). Twin: the torch `tree.build_tree_device` (and `build_tree`'s
heap); tests compare them, on CPU under Triton's interpreter.
"""

from __future__ import annotations

import torch

from ddtree.ops.triton_util import _kernel, _on_device_of, tl, triton


def pruned_pairs(budget: int, kb: int) -> int:
    """How many (i, j) pairs with i < budget, j < kb and (i + 1)(j + 1) <= budget (the per-depth candidates)."""
    return sum(min(kb, budget // (i + 1)) for i in range(budget))


def _tree_kernel(
    lp, ids, root, tokens_out, depths_out, parents_out, ranks_out, mask_out, depth_out, eq_out, dcum_out,
    sc, ps, rk, cand, cscore, wsz, node,  # scratch: slot score / parent slot / rank [D*BB], compacted [NP], W [D], node [D*BB]
    ckey, skey, lex, size, pre,  # scratch: candidate's rank-prefix key [NP]; slot's key, lex, subtree size, preorder [D*BB]
    D: tl.constexpr, K: tl.constexpr, B: tl.constexpr, KBV: tl.constexpr,  # depths, lp's row length, budget, Kb = min(K, B)
    BB: tl.constexpr, KB: tl.constexpr, NP: tl.constexpr, GP: tl.constexpr, TP: tl.constexpr,
    QB: tl.constexpr, SUMMARY: tl.constexpr,
):
    T = B + 1
    # ---- zero the ancestor mask (set in the last phase, after barriers)
    om = tl.arange(0, TP)
    tl.store(mask_out + om[:, None] * T + om[None, :], tl.zeros([TP, TP], dtype=tl.int8), mask=(om[:, None] < T) & (om[None, :] < T))
    # ---- depth 0: the drafter's top-Kb ranks
    ob = tl.arange(0, BB)
    m0 = ob < KBV
    tl.store(sc + ob, tl.load(lp + ob, mask=m0, other=0.0).to(tl.float32), mask=m0)
    tl.store(ps + ob, tl.full([BB], -1, tl.int32), mask=m0)
    tl.store(rk + ob, ob, mask=m0)
    tl.store(lex + ob, ob, mask=m0)
    tl.store(wsz + 0, KBV)
    of = tl.arange(0, BB * KB)  # flat (i, j) over the candidate tile
    fi = of // KB
    fj = of % KB
    op = tl.arange(0, NP)
    oe = tl.arange(0, GP)  # every slot of every depth, depth-major
    de = oe // BB
    ie = oe % BB
    tl.debug_barrier()
    for d in range(1, D):
        W = tl.load(wsz + d - 1)  # live slots of depth d - 1
        # Early out: no slot of depth >= d scores above depth d's best candidate (log-probs are <= 0).
        # Once B earlier slots beat it, the deeper depths cannot place a node: leave them empty.
        best = tl.load(sc + (d - 1) * BB) + tl.load(lp + d * K).to(tl.float32)
        prev = (de < d) & (ie < tl.load(wsz + de, mask=de < d, other=0))
        better = tl.sum((prev & (tl.load(sc + oe, mask=prev, other=0.0) > best)).to(tl.int32), 0)
        W = tl.where(better >= B, 0, W)
        # compact the pruned pairs (flat order = (i, j) order)
        ok = (fi < W) & (fj < KBV) & ((fi + 1) * (fj + 1) <= B)
        pos = tl.cumsum(ok.to(tl.int32), 0) - 1
        n = tl.sum(ok.to(tl.int32), 0)
        tl.store(cand + pos, (fi * KB + fj).to(tl.int32), mask=ok)
        tl.debug_barrier()
        mp = op < n
        f = tl.load(cand + op, mask=mp, other=0)
        i = f // KB
        j = f % KB
        s_p = tl.load(sc + (d - 1) * BB + i, mask=mp, other=0.0) + tl.load(lp + d * K + j, mask=mp, other=0.0).to(tl.float32)
        k_p = tl.load(lex + (d - 1) * BB + i, mask=mp, other=0) * KB + j  # rank-prefix order at depth d, distinct
        tl.store(cscore + op, s_p, mask=mp)
        tl.store(ckey + op, k_p, mask=mp)
        tl.debug_barrier()
        rank = tl.zeros([NP], dtype=tl.int32)
        for q0 in range(0, NP, QB):  # rank = how many candidates beat this one (a loop, not unrolled: compile time)
            if q0 < n:  # blocks past the live candidates: skipped
                oq = q0 + tl.arange(0, QB)
                s_q = tl.load(cscore + oq, mask=oq < n, other=0.0)
                k_q = tl.load(ckey + oq, mask=oq < n, other=0)
                beats = (oq[None, :] < n) & ((s_q[None, :] > s_p[:, None]) | ((s_q[None, :] == s_p[:, None]) & (k_q[None, :] < k_p[:, None])))
                rank += tl.sum(beats.to(tl.int32), 1)
        keep = mp & (rank < B)
        tl.store(sc + d * BB + rank, s_p, mask=keep)
        tl.store(ps + d * BB + rank, i, mask=keep)
        tl.store(rk + d * BB + rank, j, mask=keep)
        tl.store(skey + d * BB + rank, k_p, mask=keep)
        Wd = tl.minimum(W * KBV, B)
        tl.store(wsz + d, Wd)
        tl.debug_barrier()
        # lex of depth d's slots: how many of them come earlier in rank-prefix order
        k_s = tl.load(skey + d * BB + ob, mask=ob < Wd, other=0)
        lx = tl.sum(((ob[None, :] < Wd) & (k_s[None, :] < k_s[:, None])).to(tl.int32), 1)
        tl.store(lex + d * BB + ob, lx, mask=ob < Wd)
        tl.debug_barrier()
    # ---- preorder of the slots' trie (rank-prefix order across depths): subtree sizes, deepest first
    for e in range(0, D):
        d = D - 1 - e
        Wc = tl.load(wsz + d + 1, mask=d + 1 < D, other=0)  # the children's depth (none below the last)
        pc = tl.load(ps + (d + 1) * BB + ob, mask=ob < Wc, other=-1)
        zc = tl.load(size + (d + 1) * BB + ob, mask=ob < Wc, other=0)
        z = 1 + tl.sum(tl.where(pc[None, :] == ob[:, None], zc[None, :], 0), 1)
        tl.store(size + d * BB + ob, z, mask=ob < tl.load(wsz + d))
        tl.debug_barrier()
    for d in range(0, D):  # preorder = the parent's + 1 + the elder siblings' subtree sizes (root: -1)
        Wd = tl.load(wsz + d)
        live = ob < Wd
        p_s = tl.load(ps + d * BB + ob, mask=live, other=-2)
        r_s = tl.load(rk + d * BB + ob, mask=live, other=0)
        z_s = tl.load(size + d * BB + ob, mask=live, other=0)
        elder = live[None, :] & (p_s[None, :] == p_s[:, None]) & (r_s[None, :] < r_s[:, None])
        up = tl.load(pre + (d - 1) * BB + p_s, mask=live & (d > 0), other=-1)
        tl.store(pre + d * BB + ob, up + 1 + tl.sum(tl.where(elder, z_s[None, :], 0), 1), mask=live)
        tl.debug_barrier()
    # ---- global: the best B slots over all depths become nodes 1..B
    ve = (de < D) & (ie < tl.load(wsz + de, mask=de < D, other=0))
    s_e = tl.load(sc + oe, mask=ve, other=0.0)
    o_e = tl.load(pre + oe, mask=ve, other=0)
    n_live = (tl.max(tl.where(ve, de, -1), 0) + 1) * BB  # the slots of the depths that have any
    grank = tl.zeros([GP], dtype=tl.int32)
    ahead_p = tl.zeros([GP], dtype=tl.float32)  # SUMMARY: path probabilities of the nodes before this one
    ahead_d = tl.zeros([GP], dtype=tl.int32)  # and their deepest depth
    for q0 in range(0, GP, QB):
        if q0 < n_live:  # blocks of the empty depths: skipped
            oq = q0 + tl.arange(0, QB)
            dq = oq // BB
            vq = (dq < D) & (oq % BB < tl.load(wsz + dq, mask=dq < D, other=0))
            s_q = tl.load(sc + oq, mask=vq, other=0.0)
            o_q = tl.load(pre + oq, mask=vq, other=0)
            beats = vq[None, :] & ((s_q[None, :] > s_e[:, None]) | ((s_q[None, :] == s_e[:, None]) & (o_q[None, :] < o_e[:, None])))
            grank += tl.sum(beats.to(tl.int32), 1)
            if SUMMARY:
                ahead_p += tl.sum(tl.where(beats, tl.exp(s_q)[None, :], 0.0), 1)
                ahead_d = tl.maximum(ahead_d, tl.max(tl.where(beats, dq[None, :] + 1, 0), 1))
    sel = ve & (grank < B)
    nid = grank + 1
    if SUMMARY:  # E_q and depth of the best-first tree of nid draft nodes (auto's choice of budget)
        tl.store(eq_out + grank, ahead_p + tl.exp(s_e), mask=sel)
        tl.store(dcum_out + grank, tl.maximum(ahead_d, de + 1).to(tl.int64), mask=sel)
    tl.store(node + oe, nid, mask=sel)
    r_e = tl.load(rk + oe, mask=sel, other=0)
    tl.store(tokens_out + nid, tl.load(ids + de * K + r_e, mask=sel, other=0).to(tl.int64), mask=sel)
    tl.store(depths_out + nid, (de + 1).to(tl.int64), mask=sel)
    tl.store(ranks_out + nid, r_e.to(tl.int64), mask=sel)
    tl.store(tokens_out, tl.load(root).to(tl.int64))
    tl.store(depths_out, 0)
    tl.store(parents_out, -1)
    tl.store(ranks_out, 0)
    tl.store(depth_out, tl.max(tl.where(sel, de + 1, 0), 0).to(tl.int64))
    tl.debug_barrier()
    p_e = tl.load(ps + oe, mask=sel & (de > 0), other=0)
    par = tl.load(node + (de - 1) * BB + p_e, mask=sel & (de > 0), other=0)  # a parent always outranks its child
    tl.store(parents_out + nid, tl.where(de > 0, par, 0).to(tl.int64), mask=sel)
    tl.debug_barrier()
    # ---- ancestor mask: each node marks itself and walks up (depth <= D)
    cur = om
    live = om < T
    for _ in range(0, D + 1):
        tl.store(mask_out + om * T + cur, tl.full([TP], 1, tl.int8), mask=live)
        up = tl.load(parents_out + cur, mask=live, other=-1).to(tl.int32)
        live = live & (up >= 0)
        cur = tl.where(live, up, 0)


def build_tree_kernel(root: torch.Tensor, topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int,
                      out: tuple | None = None, summary: tuple | None = None):
    """`tree.build_tree_device` in one kernel. out: optional (tokens, depths, parents, ranks [B + 1]
    long, mask [B + 1, B + 1] bool, depth [1] long) to write into (the slot's buffers); each 1-D
    output unit-stride, the mask contiguous. -> that tuple (depth as a 0-dim view).
    summary: optional (eq [B] float32, dcum [B] long): for each prefix of b = i + 1 draft nodes,
    E_q(b) (its nodes' path probabilities summed) and its depth (`tree_summary` is the twin)."""
    B = int(budget)
    D, K = topk_logprobs.shape
    dev = topk_logprobs.device
    lp = topk_logprobs.float().contiguous()
    ids = topk_ids.contiguous()
    if out is None:
        ints = torch.empty(4, B + 1, dtype=torch.long, device=dev)
        out = (ints[0], ints[1], ints[2], ints[3], torch.empty(B + 1, B + 1, dtype=torch.bool, device=dev),
               torch.empty(1, dtype=torch.long, device=dev))
    tokens, depths, parents, ranks, mask, depth = out
    for t in (tokens, depths, parents, ranks):
        assert t.dtype == torch.long and t.stride(-1) == 1 and t.shape[-1] == B + 1
    assert mask.is_contiguous() and mask.shape == (B + 1, B + 1) and mask.dtype == torch.bool
    kb = min(K, B)
    BB = triton.next_power_of_2(B)
    KB = triton.next_power_of_2(kb)
    NP = max(16, triton.next_power_of_2(pruned_pairs(B, kb)))
    GP = max(16, triton.next_power_of_2(D * BB))
    QB = min(32, NP)
    # scratch (under capture: the graph's own, allocated once); every phase writes before it reads
    sc, cscore = torch.empty(D * BB + NP, dtype=torch.float32, device=dev).split([D * BB, NP])
    n = D * BB
    ib = torch.empty(7 * n + 2 * NP + D, dtype=torch.int32, device=dev)
    ps, rk, node, skey, lex, size, pre = ib[:7 * n].split(n)
    wsz, cand, ckey = ib[7 * n:].split([D, NP, NP])
    if summary is not None:
        assert summary[0].dtype == torch.float32 and summary[1].dtype == torch.long
        assert summary[0].shape == summary[1].shape == (B,) and summary[0].is_contiguous() and summary[1].is_contiguous()
    eq, dcum = summary if summary is not None else (sc, sc)  # unused pointers when not asked for
    kern = _kernel(_tree_kernel, interpret=not lp.is_cuda)
    with _on_device_of(lp):
        kern[(1,)](
            lp, ids, root.reshape(1), tokens, depths, parents, ranks, mask.view(torch.int8), depth, eq, dcum,
            sc, ps, rk, cand, cscore, wsz, node, ckey, skey, lex, size, pre,
            D=D, K=K, B=B, KBV=kb,
            BB=BB, KB=KB, NP=NP, GP=GP, TP=triton.next_power_of_2(B + 1), QB=QB, SUMMARY=summary is not None, num_warps=8,
        )
    return tokens, depths, parents, ranks, mask, depth.view(())


def tree_summary(lp: torch.Tensor, depths: torch.Tensor, ranks: torch.Tensor, mask: torch.Tensor):
    """The summary's torch twin from a built best-first tree: (eq [B], dcum [B]) as above."""
    node_lp = lp.float()[(depths - 1).clamp(min=0), ranks] * (depths > 0)  # [T]
    eq = torch.cumsum((mask.float() @ node_lp)[1:].exp(), 0)
    return eq, torch.cummax(depths, 0).values[1:]


if triton is not None:
    _kernel(_tree_kernel, interpret=False)

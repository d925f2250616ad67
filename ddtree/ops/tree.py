"""Draft trees as flat arrays, and the DDTree best-first tree builder.

A tree of N nodes is stored as flat arrays in *insertion order* (parents always precede children),
the layout vLLM / SGLang use for tree attention. Node 0 is the root (the bonus token, already
verified); nodes 1..N-1 are draft nodes. Each draft node is a prefix (r_1, ..., r_d) of per-depth
ranks into the drafter's top-K at depths 1..d; its token is ``topk_ids[d-1, r_d]`` and its score is
``sum_i topk_logprobs[i-1, r_i]``.

Worked example: D=3, K=2, budget=5, root token ``a``, with
``topk_ids = [[b, c], [d, e], [f, g]]`` and ``topk_logprobs = [[-0.1, -0.9], [-0.2, -0.7], [-0.3, -2.0]]``.
Best-first pops (score): b (-0.1), bd (-0.3), bdf (-0.6), be (-0.8), c (-0.9)::

            0:a                  depth 0
           /    \\
        1:b      5:c             depth 1   (ranks 0, 1)
       /    \\
     2:d    4:e                  depth 2   (ranks 0, 1)
      |
     3:f                         depth 3   (rank 0)

    node            0   1   2   3   4   5
    tokens          a   b   d   f   e   c
    parents        -1   0   1   2   1   0
    depths          0   1   2   3   2   1
    ranks           0   0   0   0   1   1

    ancestor_mask   0 1 2 3 4 5          built row by row:
                 0  1 . . . . .            vis[i, :i] = vis[parents[i], :i]; vis[i, i] = True
                 1  1 1 . . . .          (row i = path(i): root..i), so a node attends exactly
                 2  1 1 1 . . .          to its ancestors and itself. Positions are start + depths.
                 3  1 1 1 1 . .
                 4  1 1 . . 1 .
                 5  1 . . . . 1
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Tree:
    tokens: torch.Tensor  # [N] int64; node 0 is the root (the bonus token)
    parents: torch.Tensor  # [N] int64; parents[0] = -1; parents[n] < n
    depths: torch.Tensor  # [N] int64; depths[0] = 0
    ranks: torch.Tensor  # [N] int64; rank of node n's token in the drafter's top-k at its depth (root 0)
    ancestor_mask: torch.Tensor  # [N, N] bool; [n, j] = j is on path(n) = ancestors of n and n itself
    scores: list[float] | None = None  # best-first trees: path log-probability of each node (root 0)

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device) -> "Tree":
        return Tree(*(t.to(device, non_blocking=True) for t in
                      (self.tokens, self.parents, self.depths, self.ranks, self.ancestor_mask)))

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> "Tree":
        """A path: tokens[0] is the root, node n's parent is n-1 (ranks all 0)."""
        tokens = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)  # [N]
        n = tokens.shape[0]
        shape = _CHAINS.get(n)
        if shape is None:  # the same for every chain of n nodes (a dflash round each): made once
            ar = torch.arange(n, dtype=torch.int64)
            shape = _CHAINS[n] = (ar - 1, ar.clone(), torch.zeros(n, dtype=torch.int64),
                                  torch.ones(n, n, dtype=torch.bool).tril())
        parents, depths, ranks, mask = shape
        return cls(tokens=tokens, parents=parents, depths=depths, ranks=ranks, ancestor_mask=mask)

    def truncate(self, n: int) -> "Tree":
        """The first n nodes. For a best-first tree this is the best-first tree of budget n - 1
        (pop order is the same for every budget, and parents precede children)."""
        return Tree(self.tokens[:n], self.parents[:n], self.depths[:n], self.ranks[:n],
                    self.ancestor_mask[:n, :n], None if self.scores is None else self.scores[:n])

    def path_to(self, node: int) -> list[int]:
        """Node ids from the root to ``node`` (inclusive)."""
        parents = self.parents.tolist()
        path = []
        while node >= 0:
            path.append(node)
            node = parents[node]
        return path[::-1]


_CHAINS: dict = {}  # n -> (parents, depths, ranks, ancestor_mask) of the n-node chain (read-only)


def _ancestor_mask_np(parents: list[int]) -> np.ndarray:
    n = len(parents)
    vis = np.zeros((n, n), dtype=np.bool_)  # [N, N]
    for i, p in enumerate(parents):
        if p >= 0:
            vis[i] = vis[p]  # p < i, so row p is final and zero from column p+1 on
        vis[i, i] = True
    return vis


def ancestor_mask_from_parents(parents) -> torch.Tensor:
    """[N] parents (parents[0] = -1, parents[n] < n) -> [N, N] bool ancestor-or-self mask."""
    p = parents.tolist() if hasattr(parents, "tolist") else list(parents)
    return torch.from_numpy(_ancestor_mask_np(p))


def _as_list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def build_tree(root_token: int, topk_logprobs, topk_ids, budget: int, top1_first: bool = False) -> Tree:
    """DDTree best-first tree: the ``budget`` highest-scoring rank prefixes (plus the root), in
    descending score; ties go to the lexicographically smaller rank prefix (a parent first).

    topk_logprobs: [D, K] float, per-depth log-probs sorted descending along K (torch or numpy).
    topk_ids:      [D, K] int, the matching token ids.
    With ``top1_first`` the rank-0 chain (min(D, budget) nodes) is inserted first, then the rest
    best-first. N = budget + 1, or fewer when the tree holds every prefix (sum_d K^d < budget).
    """
    budget = int(budget)
    # A rank-r node needs its r elder siblings first and a depth-d node its d-1 ancestors,
    # so nothing past `budget` along either axis is reachable: slice before converting.
    lp = _as_list(topk_logprobs[:budget, :budget])  # [D', K'] python floats
    ids = _as_list(topk_ids[:budget, :budget])  # [D', K'] python ints
    D = len(lp)
    K = len(lp[0]) if D else 0
    chain_len = min(D, budget) if top1_first else 0

    tokens, parents, depths, ranks, scores = [int(root_token)], [-1], [0], [0], [0.0]
    # Heap entry: (key, rank prefix, score, depth, rank, parent node). key = -score, except the
    # top-1 chain candidate under top1_first gets -inf so it pops first. Ties on the score go to
    # the lexicographically smaller rank prefix (a parent before its children), as in the DDTree
    # authors' build_ddtree_tree; the device builders break ties the same way. Each prefix is
    # pushed exactly once (rank 0 by its parent, rank r>0 by its elder sibling): no duplicates.
    heap = []
    if budget > 0 and K > 0:
        s = lp[0][0]
        heap.append((-np.inf if chain_len >= 1 else -s, (0,), s, 1, 0, 0))
    push, pop = heapq.heappush, heapq.heappop
    while heap and len(tokens) <= budget:
        _, pre, s, d, r, p = pop(heap)
        node = len(tokens)
        tokens.append(ids[d - 1][r])
        parents.append(p)
        depths.append(d)
        ranks.append(r)
        scores.append(s)
        if d < D:  # first child
            cs = s + lp[d][0]
            # chain nodes are exactly nodes 1..chain_len, node i at depth i
            key = -np.inf if (r == 0 and node == d and d + 1 <= chain_len) else -cs
            push(heap, (key, pre + (0,), cs, d + 1, 0, node))
        if r + 1 < K:  # next sibling (never a chain node)
            ss = s - lp[d - 1][r] + lp[d - 1][r + 1]
            push(heap, (-ss, pre[:-1] + (r + 1,), ss, d, r + 1, p))

    mask = torch.from_numpy(_ancestor_mask_np(parents))
    cols = torch.from_numpy(np.array((tokens, parents, depths, ranks), dtype=np.int64))  # one conversion, [4, N]
    return Tree(tokens=cols[0], parents=cols[1], depths=cols[2], ranks=cols[3], ancestor_mask=mask, scores=scores)


def benchmark_build(budget: int, depth: int = 15, k: int | None = None, repeats: int = 200) -> float:
    """Mean wall time (ms) of ``build_tree`` on random CPU drafter top-k (k defaults to 64)."""
    k = 64 if k is None else k
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(depth, max(k, 1000), generator=g) * 3.0  # [D, V]
    lp, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)  # [D, K] sorted descending
    for _ in range(5):
        build_tree(0, lp, ids, budget)
    t0 = time.perf_counter()
    for _ in range(repeats):
        build_tree(0, lp, ids, budget)
    return (time.perf_counter() - t0) * 1e3 / repeats


def device_tree_fits(depth: int, k: int, budget: int) -> bool:
    """Does a best-first tree of `budget` draft nodes exist with D = depth, K = k (enough prefixes)?
    (`build_tree_device` has fixed shapes: it needs exactly `budget` of them.)"""
    total, width = 0, 1
    for _ in range(depth):
        width = min(width * k, budget)
        total += width
        if total >= budget:
            return True
    return False


def build_tree_device(root: torch.Tensor, topk_logprobs: torch.Tensor, topk_ids: torch.Tensor, budget: int):
    """`build_tree` on the device, without a host sync, for fixed-shape rounds (CUDA graphs).

    root: 0-dim long; topk_logprobs / topk_ids: [D, K] (sorted descending along K), on one device.
    The best-first tree of `budget` draft nodes is the set of the `budget` highest-scoring rank
    prefixes, in descending score (parents first on ties): per depth d the best B = budget
    prefixes extend only the best B of depth d - 1 (an extension scores at most its parent), then
    the best B over all depths. Ties on the score go to the lexicographically smaller rank prefix,
    as in `build_tree` (and the DDTree authors' heap), so the two build the same tree (tests check
    it, on tied scores too; scores here are float32 sums, the heap's float64).
    Needs `device_tree_fits(D, K, budget)`. Returns tokens, depths, parents, ranks [B + 1] long,
    ancestor mask [B + 1, B + 1] bool, and the tree depth (0-dim).
    """
    B = int(budget)
    D, K = topk_logprobs.shape
    dev = topk_logprobs.device
    Kb = min(K, B)
    lp = topk_logprobs[:, :Kb].float()  # [D, Kb]
    ar = torch.arange(Kb, device=dev)
    # Per depth, the kept prefixes sorted by (score desc, rank prefix asc); lex = each one's index in
    # rank-prefix order among its depth's, path = the lex of its ancestors at every depth (-1 past its own).
    path = torch.full((Kb, D), -1, dtype=torch.long, device=dev)
    path[:, 0] = ar
    scores, parent_g, ranks, depths, paths = [lp[0]], [torch.full((Kb,), -1, device=dev)], [ar], [], [path]
    depths.append(torch.ones(Kb, dtype=torch.long, device=dev))
    offset, beam, lex = 0, lp[0], ar  # global index of the current beam's first candidate; its scores [W], lex [W]
    for d in range(1, D):
        W = beam.shape[0]
        cand = (beam[:, None] + lp[d][None, :]).flatten()  # [W * Kb]
        key = (lex[:, None] * Kb + ar[None, :]).flatten()  # [W * Kb] rank-prefix order, distinct
        by_key = torch.sort(key).indices
        top = by_key[torch.sort(cand[by_key], descending=True, stable=True).indices[:B]]  # [W'] best first
        scores.append(cand[top])
        parent = torch.div(top, Kb, rounding_mode="floor")
        parent_g.append(offset + parent)
        ranks.append(top % Kb)
        depths.append(torch.full((top.shape[0],), d + 1, dtype=torch.long, device=dev))
        lex = torch.argsort(torch.argsort(key[top]))  # [W'] dense rank-prefix order
        path = path[parent].clone()
        path[:, d] = lex
        paths.append(path)
        offset += W
        beam = cand[top]
    S = torch.cat(scores)  # [G] every candidate, depth-major
    P = torch.cat(paths)  # [G, D]
    order = torch.arange(S.shape[0], device=dev)
    for c in range(D - 1, -1, -1):  # rank-prefix order (a prefix before its extensions: -1 sorts first)
        order = order[torch.sort(P[order, c], stable=True).indices]
    order = order[torch.sort(S[order], descending=True, stable=True).indices[:B]]  # [B] the draft nodes, in node order
    G = S.shape[0]
    node_of = torch.zeros(G, dtype=torch.long, device=dev)
    node_of[order] = torch.arange(1, B + 1, device=dev)  # candidate -> node id (selected ones)
    par_g = torch.cat(parent_g)[order]
    parents = torch.where(par_g >= 0, node_of[par_g.clamp(min=0)], 0)  # depth-1 nodes hang off the root
    dep = torch.cat(depths)[order]
    rk = torch.cat(ranks)[order]
    tok = topk_ids[:, :Kb].reshape(-1)[(dep - 1) * Kb + rk]
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    tokens = torch.cat([root.view(1).long(), tok.long()])
    parents_all = torch.cat([zero - 1, parents])
    depths_all = torch.cat([zero, dep])
    ranks_all = torch.cat([zero, rk])
    eye = torch.eye(B + 1, dtype=torch.bool, device=dev)
    up = parents_all.clamp(min=0)
    mask = eye
    for _ in range(D):  # mask[n] = {n} + mask[parent(n)]: after t passes, ancestors up to t levels up
        mask = eye | mask.index_select(0, up)
    return tokens, depths_all, parents_all, ranks_all, mask, depths_all.max()

import itertools
import math
import random

import numpy as np
import pytest
import torch

from ddtree.ops.tree import Tree, ancestor_mask_from_parents, build_tree


def _ids(D, K):  # [D, K] distinct token ids: 100*depth + rank
    return torch.tensor([[100 * (d + 1) + r for r in range(K)] for d in range(D)])


def _lp(rows):
    return torch.tensor(rows, dtype=torch.float32)


def _check_structure(t: Tree, ids=None):
    n = t.num_nodes
    parents, depths, ranks, tokens = (x.tolist() for x in (t.parents, t.depths, t.ranks, t.tokens))
    assert parents[0] == -1 and depths[0] == 0 and ranks[0] == 0
    for i in range(1, n):
        assert 0 <= parents[i] < i  # parents precede children
        assert depths[i] == depths[parents[i]] + 1
        if ids is not None:
            assert tokens[i] == int(ids[depths[i] - 1, ranks[i]])
    assert t.ancestor_mask.dtype == torch.bool and t.ancestor_mask.shape == (n, n)
    expect = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        expect[i, t.path_to(i)] = True
    assert torch.equal(t.ancestor_mask, expect)
    assert torch.equal(ancestor_mask_from_parents(t.parents), expect)
    # each node is a distinct rank prefix
    prefixes = [tuple(ranks[j] for j in t.path_to(i)[1:]) for i in range(n)]
    assert len(set(prefixes)) == n


def _score(t: Tree, lp, i):
    ranks, depths = t.ranks.tolist(), t.depths.tolist()
    return sum(float(lp[depths[j] - 1, ranks[j]]) for j in t.path_to(i)[1:])


def test_docstring_example():
    lp = _lp([[-0.1, -0.9], [-0.2, -0.7], [-0.3, -2.0]])
    ids = _ids(3, 2)
    t = build_tree(7, lp, ids, 5)
    assert t.tokens.tolist() == [7, 100, 200, 300, 201, 101]
    assert t.parents.tolist() == [-1, 0, 1, 2, 1, 0]
    assert t.depths.tolist() == [0, 1, 2, 3, 2, 1]
    assert t.ranks.tolist() == [0, 0, 0, 0, 1, 1]
    for x in (t.tokens, t.parents, t.depths, t.ranks):
        assert x.dtype == torch.int64
    _check_structure(t, ids)


def test_known_tree_d3_k2():
    # scores: a=-0.5 b=-1.0 | aa=-0.6 ab=-1.5 ba=-1.1 | aaa=-1.6 aab=-3.6 ...
    lp = _lp([[-0.5, -1.0], [-0.1, -1.0], [-1.0, -3.0]])
    ids = _ids(3, 2)
    t = build_tree(1, lp, ids, 4)  # a, aa, b, ba
    assert t.tokens.tolist() == [1, 100, 200, 101, 200]
    assert t.parents.tolist() == [-1, 0, 1, 0, 3]
    assert t.depths.tolist() == [0, 1, 2, 1, 2]
    assert t.ranks.tolist() == [0, 0, 0, 1, 0]
    _check_structure(t, ids)


def test_chain_when_peaked():
    lp = _lp([[-0.01, -5.0]] * 3)
    t = build_tree(0, lp, _ids(3, 2), 3)
    assert t.parents.tolist() == [-1, 0, 1, 2]
    assert t.ranks.tolist() == [0, 0, 0, 0]
    assert t.tokens.tolist() == [0, 100, 200, 300]


def test_star_when_depth1_flat_and_deeper_uncertain():
    K = 4
    flat = [math.log(1 / K)] * K  # every depth-1 token -1.39
    lp = _lp([flat, [-2.0, -2.5, -3.0, -3.5]])  # any depth-2 node <= -3.39
    t = build_tree(0, lp, _ids(2, K), K)
    assert t.parents.tolist() == [-1] + [0] * K
    assert t.ranks.tolist() == [0, 0, 1, 2, 3]
    assert t.depths.tolist() == [0] + [1] * K
    assert torch.equal(t.ancestor_mask[1:, 1:], torch.eye(K, dtype=torch.bool))


def test_budget_one_and_zero():
    lp = _lp([[-0.3, -1.0], [-0.2, -2.0]])
    t = build_tree(9, lp, _ids(2, 2), 1)
    assert t.num_nodes == 2 and t.tokens.tolist() == [9, 100] and t.parents.tolist() == [-1, 0]
    t0 = build_tree(9, lp, _ids(2, 2), 0)
    assert t0.num_nodes == 1 and t0.ancestor_mask.tolist() == [[True]]


def test_fewer_nodes_when_prefixes_run_out():
    lp = _lp([[-0.1, -0.2], [-0.3, -0.4]])
    t = build_tree(0, lp, _ids(2, 2), 100)
    assert t.num_nodes == 1 + 2 + 4
    _check_structure(t, _ids(2, 2))


def test_numpy_and_torch_inputs_agree():
    rng = np.random.default_rng(0)
    lp = -np.sort(rng.exponential(size=(5, 6)), axis=1)  # sorted descending
    ids = rng.integers(0, 1000, size=(5, 6))
    a = build_tree(3, lp, ids, 12)
    b = build_tree(3, torch.from_numpy(lp), torch.from_numpy(ids), 12)
    for x, y in zip(
        (a.tokens, a.parents, a.depths, a.ranks, a.ancestor_mask),
        (b.tokens, b.parents, b.depths, b.ranks, b.ancestor_mask),
    ):
        assert torch.equal(x, y)
    c = a.to("cpu")
    assert isinstance(c, Tree) and torch.equal(c.ancestor_mask, a.ancestor_mask)


@pytest.mark.parametrize("seed", range(60))
def test_matches_brute_force(seed):
    rnd = random.Random(seed)
    D, K = rnd.randint(1, 4), rnd.randint(1, 4)
    # round to a coarse grid so ties happen often
    lp = np.array([sorted((-round(rnd.uniform(0, 3), 1) for _ in range(K)), reverse=True) for _ in range(D)])
    ids = _ids(D, K)
    total = sum(K**d for d in range(1, D + 1))
    budget = rnd.randint(1, total + 2)
    t = build_tree(0, lp, ids, budget)
    _check_structure(t, ids)
    assert t.num_nodes == 1 + min(budget, total)
    brute = sorted(
        (sum(lp[i, r] for i, r in enumerate(pref)) for d in range(1, D + 1) for pref in itertools.product(range(K), repeat=d)),
        reverse=True,
    )[:budget]
    got = sorted((_score(t, lp, i) for i in range(1, t.num_nodes)), reverse=True)
    np.testing.assert_allclose(got, brute, atol=1e-9)
    # pop order is best-first: scores non-increasing along node order
    order = [_score(t, lp, i) for i in range(1, t.num_nodes)]
    assert all(a >= b - 1e-9 for a, b in zip(order, order[1:]))


def test_top1_first_forces_chain():
    # best-first with budget 3 picks a, b, aa (-0.5, -0.6, -2.5) and skips the depth-3 chain node
    lp = _lp([[-0.5, -0.6], [-2.0, -2.1], [-0.1, -3.0]])
    ids = _ids(3, 2)
    plain = build_tree(0, lp, ids, 3)
    assert plain.depths.max().item() == 2
    t = build_tree(0, lp, ids, 3, top1_first=True)
    assert t.num_nodes == 4
    assert t.parents.tolist() == [-1, 0, 1, 2] and t.ranks.tolist() == [0, 0, 0, 0]
    # with more budget: chain first, then best-first fill, no duplicates
    t = build_tree(0, lp, ids, 6, top1_first=True)
    assert t.num_nodes == 7
    assert t.tokens.tolist()[:4] == [0, 100, 200, 300]
    assert t.tokens.tolist()[4] == 101  # next best: b (-0.6)
    _check_structure(t, ids)


@pytest.mark.parametrize("seed", range(20))
def test_top1_first_random(seed):
    rnd = random.Random(100 + seed)
    D, K = rnd.randint(1, 4), rnd.randint(1, 4)
    lp = np.array([sorted((-rnd.uniform(0, 3) for _ in range(K)), reverse=True) for _ in range(D)])
    ids = _ids(D, K)
    total = sum(K**d for d in range(1, D + 1))
    budget = rnd.randint(1, total + 2)
    t = build_tree(0, lp, ids, budget, top1_first=True)
    _check_structure(t, ids)
    assert t.num_nodes == 1 + min(budget, total)
    c = min(D, budget)
    assert t.parents.tolist()[: c + 1] == list(range(-1, c)) and t.ranks.tolist()[: c + 1] == [0] * (c + 1)


def test_chain_tree():
    t = Tree.chain(torch.tensor([5, 6, 7, 8]))
    assert t.num_nodes == 4
    assert t.parents.tolist() == [-1, 0, 1, 2] and t.depths.tolist() == [0, 1, 2, 3]
    assert t.ranks.tolist() == [0] * 4
    assert torch.equal(t.ancestor_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert torch.equal(ancestor_mask_from_parents(t.parents), t.ancestor_mask)
    assert t.path_to(3) == [0, 1, 2, 3] and t.path_to(0) == [0]


def test_device_tree_builder_equals_best_first_heap():
    """build_tree_device (fixed shapes, no host sync) equals build_tree's heap wherever scores
    do not tie: random depths, top-k widths and budgets, including beams narrower than the budget."""
    from ddtree.ops.tree import build_tree_device, device_tree_fits

    g = torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(150):
        D, K, B = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 16), (1, 40), (1, 70)))
        if not device_tree_fits(D, K, B):
            continue
        lp, ids = torch.log_softmax(torch.randn(D, 300, generator=g) * 3, -1).topk(K, -1)
        ref = build_tree(7, lp, ids, B)
        tokens, depths, parents, ranks, mask, depth = build_tree_device(torch.tensor(7), lp, ids, B)
        assert ref.num_nodes == B + 1
        for got, want in ((tokens, ref.tokens), (depths, ref.depths), (parents, ref.parents), (ranks, ref.ranks),
                          (mask, ref.ancestor_mask)):
            assert torch.equal(got, want), (D, K, B)
        assert int(depth) == int(ref.depths.max())
        checked += 1
    assert checked > 100


def test_device_tree_fits():
    from ddtree.ops.tree import device_tree_fits

    assert device_tree_fits(15, 32, 32) and device_tree_fits(2, 6, 42) and not device_tree_fits(2, 6, 43)
    assert not device_tree_fits(1, 4, 5) and device_tree_fits(1, 4, 4)


@pytest.mark.parametrize("seed", range(20))
def test_ties_go_to_the_smaller_rank_prefix(seed):
    """On tied scores (a dyadic grid: exact sums) the heap pops in the DDTree authors' order,
    (-score, rank prefix), and build_tree_device builds the same tree node for node."""
    from ddtree.ops.tree import build_tree_device, device_tree_fits

    rnd = random.Random(200 + seed)
    D, K = rnd.randint(1, 4), rnd.randint(1, 5)
    lp = np.array([sorted((-0.5 * rnd.randint(0, 4) for _ in range(K)), reverse=True) for _ in range(D)],
                  dtype=np.float32)
    ids = _ids(D, K)
    total = sum(K**d for d in range(1, D + 1))
    budget = rnd.randint(1, min(total, 40))
    order = sorted((-sum(float(lp[i, r]) for i, r in enumerate(pre)), pre)
                   for d in range(1, D + 1) for pre in itertools.product(range(min(K, budget)), repeat=d))
    t = build_tree(0, lp, ids, budget)
    got = [tuple(int(t.ranks[j]) for j in t.path_to(i)[1:]) for i in range(1, t.num_nodes)]
    assert got == [pre for _, pre in order[:budget]]
    if device_tree_fits(D, K, budget):
        out = build_tree_device(torch.tensor(0), torch.from_numpy(lp), ids, budget)
        for a, b in zip(out, (t.tokens, t.depths, t.parents, t.ranks, t.ancestor_mask)):
            assert torch.equal(a, b)

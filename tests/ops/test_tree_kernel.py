"""The one-kernel device tree builder (ddtree.ops.tree_kernel) against its twins: build_tree's heap and
the torch build_tree_device. Compiled on a GPU; without one under Triton's interpreter on CPU."""

from __future__ import annotations

import itertools

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed (pip install triton): its interpreter runs these on CPU")

from ddtree.ops.tree import ancestor_mask_from_parents, build_tree, build_tree_device, device_tree_fits  # noqa: E402
from ddtree.decode.budget import expected_accepts  # noqa: E402
from ddtree.ops.tree_kernel import build_tree_kernel, pruned_pairs, tree_summary  # noqa: E402
from helpers import kernel_device  # noqa: E402

DEV = kernel_device()


def _configs(n: int, seed: int, real: bool = True):
    """Real shapes, then random ones. On a GPU each shape is a compile (the sizes are constexpr):
    fewer there; the interpreter on CPU takes them all."""
    if DEV.type == "cuda":  # the same few shapes in every test, so each compiles once
        n, seed = min(n, 10), 11
    g = torch.Generator().manual_seed(seed)
    out = [(15, 32, 32), (15, 64, 64), (15, 16, 16), (15, 8, 8), (1, 4, 4), (2, 6, 42)] if real else []
    while len(out) < n:
        D, K, B = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 16), (1, 40), (1, 70)))
        if device_tree_fits(D, K, B):
            out.append((D, K, B))
    return out


def _kernel_tree(lp, ids, B, root=7):
    t = build_tree_kernel(torch.tensor(root, device=DEV), lp.to(DEV), ids.to(DEV), B)
    return [x.cpu() for x in t]


@pytest.mark.slow
def test_kernel_equals_heap_without_ties():
    """Random depths, top-k widths and budgets (beams narrower than the budget included) and the
    real shapes (15 positions, K = budget = 8..64): every output equals the heap's tree."""
    g = torch.Generator().manual_seed(1)
    shallow = 0
    for c, (D, K, B) in enumerate(_configs(60, 11)):
        # flat and peaked drafts alike: flat ones leave the deep depths empty (the kernel's early out)
        scale = (0.3, 3.0, 8.0)[c % 3]
        lp, ids = torch.log_softmax(torch.randn(D, 300, generator=g) * scale, -1).topk(K, -1)
        ref = build_tree(7, lp, ids, B)
        shallow += int(ref.depths.max()) < D - 1
        tokens, depths, parents, ranks, mask, depth = _kernel_tree(lp, ids, B)
        for name, got, want in (("tokens", tokens, ref.tokens), ("depths", depths, ref.depths),
                                ("parents", parents, ref.parents), ("ranks", ranks, ref.ranks),
                                ("mask", mask, ref.ancestor_mask)):
            assert torch.equal(got, want), (name, D, K, B)
        assert int(depth) == int(ref.depths.max())
    assert shallow >= 10  # the early out was exercised


@pytest.mark.slow
def test_kernel_with_ties_builds_a_best_first_tree():
    """Log-probs on a coarse grid (many exact ties, including zeros): a valid best-first tree
    (parents first, distinct prefixes, tokens / ranks / depths / mask consistent, the same multiset
    of node scores as the heap and the torch device builder: the best B prefixes), and since ties go
    to the smaller rank prefix in every builder, the heap's and the torch builder's tree node for node."""
    g = torch.Generator().manual_seed(2)
    for D, K, B in _configs(40, 12):
        lp = -(torch.randint(0, 4, (D, K), generator=g).float() * 0.5).sort(-1).values  # descending, tied
        ids = torch.randint(0, 1000, (D, K), generator=g)
        tokens, depths, parents, ranks, mask, depth = _kernel_tree(lp, ids, B)
        assert parents[0] == -1 and depths[0] == 0 and tokens[0] == 7
        assert all(0 <= parents[n] < n for n in range(1, B + 1)), (D, K, B)
        assert torch.equal(depths[1:], depths[parents[1:]] + 1)
        assert torch.equal(mask, ancestor_mask_from_parents(parents))
        assert torch.equal(tokens[1:], ids[depths[1:] - 1, ranks[1:]])
        prefixes, score = {0: ()}, {0: 0.0}
        for n in range(1, B + 1):
            prefixes[n] = prefixes[int(parents[n])] + (int(ranks[n]),)
            score[n] = score[int(parents[n])] + float(lp[depths[n] - 1, ranks[n]])
        assert len(set(prefixes.values())) == B + 1
        assert all(score[n] >= score[n + 1] for n in range(1, B)), "nodes in best-first order"
        assert int(depth) == int(depths.max())
        heap = build_tree(7, lp, ids, B)
        t_dev = build_tree_device(torch.tensor(7), lp, ids, B)
        dev = _path_scores(t_dev[2], t_dev[1], t_dev[3], lp)
        assert sorted(score.values()) == sorted(_path_scores(heap.parents, heap.depths, heap.ranks, lp).values()) \
            == sorted(dev.values()), (D, K, B)
        for got, want, twin in zip((tokens, depths, parents, ranks, mask),
                                   (heap.tokens, heap.depths, heap.parents, heap.ranks, heap.ancestor_mask), t_dev):
            assert torch.equal(got, want) and torch.equal(twin, want), (D, K, B)


def _published_prefixes(lp, B):
    """The DDTree authors' build_ddtree_tree pop order, written out: every rank prefix (ranks below
    min(K, B)) sorted by (-score, prefix), the first B. Scores on a dyadic grid, so sums are exact."""
    D, K = lp.shape
    K = min(K, B)
    every = [(-sum(float(lp[i, r]) for i, r in enumerate(pre)), pre)
             for d in range(1, D + 1) for pre in itertools.product(range(K), repeat=d)]
    return [pre for _, pre in sorted(every)[:B]]


def _prefixes(parents, ranks):
    out = {0: ()}
    for n in range(1, parents.shape[0]):
        out[n] = out[int(parents[n])] + (int(ranks[n]),)
    return [out[n] for n in range(1, parents.shape[0])]


def test_every_builder_breaks_ties_as_the_published_heap():
    """Hand-made tied scores: the heap, the torch device builder and the kernel build the same tree,
    node for node, and it is the published heap's (on a tie the smaller rank prefix, so here the
    deeper node (0, 0) comes before its tied uncle (1,))."""
    lp = torch.tensor([[-0.5, -1.0], [-0.5, -2.0]])  # (0,) -0.5; (0, 0) and (1,) both -1.0
    ids = torch.tensor([[10, 11], [20, 21]])
    cases = [(lp, ids, B) for B in (2, 3)]
    g = torch.Generator().manual_seed(5)
    for D, K, B in [(2, 3, 5), (3, 3, 9), (4, 2, 12), (3, 4, 20), (5, 2, 16), (2, 6, 30), (1, 4, 4)] * 3:
        tied = -(torch.randint(0, 4, (D, K), generator=g).float() * 0.5).sort(-1).values  # descending, tied
        cases.append((tied, torch.randint(0, 1000, (D, K), generator=g), B))
    for lp, ids, B in cases:
        want = _published_prefixes(lp, B)
        heap = build_tree(7, lp, ids, B)
        assert _prefixes(heap.parents, heap.ranks) == want, (lp, B)
        ref = (heap.tokens, heap.depths, heap.parents, heap.ranks, heap.ancestor_mask)
        for name, got in (("torch", build_tree_device(torch.tensor(7), lp, ids, B)), ("kernel", _kernel_tree(lp, ids, B))):
            for field, a, b in zip(("tokens", "depths", "parents", "ranks", "mask"), got, ref):
                assert torch.equal(a, b), (name, field, lp, B)
    assert build_tree(7, *cases[0][:2], 2).depths.tolist() == [0, 1, 2]


def _path_scores(parents, depths, ranks, lp):
    s = {0: 0.0}
    for n in range(1, parents.shape[0]):
        s[n] = s[int(parents[n])] + float(lp[depths[n] - 1, ranks[n]])
    return s


def test_kernel_writes_into_given_buffers():
    """The decoder passes its slot's rows (strided views of one [3, T] buffer) and mask: written in
    place, nothing else touched."""
    D, K, B = 15, 32, 32
    g = torch.Generator().manual_seed(3)
    lp, ids = torch.log_softmax(torch.randn(D, 300, generator=g) * 3, -1).topk(K, -1)
    ints = torch.full((3, B + 1), -5, dtype=torch.long, device=DEV)
    ranks = torch.full((B + 1,), -5, dtype=torch.long, device=DEV)
    mask = torch.ones(B + 1, B + 1, dtype=torch.bool, device=DEV)
    depth = torch.zeros(1, dtype=torch.long, device=DEV)
    build_tree_kernel(torch.tensor(7, device=DEV), lp.to(DEV), ids.to(DEV), B,
                      out=(ints[0], ints[1], ints[2], ranks, mask, depth))
    ref = build_tree(7, lp, ids, B)
    assert torch.equal(ints.cpu(), torch.stack([ref.tokens, ref.depths, ref.parents]))
    assert torch.equal(ranks.cpu(), ref.ranks) and torch.equal(mask.cpu(), ref.ancestor_mask)
    assert int(depth) == int(ref.depths.max())


def test_pruned_pairs_bound():
    """The per-depth candidate count the kernel sizes its buffers by: pairs with (i+1)(j+1) <= B."""
    assert pruned_pairs(1, 1) == 1 and pruned_pairs(4, 4) == 4 + 2 + 1 + 1
    for B in (8, 32, 64):
        brute = sum(1 for i in range(B) for j in range(B) if (i + 1) * (j + 1) <= B)
        assert pruned_pairs(B, B) == brute


def test_kernel_summary_equals_its_twin_and_the_heap():
    """--budget auto's per-prefix summary computed inside the kernel (E_q of the best-first tree of
    b nodes and its depth, b = 1..B) against tree_summary on the heap's tree and expected_accepts."""
    g = torch.Generator().manual_seed(4)
    for D, K, B in _configs(12, 13):
        lp, ids = torch.log_softmax(torch.randn(D, 300, generator=g) * 3, -1).topk(K, -1)
        ref = build_tree(7, lp, ids, B)
        eq, dcum = torch.empty(B, device=DEV), torch.empty(B, dtype=torch.long, device=DEV)
        build_tree_kernel(torch.tensor(7, device=DEV), lp.to(DEV), ids.to(DEV), B, summary=(eq, dcum))
        want_eq, want_d = tree_summary(lp, ref.depths, ref.ranks, ref.ancestor_mask)
        torch.testing.assert_close(eq.cpu(), want_eq, rtol=1e-5, atol=1e-6)
        assert torch.equal(dcum.cpu(), want_d), (D, K, B)
        ea = expected_accepts(ref.scores, range(1, B + 1))
        torch.testing.assert_close(want_eq, torch.tensor([ea[b] for b in range(1, B + 1)]), rtol=1e-5, atol=1e-6)
        assert torch.equal(want_d, torch.cummax(ref.depths, 0).values[1:])


def test_decoder_falls_back_to_torch_when_the_kernel_fails(monkeypatch):
    """A kernel that cannot compile here (an old Triton, an unknown GPU) must not break decoding:
    the first failure is logged and trees are built with the torch twin from then on."""
    from ddtree.decode import decoder as decoding
    from ddtree.decode.random_pair import build_random_pair
    from ddtree.options import Options

    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("no kernel for this GPU")

    monkeypatch.setattr(decoding, "build_tree_kernel", broken)  # a tree kernel that cannot run here
    import dataclasses

    # the decoder's tree build takes the kernel path; the model's layers stay on their torch twins
    # (this test is about the tree kernel, and the interpreter is slow)
    dec, _ = build_random_pair("hybrid", seed=3, options=Options(triton=False))
    dec.kernels = dataclasses.replace(dec.kernels, triton=True)
    prompt = list(range(3, 20))
    got = dec.generate(prompt, "ddtree", budget=8, max_new_tokens=20).token_ids
    assert calls == [1] and dec.tree_kernel_ok is False
    monkeypatch.undo()
    assert got == dec.generate(prompt, "ar", max_new_tokens=20).token_ids


def test_walk_kernel_equals_walk():
    """The one-kernel walk against its torch twin (ddtree.ops.walk.walk) on built trees (chains and one-node trees
    included) with choices steered into the tree: path, accepted count and bonus, every P."""
    from ddtree.ops.tree import Tree
    from ddtree.ops.walk import walk, walk_kernel

    g = torch.Generator().manual_seed(4)
    trees = [Tree.chain(torch.tensor([5])), Tree.chain(torch.arange(3, 19))]
    for D, B in ((15, 32), (15, 64), (4, 9), (15, 16)):
        lp, ids = torch.log_softmax(torch.randn(D, 50, generator=g) * 2, -1).topk(min(B, 50), -1)
        trees.append(build_tree(3, lp, ids, B))
    deep = 0
    for tree in trees:
        T = tree.num_nodes
        kids: dict[int, list[int]] = {}
        for i in range(1, T):
            kids.setdefault(int(tree.parents[i]), []).append(int(tree.tokens[i]))
        t = [x.to(DEV).contiguous() for x in (tree.tokens, tree.parents, tree.depths, tree.ancestor_mask)]
        ranks = torch.randint(0, 64, (T,), generator=g).to(DEV)
        for trial in range(12):
            choice = torch.randint(0, 50, (T,), generator=g)
            for i in range(T):  # steer often into the tree
                if i in kids and torch.rand(1, generator=g) < 0.85:
                    choice[i] = kids[i][int(torch.randint(0, len(kids[i]), (1,), generator=g))]
            choice = choice.to(DEV)
            P = int(tree.depths.max()) + 1 + trial % 3  # the path buffer may be longer than the tree
            last, n, path = walk(*t[:3], t[3], choice, P)
            out = (torch.full((P,), -7, dtype=torch.long, device=DEV), torch.zeros((), dtype=torch.long, device=DEV),
                   torch.zeros((), dtype=torch.long, device=DEV))
            walk_kernel(*t[:3], t[3], choice, P, out)
            assert out[0].tolist() == path.tolist() and int(out[1]) == int(n), (T, P)
            assert int(out[2]) == int(choice[last])
            # with the host's header: [n, bonus, tokens[path], ranks[path]], zero-padded to PK >= P
            PK = P + trial % 2 * 3
            pack = torch.full((2 + 2 * PK,), -5.0, device=DEV)
            walk_kernel(*t[:3], t[3], choice, P, out, ranks=ranks, pack=pack)
            pad = torch.zeros(PK - P, device=DEV)
            want = torch.cat([n.view(1).float(), choice[last].view(1).float(), t[0][path].float(), pad,
                              ranks[path].float(), pad])
            assert torch.equal(pack, want), (T, P, PK)
            deep += int(n) > 2
    assert deep > 10  # the walks went deep, not just the root

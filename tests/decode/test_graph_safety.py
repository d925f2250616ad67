"""What CUDA-graph capture needs from a round, checked on CPU.

Capturing a graph first runs its function once eagerly (warm-up), restores the state from
`GraphRunner.snapshot` (over `ddtree.decode.graphs.mutable_state`), and then replays the graph: every piece of a round must therefore give the
same result when run twice around a snapshot/restore. The K/V commit is not idempotent by
itself (it reads slots its own first run overwrote), so the snapshot must cover them.
"""

import torch

from ddtree.decode.budget import Chain, Plan
from ddtree.decode.decoder import Decoder
from ddtree.decode.graphs import HostCommitKey, HostDraftKey, StepKey, VerifyKey, bucket
from ddtree.decode.reference import host_draft
from ddtree.decode.round import Pipeline
from ddtree.decode.sampling import SamplingParams
from ddtree.decode.random_pair import build_random_pair
from ddtree.ops.tree import Tree, ancestor_mask_from_parents


def _state(dec: Decoder, upto: int):
    t = dec.target
    out = [dec.start_d.clone()]
    for g in t.gdn_groups.values():
        out += [g.state.clone(), g.conv.clone()]
    for kc, vc in t.kv_stacks.values():
        out += [kc[:, :upto].clone(), vc[:, :upto].clone()]
    return out


def test_round_pieces_repeat_exactly_around_snapshot_restore():
    torch.manual_seed(0)
    dec, _ = build_random_pair("hybrid", seed=4)
    dec.generate([3, 4, 5, 6, 7, 8], "ar", max_new_tokens=2)  # a committed prefix
    start = int(dec.start_d)
    # accepted path [0, 3, 6] padded to [0, 3, 6, 6]: the move into slot 3 overwrites node 3's
    # K/V, which a second run of the commit would then read for slot 1
    parents = [-1, 0, 1, 0, 2, 4, 3]
    par = torch.tensor(parents)
    depths = torch.tensor([0, 1, 2, 1, 2, 3, 2])
    tree = Tree(torch.tensor([9, 10, 11, 12, 13, 14, 15]), par, depths, torch.zeros(7, dtype=torch.long),
                ancestor_mask_from_parents(par))
    slot = dec.slot(7)
    slot.load(tree)
    kv = bucket(start + 7, dec.bucket)
    dec._verify(slot, VerifyKey(7, kv, True, True))
    slot.choice.copy_(torch.tensor([12, 0, 0, 15, 0, 0, 0]))  # root picks 12 (node 3), node 3 picks 15 (node 6)
    P = 4
    once = dec.walk(slot, P)
    assert once[0].tolist() == [0, 3, 6, 6] and int(once[1]) == 3
    dec.commit(*once[:2])
    ref = _state(dec, start + 8)
    # reference done; now redo from scratch: verify, snapshot, commit, restore, commit
    dec2, _ = build_random_pair("hybrid", seed=4)
    dec2.generate([3, 4, 5, 6, 7, 8], "ar", max_new_tokens=2)
    slot2 = dec2.slot(7)
    slot2.load(tree)
    dec2._verify(slot2, VerifyKey(7, kv, True, True))
    slot2.choice.copy_(torch.tensor([12, 0, 0, 15, 0, 0, 0]))
    path, n, _ = dec2.walk(slot2, P)
    snap = dec2.graphs.snapshot()
    dec2.commit(path, n)
    dec2.graphs.restore(snap)
    dec2.commit(path, n)
    for a, b in zip(ref, _state(dec2, start + 8)):
        assert torch.equal(a, b)


def test_draft_piece_repeats_exactly():
    dec, _ = build_random_pair("dense", seed=6)
    dec.generate([3, 4, 5], "ar", max_new_tokens=2)
    start = int(dec.start_d)
    tree = Tree.chain(torch.tensor([7, 8, 9]))
    slot = dec.slot(3)
    slot.load(tree)
    kv = bucket(start + 3, dec.bucket)
    _, taps = dec._verify(slot, VerifyKey(3, kv, True, True))
    snap = dec.graphs.snapshot()
    sp = SamplingParams()
    a = host_draft(dec, slot, taps, dec.block_size, kv, 4, sp).clone()
    dec.graphs.restore(snap)
    b = host_draft(dec, slot, taps, dec.block_size, kv, 4, sp)
    assert torch.equal(a, b)


def test_commit_uses_its_own_verify_step_under_replay_order():
    """Under graphs a verify replay runs no Python, so when a commit is captured the GDN groups'
    `step` may still describe another verify (--budget auto captures every tree size up front).
    Replayed in that order on CPU, the commit must still equal verify-then-commit of its own tree."""
    dec, _ = build_random_pair("hybrid", seed=4)
    dec.generate([3, 4, 5, 6, 7, 8], "ar", max_new_tokens=2)
    start = int(dec.start_d)
    par = torch.tensor([-1, 0, 1, 0, 2, 4, 3, 1, 7])
    tree_a = Tree(torch.arange(20, 29), par, torch.tensor([0, 1, 2, 1, 3, 4, 2, 2, 3]), torch.zeros(9, dtype=torch.long),
                  ancestor_mask_from_parents(par))
    tree_b = Tree.chain(torch.tensor([30, 31, 32, 33, 34]))
    slot_a, slot_b = dec.slot(9), dec.slot(5)
    slot_a.load(tree_a)
    slot_b.load(tree_b)
    kv = bucket(start + 9, dec.bucket)
    key_a, key_b = VerifyKey(9, kv, True, False), VerifyKey(5, kv, True, False)
    P = dec.block_size
    run, commit_key = dec.graphs.run, HostCommitKey(key_a, P)

    def choose_a():  # root -> node 1 -> node 7 -> node 8: a path that is not a prefix of node order
        slot_a.choice.copy_(torch.tensor([21, 27, 0, 0, 0, 0, 0, 28, 0]))

    snap = dec.graphs.snapshot()
    run(key_a, lambda: dec._verify(slot_a, key_a))
    choose_a()
    path, n, _ = dec.walk(slot_a, P)
    assert path[:4].tolist() == [0, 1, 7, 8] and int(n) == 4
    run(commit_key, lambda: dec.commit(path, n))
    ref = _state(dec, start + 10)
    dec.graphs.restore(snap)
    run(key_a, lambda: dec._verify(slot_a, key_a))  # "capture" of a
    run(key_b, lambda: dec._verify(slot_b, key_b))  # "capture" of b: the last Python verify
    groups = dec.target.gdn_groups.values()
    step_b = [g.step for g in groups]
    dec._verify(slot_a, key_a)  # a "replay" of a: same kernels, no Python bookkeeping ...
    for g, st in zip(groups, step_b):
        g.step = st  # ... so the groups still hold b's step
    choose_a()
    dec.walk(slot_a, P)
    run(commit_key, lambda: dec.commit(path, n))
    for a, b in zip(ref, _state(dec, start + 10)):
        assert torch.equal(a, b)


def test_graphs_that_commit_inside_use_their_own_verify_step():
    """The pipeline's step (walk + commit + drafter + next tree) and the host loop's ar piece
    (walk + commit) commit inside. Captured while their verify only replays (a new context
    bucket for the drafter, new sampling settings), the groups' `step` still describes the last
    forward run in Python (typically the prefill's last chunk); they must commit with their own
    verify's step."""
    from ddtree.decode.sampling import SamplingParams

    sp = SamplingParams()
    for kind in ("ahead", "draft"):
        dec, _ = build_random_pair("hybrid", seed=4)
        dec.generate([3, 4, 5, 6, 7, 8], "ar", max_new_tokens=2)
        start = int(dec.start_d)
        if kind == "ahead":  # a 9-node tree, path 0 -> 1 -> 7 -> 8
            par = torch.tensor([-1, 0, 1, 0, 2, 4, 3, 1, 7])
            tree_a = Tree(torch.arange(20, 29), par, torch.tensor([0, 1, 2, 1, 3, 4, 2, 2, 3]),
                          torch.zeros(9, dtype=torch.long), ancestor_mask_from_parents(par))
            choice = torch.tensor([21, 27, 0, 0, 0, 0, 0, 28, 0])
        else:  # an ar step
            tree_a, choice = Tree.chain(torch.tensor([21])), torch.tensor([40])
        T = tree_a.num_nodes
        slot_a = dec.slot(T)
        kv = bucket(start + 9, dec.bucket)
        taps_on = kind == "ahead"
        key_a = VerifyKey(T, kv, True, taps_on)
        P = dec.block_size if taps_on else 1
        pipe = Pipeline(dec, Chain(dec.block_size, 8, 8), sp, None, None)
        plan = Plan(slot=slot_a, into=slot_a, build=8, walk=P, k=8)
        piece_key = StepKey(key_a, P, P, kv, 8, None, 8, T, 0, "path") if kind == "ahead" else \
            HostDraftKey(key_a, P, kv, 1, None)

        def piece(taps):
            if kind == "ahead":
                return pipe.step(plan, taps, kv)
            return host_draft(dec, slot_a, None, P, kv, 1, sp)

        def run_a():
            slot_a.load(tree_a)
            _, taps = dec.graphs.run(key_a, lambda: dec._verify(slot_a, key_a))
            slot_a.choice.copy_(choice)
            return taps

        snap = dec.graphs.snapshot()
        piece(run_a())
        upto = int(dec.start_d)  # the committed length: K/V past it is scratch
        ref = _state(dec, upto)
        dec.graphs.restore(snap)
        run_a()  # "capture" of a's verify
        n = 5  # then another forward (a 5-node chain, not committed): the last forward in Python
        pos = start + torch.arange(n)
        dec.target.forward(torch.arange(50, 55), pos, torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n) - 1,
                           torch.tensor(start), kv)
        step_chain = [g.step for g in dec.target.gdn_groups.values()]
        taps = run_a()  # a "replay" of a's verify: no Python bookkeeping ...
        for g, st in zip(dec.target.gdn_groups.values(), step_chain):
            g.step = st  # ... so the groups still hold the chunk's step
        dec.graphs.run(piece_key, lambda: piece(taps))
        for x, y in zip(ref, _state(dec, upto)):
            assert torch.equal(x, y), kind

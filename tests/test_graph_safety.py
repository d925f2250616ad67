"""What CUDA-graph capture needs from a round, checked on CPU.

Capturing a graph first runs its function once eagerly (warm-up), restores the state from
`Decoder._snapshot`, and then replays the graph: every piece of a round must therefore give the
same result when run twice around a snapshot/restore. The K/V commit is not idempotent by
itself (it reads slots its own first run overwrote), so the snapshot must cover them.
"""

import torch

from ddtree.decoding import Decoder, _bucket
from ddtree.sampling import SamplingParams
from ddtree.testing import build_random_pair
from ddtree.tree import Tree, ancestor_mask_from_parents


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
    slot = dec._slot(7)
    slot.load(tree)
    kv = _bucket(start + 7, dec.bucket)
    dec._verify(slot, kv, True, True)
    slot.choice.copy_(torch.tensor([12, 0, 0, 15, 0, 0, 0]))  # root picks 12 (node 3), node 3 picks 15 (node 6)
    P = 4
    once = dec._commit(slot, P)
    assert once[0].tolist() == [0, 3, 6, 6] and int(once[1]) == 3
    ref = _state(dec, start + 8)
    # reference done; now redo from scratch: verify, snapshot, commit, restore, commit
    dec2, _ = build_random_pair("hybrid", seed=4)
    dec2.generate([3, 4, 5, 6, 7, 8], "ar", max_new_tokens=2)
    slot2 = dec2._slot(7)
    slot2.load(tree)
    dec2._verify(slot2, kv, True, True)
    slot2.choice.copy_(torch.tensor([12, 0, 0, 15, 0, 0, 0]))
    snap = dec2._snapshot()
    dec2._commit(slot2, P)
    dec2._restore(snap)
    dec2._commit(slot2, P)
    for a, b in zip(ref, _state(dec2, start + 8)):
        assert torch.equal(a, b)


def test_draft_piece_repeats_exactly():
    dec, _ = build_random_pair("dense", seed=6)
    dec.generate([3, 4, 5], "ar", max_new_tokens=2)
    start = int(dec.start_d)
    tree = Tree.chain(torch.tensor([7, 8, 9]))
    slot = dec._slot(3)
    slot.load(tree)
    kv = _bucket(start + 3, dec.bucket)
    _, taps = dec._verify(slot, kv, True, True)
    committed = dec._commit(slot, dec.block_size)
    snap = dec._snapshot()
    sp = SamplingParams()
    a = dec._draft(committed, taps, kv, 4, sp).clone()
    dec._restore(snap)
    b = dec._draft(committed, taps, kv, 4, sp)
    assert torch.equal(a, b)

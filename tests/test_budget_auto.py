"""--budget auto: the chooser's rule, and exactness of decoding with it."""

import math

import pytest
import torch

from ddtree.decoding import AUTO_BUDGETS, BudgetChooser
from ddtree.testing import build_random_pair


def _scores(probs):
    """Best-first path log-probabilities for per-node acceptance probabilities (root first)."""
    return [0.0] + [math.log(p) for p in probs]


def test_flat_cost_picks_the_largest_tree():
    ch = BudgetChooser({b: 10.0 for b in AUTO_BUDGETS})
    b, pred = ch.pick(_scores([0.5] * 128))
    assert b == max(AUTO_BUDGETS) and math.isclose(pred, 0.5 * max(AUTO_BUDGETS))


def test_steep_cost_picks_a_small_tree():
    # verify cost grows fast; nodes past the first few are nearly worthless
    ch = BudgetChooser({b: 10.0 + 2.0 * b for b in AUTO_BUDGETS})
    b, _ = ch.pick(_scores([0.9, 0.8, 0.7, 0.6] + [1e-4] * 60))
    assert b == 4


def test_acceptance_ratio_and_fixed_cost_are_learnt():
    ch = BudgetChooser({4: 10.0, 64: 14.0})
    scores = _scores([0.6] * 4 + [0.3] * 60)  # E_q(4) = 2.4, E_q(64) = 20.4
    assert ch.pick(scores)[0] == 64  # trusting the drafter, the big tree pays
    for _ in range(30):  # but the target accepts nothing the drafter proposes
        ch.update(64, 20.4, 0, wall_ms=20.0)
    assert ch.acc / ch.pred < 0.01
    assert abs(ch.fixed_ms - 6.0) < 1e-6
    assert ch.pick(scores)[0] == 4  # then the cheaper verify wins


def test_auto_budget_decoding_is_exact():
    for kind in ("hybrid", "dense"):
        dec, _ = build_random_pair(kind, seed=7)
        prompt = torch.randint(2, 97, (13,), generator=torch.Generator().manual_seed(1)).tolist()
        ar = dec.generate(prompt, "ar", max_new_tokens=30)
        auto = dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=30)
        assert auto.token_ids == ar.token_ids
        assert all(r.tree_size in AUTO_BUDGETS for r in auto.rounds)


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_auto_rounds_ahead_equal_host_loop_under_forced_switches(kind, monkeypatch):
    """--budget auto with rounds ahead (the device builds the largest tree every round, a copy
    graph takes the chosen prefix) against the host-tree round loop, with the chooser forced to
    cycle through every budget (a switch each round, in both directions): the same tokens and
    per-round records (tree size, depth, accepted ranks), greedy and sampled, with a stop token."""
    from ddtree.sampling import SamplingParams

    cycle = [15, 4, 64, 8, 32, 64, 4]

    def forced(self, eq):
        self.calls = getattr(self, "calls", -1) + 1
        b = cycle[self.calls % len(cycle)]
        return b, eq[b]

    monkeypatch.setattr(BudgetChooser, "pick_eq", forced)
    from ddtree.decoding import Decoder

    ahead_calls = []
    real = Decoder._ahead_rounds
    monkeypatch.setattr(Decoder, "_ahead_rounds", lambda self, *a: ahead_calls.append(1) or real(self, *a))
    dec, _ = build_random_pair(kind, seed=7)
    prompt = torch.randint(2, 97, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    runs = {}
    for ahead in (True, False):
        dec.rounds_ahead = ahead
        got = []
        for sp in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)):
            rec = dec.generate(prompt, "ddtree", budget="auto", sampling=sp, max_new_tokens=40, seed=3)
            got.append((rec.token_ids, [(r.tree_size, r.tree_depth, r.accepted, r.accepted_ranks, r.committed)
                                        for r in rec.rounds]))
        stop = got[0][0][9]
        got.append(dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=40, stop_ids={stop}).token_ids)
        runs[ahead] = got
        assert len(ahead_calls) == 3  # the ahead runs went through _ahead_rounds; the host-loop runs did not
    dec.rounds_ahead = True
    assert [r[0] for r in runs[True][0][1]][: len(cycle)] == [b for b in cycle]
    assert runs[True] == runs[False]
    ar = dec.generate(prompt, "ar", max_new_tokens=40).token_ids
    assert runs[True][0][0] == ar and runs[True][2] == ar[: ar.index(stop) + 1]

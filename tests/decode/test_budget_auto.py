"""--budget auto: the chooser's rule, and exactness of decoding with it."""

import math

import pytest
import torch

from ddtree.decode.budget import AUTO_BUDGETS, BudgetChooser
from ddtree.decode.random_pair import build_random_pair


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


def test_acceptance_ratio_and_round_costs_are_learnt():
    ch = BudgetChooser({4: 10.0, 64: 14.0})
    scores = _scores([0.6] * 4 + [0.3] * 60)  # E_q(4) = 2.4, E_q(64) = 20.4
    assert ch.pick(scores)[0] == 64  # trusting the drafter, the big tree pays
    for _ in range(30):  # but the target accepts nothing the drafter proposes
        ch.update(64, 20.4, 0, wall_ms=20.0)
    assert ch.acc / ch.pred < 0.01 and ch.ratio() < 0.01
    assert ch.cost(64) == 20.0  # the whole round, measured
    assert abs(ch.cost(4) - 16.0) < 1e-9  # an arm not yet timed: its verify + what timed trees spent beyond theirs
    assert ch.pick(scores)[0] == 4  # then the cheaper verify wins


def test_round_costs_are_medians_of_timed_rounds():
    """A round that captured a graph (or round 0) is not timed, and one slow round among timed ones
    moves an arm's cost no more than a median lets it: one outlier does not lock an arm out."""
    ch = BudgetChooser({15: 1.0}, plain_ms=0.5)
    ch.update(15, 2.0, 2, wall_ms=None)  # not timed
    assert ch.cost(15) == 1.0
    for ms in (1.5, 400.0, 1.6, 1.4):
        ch.update(15, 2.0, 2, wall_ms=ms)
    assert 1.4 <= ch.cost(15) <= 1.6


def test_auto_budget_decoding_is_exact():
    for kind in ("hybrid", "dense"):
        dec, _ = build_random_pair(kind, seed=7)
        prompt = torch.randint(2, 97, (13,), generator=torch.Generator().manual_seed(1)).tolist()
        ar = dec.generate(prompt, "ar", max_new_tokens=30)
        auto = dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=30)
        assert auto.token_ids == ar.token_ids
        assert all(r.tree_size in (0, dec.block_size - 1) + AUTO_BUDGETS for r in auto.rounds)  # 0: a plain step; the chain


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_auto_rounds_ahead_equal_host_loop_under_forced_switches(kind, monkeypatch):
    """--budget auto with rounds ahead (the device builds the largest tree every round, a copy
    graph takes the chosen prefix) against the host-tree round loop, with the chooser forced to
    cycle through every budget (a switch each round, in both directions): the same tokens and
    per-round records (tree size, depth, accepted ranks), greedy and sampled, with a stop token."""
    from ddtree.decode.round import Pipeline
    from ddtree.decode.sampling import SamplingParams
    from helpers import AUTO_CYCLE, forced_chooser

    cycle = AUTO_CYCLE
    ahead_calls = []
    real = Pipeline.run
    monkeypatch.setattr(Pipeline, "run", lambda self, *a: ahead_calls.append(1) or real(self, *a))  # a spy
    dec, _ = build_random_pair(kind, seed=7)
    dec.chooser_class = forced_chooser(cycle)
    prompt = torch.randint(2, 97, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    runs = {}
    for ahead in (True, False):
        dec.options = dec.options.replace(host_rounds=not ahead)
        got = []
        for sp in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9)):
            rec = dec.generate(prompt, "ddtree", budget="auto", sampling=sp, max_new_tokens=40, seed=3)
            got.append((rec.token_ids, [(r.tree_size, r.tree_depth, r.accepted, r.accepted_ranks, r.committed)
                                        for r in rec.rounds]))
        stop = got[0][0][9]
        got.append(dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=40, stop_ids={stop}).token_ids)
        runs[ahead] = got
        assert len(ahead_calls) == 3  # the ahead runs went through the pipeline; the host-loop runs did not
    dec.options = dec.options.replace(host_rounds=False)
    assert [r[0] for r in runs[True][0][1]][: len(cycle)] == [b for b in cycle]
    assert runs[True] == runs[False]
    ar = dec.generate(prompt, "ar", max_new_tokens=40).token_ids
    assert runs[True][0][0] == ar and runs[True][2] == ar[: ar.index(stop) + 1]


def test_plain_step_wins_only_where_trees_cannot_pay():
    """Budget 0 (a plain step, no drafter) against trees: chosen when one token per plain round
    beats the trees' expected tokens per ms of their whole rounds, each measured on its own rounds."""
    scores = _scores([0.6] * 4 + [0.3] * 60)  # E_q(4) = 2.4, E_q(64) = 20.4
    ch = BudgetChooser({4: 10.0, 64: 14.0}, plain_ms=9.0)
    assert ch.pick(scores)[0] == 64  # a 64-node tree: ~21 tokens in 14 ms against 1 in 9 ms
    for _ in range(30):  # the target accepts nothing, and a round costs 6 ms more than its verify
        ch.update(64, 20.4, 0, wall_ms=20.0)
    assert ch.pick(scores) == (0, 0.0)  # 1 token in 9 ms beats 1 in 16 ms
    for _ in range(30):  # but plain steps turn out to cost 25 ms each
        ch.update_plain(25.0)
    assert ch.cost(0) == 25.0 and ch.pick(scores)[0] == 4
    assert BudgetChooser({4: 10.0}).pick(scores)[0] == 4  # no plain_ms: trees only


def test_a_new_chooser_starts_from_what_the_decoder_measured():
    """Generations of one decoder share an AutoMemory: round costs, acceptance and the probe interval."""
    from ddtree.decode.budget import AutoMemory, PLAIN_PROBE

    mem = AutoMemory()
    first = BudgetChooser({4: 10.0}, plain_ms=9.0, memory=mem)
    first.update_plain(30.0)
    first.update(4, 2.0, 2, wall_ms=12.0)
    first.probe_answered(0)
    second = BudgetChooser({4: 10.0}, plain_ms=9.0, memory=mem)
    assert second.cost(0) == 30.0 and second.cost(4) == 12.0 and second.probe_every == 2 * PLAIN_PROBE
    assert second.ratio() == first.ratio()


def test_the_step_stages_the_arm_the_averages_say_pays():
    """What a drafting step stages (build_for): before any drafting round is timed, the last build
    (the chain first where it is on, else the block chain's size, 15); then the arm with the best
    rate on the average E_q at the measured costs, where an untried arm is priced at its verify
    plus the cheapest step seen (so it is tried once it could win); after plain steps the last
    build. pick_eq chooses among the arms at hand: a host-built tree's budgets, or a staged arm."""
    from ddtree.decode.budget import CHAIN

    verify = {4: 1.0, 8: 1.0, 15: 1.0, 32: 1.0, 64: 1.0}
    trees = BudgetChooser(dict(verify), plain_ms=0.5)
    assert trees.build_for(0, 5) == 15 and trees.build_for(15, 0) == 15  # nothing timed: the last build
    ch = BudgetChooser(dict(verify), plain_ms=0.5, chain=15)
    assert ch.build_for(0, 5) == CHAIN and ch.build_for(15, 0) == CHAIN  # the chain first
    ch.observe({CHAIN: 2.0, 8: 3.0, 32: 3.2})
    for _ in range(3):
        ch.update(CHAIN, 2.0, 2, wall_ms=1.2)  # the chain's step: 0.2 ms past its verify
    assert ch.cost(8) == 1.2  # untried: its verify and the cheapest step seen
    assert ch.build_for(CHAIN, 1) == 32  # 4.2 tokens in 1.2 ms on paper: tried
    for _ in range(3):
        ch.update(32, 3.2, 3, wall_ms=2.0)  # its top-k and build make its round dear
    assert ch.cost(8) == 1.2 and ch.build_for(32, 2) == 8  # 4 tokens in 1.2 ms beats 3 in 1.2 and 4.2 in 2
    for _ in range(3):
        ch.update(8, 3.0, 3, wall_ms=1.7)
    assert ch.build_for(8, 3) == CHAIN  # 3 tokens in 1.2 ms beats 4 in 1.7
    assert ch.build_for(0, 4) == CHAIN  # a probe builds the last build
    assert ch.pick_eq({4: 3.0, 8: 5.0})[0] == 8 and ch.pick_eq({4: 3.0})[0] == 4  # a tree's budgets; a staged 4
    assert ch.pick_eq({CHAIN: 9.0})[0] == CHAIN  # a staged chain
    assert trees.pick_eq({CHAIN: 9.0}) == (0, 0.0)  # without the chain arm: nothing at hand


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_auto_plain_steps_are_exact(kind):
    """--budget auto rounds ahead with plain steps forced in (runs of them, a probe that drafts
    after PLAIN_PROBE of them, and switches to trees and back): greedy tokens equal ar's, plain
    rounds are recorded as tree size 0, and trees follow only a step that drafted."""
    from helpers import forced_chooser

    cycle = [8, 0, 0, 0, 0, 32, 0, 15, 0, 0, 0, 0, 0, 4]
    dec, _ = build_random_pair(kind, seed=7)
    dec.chooser_class = forced_chooser(cycle, probe_every=3)
    prompt = torch.randint(2, 97, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    ar = dec.generate(prompt, "ar", max_new_tokens=48).token_ids
    rec = dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=48)
    assert rec.token_ids == ar
    sizes = [r.tree_size for r in rec.rounds]
    assert 0 in sizes and any(s > 0 for s in sizes[sizes.index(0):])
    assert set(sizes) - {0} <= set(cycle) and 32 in sizes  # up from 8 to 32 across plain steps: staged at 32
    assert all(r.committed == 1 and r.accepted == 0 for r in rec.rounds if r.tree_size == 0)
    # a run of plain steps is left only after a drafting one: the PLAIN_PROBE-th (3rd) in a row
    run = 0
    for s in sizes:
        if s == 0:
            run += 1
        else:
            assert run == 0 or run % 3 == 0, sizes
            run = 0


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_auto_chain_arm_is_exact(kind):
    """The chain arm forced in among trees and plain steps (chain after chain, tree, plain step and
    probe, and each of those after a chain): greedy tokens equal ar's, and every chain round
    verified the staged chain: block - 1 nodes of that depth, accepted nodes all of rank 0."""
    from ddtree.decode.budget import CHAIN
    from helpers import Oracle, forced_chooser

    cycle = [8, CHAIN, CHAIN, 4, CHAIN, 0, 0, 0, CHAIN, 31, CHAIN, 0, 0, 0, 63, CHAIN]  # (round 0: a tree)
    dec, _ = build_random_pair(kind, seed=7)
    dec.chooser_class = forced_chooser(cycle, probe_every=3)
    prompt = torch.randint(2, 97, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    ar = dec.generate(prompt, "ar", max_new_tokens=60).token_ids
    oracle = Oracle(dec, prompt + dec.generate(prompt, "ar", max_new_tokens=90).token_ids)  # drafts that get accepted
    try:
        rec = dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=60)
    finally:
        oracle.restore()
    assert rec.token_ids == ar
    D = dec.block_size - 1  # the chain's draft nodes (no tree of that size in the cycle)
    chains = [r for r in rec.rounds if r.tree_size == D]
    assert D not in cycle and len(chains) >= 4 and {0, 4, 8, 31, 63} <= {r.tree_size for r in rec.rounds}
    assert all(r.tree_depth == D and set(r.accepted_ranks) <= {0} for r in chains)
    assert sum(r.accepted for r in chains) >= 2 * len(chains)


def test_probe_interval_doubles_when_probes_do_not_pay():
    """After a probe's sample the chooser answers with another plain step: the interval doubles up to
    PLAIN_PROBE_MAX; a tree chosen after a probe resets it."""
    from ddtree.decode.budget import PLAIN_PROBE, PLAIN_PROBE_MAX

    ch = BudgetChooser({4: 1.0}, plain_ms=0.5)
    seen = [ch.probe_every]
    for _ in range(6):
        ch.probe_answered(0)
        seen.append(ch.probe_every)
    assert seen[0] == PLAIN_PROBE and seen[1] == 2 * PLAIN_PROBE and seen[-1] == PLAIN_PROBE_MAX
    assert all(b >= a for a, b in zip(seen, seen[1:]))
    ch.probe_answered(4)
    assert ch.probe_every == PLAIN_PROBE


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_deferred_context_rows_land_where_immediate_ones_would(kind):
    """--budget auto's plain steps keep their context rows aside and the next drafting step adds
    them: after a run with runs of plain steps, the drafter's context cache equals the context
    built from the target's taps over the whole committed sequence (each row at its position)."""
    from helpers import forced_chooser

    dec, _ = build_random_pair(kind, seed=7)
    dec.chooser_class = forced_chooser([8, 0, 0, 0, 0, 0, 31, 0, 0, 15], probe_every=4)
    prompt = torch.randint(2, 97, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    rec = dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=40)
    sizes = [r.tree_size for r in rec.rounds]
    assert sizes.count(0) >= 8 and any(s > 0 for s in sizes)
    d = dec.drafter
    n = int(d.ctx_len)
    got = [(layer.self_attn.k_cache[:n].clone(), layer.self_attn.v_cache[:n].clone()) for layer in d.layers]
    # the reference: the target's taps over the committed tokens (prompt + emitted, less the last
    # bonus, which no verify has consumed yet), added to a fresh context in one go
    seq = (prompt + rec.token_ids)[:n]
    dec.target.reset()
    _, taps = dec.target.prefill(torch.tensor(seq), chunk=7)
    d.reset()
    d.add_context(taps)
    assert int(d.ctx_len) == n
    for (k, v), layer in zip(got, d.layers):
        for a, b in ((k, layer.self_attn.k_cache[:n]), (v, layer.self_attn.v_cache[:n])):
            assert (a - b).abs().max() <= 1e-4 * b.abs().max(), kind


def test_a_probe_is_answered_by_a_verified_tree_and_backs_off():
    """A chooser that never wants a tree still gets an acceptance sample after every probe (the
    round after it verifies the probe's tree), and each plain answer doubles the probe interval:
    the plain runs between sampled trees grow 3, 6, 12, ...; tokens equal ar's."""
    from ddtree.decode.budget import BudgetChooser as Base

    class NeverTrees(Base):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.probe_every = 3

        def pick_eq(self, eq):
            return 0, 0.0

        def plain_pays(self, eq=None):  # nor a probe before its interval
            return True

    dec, _ = build_random_pair("hybrid", seed=7)
    dec.chooser_class = NeverTrees
    prompt = torch.randint(2, 97, (13,), generator=torch.Generator().manual_seed(4)).tolist()
    ar = dec.generate(prompt, "ar", max_new_tokens=60).token_ids
    rec = dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=60)
    assert rec.token_ids == ar
    sizes = [r.tree_size for r in rec.rounds]
    runs, run = [], 0
    for s in sizes:  # (round 0 too: the chooser picks it from the prefill's tree, and this one picks plain)
        if s == 0:
            run += 1
        else:
            runs.append(run)
            run = 0
    assert runs[:3] == [3, 6, 12], sizes


def test_verbose_logs_one_line_per_auto_round():
    """--verbose (debug logs): one line per round says the budget auto took, plain, tree or chain,
    and the tokens it committed; they agree with the round records."""
    import re

    from loguru import logger

    dec, _ = build_random_pair("hybrid", seed=7)
    prompt = torch.randint(2, 97, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    lines: list[str] = []
    sink = logger.add(lines.append, level="DEBUG", format="{message}", filter=lambda r: "auto round" in r["message"])
    try:
        rec = dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=30)
    finally:
        logger.remove(sink)
    got = [re.match(r"auto round (\d+): budget (\d+) \((plain|tree|chain)\), (\d+) tokens", s).groups() for s in lines]
    assert len(got) == len(rec.rounds) > 1
    for i, ((r, b, kind, n), rr) in enumerate(zip(got, rec.rounds)):
        assert int(r) == i and int(b) == rr.tree_size and (kind == "plain") == (rr.tree_size == 0)
        assert int(n) == rr.committed


def _among_trees(verify: dict[int, float], round_ms: dict[int, float], plain_ms: float) -> BudgetChooser:
    """A chooser whose trees have paid (E_q 2 / 3 accepted in full) at these round costs."""
    ch = BudgetChooser(verify, plain_ms=plain_ms)
    for _ in range(10):
        ch.observe({4: 2.0, 15: 3.0})
        for b, ms in round_ms.items():
            ch.update(b, 3.0, 3, wall_ms=ms)
        ch.update_plain(plain_ms)
    return ch


def test_one_low_eq_does_not_buy_a_plain_step():
    """The round's E_q chooses among budgets; plain steps against trees follows the average E_q:
    where a verify costs about a plain step (a GPU's), a plain step and the probe after it cost
    more than one poor tree round."""
    ch = _among_trees({4: 9.2, 15: 9.6}, {4: 12.0, 15: 13.0}, plain_ms=9.0)
    low = {4: 0.05, 15: 0.1}  # this round: 1 / 9 ms for a plain step beats 1.05 / 12 ms
    assert ch.pick_eq(low)[0] == 4 and not ch.plain_pays(low)
    for _ in range(60):  # but where the drafter stays that poor, plain steps win
        ch.observe(low)
    assert ch.plain_pays() and ch.pick_eq(low) == (0, 0.0) and not ch.wants_tree(low)


def test_a_tree_not_worth_its_verify_buys_a_plain_step():
    """Where a verify costs more than its expected tokens at plain-step pace (a CPU's: a 4-node
    verify 1.6 plain steps, a 15-node one 2.3), a low round takes a plain step although the
    average still says trees pay; the drafting past the verify is not held against a tree
    (coming back would draft too), so a round whose tokens cover its verify keeps its tree."""
    ch = _among_trees({4: 15.0, 15: 22.0}, {4: 25.0, 15: 31.0}, plain_ms=9.5)
    assert ch.ratio() == 1.0 and not ch.plain_pays()
    assert ch.pick_eq({4: 0.3, 15: 0.6}) == (0, 0.0)  # 1.3 and 1.6 tokens: 12.4 and 15.2 ms of plain steps
    assert not ch.plain_pays({4: 0.3, 15: 0.6})  # the average alone would have kept the tree
    worth = {4: 0.7, 15: 1.2}  # 1.7 tokens: 16.2 ms of plain steps, past the 4-node verify, short of its round
    assert (1 + worth[4]) * 9.5 < ch.cost(4) and ch.pick_eq(worth)[0] in (4, 15)
    same_gpu = _among_trees({4: 9.2, 15: 9.6}, {4: 12.0, 15: 13.0}, plain_ms=9.0)
    assert same_gpu.pick_eq({4: 0.3, 15: 0.6})[0] in (4, 15)  # the same round where verifies are cheap


def test_a_probe_tree_restarts_the_eq_average():
    """The E_q average that decides plain steps against trees restarts at a probe's tree: trees
    averaged before a plain run say nothing of the text after it."""
    ch = BudgetChooser({4: 1.0, 15: 1.0}, plain_ms=0.5)
    ch.update_plain(0.5)
    ch.update(15, 0.1, 0, wall_ms=1.0)
    for _ in range(20):
        ch.observe({4: 0.05, 15: 0.1})  # a stretch where trees accept nothing
    assert ch.plain_pays()
    decayed = BudgetChooser({4: 1.0, 15: 1.0}, plain_ms=0.5, memory=ch.mem)
    good = {4: 2.0, 15: 4.0}
    ch.observe(good, restart=True)
    assert ch.mem.eq_avg == good and not ch.plain_pays()
    for _ in range(20):
        decayed.observe({4: 0.05, 15: 0.1}, restart=True)
    decayed.observe(good)  # the same tree without the restart: one sample against the old average
    assert decayed.plain_pays()


def test_auto_leaves_plain_steps_when_a_probe_finds_the_text_changed():
    """Replayed with the real policy (scripts/simulate_auto.replay_auto): one generation whose
    first 200 positions leave the drafter useless (auto settles on plain steps, its probes backing
    off) and whose next 200 it drafts well. The first probe in the good stretch brings trees back
    (its draft restarts the E_q averages it covers: without that, with the build one budget up,
    auto answered that probe with plain steps: 256 plain steps against 240)."""
    from scripts.simulate_auto import Costs, replay_auto

    from ddtree.decode.budget import AutoMemory

    n = 400
    good = [t >= 200 for t in range(n)]
    # the good stretch: E_q(b) 1.2 to 1.8 and 2 tokens accepted, so a tree round (1.6 ms for 3
    # tokens) beats a plain step (1 ms for 1) by half, but one such tree weighs a tenth of the average
    trace = {f"acc:a{b}": [2 if g else 0 for g in good] for b in AUTO_BUDGETS}
    trace.update({f"eq:{b}": [min(b, 6) * 0.3 if g else 0.02 for g in good] for b in AUTO_BUDGETS})
    costs = Costs(ar=1.0, verify={1: 1.0, 16: 1.1, 65: 1.3}, rounds={}, beyond={64: 0.5})

    def replay(restart: bool):
        import ddtree.decode.budget as B

        observe = B.BudgetChooser.observe
        if not restart:
            B.BudgetChooser.observe = lambda self, eq, restart=False: observe(self, eq)
        try:
            tokens, ms, arms = replay_auto(trace, costs, n, AutoMemory())
            return arms.get(0, 0), tokens / ms
        finally:
            B.BudgetChooser.observe = observe

    (plain, rate), (plain_old, rate_old) = replay(True), replay(False)
    # the 200 useless positions take plain steps (and probes); the good stretch takes trees within a
    # probe interval or two: at most 45 more plain steps (measured 240, 1.213 tokens per ms; plain
    # steps throughout would give 1.0, trees from position 200 on at best 1.32)
    assert plain <= 245 and rate >= 1.2 and rate >= rate_old, (plain, plain_old, rate, rate_old)


@pytest.mark.parametrize("kind", ["hybrid", "dense"])
def test_capture_ahead_covers_every_piece_a_generation_runs(kind, monkeypatch):
    """capture_ahead (a benchmark's warm-up) runs every graph piece a generation can run: --budget
    auto whatever it chooses (a chooser that picks at random: plain steps, probes, every arm and
    build), and the fixed methods, over prompts whose rounds cross context-bucket edges, greedy
    and sampled, run no piece it did not. It changes no state: the generation after it equals `ar`."""
    from ddtree.decode.auto import capture_ahead
    from ddtree.decode.sampling import SamplingParams
    from helpers import random_chooser

    dec, _ = build_random_pair(kind, seed=7)
    dec.bucket = 32
    runs = []
    real_run = dec.graphs.run
    monkeypatch.setattr(dec.graphs, "run", lambda key, fn, keep=(): runs.append(key) or real_run(key, fn, keep))
    gen = torch.Generator().manual_seed(2)
    n_new = 24
    for sp in (SamplingParams(), SamplingParams(temperature=0.8)):
        for L in (21, 30):  # the rounds cross the 32 and 64 edges at different offsets
            prompt = torch.randint(2, 97, (L,), generator=gen).tolist()
            ar = dec.generate(prompt, "ar", max_new_tokens=n_new).token_ids
            for method, budget in (("ddtree", "auto"), ("ddtree", 8), ("dflash", 1), ("ar", 1)):
                job = dec.job(method, budget, sp, n_new, 0, False, L)
                pre = dec.prefill(prompt, job)
                runs.clear()
                assert capture_ahead(dec, job, L, eager=True) == 0  # (eager: nothing captured)
                ahead = set(runs)
                kinds = {type(k).__name__ for k in ahead}
                assert kinds == ({"PrefixKey", "VerifyKey", "StepKey"} if budget == "auto" else {"VerifyKey", "StepKey"})
                got = dec.decode(pre, job).token_ids  # from the state capture_ahead found
                if sp.greedy:
                    assert got == ar, (method, budget)
                dec.chooser_class = random_chooser(L)
                for seed in range(4 if budget == "auto" else 1):
                    runs.clear()
                    dec.generate(prompt, method, budget=budget, sampling=sp, max_new_tokens=n_new, seed=seed)
                    missed = set(runs) - ahead
                    assert not missed, (method, budget, sorted(map(str, missed))[:5])
                dec.chooser_class = BudgetChooser


def test_auto_verifies_a_staged_tree_where_its_step_built_it(monkeypatch):
    """A step stages a tree in its budget's verify slot, so the round verifying it copies nothing:
    auto's only copies (PrefixKey) are a plain step's root (one node) and a staged chain (its own
    slot, whose shape stays a chain's). Under a chooser that picks at random (every arm, build,
    plain step and probe) greedy tokens equal `ar`, and tree rounds ran."""
    from ddtree.decode.graphs import PrefixKey, VerifyKey
    from helpers import random_chooser

    dec, _ = build_random_pair("hybrid", seed=7)
    runs = []
    real_run = dec.graphs.run
    monkeypatch.setattr(dec.graphs, "run", lambda key, fn, keep=(): runs.append(key) or real_run(key, fn, keep))
    prompt = torch.randint(2, 97, (25,), generator=torch.Generator().manual_seed(3)).tolist()
    ar = dec.generate(prompt, "ar", max_new_tokens=40).token_ids
    for seed in range(3):
        dec.chooser_class = random_chooser(seed)
        runs.clear()
        got = dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=40).token_ids
        assert got == ar, seed
        copies = [k for k in runs if isinstance(k, PrefixKey)]
        assert copies and all(k.T == 1 or k.chain for k in copies), copies
        assert {k.T for k in runs if isinstance(k, VerifyKey)} - {1, dec.block_size}, "no tree of another size verified"


def test_host_loop_after_auto_uploads_the_slots_auto_built():
    """Auto's steps build trees in the verify slots; the host-tree loop then loads its trees into
    the same slots, and a chain whose shape it loaded before goes up as its tokens alone
    (Slot.load). With a block of 16, auto's 15-node trees share dflash's 16-node slot: a slot the
    device rewrites is marked so (auto's first upload, every build), and dflash's host loop after
    auto still equals `ar`."""
    import dataclasses

    from ddtree.decode.decoder import Decoder
    from ddtree.model.synthetic import build_random_drafter, build_random_target, tiny_drafter_config, tiny_hybrid_config
    from helpers import random_chooser

    raw = tiny_hybrid_config()
    target = build_random_target(raw, seed=7)
    dec = Decoder(target, build_random_drafter(tiny_drafter_config(raw, block_size=16), target, seed=8))
    assert dec.block_size - 1 in AUTO_BUDGETS
    prompt = torch.randint(2, 97, (25,), generator=torch.Generator().manual_seed(4)).tolist()
    ar = dec.generate(prompt, "ar", max_new_tokens=40).token_ids
    B = dec.block_size - 1

    class Trees(BudgetChooser):  # 15-node trees only: nothing but their builds touches slot 16
        def pick_eq(self, eq):
            return B, eq.get(B, 0.0)

        def build_for(self, b, r):
            self.last_build = B
            return B

    pipelined, host = dec.options, dataclasses.replace(dec.options, host_rounds=True)
    for chooser in (Trees, random_chooser(0), random_chooser(1)):
        dec.options = host
        assert dec.generate(prompt, "dflash", max_new_tokens=40).token_ids == ar  # the chain's shape, loaded
        dec.options, dec.chooser_class = pipelined, chooser
        r = dec.generate(prompt, "ddtree", budget="auto", max_new_tokens=40)
        assert r.token_ids == ar
        assert chooser is not Trees or {x.tree_size for x in r.rounds} == {B}
        dec.options = host
        assert dec.generate(prompt, "dflash", max_new_tokens=40).token_ids == ar, chooser


def test_a_few_unlucky_rounds_do_not_buy_a_plain_run():
    """Plain steps against trees reads the larger of the short-memory acceptance ratio and its
    long-memory twin (plain_ratio): a plain step starts a run that lasts until a probe, while a
    tree is chosen again every round. After a long stretch of trees accepting what the drafter
    predicted, ten rounds that accept nothing sink the short ratio (0.9 decay) but not the long
    one, and trees stay; a long stretch of rejections sinks both, and plain steps win."""
    from ddtree.decode.budget import SLOW_DECAY

    ch = _among_trees({4: 9.2, 15: 9.6}, {4: 12.0, 15: 13.0}, plain_ms=9.0)
    eq = {4: 0.5, 15: 1.0}
    for _ in range(60):  # the drafter's E_q accepted as predicted
        ch.observe(eq)
        ch.update(15, 1.0, 1, wall_ms=13.0)
    for _ in range(10):  # then a short unlucky stretch
        ch.update(15, 1.0, 0, wall_ms=13.0)
    short, long_ = ch.ratio(), ch.mem.slow_acc / ch.mem.slow_pred
    assert short < 0.4 < 0.6 < long_ and ch.plain_ratio() == long_
    assert (1 + short * 1.0) / 13.0 < 1 / 9.0 < (1 + long_ * 1.0) / 13.0  # the short ratio alone says plain
    assert not ch.plain_pays()
    for _ in range(60):  # a long stretch of rejections: both ratios fall
        ch.update(15, 1.0, 0, wall_ms=13.0)
    assert ch.plain_ratio() < 0.2 and ch.plain_pays()
    # the long memory is SLOW_DECAY's: one round's weight is 1 - SLOW_DECAY of the sum's limit
    m = ch.mem
    a, p = m.slow_acc, m.slow_pred
    ch.update(15, 2.0, 2, wall_ms=13.0)
    assert math.isclose(m.slow_acc, SLOW_DECAY * a + 2) and math.isclose(m.slow_pred, SLOW_DECAY * p + 2.0)

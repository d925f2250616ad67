"""What each round verifies: the budget policies (plain steps, the chain, a fixed budget, auto).

A policy decides, when round r is queued, which tree its verify reads and what its step builds
for round r + 1 (`plan`), and reads round r's packet when the host gets it (`read`). The round
itself (ddtree.decode.round) is the same for all of them:

    policy      verifies                      the step after it builds           packet extra
    Plain (ar)  the bonus alone (1 node)      nothing: the bonus is the next root  -
    Chain       the block's chain (B nodes)   the next chain                       next depth
    Fixed(b)    a best-first tree of b + 1    the next tree of b                   next depth
    Auto        the staged tree or chain,     a staged tree or chain (or a plain   E_q and depth per prefix,
                or the bonus alone            step)                                the chain's E_q

`BudgetChooser` is auto's cost model: expected tokens per millisecond of each budget.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from loguru import logger

from ddtree.decode.buffers import RoundOut, Slot
from ddtree.model.drafter import DEFERRED_ROWS
from ddtree.ops.tree import Tree

AUTO_BUDGETS = (4, 8, 15, 31, 63)  # 15 / 31 / 63 draft nodes: verifies of 16 / 32 / 64 nodes, below the tiles' edges
AUTO_TOPK = 32  # drafter top-k columns of auto's trees (a 64-node tree rarely needs a 33rd token per position)
PLAIN_PROBE = 16  # auto: after this many plain steps in a row, one drafts again (a fresh E_q curve)
PLAIN_PROBE_MAX = DEFERRED_ROWS  # ... and after probes that did not pay, up to this many (doubling; the
#                                  drafter's cache has room for that many deferred context rows)
ROUND_SAMPLES = 8  # auto: an arm's round cost is the median of its last this many timed rounds
SLOW_DECAY = 0.97  # auto: the decay of the long-memory acceptance ratio behind plain_pays (BudgetChooser)
CHAIN = -1  # auto's chain arm: it verifies the block's top-1 chain, and its step drafts the next chain


class AutoMemory:
    """What --budget auto has measured on this machine, shared by the generations of one decoder
    (ddtree.decode.auto.calibrate keeps one per context bucket and choice mode), so a later
    generation starts from it instead of from the calibration's verify-only figures:

    round_ms: arm -> the wall ms of its last ROUND_SAMPLES timed rounds (arm 0: a plain step, CHAIN
              the chain, b a best-first tree of b draft nodes; a
              round is timed from the host's read of the round before it to its own read, so it
              is the whole round: verify, step, drafter, tree, any prefix copy and host work);
    acc, pred: the decayed sums of accepted draft tokens and of E_q over the tree rounds;
    slow_acc, slow_pred: the same sums decayed by SLOW_DECAY (about 33 rounds' memory against 10);
    probe_every: the plain-run length after which a plain step drafts again (a probe)."""

    def __init__(self):
        self.round_ms: dict[int, deque] = {}
        self.eq_avg: dict[int, float] = {}  # arm -> decayed average of the staged trees' (chain's) E_q
        self.cost_ms: dict[int, float] = {}  # arm -> the median of round_ms[arm]
        self.timings = 0  # timed rounds so far: the choosers' cost caches hold for one count
        self.acc = self.pred = 1.0  # prior: the drafter's probabilities are honest
        self.slow_acc = self.slow_pred = 1.0
        self.probe_every = PLAIN_PROBE


class BudgetChooser:
    """`--budget auto`: each round, the arm with the most expected committed tokens per wall-clock
    millisecond. Arms: 0 (a plain step: the bonus alone, no drafter), the best-first budgets b and,
    where the chain is on (`chain`: its draft nodes, the block less its root), CHAIN: the block's
    top-1 chain, whose step drafts with a max instead of a top-k and builds no tree (on the H200's
    codepair rounds 134 us against 210 to 280 for a tree's).

        rate(0) = 1 / cost(0)
        rate(a) = (1 + ratio * E_q(a)) / cost(a)

    cost(arm) is what the arm's rounds measured on this machine (the median of its last
    ROUND_SAMPLES timed rounds: see Auto for which rounds are timed); until an arm has a timed
    round, its calibrated verify (`verify_ms`, `plain_ms`: one timed verify per size) plus the
    least that a timed drafting arm spent beyond its verify (before any is timed, the calibrated
    draft, `draft_ms`): an untried arm is priced as if its step were the cheapest seen, so it is
    tried once it could win, and its own rounds then price it. E_q(b) is the sum of the drafter's
    path probabilities over the tree's first b nodes (the expected accepted length if the drafter
    were calibrated), E_q(CHAIN) the chain's; ratio = accepted / E_q over the drafted rounds so far
    (decayed). The round's E_q decides a plain step against the staged arm
    (worth_verify); what the next step stages (build_for) and a plain step against drafting
    (plain_pays) follow the arms' average E_q (a staged tree's prefixes give the E_q of the
    smaller budgets: the pop order of a best-first tree is the same for every budget).

    After PLAIN_PROBE plain steps in a row (or sooner, once the measurements say a tree would pay)
    one drafts again (a probe) and the next round verifies that tree (a sample of the acceptance);
    each sample the chooser answers with another plain step doubles the interval, up to
    PLAIN_PROBE_MAX, so where trees never pay auto is `ar` plus rare probes.
    """

    def __init__(self, verify_ms: dict[int, float], decay: float = 0.9, plain_ms: float | None = None,
                 memory: AutoMemory | None = None, draft_ms: float = 0.0, chain: int | None = None,
                 chain_ms: float | None = None):
        self.verify_ms = verify_ms  # budget -> ms of one verify of budget + 1 nodes (calibration)
        self.draft_ms = draft_ms  # one draft (calibration; 0 where rounds are graphed): a drafting arm's extra until timed
        self.decay = decay  # of the E_q averages and of the acceptance ratio
        self.plain_ms = plain_ms  # verify of the bonus alone with taps, or None: trees only
        self.chain = chain  # the chain's draft nodes, or None: no chain arm
        self.chain_ms = verify_ms.get(chain) if chain_ms is None else chain_ms  # its verify
        if self.chain_ms is None:
            self.chain = None
        self.mem = memory or AutoMemory()
        self._costs: tuple[dict, int] = ({}, -1)  # (arm -> cost, mem.timings it holds for)
        bs = sorted(verify_ms)
        # what the last drafting step built: the chain first (the cheapest step, and timed first
        # it prices the untried trees by it), else the budget of the block's chain (15)
        self.last_build = CHAIN if self.chain else bs[min(2, len(bs) - 1)] if bs else 0

    # ---------------------------------------------------------------- the model
    @property
    def probe_every(self) -> int:
        return self.mem.probe_every

    @probe_every.setter
    def probe_every(self, n: int):
        self.mem.probe_every = n

    @property
    def acc(self) -> float:
        return self.mem.acc

    @property
    def pred(self) -> float:
        return self.mem.pred

    def ratio(self) -> float:
        """accepted / E_q over the tree rounds so far, pooled over budgets (a ratio per budget
        would learn only from the budgets chosen, and keep the others where an unlucky round left them)."""
        return self.acc / self.pred

    def plain_ratio(self) -> float:
        """The ratio behind plain_pays: the larger of ratio() and its long-memory twin (decay
        SLOW_DECAY). A plain step starts a run that lasts until a probe (16 to 64 steps), while a
        tree is chosen again every round, so a few unlucky rounds must not buy a plain run on their
        own: on the codepair drafters' traces at an H100's round costs (`scripts/simulate_auto.py
        --bench`) a ratio that fell to 0.26 after a bad stretch kept `drafter-large` on 63-step
        plain runs through a prompt where dflash ran 1.8x `ar`."""
        return max(self.ratio(), self.mem.slow_acc / self.mem.slow_pred)

    def drafts(self, arm: int) -> bool:
        """Is `arm` one of this chooser's drafting arms (a tree budget, or the chain where it is on)?"""
        return arm in self.verify_ms if arm > 0 else arm == CHAIN and self.chain is not None

    def nodes(self, arm: int) -> int:
        """Draft nodes a round of `arm` verifies."""
        return self.chain if arm == CHAIN else arm

    def _base(self, arm: int) -> float:
        return self.plain_ms if arm == 0 else self.chain_ms if arm == CHAIN else self.verify_ms[arm]

    def cost(self, arm: int) -> float:
        """ms of a round of `arm` (0: a plain step). Kept until the next timed round: a round's
        choices ask it of every arm several times (the host's share of a round on a GPU)."""
        cache, timings = self._costs
        if timings != self.mem.timings:
            cache, timings = self._costs = {}, self.mem.timings
        c = cache.get(arm)
        if c is None:
            c = cache[arm] = self._cost(arm)
        return c

    def _cost(self, arm: int) -> float:
        known = self.mem.cost_ms
        if arm in known:
            return known[arm]
        if arm == 0:
            return self._base(0)
        extra = [ms - self._base(a) for a, ms in known.items() if self.drafts(a)]
        return self._base(arm) + (min(extra) if extra else self.draft_ms)

    def rates(self, eq: dict[int, float]) -> dict[int, float]:
        """Expected tokens per ms of every arm at hand (eq: arm -> its E_q) and of a plain step."""
        k = self.ratio()
        rate = {a: (1 + k * e) / self.cost(a) for a, e in eq.items() if self.drafts(a)}
        if self.plain_ms is not None:
            rate[0] = 1.0 / self.cost(0)
        return rate

    # ---------------------------------------------------------------- choices
    def pick(self, scores: list[float]) -> tuple[int, float]:
        """scores: path log-probabilities of a best-first tree's nodes (root first).
        -> (budget, its predicted accepted length E_q)."""
        return self.pick_eq(expected_accepts(scores, self.verify_ms))

    def pick_eq(self, eq: dict[int, float]) -> tuple[int, float]:
        """eq: arm -> E_q(arm) of what is at hand (the budgets a host-built tree covers; in the
        pipeline the staged arm alone, Auto.at_hand); the candidates are those arms and 0.
        The round's E_q chooses among the budgets; plain steps against trees is the arms' average
        (`plain_pays`): one low E_q would buy a plain step and a probe's drafting to come back,
        unless no tree at hand is worth its verify (`worth_verify`).
        -> (arm, its E_q)."""
        rate = self.rates(eq)
        rate.pop(0, None)
        if not rate or self.plain_pays(eq) or not self.worth_verify(eq, rate):
            return 0, 0.0
        best = max(rate, key=rate.get)
        return best, eq[best]

    def observe(self, eq: dict[int, float], restart: bool = False):
        """A staged tree's (chain's) E_q per arm, as the host reads it: the decayed average behind
        plain_pays and build_for. restart: what a probe drafted after a plain run: the averages of
        the arms it covers start again from it. The ones averaged before the run are as old as the
        run, and the text has moved on (on the H200's codepair runs a probe whose tree accepted 3
        tokens was answered by 64 more plain steps, the average still that of the trees before;
        `scripts/simulate_auto.py --bench`)."""
        avg, d = self.mem.eq_avg, self.decay
        for b, e in eq.items():
            avg[b] = e if restart or b not in avg else d * avg[b] + (1 - d) * e

    def plain_pays(self, eq: dict[int, float] | None = None) -> bool:
        """Does a plain step beat the best tree on the average E_q seen (on eq before any), at
        plain_ratio?"""
        if self.plain_ms is None:
            return False
        avg = self.mem.eq_avg or eq or {}
        k = self.plain_ratio()
        trees = [(1 + k * e) / self.cost(b) for b, e in avg.items() if self.drafts(b)]
        return not trees or 1.0 / self.cost(0) > max(trees)

    def worth_verify(self, eq: dict[int, float], budgets) -> bool:
        """Among trees (the average says they pay): do the expected tokens of some tree at hand take
        plain steps at least as long as its verify? One plain step instead saves the tree round's
        cost past those tokens' plain steps and costs its drafting, since coming back takes a
        probe's drafting, the same work: so the drafting is not held against the tree, its verify
        is. On a GPU (a 15-node verify about 1.05 to 1.2 plain steps) that nearly always holds; on
        a CPU (about 2.3 plain steps; drafting about one more) only where the drafter is
        confident, and holding trees through the other rounds cost 2 to 5% against `ar`
        (`scripts/simulate_auto.py --bench` at a quiet CPU's costs)."""
        if self.plain_ms is None:
            return True
        plain = self.cost(0)
        k = self.ratio()
        return any((1 + k * eq[b]) * plain >= min(self.cost(b), self._base(b)) for b in budgets)

    def wants_tree(self, eq: dict[int, float]) -> bool:
        """During plain steps: would trees pay now, on the measurements? (Then the next plain step
        drafts: a probe before its interval is up.)"""
        return self.plain_ms is not None and bool(eq) and not self.plain_pays(eq)

    def build_for(self, b: int, r: int) -> int:
        """What round r's step stages for round r + 1 (a tree budget, or CHAIN), given round r's
        own arm b (0: a plain step, whose probe builds the last build). The arm with the best rate
        on the average E_q: a tree's step costs more the bigger it is (its top-k and its build),
        so the staged tree is the one the averages say pays, and the next round verifies it or
        takes a plain step. Until a drafting round is timed: the last build (the chain first)."""
        if b == 0:
            return self.last_build
        known, avg = self.mem.cost_ms, self.mem.eq_avg
        arms = [a for a in avg if self.drafts(a)]
        if arms and any(self.drafts(a) for a in known):
            k = self.ratio()
            self.last_build = max(arms, key=lambda a: (1 + k * avg[a]) / self.cost(a))
        return self.last_build

    def probe_answered(self, b: int):
        """The budget chosen right after a probe: plain again doubles the probe interval, a tree resets it."""
        self.probe_every = min(2 * self.probe_every, PLAIN_PROBE_MAX) if b == 0 else PLAIN_PROBE

    # ---------------------------------------------------------------- measurements
    def timed(self, arm: int, wall_ms: float | None):
        """One round of `arm` took wall_ms (None: not timed: round 0, or a round that captured)."""
        if wall_ms is not None:
            seen = self.mem.round_ms.setdefault(arm, deque(maxlen=ROUND_SAMPLES))
            seen.append(wall_ms)
            self.mem.cost_ms[arm] = statistics.median(seen)
            self.mem.timings += 1

    def update_plain(self, wall_ms: float | None):
        """A plain step's wall time (the time between two reads)."""
        self.timed(0, wall_ms)

    def update(self, budget: int, predicted: float, accepted: int, wall_ms: float | None):
        """A tree round of `budget`: its E_q, the draft tokens it accepted, its wall time."""
        d, m, e = self.decay, self.mem, max(predicted, 1e-6)
        m.acc, m.pred = d * m.acc + accepted, d * m.pred + e
        m.slow_acc, m.slow_pred = SLOW_DECAY * m.slow_acc + accepted, SLOW_DECAY * m.slow_pred + e
        self.timed(budget, wall_ms)


def expected_accepts(scores: list[float], budgets) -> dict[int, float]:
    """E_q(b): the sum of the first b draft nodes' path probabilities (scores: root first)."""
    probs = [math.exp(x) for x in scores[1:]]
    return {b: sum(probs[:b]) for b in sorted(budgets)}


# ------------------------------------------------------------------------------------ policies
@dataclass
class Plan:
    """What round r runs, decided when it is queued."""

    slot: Slot  # the tree its verify reads
    into: Slot  # where its step writes the next tree (or the bonus alone)
    build: int | str | None  # the next tree: None (the bonus alone), "chain", or a best-first budget
    walk: int  # nodes the walk may accept
    k: int = 1  # drafter top-k columns
    arm: int = 0  # auto: the chooser's arm (0 a plain step, CHAIN, or the tree budget verified)
    prefix_of: Slot | None = None  # first copy slot's tree as this staged tree's prefix (auto)
    summary: int = 0  # auto: summarise every prefix of the built tree, padded to this many
    context: str = "path"  # the drafter's context: "path" (add the accepted rows), "defer" (keep the
    #                        root's row for later), "flush" (deferred rows, then the path), "none" (ar)
    keep: tuple = ()  # inputs the step rewrites (capture snapshots them)


class Policy:
    """Base: P (path length of the packet), E (extra floats), taps (the verify returns the drafter's
    tap rows), T_max (largest tree verified)."""

    P = 1
    E = 0
    taps = True
    T_max = 1
    defers = False  # keeps plain steps' context rows for later (ddtree.decode.round.DeferredContext)

    def begin(self, tree: Tree, dec, draft=None) -> None:
        """Round 0's tree (built on the host from the prefill's draft, ddtree.decode.reference.Draft) goes up."""

    def plan(self, r: int, dec) -> Plan:
        raise NotImplementedError

    def read(self, r: int, out: RoundOut, T: int) -> int:
        """Round r's packet. -> the depth of round r's tree (for its record)."""
        return 0

    def every_plan(self, dec) -> list[Plan]:
        """Every plan `plan` can return (ddtree.decode.auto.capture_ahead captures their graph
        pieces before a generation): a fixed policy's one."""
        self.slot = dec.slot(self.T_max)
        return [self.plan(0, dec)]


class PlainSteps(Policy):
    """`ar`: every round verifies the bonus alone; its step writes the chosen token as the next root."""

    taps = False

    def begin(self, tree, dec, draft=None):
        self.slot = dec.slot(1)
        self.slot.load(tree)

    def plan(self, r, dec):
        return Plan(slot=self.slot, into=self.slot, build=None, walk=1, context="none")


class Chain(Policy):
    """`dflash`: the drafter's top-1 chain of the block every round; `Fixed(b)`: the best-first tree
    of b draft nodes. The step builds the next one into the same slot (E: its depth)."""

    E = 1

    def __init__(self, block: int, budget: int | None = None, k: int = 1):
        self.P = block
        self.build = "chain" if budget is None else budget
        self.T_max = block if budget is None else budget + 1
        self.k = k
        self.depths: dict[int, int] = {}

    def begin(self, tree, dec, draft=None):
        self.slot = dec.slot(self.T_max)
        self.slot.load_with_ranks(tree)
        self.depths = {0: int(tree.depths.max())}

    def plan(self, r, dec):
        s = self.slot
        return Plan(slot=s, into=s, build=self.build, walk=self.P, k=self.k, keep=(s.ints, s.mask, s.ranks))

    def read(self, r, out, T):
        self.depths[r + 1] = int(out.extra[0])
        return self.depths.pop(r)


def Fixed(block: int, budget: int, k: int) -> Chain:
    return Chain(block, budget, k)


@dataclass
class Auto(Policy):
    """`--budget auto`: every drafting step stages what BudgetChooser.build_for says: a best-first
    tree of that budget, summarised per prefix (E_q and depth), or the block's top-1 chain (its
    E_q; every drafting step also reports the chain's E_q, so the chain's average stays current
    under trees). When the host queues round r + 1 it verifies what is staged (a tree where its
    step built it, in its budget's verify slot; a chain after a tiny piece copies it into its own)
    or takes 0, a plain step (the tiny piece copies the staged root into the one-node slot).
    Trees draft with k columns whatever their budget: one compiled draft for all of them.

    A plain step costs what an `ar` step costs: its verify is the bonus alone, its step walks,
    commits and keeps the root's tap row aside ("defer"; the drafter's context gets the deferred
    rows at the next drafting step, "flush"), and writes the chosen token as the next root. Every
    chooser.probe_every-th plain step in a row drafts again (a probe; sooner where the chooser's
    measurements say drafting would pay), and the round after it verifies what it staged whatever
    the chooser thinks (a smaller sample would leave a smaller staged tree, and the choice after it
    only that to pick from): the acceptance ratio only learns from drafts verified, so without that
    sample one bad start would keep auto on plain steps for good. The probe's draft also restarts
    the E_q averages it covers (BudgetChooser.observe): the ones before the plain run say little
    about the text now.
    Rounds are timed by `clock` between the host's reads, except round 0, rounds during which a
    graph was captured (`new_keys` moved) and rounds whose successor differs in kind (plain, probe,
    tree, chain), arm or build: the span between two reads also holds the queueing of the next round."""

    chooser: BudgetChooser
    block: int
    k: int
    budgets: tuple = ()
    staged: dict = field(default_factory=dict)  # round -> what its step staged: a tree budget, or CHAIN
    summary: dict = field(default_factory=dict)  # round -> (E_q per arm, depth per arm) of what it verifies, or None
    drafted: dict = field(default_factory=dict)  # round -> did its step draft
    kinds: dict = field(default_factory=dict)  # round -> "tree", "chain", "plain" or "probe" (a plain step that drafts)
    arms: dict = field(default_factory=dict)  # round -> its arm (0, CHAIN or a tree budget)
    plain_run: int = 0  # plain steps in a row
    sampled: bool = False  # the last drafted round was a probe's sample
    t_last: float | None = None  # when the host read the last round (None: none yet, or it captured)
    clock: Callable[[], float] = time.perf_counter  # seconds (the simulation drives its own)
    new_keys: Callable[[], int] = lambda: 0  # graph keys run for the first time so far (GraphRunner.new_keys)

    defers = True

    def __post_init__(self):
        self.budgets = tuple(sorted(self.chooser.verify_ms))
        self.nb = self.budgets[-1]
        # extra: E_q per tree prefix [nb], depth per prefix [nb], the chain's E_q [1]
        self.P, self.E, self.T_max = self.block, 2 * self.nb + 1, self.nb + 1

    def begin(self, tree, dec, draft=None):
        """Round 0 verifies what build_for stages: the best-first tree (`tree`, the largest budget)
        cut to that budget, or the draft's top-1 chain."""
        top1 = draft.topk_lp[:, 0].astype(float)
        first = self.start(expected_accepts(tree.scores, self.budgets), {b: int(tree.depths[: b + 1].max()) for b in self.budgets},
                           float(np.exp(np.cumsum(top1)).sum()))
        if first == CHAIN:
            self.stage_of(dec, CHAIN).load_with_ranks(Tree.chain([int(tree.tokens[0])] + draft.topk_ids[:, 0].tolist()))
        else:
            self.stage_of(dec, first).load_with_ranks(tree.truncate(first + 1))
        self.new_keys = lambda: dec.graphs.new_keys
        self.keys_seen = self.new_keys()

    def start(self, eq: dict[int, float], depth: dict[int, int], chain: float = 0.0) -> int:
        """Round 0's draft: its tree's E_q and depth per budget, the chain's E_q (the host-side part
        of begin). -> what round 0 verifies (the chooser's build: CHAIN or a tree budget)."""
        ch = self.chooser
        self.latest = dict(eq)  # E_q per arm of the newest draft the host has read (the chain's too)
        if ch.chain:
            self.latest[CHAIN] = chain
        ch.observe(self.latest)
        first = ch.build_for(ch.last_build, -1)
        self.summary = {0: ({CHAIN: chain}, {CHAIN: self.block - 1}) if first == CHAIN else (eq, depth)}
        self.staged, self.drafted = {-1: first}, {-1: True}
        self.t_last, self.keys_seen = None, self.new_keys()  # round 0's wall holds two launches: not timed
        return first

    def at_hand(self, src: int) -> dict[int, float]:
        """E_q of what a round verifies when `src` is staged: the staged arm itself (the newest
        figure the host has: the draft before, or the average). The round's E_q decides a plain
        step against it; which arm is staged is build_for's choice. (A prefix of the staged tree
        would be a graph key of its own in each context bucket, and a key's first capture costs
        13 to 15 ms on the H200's codepair rounds.)"""
        avg = self.chooser.mem.eq_avg
        return {src: self.latest.get(src, avg.get(src, 0.0))}

    def plan(self, r, dec):
        ch = self.chooser
        after_draft = self.drafted[r - 1]
        src = self.staged[r - 1]
        if after_draft and self.plain_run:  # the round after a probe verifies its draft: an acceptance sample
            b, self.sampled = src, True
        elif after_draft:
            b = ch.pick_eq(self.at_hand(src))[0]
            if self.sampled:  # the choice after that sample: another plain step backs the probes off
                ch.probe_answered(b)
                self.sampled = False
        else:
            b = 0
        plain = b == 0
        self.plain_run = self.plain_run + 1 if plain else 0
        # a plain step drafts (a probe) when its interval is up, or as soon as drafting would pay
        drafting = not plain or self.plain_run % ch.probe_every == 0 or (not after_draft and ch.wants_tree(self.latest))
        self.drafted[r] = drafting
        self.kinds[r] = ("chain" if b == CHAIN else "tree") if not plain else "probe" if drafting else "plain"
        self.arms[r] = b
        for d in (self.drafted, self.kinds, self.arms, self.staged):
            d.pop(r - 2, None)
        build = self.staged[r] = ch.build_for(b, r)
        return self.make_plan(dec, b, build if drafting else None, src if after_draft else None)

    def make_plan(self, dec, b: int, build: int | None, src: int | None) -> Plan:
        """The plan of a round of arm b (0: a plain step) whose step stages `build` (None: it does not
        draft), after a step that staged `src` (None: a plain step that did not draft)."""
        slot = dec.slot(self.chooser.nodes(b) + 1)
        # after a plain step slot(1) holds the root; else the root (and the tree) come from the
        # staged draft: a staged tree verified whole is read where its step built it (its slot)
        prefix_of = None if src is None or (src == b and src != CHAIN) else self.stage_of(dec, src)
        if build is None:  # a plain step: the chosen token becomes slot(1)'s root
            return Plan(slot=slot, into=dec.slot(1), build=None, walk=1, prefix_of=prefix_of,
                        summary=self.nb, context="defer")
        into = self.stage_of(dec, build)
        chain, plain = build == CHAIN, b == 0
        return Plan(slot=slot, into=into, build="chain" if chain else build, walk=1 if plain else self.P,
                    k=1 if chain else self.k, arm=b, prefix_of=prefix_of, summary=self.nb,
                    context="flush" if plain else "path", keep=(into.ints, into.mask, into.ranks))

    def every_plan(self, dec) -> list[Plan]:
        """Every plan `plan` can return, whatever the chooser measures: after a plain step that did
        not draft, a plain step; after a draft that staged arm a, a plain step or a; a plain step
        stages any drafting arm or nothing, a tree or chain round any drafting arm.
        (ddtree.decode.auto.capture_ahead captures their graph pieces before a generation.)"""
        arms = [a for a in (CHAIN, *self.budgets) if self.chooser.drafts(a)]
        plans = []
        for src in (None, *arms):
            for b in (0,) if src is None else (0, src):
                for build in (None, *arms) if b == 0 else arms:
                    plans.append(self.make_plan(dec, b, build, src))
        return plans

    def stage_of(self, dec, build: int):
        """Where a step stages a build: the chain in its own slot (its shape fixed: the chain
        step writes tokens only), copied into the verify slot when verified; a tree budget b in
        the verify slot of b + 1 nodes, which a round verifying that tree reads as it is (as a
        fixed budget's rounds do) and a plain step copies its root from."""
        return dec.chain_stage(self.block) if build == CHAIN else dec.slot(build + 1)

    def read(self, r, out, T):
        ch, now, keys = self.chooser, self.clock(), self.new_keys()
        eq, depth_of = self.summary.pop(r) or ({}, {})
        arm = self.arms.get(r, T - 1)
        # the round's wall time: from the last read to this one. That span holds the host queueing
        # round r + 1 too (on a CPU, running it), so it is the round's only where round r + 1 is
        # the same (kind, arm and build); and not where a graph was captured meanwhile
        steady = all(d.get(r + 1) == d.get(r) for d in (self.kinds, self.arms, self.staged))
        ms = None if self.t_last is None or keys != self.keys_seen or not steady else (now - self.t_last) * 1e3
        self.keys_seen = keys
        if T == 1:  # a plain step
            depth = 0
            ch.update_plain(ms)
        else:
            depth = depth_of.get(arm, T - 1)
            ch.update(arm, eq.get(arm, 0.0), out.n - 1, ms)
        self.t_last = now
        # --verbose: what auto chose and saw each round (formatted only when debug logs are on)
        logger.opt(lazy=True).debug("auto round {}: budget {} ({}), {} tokens, E_q {}, {} ms, probe every {}",
                                    lambda: r, lambda: T - 1,
                                    lambda: "plain" if T == 1 else "chain" if arm == CHAIN else "tree", lambda: out.n,
                                    lambda: "-" if T == 1 else f"{eq.get(arm, 0.0):.2f}",
                                    lambda: "-" if ms is None else f"{ms:.2f}", lambda: ch.probe_every)
        nb, h = self.nb, out.extra
        if h[nb] >= 1:  # the step drafted (its one-node prefix's depth is 1)
            built = self.staged.get(r, nb)
            if built == CHAIN:
                seen = {CHAIN: h[2 * nb]}
                self.summary[r + 1] = (seen, {CHAIN: self.block - 1})
            else:
                cover = [b for b in self.budgets if b <= built]
                seen = {b: h[b - 1] for b in cover}
                self.summary[r + 1] = (dict(seen), {b: int(h[nb + b - 1]) for b in cover})
                if ch.chain:
                    seen[CHAIN] = h[2 * nb]
            self.latest = seen
            ch.observe(seen, restart=self.kinds.get(r) == "probe")
        else:
            self.summary[r + 1] = None
        return depth


def auto_summary(summary: tuple[torch.Tensor, torch.Tensor], nb: int, statics, chain: torch.Tensor) -> torch.Tensor:
    """--budget auto's packet extra from a staged tree of B <= nb draft nodes: [E_q(b) for b = 1..nb,
    depth of b's prefix for b = 1..nb, the chain's E_q], zeros past B. A staged chain's: its
    E_q and depth per prefix likewise (B: the block less its root)."""
    eq, depth = summary
    B = eq.shape[0]
    pad = [statics.full(nb - B, 0.0)] if nb > B else []
    return torch.cat([eq, *pad, depth.float(), *pad, chain.view(1).float()])


def chain_probs(lp: torch.Tensor) -> torch.Tensor:
    """lp [D, k] top-k log-probs (sorted) -> [D] the path probability of each prefix of the top-1 chain."""
    return torch.cumsum(lp[:, 0].float(), 0).exp()


def chain_summary(lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """lp [D, k] -> the top-1 chain's (E_q per prefix [D], depth per prefix [D]); its E_q is the last."""
    return torch.cumsum(chain_probs(lp), 0), torch.arange(1, lp.shape[0] + 1, device=lp.device)

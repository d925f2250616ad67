"""What each round verifies: the budget policies (plain steps, the chain, a fixed budget, auto).

A policy decides, when round r is queued, which tree its verify reads and what its step builds
for round r + 1 (`plan`), and reads round r's packet when the host gets it (`read`). The round
itself (ddtree.decode.round) is the same for all of them:

    policy      verifies                      the step after it builds           packet extra
    Plain (ar)  the bonus alone (1 node)      nothing: the bonus is the next root  -
    Chain       the block's chain (B nodes)   the next chain                       next depth
    Fixed(b)    a best-first tree of b + 1    the next tree of b                   next depth
    Auto        a prefix of the staged tree   a staged tree (or a plain step)      E_q and depth per prefix

`BudgetChooser` is auto's cost model: expected tokens per millisecond of each budget.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch
from loguru import logger

from ddtree.decode.buffers import RoundOut, Slot
from ddtree.model.drafter import DEFERRED_ROWS
from ddtree.ops.tree import Tree

AUTO_BUDGETS = (4, 8, 15, 32, 64)  # 15 draft nodes = the block-16 chain's verify size
AUTO_TOPK = 32  # drafter top-k columns of auto's trees (a 64-node tree rarely needs a 33rd token per position)
PLAIN_PROBE = 16  # auto: after this many plain steps in a row, one drafts again (a fresh E_q curve)
PLAIN_PROBE_MAX = DEFERRED_ROWS  # ... and after probes that did not pay, up to this many (doubling; the
#                                  drafter's cache has room for that many deferred context rows)
ROUND_SAMPLES = 8  # auto: an arm's round cost is the median of its last this many timed rounds


class AutoMemory:
    """What --budget auto has measured on this machine, shared by the generations of one decoder
    (ddtree.decode.auto.calibrate keeps one per context bucket and choice mode), so a later
    generation starts from it instead of from the calibration's verify-only figures:

    round_ms: arm -> the wall ms of its last ROUND_SAMPLES timed rounds (arm 0: a plain step; a
              round is timed from the host's read of the round before it to its own read, so it
              is the whole round: verify, step, drafter, tree, prefix copy and host work);
    acc, pred: the decayed sums of accepted draft tokens and of E_q over the tree rounds;
    probe_every: the plain-run length after which a plain step drafts again (a probe)."""

    def __init__(self):
        self.round_ms: dict[int, deque] = {}
        self.eq_avg: dict[int, float] = {}  # budget -> decayed average of the staged trees' E_q
        self.cost_ms: dict[int, float] = {}  # arm -> the median of round_ms[arm]
        self.acc = self.pred = 1.0  # prior: the drafter's probabilities are honest
        self.probe_every = PLAIN_PROBE


class BudgetChooser:
    """`--budget auto`: each round, the arm with the most expected committed tokens per wall-clock
    millisecond. Arms: 0 (a plain step: the bonus alone, no drafter) and the best-first budgets b.

        rate(0) = 1 / cost(0)
        rate(b) = (1 + ratio(b) * E_q(b)) / cost(b)

    cost(arm) is what the arm's rounds measured on this machine (the median of its last
    ROUND_SAMPLES timed rounds: see Auto for which rounds are timed); until an
    arm has a timed round, its calibrated verify (`verify_ms`, `plain_ms`: one timed verify per
    budget) plus what the timed arms of its kind (plain, or trees) spent beyond their verifies
    (before any tree round is timed, a tree's extra is the calibrated draft, `draft_ms`).
    E_q(b) is the sum of the drafter's path probabilities over the tree's first b nodes (the
    expected accepted length if the drafter were calibrated); ratio = accepted / E_q over the tree
    rounds so far (decayed). The round's E_q chooses among the budgets; a plain step against the
    trees is decided on the staged trees' average E_q (plain_pays). The pop order of a best-first
    tree is the same for every budget, so the tree of budget b is the first b + 1 nodes of the largest one.

    After PLAIN_PROBE plain steps in a row (or sooner, once the measurements say a tree would pay)
    one drafts again (a probe) and the next round verifies that tree (a sample of the acceptance);
    each sample the chooser answers with another plain step doubles the interval, up to
    PLAIN_PROBE_MAX, so where trees never pay auto is `ar` plus rare probes.
    """

    def __init__(self, verify_ms: dict[int, float], decay: float = 0.9, plain_ms: float | None = None,
                 memory: AutoMemory | None = None, draft_ms: float = 0.0):
        self.verify_ms = verify_ms  # budget -> ms of one verify of budget + 1 nodes (calibration)
        self.draft_ms = draft_ms  # one draft (calibration; 0 where rounds are graphed): a tree's extra until timed
        self.decay = decay
        self.plain_ms = plain_ms  # verify of the bonus alone with taps, or None: trees only
        self.mem = memory or AutoMemory()
        bs = sorted(verify_ms)
        self.last_tree = bs[min(2, len(bs) - 1)] if bs else 0  # the last tree budget chosen (15 by default)

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

    def _base(self, arm: int) -> float:
        return self.plain_ms if arm == 0 else self.verify_ms[arm]

    def cost(self, arm: int) -> float:
        """ms of a round of `arm` (0: a plain step)."""
        known = self.mem.cost_ms
        if arm in known:
            return known[arm]
        kin = [ms - self._base(a) for a, ms in known.items() if (a == 0) == (arm == 0) and (a == 0 or a in self.verify_ms)]
        return self._base(arm) + (sum(kin) / len(kin) if kin else 0.0 if arm == 0 else self.draft_ms)

    def rates(self, eq: dict[int, float], cap: int | None = None) -> dict[int, float]:
        """Expected tokens per ms of every arm the tree at hand covers (eq: budget -> its E_q)."""
        rate = {b: (1 + self.ratio() * eq[b]) / self.cost(b) for b in self.verify_ms
                if b in eq and (cap is None or b <= cap)}
        if self.plain_ms is not None:
            rate[0] = 1.0 / self.cost(0)
        return rate

    # ---------------------------------------------------------------- choices
    def pick(self, scores: list[float]) -> tuple[int, float]:
        """scores: path log-probabilities of a best-first tree's nodes (root first).
        -> (budget, its predicted accepted length E_q)."""
        return self.pick_eq(expected_accepts(scores, self.verify_ms))

    def pick_eq(self, eq: dict[int, float], cap: int | None = None) -> tuple[int, float]:
        """eq: budget -> E_q(budget) of the tree at hand (or the latest one seen); the candidates are
        the budgets it covers, up to cap (the budget of the tree that will be truncated), and 0.
        The round's E_q chooses among the budgets; plain steps against trees is the arms' average
        (`plain_pays`): one low E_q would buy a plain step and a probe's drafting to come back,
        unless no tree at hand is worth its verify (`worth_verify`).
        -> (arm, its E_q)."""
        rate = self.rates(eq, cap)
        rate.pop(0, None)
        if not rate or self.plain_pays(eq) or not self.worth_verify(eq, rate):
            return 0, 0.0
        best = max(rate, key=rate.get)
        return best, eq[best]

    def observe(self, eq: dict[int, float], restart: bool = False):
        """A staged tree's E_q per budget, as the host reads it: the decayed average behind plain_pays.
        restart: the tree a probe drafted after a plain run: the average starts again from it. The
        trees averaged before the run are as old as the run, and the text has moved on (on the
        H200's codepair runs a probe whose tree accepted 3 tokens was answered by 64 more plain
        steps, the average still that of the trees before; `scripts/simulate_auto.py --bench`)."""
        avg, d = self.mem.eq_avg, self.decay
        if restart:
            avg.clear()
        for b, e in eq.items():
            avg[b] = e if b not in avg else d * avg[b] + (1 - d) * e

    def plain_pays(self, eq: dict[int, float] | None = None) -> bool:
        """Does a plain step beat the best tree on the average E_q seen (on eq before any)?"""
        if self.plain_ms is None:
            return False
        avg = self.mem.eq_avg or eq or {}
        trees = [(1 + self.ratio() * e) / self.cost(b) for b, e in avg.items() if b in self.verify_ms]
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
        return any((1 + self.ratio() * eq[b]) * plain >= min(self.cost(b), self.verify_ms[b]) for b in budgets)

    def wants_tree(self, eq: dict[int, float]) -> bool:
        """During plain steps: would trees pay now, on the measurements? (Then the next plain step
        drafts: a probe before its interval is up.)"""
        return self.plain_ms is not None and bool(eq) and not self.plain_pays(eq)

    def build_for(self, b: int, r: int) -> int:
        """The budget of the tree round r's step stages for round r + 1, given round r's own budget
        b (0: a plain step). Building bigger than the choice costs more drafting work than it
        returns, so it is one budget above b (the next round then sees the bigger tree's E_q and
        may truncate it: the choice can climb every round); after plain steps, the last tree
        budget chosen."""
        if b == 0:
            return self.last_tree
        self.last_tree = b
        up = [x for x in sorted(self.verify_ms) if x > b]
        return up[0] if up else b

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

    def update_plain(self, wall_ms: float | None):
        """A plain step's wall time (the time between two reads)."""
        self.timed(0, wall_ms)

    def update(self, budget: int, predicted: float, accepted: int, wall_ms: float | None):
        """A tree round of `budget`: its E_q, the draft tokens it accepted, its wall time."""
        d, m = self.decay, self.mem
        m.acc, m.pred = d * m.acc + accepted, d * m.pred + max(predicted, 1e-6)
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

    def begin(self, tree: Tree, dec) -> None:
        """Round 0's tree (built on the host from the prefill's draft) goes up."""

    def plan(self, r: int, dec) -> Plan:
        raise NotImplementedError

    def read(self, r: int, out: RoundOut, T: int) -> int:
        """Round r's packet. -> the depth of round r's tree (for its record)."""
        return 0


class PlainSteps(Policy):
    """`ar`: every round verifies the bonus alone; its step writes the chosen token as the next root."""

    taps = False

    def begin(self, tree, dec):
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

    def begin(self, tree, dec):
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
    """`--budget auto`: every drafting step builds a best-first tree into a staging slot of its
    build budget (BudgetChooser.build_for) and summarises every prefix (E_q and depth); when the
    host queues round r + 1 it picks its budget among those the staged tree covers (or 0, a plain
    step), and a tiny piece copies that prefix into the budget's own slot.

    A plain step costs what an `ar` step costs: its verify is the bonus alone, its step walks,
    commits and keeps the root's tap row aside ("defer"; the drafter's context gets the deferred
    rows at the next drafting step, "flush"), and writes the chosen token as the next root. Every
    chooser.probe_every-th plain step in a row drafts again (a probe; sooner where the chooser's
    measurements say a tree would pay), and the round after it verifies that tree whatever the
    chooser thinks (a smaller sample would leave a smaller staged tree, and the choice after it
    only that to pick from): the acceptance ratio only learns from trees verified, so without that
    sample one bad start would keep auto on plain steps for good. The probe's tree also restarts
    the E_q average that decides plain steps against trees (BudgetChooser.observe): the trees
    before the plain run say little about the text now.
    Rounds are timed by `clock` between the host's reads, except round 0, rounds during which a
    graph was captured (`new_keys` moved) and rounds whose successor is of another kind (plain,
    probe, tree): the span between two reads also holds the queueing of the next round."""

    chooser: BudgetChooser
    block: int
    k: int
    budgets: tuple = ()
    staged: dict = field(default_factory=dict)  # round -> build budget of the tree its step staged
    summary: dict = field(default_factory=dict)  # round -> (E_q per budget, depth per budget) of its tree, or None
    drafted: dict = field(default_factory=dict)  # round -> did its step draft a tree
    kinds: dict = field(default_factory=dict)  # round -> "tree", "plain" or "probe" (a plain step that drafts)
    plain_run: int = 0  # plain steps in a row
    sampled: bool = False  # the last tree round was a probe's sample
    t_last: float | None = None  # when the host read the last round (None: none yet, or it captured)
    clock: Callable[[], float] = time.perf_counter  # seconds (the simulation drives its own)
    new_keys: Callable[[], int] = lambda: 0  # graph keys run for the first time so far (GraphRunner.new_keys)

    defers = True

    def __post_init__(self):
        self.budgets = tuple(sorted(self.chooser.verify_ms))
        self.nb = self.budgets[-1]
        self.P, self.E, self.T_max = self.block, 2 * self.nb, self.nb + 1

    def begin(self, tree, dec):
        stage = dec.stage(self.nb + 1)
        stage.load_with_ranks(tree)
        self.new_keys = lambda: dec.graphs.new_keys
        self.start(expected_accepts(tree.scores, self.budgets), {b: int(tree.depths[: b + 1].max()) for b in self.budgets})

    def start(self, eq: dict[int, float], depth: dict[int, int]):
        """Round 0's tree: its E_q and depth per budget (the host-side part of begin)."""
        self.summary = {0: (eq, depth)}
        self.latest = eq  # E_q per budget of the newest tree the host has read
        self.chooser.observe(eq)
        self.staged, self.drafted = {-1: self.nb}, {-1: True}
        self.t_last, self.keys_seen = None, self.new_keys()  # round 0's wall holds two launches: not timed

    def plan(self, r, dec):
        ch = self.chooser
        after_tree = self.drafted[r - 1]
        src = self.staged[r - 1]
        if after_tree and self.plain_run:  # the round after a probe verifies its tree: an acceptance sample
            b, self.sampled = src, True
        elif after_tree:
            b = ch.pick_eq(self.latest, cap=src)[0]
            if self.sampled:  # the choice after that sample: another plain step backs the probes off
                ch.probe_answered(b)
                self.sampled = False
        else:
            b = 0
        plain = b == 0
        self.plain_run = self.plain_run + 1 if plain else 0
        # a plain step drafts (a probe) when its interval is up, or as soon as a tree would pay
        drafting = not plain or self.plain_run % ch.probe_every == 0 or (not after_tree and ch.wants_tree(self.latest))
        self.drafted[r] = drafting
        self.drafted.pop(r - 2, None)
        self.kinds[r] = "tree" if not plain else "probe" if drafting else "plain"
        self.kinds.pop(r - 2, None)
        slot = dec.slot(b + 1)
        b_build = self.staged[r] = ch.build_for(b, r)
        self.staged.pop(r - 2, None)
        prefix_of = dec.stage(src + 1) if after_tree else None  # after a plain step slot(1) holds the root
        if not drafting:  # a plain step: the chosen token becomes slot(1)'s root
            return Plan(slot=slot, into=dec.slot(1), build=None, walk=1, prefix_of=prefix_of,
                        summary=self.nb, context="defer")
        into = dec.stage(b_build + 1)
        return Plan(slot=slot, into=into, build=b_build, walk=1 if plain else self.P, k=min(self.k, b_build),
                    prefix_of=prefix_of, summary=self.nb, context="flush" if plain else "path",
                    keep=(into.ints, into.mask, into.ranks))

    def read(self, r, out, T):
        ch, now, keys = self.chooser, self.clock(), self.new_keys()
        eq, depth_of = self.summary.pop(r) or ({}, {})
        # the round's wall time: from the last read to this one. That span holds the host queueing
        # round r + 1 too (on a CPU, running it), so it is the round's only where round r + 1 is of
        # its kind; and not where a graph was captured meanwhile
        steady = self.kinds.get(r + 1) == self.kinds.get(r)
        ms = None if self.t_last is None or keys != self.keys_seen or not steady else (now - self.t_last) * 1e3
        self.keys_seen = keys
        if T == 1:  # a plain step
            depth = 0
            ch.update_plain(ms)
        else:
            depth = depth_of[T - 1]
            ch.update(T - 1, eq[T - 1], out.n - 1, ms)
        self.t_last = now
        # --verbose: what auto chose and saw each round (formatted only when debug logs are on)
        logger.opt(lazy=True).debug("auto round {}: budget {} ({}), {} tokens, E_q {}, {} ms, probe every {}",
                                    lambda: r, lambda: T - 1, lambda: "plain" if T == 1 else "tree", lambda: out.n,
                                    lambda: "-" if T == 1 else f"{eq[T - 1]:.2f}",
                                    lambda: "-" if ms is None else f"{ms:.2f}", lambda: ch.probe_every)
        nb, h = self.nb, out.extra
        if h[nb] >= 1:  # the step drafted a tree (its depth-of-one-node prefix is 1)
            cover = [b for b in self.budgets if b <= self.staged.get(r, nb)]
            self.summary[r + 1] = ({b: h[b - 1] for b in cover}, {b: int(h[nb + b - 1]) for b in cover})
            self.latest = self.summary[r + 1][0]
            ch.observe(self.latest, restart=self.kinds.get(r) == "probe")
        else:
            self.summary[r + 1] = None
        return depth


def auto_summary(summary: tuple[torch.Tensor, torch.Tensor], nb: int, statics) -> torch.Tensor:
    """--budget auto's packet extra from a staged tree of B <= nb draft nodes: [E_q(b) for b = 1..nb,
    depth of b's prefix for b = 1..nb], zeros past B."""
    eq, depth = summary
    B = eq.shape[0]
    pad = [statics.full(nb - B, 0.0)] if nb > B else []
    return torch.cat([eq, *pad, depth.float(), *pad])

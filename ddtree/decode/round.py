"""One round of every method, in the order it runs on the device:

    verify --> choose --> walk --> commit --> drafter context --> draft --> next tree --> packet
      ^        (per node: argmax,  (accepted   (target K/V,        (top-k of   (chain or          |
      |         or a sample)        path)       GDN states)         the block)  best-first)        |
      +---- round r + 1 is queued before the host reads round r's packet: ONE device-to-host copy -+

`ar`, `dflash` and `ddtree` (a fixed budget or `--budget auto`) all run this pipeline; what differs
is the policy (ddtree.decode.budget): which tree a verify reads and what its step builds. `ar` is
the plain step: a one-node tree, no drafter, and the chosen token written as the next root.

The walk starts at the root, takes the target's own token at the current node, moves to the child
holding it and stops where no child does; that token is the next bonus (root). Every emitted token
is a token the target chose given exactly the prefix before it, so outputs equal the target's own
decoding: token for token when greedy, in distribution when sampling.

Everything that depends on acceptance stays on the device: round r + 1's verify is queued with
its context bucket taken for the longest possible acceptance (the attention masks use the true
length on the device), so the host reads round r while the device runs round r + 1.
Reference twin: the host-tree loop (ddtree.decode.reference).
"""

from __future__ import annotations

import time

import torch

from ddtree.decode.budget import PLAIN_PROBE_MAX, Plan, Policy, auto_summary, chain_probs, chain_summary
from ddtree.decode.buffers import HostRing, Packet
from ddtree.decode.graphs import PrefixKey, StepKey
from ddtree.stats import RoundRecord

# A queued round's committed length is at least its upper bound less what the round before it may
# still commit (its path length P): Decoder.start_floor subtracts this margin, so P must not pass it.
AHEAD_MARGIN = 256


def emit(toks: list[int], room: int, stop_ids) -> tuple[list[int], bool]:
    """A round's tokens as emitted: at most `room`, cut after the first stop token. -> (tokens, stopped)."""
    toks = toks[:room]
    for i, t in enumerate(toks):
        if t in stop_ids:
            return toks[: i + 1], True
    return toks, False


class DeferredContext:
    """Tap rows of --budget auto's plain steps, kept until the next drafting step adds them to the
    drafter's context with its own path (a plain step then runs no drafter layer at all)."""

    def __init__(self, width: int, dev, dtype, rows: int = PLAIN_PROBE_MAX):
        self.rows = torch.zeros(rows, width, device=dev, dtype=dtype)  # [Q, taps * hidden]
        self.count = torch.zeros((), dtype=torch.long, device=dev)
        self.index = torch.arange(rows, device=dev)

    @classmethod
    def for_models(cls, cfg, dcfg, dev, dtype) -> "DeferredContext":
        """The context of a target config and its drafter's (rows of taps x hidden), on the drafter's device."""
        return cls(cfg.hidden_size * len(dcfg.target_layer_ids), dev, dtype)

    def push(self, drafter, taps: torch.Tensor):
        """taps [1, W] (a plain verify's root) -> rows[count]; count += 1 (on the drafter's stage)."""
        taps, = drafter.enter(drafter.stage, taps)
        self.rows.index_copy_(0, self.count.view(1), taps[:1].to(self.rows.dtype))
        self.count += 1

    def flush(self, drafter, taps: torch.Tensor, path: torch.Tensor, n: torch.Tensor):
        """Add the deferred rows, then the path's rows of taps [T, W], in one fixed-shape call."""
        taps, path, n = drafter.enter(drafter.stage, taps, path, n)
        Q, P = self.rows.shape[0], path.shape[0]
        i = torch.arange(Q + P, device=path.device)
        rows = torch.where(i < self.count, i, Q + path.gather(0, (i - self.count).clamp(0, P - 1)))  # [Q + P]
        drafter.add_context(torch.cat([self.rows, taps.to(self.rows.dtype)]), self.count + n, rows=rows)
        self.count.zero_()


def reserve_deferred(dec) -> None:
    """The decoder's DeferredContext, once: at load where the run is --budget auto (the memory
    plan counts it with the models), else at the first auto generation (before any capture:
    graphs keep its buffers' addresses)."""
    if dec.deferred is None:
        dec.deferred = DeferredContext.for_models(dec.target.cfg, dec.drafter.cfg, dec.drafter.device, dec.target.dtype)


class Pipeline:
    """Runs the rounds of one generation for `policy` (see the module docstring)."""

    def __init__(self, dec, policy: Policy, sampling, gen, clock):
        self.dec, self.policy, self.sampling, self.gen, self.clock = dec, policy, sampling, gen, clock
        assert policy.P <= AHEAD_MARGIN, f"path length {policy.P} past the queued rounds' margin {AHEAD_MARGIN}"
        self.packet = Packet(policy.P, policy.E)
        self.ring = HostRing(self.packet.size, dec.device)
        self.zeros = dec.statics.full(policy.E, 0.0) if policy.E else None
        if policy.defers:
            reserve_deferred(dec)
        if dec.deferred is not None:
            dec.deferred.count.zero_()  # a generation starts with nothing deferred

    # ---------------------------------------------------------------- the host side
    def run(self, out: list[int], start: int, max_new: int, stop_ids, on_tokens, rounds: list, pending: list):
        """Rounds until max_new tokens, a stop token, or on_tokens returning True (a stop string, a
        cancelled request: the round in flight is still committed, as after a stop token); appends
        to out, rounds and pending (stage marks)."""
        dec, P = self.dec, self.policy.P
        sizes: dict[int, int] = {}
        marks = {0: self.launch(0, start, sizes)}
        r = 0
        while True:
            h0 = time.perf_counter()
            # round r + 1 starts at most P past round r's start: queue it now if that fits
            ahead = len(out) + 1 < max_new and start + P + self.policy.T_max + P <= dec.max_len
            if ahead:
                marks[r + 1] = self.launch(r + 1, start + P, sizes)
            w0 = time.perf_counter()
            got = self.packet.read(self.ring.get(r))  # the round's one device-to-host sync
            wait_s = time.perf_counter() - w0
            T = sizes.pop(r)
            depth = self.policy.read(r, got, T)
            start += got.n
            toks, stopped = emit(got.tokens[1:] + [got.bonus], max_new - len(out), stop_ids)
            out.extend(toks)
            halt = bool(on_tokens(toks)) if on_tokens else False  # True: the caller ends the generation here
            rounds.append(RoundRecord(tree_size=T - 1, tree_depth=depth, accepted=got.n - 1, accepted_ranks=got.ranks,
                                      committed=len(toks), times_ms={}))
            pending.append(marks.pop(r) + [("host", (time.perf_counter() - h0 - wait_s) * 1e3)])
            if stopped or halt or len(out) >= max_new:
                return
            if not ahead:
                marks[r + 1] = self.launch(r + 1, start, sizes)
            r += 1

    def launch(self, r: int, start_bound: int, sizes: dict) -> list:
        """Queue round r (its committed length is at most start_bound): verify, then its step."""
        dec, clock = self.dec, self.clock
        plan = self.policy.plan(r, dec)
        slot = plan.slot
        if plan.prefix_of is not None:  # auto: this round's tree is a prefix of the staged one
            src = plan.prefix_of
            slot.device_written()
            dec.graphs.run(PrefixKey(slot.T, src.T - 1, src.chain), lambda: dec.copy_prefix(slot, src))
        if plan.build is not None:  # its step rewrites into's tree on the device: a host load then uploads it whole
            plan.into.device_written()
        sizes[r] = slot.T
        kv_len = dec.kv_len(start_bound + slot.T)
        draft_kv = dec.kv_len(start_bound + self.policy.P)
        e0 = clock.now()
        vkey, taps = dec.verify(slot, kv_len, self.sampling, self.gen, self.policy.taps)
        e1 = clock.now()
        packet = dec.graphs.run(self.step_key(plan, vkey, draft_kv), lambda: self.step(plan, taps, draft_kv),
                                keep=plan.keep)
        e2 = clock.now()
        self.ring.put(r, packet)
        return [("verify", e0, e1), ("draft", e1, e2)]

    def step_key(self, plan: Plan, vkey, draft_kv: int) -> StepKey:
        """The graph key of the step after verify `vkey` under `plan`."""
        return StepKey(vkey, self.policy.P, plan.walk, draft_kv, plan.k, self.sampling.temperature_or_none,
                       plan.build, plan.into.T, plan.summary, plan.context)

    # ---------------------------------------------------------------- the device side (one graph)
    def step(self, plan: Plan, taps, draft_kv: int) -> torch.Tensor:
        """Everything after a verify: walk -> commit -> drafter context -> draft -> next tree.
        -> the packet (ddtree.decode.buffers.Packet). On a split target: home (walk) -> stage 0
        (commit; the draft block's embedding) -> .. -> the last stage (commit, and the rest when
        the drafter is there, as placement puts it)."""
        dec = self.dec
        dec.target.enter(dec.home)
        plan.slot.device_written()
        plan.into.device_written()
        head = dec.statics.header(self.policy.P)
        path, n, bonus = dec.walk(plan.slot, plan.walk, head)  # the accepted path; the header for the host
        # a split looks the block's embedding up while the commit is on the embedding's stage
        block = dec.drafter.block_tokens(bonus) if plan.build is not None and dec.split else None
        rows = dec.commit(path, n, embed=block)  # target K/V, GDN states; the committed length
        self.add_context(plan, taps, path, n)
        if plan.build is None:  # the bonus alone is the next tree
            dec.target.enter(dec.home)
            plan.into.tokens[:1].copy_(bonus.view(1))
            extra = self.zeros
        else:
            lp, ids = dec.draft_topk(bonus, draft_kv, plan.k, self.sampling, rows=rows)
            extra = self.next_tree(plan, bonus, lp, ids)
        return head if extra is None else torch.cat([head, extra])

    def add_context(self, plan: Plan, taps, path, n):
        """The drafter's context += the accepted rows (now, or deferred: see DeferredContext)."""
        if plan.context == "none":
            return
        drafter = self.dec.drafter
        if plan.context == "path":
            drafter.add_context(taps, n, rows=path)
        elif plan.context == "defer":
            self.dec.deferred.push(drafter, taps)
        else:
            self.dec.deferred.flush(drafter, taps, path, n)

    def next_tree(self, plan: Plan, bonus, lp, ids) -> torch.Tensor:
        """Write the next round's tree into plan.into; -> the packet's extra (its depth, or auto's
        per-prefix summary)."""
        dec, into = self.dec, plan.into
        lp, ids = dec.target.enter(dec.home, lp, ids)
        if plan.build == "chain":  # bonus, then the drafter's top-1 per position
            torch.cat([bonus.view(1), ids[:, 0]], out=into.tokens)
            if plan.summary:  # auto's staged chain
                eq, depth = chain_summary(lp)
                return auto_summary((eq, depth), plan.summary, dec.statics, eq[-1])
            return dec.statics.full(1, float(into.T - 1))
        depth, summary = dec.build_tree(bonus, lp, ids, plan.build, into, summarise=bool(plan.summary))
        if summary is not None:
            return auto_summary(summary, plan.summary, dec.statics, chain_probs(lp).sum())
        return depth.float().view(1)

"""A conversation's state kept between turns (`ddtree chat`): a turn prefills only what the
committed state does not already hold.

The target's K/V rows and the drafter's context rows are written per position and depend only on
the tokens up to it, so the rows of the longest common prefix of the committed tokens and a new
rendering of the conversation stay valid as they are (rows past it are overwritten). The Gated
DeltaNet recurrent and convolution states are one per layer: they cannot be cut back, only
restored from a snapshot taken at a boundary (per stage fp32 [L, hv, dk, dv] + [L, w-1, C]:
154 MB for Qwen3.6-27B, next to 64 KiB of K/V per token). A turn restores the latest snapshot
inside the common prefix (or starts over at 0), prefills the rest from there (`Decoder.prefill`
with `start=`), taking snapshots at the boundaries its caller names and at the prompt's end, and
decodes.

What a reply commits: the prompt and every emitted token but the last (the last bonus is the
next tree's root, not yet processed). Past them the live state is not known: the rounds run ahead
of the host (round r + 1 is queued before round r is read), and a round commits its whole accepted
path even where a stop token inside it ends the reply. So the live recurrent state after a reply
is never reused; `settle` brings the state to a known point instead (restore the latest boundary,
prefill up to the given end, snapshot there), right after a reply, while the user reads it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ddtree.decode.clock import sync
from ddtree.stats import GenerationRecord

#: GDN state snapshots a conversation keeps (counted by the memory plan: ddtree.model.memory.gdn_snapshot_bytes):
#: a pinned head (the system prompt's end) and the last three boundaries (a turn's: where its
#: generation prompt starts, its prompt's end, and the settled end of its reply)
SNAPSHOTS = 4


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class Snapshot:
    pos: int  # the committed length whose GDN states it holds
    slot: int  # its index in the snapshot buffers
    pinned: bool = False  # kept when others are evicted (the conversation's head)


@dataclass
class Reuse:
    """How a turn (or a settle) met the committed state."""

    common: int  # longest common prefix with the committed tokens
    reused: int  # tokens not prefilled again: the restored boundary (0: from scratch)
    prefilled: int  # tokens prefilled
    restored: bool  # a snapshot was copied back (False: the live state, or a reset)


class Conversation:
    """The committed state of one conversation on a Decoder's target (+ drafter); see the module
    docstring. Not thread-safe; one per Decoder."""

    def __init__(self, decoder, slots: int = SNAPSHOTS):
        self.dec = decoder
        self.tokens: list[int] = []  # committed tokens: K/V rows [0, len) hold them
        self.live: int | None = None  # the live GDN states hold tokens[:live] (None: unknown, past them)
        self.ctx_ok = 0  # the drafter's context rows [0, ctx_ok) hold tokens[:ctx_ok]
        self.snaps: list[Snapshot] = []  # oldest first
        # per stage: states [slots, L, hv, dk, dv] fp32 and conv [slots, L, w-1, C], allocated once
        self.store = {j: (torch.empty((slots, *g.state.shape), dtype=g.state.dtype, device=g.state.device),
                          torch.empty((slots, *g.conv.shape), dtype=g.conv.dtype, device=g.conv.device))
                      for j, g in decoder.target.gdn_groups.items()}
        self.slots = slots
        self.last: Reuse | None = None

    # ------------------------------------------------------------------ state bookkeeping
    def reset(self) -> None:
        """Forget everything committed (the next turn prefills from position 0)."""
        self.tokens, self.live, self.ctx_ok, self.snaps = [], None, 0, []

    def snapshot_positions(self) -> list[int]:
        return sorted(s.pos for s in self.snaps)

    def _snapshot(self, pos: int, pinned: bool = False) -> None:
        """Copy the live GDN states (they hold tokens[:pos]) into a snapshot slot."""
        for s in self.snaps:
            if s.pos == pos:
                s.pinned |= pinned
                return
        if pinned:
            for s in self.snaps:
                s.pinned = False  # one head
        used = {s.slot for s in self.snaps}
        free = [i for i in range(self.slots) if i not in used]
        if not free:
            old = next((s for s in self.snaps if not s.pinned), None)
            if old is None:
                return
            self.snaps.remove(old)
            free = [old.slot]
        slot = free[0]
        for j, g in self.dec.target.gdn_groups.items():
            st, cv = self.store[j]
            st[slot].copy_(g.state)
            cv[slot].copy_(g.conv)
        self.snaps.append(Snapshot(pos, slot, pinned))

    def _plan(self, ids: list[int], taps: bool, limit: int) -> tuple[int, int, Snapshot | None]:
        """-> (the resume point p <= limit, the common prefix, the snapshot to restore or None:
        the live state or a reset)."""
        common = common_prefix(self.tokens, ids)
        top = min(common, limit, self.ctx_ok if taps else common)
        best = max((s for s in self.snaps if s.pos <= top), key=lambda s: s.pos, default=None)
        if self.live is not None and self.live <= top and (best is None or self.live >= best.pos):
            return self.live, common, None
        return (best.pos, common, best) if best is not None else (0, common, None)

    def _restore(self, ids: list[int], p: int, common: int, snap: Snapshot | None) -> None:
        """The state at ids[:p]: a snapshot copied back, the live state, or a reset (p = 0).
        Snapshots past the common prefix belong to other tokens: dropped."""
        tgt, drafter = self.dec.target, self.dec.drafter
        self.snaps = [s for s in self.snaps if s.pos <= common]
        self.tokens = list(ids[:common])
        self.ctx_ok = min(self.ctx_ok, common)
        if snap is not None or p == 0:
            self.live = None  # (an interrupt mid-copy leaves it unknown)
            if p == 0:
                tgt.reset()
            else:
                for j, g in tgt.gdn_groups.items():
                    st, cv = self.store[j]
                    g.state.copy_(st[snap.slot])
                    g.conv.copy_(cv[snap.slot])
        if drafter is not None:
            drafter.ctx_len.fill_(min(p, self.ctx_ok))
        self.live = p

    def _extend(self, ids: list[int], a: int, b: int, taps: bool) -> None:
        """Prefill ids[a:b] onto the state at ids[:a] (the drafter's context with it when taps)."""
        dec = self.dec
        self.live = None
        dec.target.prefill(torch.tensor(ids[a:b], dtype=torch.long, device=dec.device), start=a, want_taps=taps,
                           on_taps=dec.drafter.add_context if taps else None)
        self._committed(ids, b, taps)

    def _committed(self, ids: list[int], b: int, taps: bool) -> None:
        if len(self.tokens) < b:
            self.tokens = list(ids[:b])
        if taps:
            self.ctx_ok = max(self.ctx_ok, b)
        self.live = b

    # ------------------------------------------------------------------ turns
    @torch.no_grad()
    def settle(self, ids: list[int], taps: bool, pin: bool = False) -> Reuse:
        """Make ids the committed state, at a snapshot: restore the latest boundary inside the
        common prefix and prefill the rest (nothing when a boundary at len(ids) is kept)."""
        p, common, snap = self._plan(ids, taps, len(ids))
        if p == len(ids) and snap is not None:  # a boundary there already: restored when a turn needs it
            if pin:
                for s in self.snaps:
                    s.pinned = s is snap
            self.last = Reuse(common, p, 0, False)
            return self.last
        self.dec.use_compile()
        self._restore(ids, p, common, snap)
        if p < len(ids):
            self._extend(ids, p, len(ids), taps)
        self.tokens = list(ids)
        self._snapshot(len(ids), pinned=pin)
        self.last = Reuse(common, p, len(ids) - p, snap is not None)
        return self.last

    @torch.no_grad()
    def turn(self, ids: list[int], job, stop_ids=frozenset(), on_tokens: Callable[[list[int]], None] | None = None,
             marks: tuple[int, ...] = (), pin: tuple[int, ...] = ()) -> GenerationRecord:
        """One turn: prompt ids (the whole conversation, rendered) -> the reply. Resumes from the
        latest boundary inside the common prefix, prefills the rest with snapshots at `marks`
        (`pin`: the one kept) and at the prompt's end, then decodes. The record's ttft_s is the
        turn's whole time to its first token (restore and prefill; the token goes to on_tokens
        before the drafter's first block)."""
        dec, dev = self.dec, self.dec.device
        taps = job.method != "ar"
        self.last = None
        sync(dev)
        t0 = time.perf_counter()
        p, common, snap = self._plan(ids, taps, len(ids) - 1)  # at least one token to prefill: its logits
        dec.use_compile()
        self._restore(ids, p, common, snap)
        a = p
        for m in sorted(set(marks)):
            if a < m < len(ids):
                self._extend(ids, a, m, taps)
                self._snapshot(m, pinned=m in pin)
                a = m
        self.live = None
        got: list[int] = []
        t_first: list[float] = []

        def emitted(toks: list[int]) -> bool | None:
            got.extend(toks)
            return on_tokens(toks) if on_tokens else None

        def first(tok: int) -> bool | None:  # the reply's first token, before the drafter's first block
            halt = emitted([tok])
            t_first.append(time.perf_counter())
            return halt

        pre = dec.prefill(ids, job, start=a, taps=taps, on_first=first)
        self._committed(ids, len(ids), taps)
        self._snapshot(len(ids))
        pre.ttft_s = (t_first[0] if t_first else time.perf_counter()) - t0
        self.last = Reuse(common, p, len(ids) - p, snap is not None)
        self.live = None  # the rounds move it past what the host reads
        try:
            return dec.decode(pre, job, stop_ids, emitted)
        finally:  # (an interrupt too): committed = the prompt and every emitted token but the last
            self.tokens = list(ids) + got[:-1]
            self.ctx_ok = min(self.ctx_ok, len(ids))
            self.live = None

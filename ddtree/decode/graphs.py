"""Graph capture: every piece of a round runs through `GraphRunner.run(key, fn)`.

On one GPU a piece is captured once per key as a CUDA graph and replayed (a step of a 27B model is
~5000 kernels eagerly, a few hundred compiled; either way, launches would otherwise bound it);
on the CPU or across devices it runs eagerly. Keys are typed: each says which verify's results its
piece commits (`commits`), because a commit reads, at capture time, what that verify left in the
GDN groups' `step` (tree size, conv windows, path mask), and under graphs the last verify run in
Python need not be the one being committed (--budget auto captures several sizes; replays run no
Python). The runner keeps each verify's step and reinstates it before any piece that commits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def bucket(n: int, size: int) -> int:
    """n rounded up to a multiple of size (context-length buckets of the graph keys)."""
    return -(-n // size) * size


@dataclass(frozen=True)
class VerifyKey:
    """The target's forward over a T-node tree (greedy choice inside) at context bucket kv_len."""

    T: int
    kv_len: int
    greedy: bool
    taps: bool  # return the drafter's tap rows

    commits = None


@dataclass(frozen=True)
class StepKey:
    """What follows a verify in the device pipeline: walk -> commit -> drafter context -> draft ->
    next tree -> packet (ddtree.decode.round)."""

    verify: VerifyKey
    P: int  # the packet's path length
    walk: int  # nodes the walk may accept (P, or 1 after a plain verify)
    draft_kv: int  # the drafter's context bucket
    k: int  # drafter top-k columns
    temperature: float | None
    build: int | str | None  # the next tree: None (the bonus alone), "chain", or a best-first budget
    into: int  # nodes of the slot the next tree is written into
    summary: int  # --budget auto: prefixes summarised for the host (0: none)
    context: str  # the drafter's context: "path", "defer", "flush" or "none" (ddtree.decode.budget.Plan)

    @property
    def commits(self) -> VerifyKey:
        return self.verify


@dataclass(frozen=True)
class PrefixKey:
    """--budget auto: copy the first T nodes of the staged tree of `src` draft nodes."""

    T: int
    src: int

    commits = None


@dataclass(frozen=True)
class HostDraftKey:
    """The host-tree loop's piece after a verify: walk, drafter context and draft (without a
    drafter, `ar`: walk and commit)."""

    verify: VerifyKey
    P: int
    draft_kv: int
    k: int
    temperature: float | None

    @property
    def commits(self) -> VerifyKey | None:
        return None if self.verify.taps else self.verify


@dataclass(frozen=True)
class HostCommitKey:
    """The host-tree loop's commit, queued after the round's sync."""

    verify: VerifyKey
    P: int

    @property
    def commits(self) -> VerifyKey:
        return self.verify


class GraphRunner:
    """Runs pieces eagerly or through CUDA graphs captured on first use of their key.

    `mutable()` lists every tensor a piece may change (states, K/V rows a tree or commit touches,
    the committed length): the warm-up and capture run on snapshots of them, so capturing changes
    nothing. A compile failure on first use falls back to the eager layers (`on_compile_failure`)."""

    def __init__(self, target, use_graphs: bool, mutable: Callable[[], list[torch.Tensor]],
                 on_compile_failure: Callable[[Exception], None], log: Callable[[str], None] | None = None):
        self.target, self.use_graphs = target, use_graphs
        self.mutable, self.on_compile_failure = mutable, on_compile_failure
        self.log = log or (lambda msg: None)
        self._graphs: dict = {}
        self._outs: dict = {}
        self._steps: dict = {}  # verify key -> {device: GDNGroup.step of that verify}
        self._seen: set = set()  # eager pieces already run once (a compile failure falls back there)

    def run(self, key, fn: Callable, keep=()):
        """fn()'s result, eagerly or by replaying key's graph; `keep`: inputs the piece rewrites."""
        if key.commits is not None:
            for dev, st in self._steps.get(key.commits, {}).items():
                self.target.gdn_groups[dev].step = st
        out = self._run(key, fn, keep)
        if isinstance(key, VerifyKey) and (not self.use_graphs or key not in self._steps):
            self._steps[key] = {dev: g.step for dev, g in self.target.gdn_groups.items()}
        return out

    def replay(self, key):
        """Replay a captured graph (benchmarks), returning its output buffers."""
        self._graphs[key].replay()
        return self._outs[key]

    def captured(self, key) -> bool:
        return key in self._graphs

    def _run(self, key, fn, keep):
        compiled = self.target.compile_layers
        if not self.use_graphs:
            if not compiled or key in self._seen:
                return fn()
            # first run with compiled layers in eager rounds (a layer split): a compile failure
            # restores the state and runs it with the eager layers, as under graphs
            snap = self.snapshot(keep)
            try:
                out = fn()
            except Exception as e:
                self.on_compile_failure(e)
                self.restore(snap)
                out = fn()
            self._seen.add(key)
            return out
        if key not in self._graphs:
            self.log(f"capturing {key}")
            # Warm up on a side stream (allocator, cuBLAS handles, compiling), then capture. The
            # warm-up mutates state, so it runs on snapshots: capture only reads buffers' addresses.
            snap = self.snapshot(keep)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                try:
                    fn()
                except Exception as e:
                    if not compiled:
                        raise
                    self.on_compile_failure(e)
                    self.restore(snap)
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            self.restore(snap)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = fn()
            self.restore(snap)  # capture ran nothing, but keep the state exact
            self._graphs[key], self._outs[key] = g, out
        self._graphs[key].replay()
        return self._outs[key]

    def snapshot(self, keep=()):
        return [(t, t.clone()) for t in list(self.mutable()) + list(keep)]

    @staticmethod
    def restore(snap):
        for t, c in snap:
            t.copy_(c)

"""Graph capture: every piece of a round runs through `GraphRunner.run(key, fn)`.

On CUDA a piece is captured once per key and replayed (a step of a 27B model is ~5000 kernels
eagerly, a few hundred compiled; either way, launches would otherwise bound it); on the CPU, or
with use_graphs=False, it runs eagerly. Keys are typed: each says which verify's results its
piece commits (`commits`), because a commit reads, at capture time, what that verify left in the
GDN groups' `step` (tree size, conv windows, path mask), and under graphs the last verify run in
Python need not be the one being committed (--budget auto captures several sizes; replays run no
Python). The runner keeps each verify's step and reinstates it before any piece that commits.

A one-stage target's piece is one CUDA graph. A split target's (ddtree.model.stages) is one graph
segment per stage visit, since one CUDA graph cannot span devices: the pieces call
`target.enter(j, ...)` at every stage boundary, and while capturing the runner's hook ends the
current segment there and starts stage j's, on that stage's own stream (two stages on one GPU get
two streams, so one GPU exercises the ordering too). A tensor handed over within a device is read
in place (the segment keeps it alive); across devices it is copied, eagerly and without a host
sync, into a buffer the consuming segment's graph reads, right before that segment replays (a
captured peer copy would pull the source device's stream into the capture). `Segments.replay`
runs them in order: each segment's stream waits on an event recorded after the previous one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ddtree.decode.startup import StartupClock


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
    """--budget auto: copy the first T nodes of the staged tree of `src` draft nodes (or its staged chain)."""

    T: int
    src: int
    chain: bool = False

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


class _Segment:
    """One stage's share of a piece: its graph, the stream it replays on, the cross-device copies
    that run right before it ((source, buffer) pairs), the tensors it reads from other segments."""

    def __init__(self, stage: int, stream, graph):
        self.stage, self.stream, self.graph = stage, stream, graph
        self.pulls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.keep: list[torch.Tensor] = []
        self.done = torch.cuda.Event()


class Segments:
    """A split piece: its segments, replayed in order with device-side ordering only (no host sync).

    The first segment waits on the current stream of every device of the split (earlier eager work:
    tree uploads, a sampled choice); every other on the previous segment's event; afterwards every
    device's current stream waits on the last one (what follows on the host side: the packet's
    copy, timing events, the next piece)."""

    def __init__(self, segments: list[_Segment], devices: list[torch.device]):
        self.segments, self.devices = segments, devices
        self._start = [torch.cuda.Event() for _ in devices]

    def __len__(self) -> int:
        return len(self.segments)

    def replay(self):
        first = self.segments[0].stream
        for dev, ev in zip(self.devices, self._start):
            ev.record(torch.cuda.current_stream(dev))
            first.wait_event(ev)
        prev = None
        for seg in self.segments:
            if prev is not None:
                seg.stream.wait_event(prev.done)
            with torch.cuda.stream(seg.stream):
                for src, dst in seg.pulls:  # PyTorch orders a peer copy against both devices' current streams
                    dst.copy_(src, non_blocking=True)
                seg.graph.replay()
            seg.done.record(seg.stream)
            prev = seg
        for dev in self.devices:
            torch.cuda.current_stream(dev).wait_event(prev.done)


class _Hook:
    """What the warm-up and the capture share: which hand-overs are copies."""

    streams: list

    def crosses(self, t: torch.Tensor, j: int, boundary: bool) -> bool:
        """Is handing t to stage j a copy? Across devices (a tensor on j's device is read in place;
        `boundary`: this enter starts j's segment)."""
        return t.device != self.streams[j].device


class _StageStreams(_Hook):
    """Runs a piece eagerly on the stages' own streams (the warm-up before a capture: allocator,
    cuBLAS workspaces per stream, compiling), with the ordering of a replay. Cross-device
    hand-overs are fresh copies, kept in order: the capture takes them as its buffers."""

    def __init__(self, streams: list, devices: list[torch.device]):
        self.streams, self.devices = streams, devices
        self.buffers: list[torch.Tensor] = []
        self.cur, self._ctx, self._last = None, None, None

    def enter(self, j: int, tensors) -> list:
        boundary = j != self.cur
        if boundary:
            self._leave()
            s = self.streams[j]
            if self._last is None:
                for dev in self.devices:
                    s.wait_stream(torch.cuda.current_stream(dev))
            else:
                s.wait_event(self._last)
            self._ctx = torch.cuda.stream(s)
            self._ctx.__enter__()
            self.cur = j
        return [self._hand(j, t, boundary) for t in tensors]

    def _hand(self, j: int, t, boundary: bool):
        if t is None or not self.crosses(t, j, boundary):
            return t
        buf = torch.empty_like(t, device=self.streams[j].device)
        buf.copy_(t, non_blocking=True)
        self.buffers.append(buf)
        return buf

    def _leave(self):
        if self._ctx is not None:
            self._last = torch.cuda.Event()
            self._last.record(self.streams[self.cur])
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def close(self):
        self._leave()
        if self._last is not None:
            for dev in self.devices:
                torch.cuda.current_stream(dev).wait_event(self._last)


class _SegmentCapture(_Hook):
    """Captures a piece as one graph per stage visit (see the module docstring). Cross-device
    hand-overs take the warm-up's buffers in order (same shapes, checked)."""

    def __init__(self, streams: list, buffers: list[torch.Tensor]):
        self.streams, self.buffers = streams, buffers
        self.segments: list[_Segment] = []
        self.pools: dict = {}  # device -> the memory pool this piece's segments on it share
        self.cur, self._ctx, self._i = None, None, 0

    def enter(self, j: int, tensors) -> list:
        boundary = j != self.cur
        if boundary:
            self._end()
            s = self.streams[j]
            g = torch.cuda.CUDAGraph()
            # segments of one piece always replay in capture order, never concurrently: they may share a pool
            if s.device not in self.pools:
                self.pools[s.device] = torch.cuda.graph_pool_handle()
            pool = self.pools[s.device]
            self.segments.append(_Segment(j, s, g))
            self._ctx = torch.cuda.graph(g, pool=pool, stream=s)
            self._ctx.__enter__()
            self.cur = j
        return [self._hand(j, t, boundary) for t in tensors]

    def _hand(self, j: int, t, boundary: bool):
        if t is None:
            return t
        seg = self.segments[-1]
        if not self.crosses(t, j, boundary):
            seg.keep.append(t)  # read in place by this segment's graph: it must outlive the capture
            return t
        if self._i >= len(self.buffers):
            raise RuntimeError("a split piece handed over more tensors under capture than in its warm-up")
        buf = self.buffers[self._i]
        self._i += 1
        if buf.shape != t.shape or buf.dtype != t.dtype:
            raise RuntimeError(f"a split piece's hand-over changed between warm-up and capture: "
                               f"{tuple(buf.shape)} {buf.dtype} vs {tuple(t.shape)} {t.dtype}")
        seg.pulls.append((t, buf))
        return buf

    def _end(self):
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            ctx.__exit__(None, None, None)

    def abort(self):
        """End a capture that raised (its graph is discarded) and leave its stream."""
        if self._ctx is not None:
            ctx, self._ctx = self._ctx, None
            try:
                ctx.cuda_graph.capture_end()
            except Exception:
                pass
            finally:
                ctx.stream_ctx.__exit__(None, None, None)

    def close(self):
        self._end()
        if not self.segments:
            raise RuntimeError("a piece of a split target entered no stage: it must call target.enter before its kernels")


def mutable_state(dec) -> list[torch.Tensor]:
    """Everything a decoder's piece mutates: start_d, GDN states, the drafter's length, the K/V
    slots a tree or commit can touch (the commit move is not idempotent: run twice, it reads slots
    its first run overwrote), --budget auto's deferred context. Called at capture time only."""
    tgt = dec.target
    tensors = [dec.start_d]
    for group in tgt.gdn_groups.values():
        tensors += [group.state, group.conv]
    start = int(dec.start_d)
    end = min(start + tgt.tree_capacity, tgt.max_len)
    for kc, vc in tgt.kv_stacks.values():
        tensors += [kc[:, start:end], vc[:, start:end]]
    if dec.drafter is not None:
        tensors.append(dec.drafter.ctx_len)
    if dec.deferred is not None:
        tensors += [dec.deferred.rows, dec.deferred.count]
    return tensors


class GraphRunner:
    """Runs pieces eagerly or through CUDA graphs captured on first use of their key.

    `mutable()` lists every tensor a piece may change (states, K/V rows a tree or commit touches,
    the committed length): the warm-up and capture run on snapshots of them, so capturing changes
    nothing. A compile failure on first use falls back to the eager layers (`on_compile_failure`)."""

    def __init__(self, target, use_graphs: bool, mutable: Callable[[], list[torch.Tensor]],
                 on_compile_failure: Callable[[Exception], None], log: Callable[[str], None] | None = None,
                 clock: StartupClock | None = None):
        self.target, self.use_graphs = target, use_graphs
        self.clock = clock or StartupClock()  # a key's first use: compile and capture (ddtree.decode.startup)
        self.mutable, self.on_compile_failure = mutable, on_compile_failure
        self.log = log or (lambda msg: None)
        self._graphs: dict = {}
        self._outs: dict = {}
        self._steps: dict = {}  # verify key -> {stage: GDNGroup.step of that verify}
        self._seen: set = set()  # eager pieces already run once (a compile failure falls back there)
        self._streams: list | None = None  # a split's stage streams (made on its first capture)
        self.new_keys = 0  # pieces captured or compiled so far (--budget auto does not time their rounds)

    def run(self, key, fn: Callable, keep=()):
        """fn()'s result, eagerly or by replaying key's graph; `keep`: inputs the piece rewrites."""
        if key.commits is not None:
            for j, st in self._steps.get(key.commits, {}).items():
                self.target.gdn_groups[j].step = st
        out = self._run(key, fn, keep)
        if isinstance(key, VerifyKey) and (not self.use_graphs or key not in self._steps):
            self._steps[key] = {j: g.step for j, g in self.target.gdn_groups.items()}
        return out

    def ahead(self, key, fn: Callable, keep=()):
        """run(key, fn) with every state it mutates restored after: captures key's piece ahead of
        its first use (--budget auto's warm-up, ddtree.decode.auto.capture_ahead) without
        changing what the decoder holds. -> its outputs (a graph's static buffers)."""
        snap = self.snapshot(keep)
        try:
            return self.run(key, fn, keep)
        finally:
            self.restore(snap)

    def replay(self, key):
        """Replay a captured graph (benchmarks), returning its output buffers."""
        self._graphs[key].replay()
        return self._outs[key]

    def outputs(self, key):
        """A captured piece's output buffers."""
        return self._outs[key]

    def captured(self, key) -> bool:
        return key in self._graphs

    def segments(self, key) -> int:
        """Graph segments of a captured piece (1: a one-stage target's single graph)."""
        g = self._graphs[key]
        return len(g) if isinstance(g, Segments) else 1

    @property
    def split(self) -> bool:
        return len(self.target.stages) > 1

    def _run(self, key, fn, keep):
        first = key not in self._graphs if self.use_graphs else (self.target.compile_layers and key not in self._seen)
        if not first:
            return self._first_or_replay(key, fn, keep)
        self.new_keys += 1  # a capture, or the first compiled run of an eager piece
        with self.clock.phase("capture"):
            return self._first_or_replay(key, fn, keep)

    def _first_or_replay(self, key, fn, keep):
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
        if key not in self._graphs and self.split:
            self.log(f"capturing {key} in segments")
            self._capture_segments(key, fn, keep)
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

    def _capture_segments(self, key, fn, keep):
        """Warm up on the stage streams, then capture one graph per stage visit (see the module docstring)."""
        tgt, compiled = self.target, self.target.compile_layers
        if self._streams is None:
            self._streams = [torch.cuda.Stream(device=st.device) for st in tgt.stages]
        devices = list(dict.fromkeys(st.device for st in tgt.stages))
        snap = self.snapshot(keep)
        warm = _StageStreams(self._streams, devices)
        try:
            self._hooked(warm, fn)
        except Exception as e:
            if not compiled:
                raise
            self.on_compile_failure(e)
            self.restore(snap)
            warm = _StageStreams(self._streams, devices)
            self._hooked(warm, fn)
        self.restore(snap)
        cap = _SegmentCapture(self._streams, warm.buffers)
        out = self._hooked(cap, fn)
        self.restore(snap)  # capture ran nothing, but keep the state exact
        self._graphs[key], self._outs[key] = Segments(cap.segments, devices), out

    def _hooked(self, hook, fn):
        """fn() with `hook` as the target's stage hook (closed after; a capture that raised is ended)."""
        saved, self.target.hook = self.target.hook, hook
        try:
            out = fn()
        except BaseException:
            if isinstance(hook, _SegmentCapture):
                hook.abort()
            else:
                hook.close()
            raise
        finally:
            self.target.hook = saved
        hook.close()
        return out

    def snapshot(self, keep=()):
        return [(t, t.clone()) for t in list(self.mutable()) + list(keep)]

    @staticmethod
    def restore(snap):
        for t, c in snap:
            t.copy_(c)

"""Where a process's start-up goes: the interpreter and imports, configs and tokenizer, the
weights, torch.compile, CUDA-graph capture and the prefill.

`StartupClock` sums seconds per phase. The decoder times its prefills and its first use of every
graph key in it; the compile time inside those is torch's own counter (dynamo's and inductor's
wall time, `compile_seconds`), moved from the phase into `compile`, so the phases add up to the
wall time they cover. A key's first use also launches the Triton kernels its pieces need for the
first time (their JIT compile, or the load from Triton's disk cache): that stays in `capture`.
The command line adds the phases before the decoder exists (`python`: process start to the
command's entry; `setup`; `weights`) and prints one line after the first generation
(`StartupClock.line`); the statistics' metadata holds the same numbers (`StartupClock.to_dict`).

`freeze_heap` hands what that work left behind to gc.freeze, so later collections skip it (for good,
where a process keeps its decoder); `heap_frozen` does it for a bench's timed prompts alone.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from contextlib import contextmanager

PHASES = ("python", "setup", "weights", "compile", "capture", "prefill")
_NAMES = {"capture": "graph capture"}


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (dynamo + inductor; 0 without the counter,
    and 0 before dynamo is imported: nothing compiled yet, and importing it costs seconds: ddtree.ops.eager)."""
    if "torch._dynamo" not in sys.modules:
        return 0.0
    try:
        from torch._dynamo.utils import calculate_time_spent
    except Exception:  # pragma: no cover - a torch without the counter
        return 0.0
    return float(calculate_time_spent().get("entire_frame_compile", 0.0))


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


def freeze_heap(graphs) -> bool:
    """Where a process keeps one decoder for good (ddtree chat, between turns): after compiling or
    capturing (graphs: its GraphRunner, whose new_keys count; torch's compile counter), one full collection, then
    gc.freeze moves every surviving object into the collector's permanent generation.
    torch.compile and graph capture leave hundreds of thousands of long-lived objects (FX graphs,
    guards, sympy expressions, kernels); a full collection rescans all of them, and one that falls
    inside a launch-bound prefill (a chat turn's) holds it up for as long. Frozen objects are still
    freed by reference counting, but an object in a reference cycle (a Decoder and its graph
    runner) never is: so not where decoders come and go (tests, benches). Nothing happens when
    nothing new was compiled or captured since the runner's last freeze (`graphs.frozen_at`).
    On the Qwen3.6-27B shapes after a chat's warm-up: about 950K objects, a full collection 498 ms
    (scripts/bench_serve.py chat). -> whether it froze."""
    mark = (graphs.new_keys, round(compile_seconds(), 6))
    if getattr(graphs, "frozen_at", None) == mark:
        return False
    gc.collect()
    gc.freeze()
    graphs.frozen_at = mark
    return True


@contextmanager
def heap_frozen():
    """For a stretch that times decoding in a process that frees its decoder afterwards (a bench):
    one full collection and gc.freeze, as chat and serve keep for good (freeze_heap), so that no
    full collection rescans the compile's and the capture's objects inside a timed prompt (on the
    H100's codepair bench, before this, one prompt in about 240 took 0.38-0.58 s for 0.03-0.05,
    about what such a collection takes: 498 ms after a 27B chat's warm-up); on leaving,
    gc.unfreeze where nothing was frozen before, so the decoder's reference cycles are
    collectable again."""
    before = gc.get_freeze_count()
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        if before == 0:
            gc.unfreeze()


class StartupClock:
    """Seconds per start-up phase (PHASES), summed over the process's life."""

    def __init__(self):
        self.seconds = {p: 0.0 for p in PHASES}
        self.first_token_s: float | None = None  # command start to the first generated token

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += max(0.0, seconds)

    @contextmanager
    def phase(self, name: str):
        """Time the block as `name`, less the compile time inside it (counted as `compile`)."""
        c0, t0 = compile_seconds(), time.perf_counter()
        try:
            yield
        finally:
            dc = compile_seconds() - c0
            self.add("compile", dc)
            self.add(name, time.perf_counter() - t0 - dc)

    def to_dict(self) -> dict:
        out = {f"{p}_s": round(s, 4) for p, s in self.seconds.items()}
        out["first_token_s"] = None if self.first_token_s is None else round(self.first_token_s, 4)
        return out

    def line(self) -> str:
        """'start-up: python 2.1 s, setup 0.4 s, ...; first token 3.2 s after the command'."""
        parts = ", ".join(f"{_NAMES.get(p, p)} {s:.1f} s" for p, s in self.seconds.items())
        tail = "" if self.first_token_s is None else f"; first token {self.first_token_s:.1f} s after the command"
        return f"start-up: {parts}{tail}"

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
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

PHASES = ("python", "setup", "weights", "compile", "capture", "prefill")
_NAMES = {"capture": "graph capture"}


def compile_seconds() -> float:
    """Seconds this process has spent in torch.compile so far (dynamo + inductor; 0 without the counter)."""
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

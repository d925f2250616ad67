"""Per-stage times of a round without host syncs."""

from __future__ import annotations

import time

import torch


class StageClock:
    """CUDA events on the GPU (read once, after the generation), wall time on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device  # events go on its current stream: a split's home may not be the current device
        self.marks: list[tuple[str, object, object]] = []

    def now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record(torch.cuda.current_stream(self.device))
            return e
        return time.perf_counter()

    def add(self, name, t0, t1):
        self.marks.append((name, t0, t1))

    def resolve(self) -> list[tuple[str, float]]:
        if self.cuda:
            torch.cuda.synchronize()
            return [(n, a.elapsed_time(b)) for n, a, b in self.marks]
        return [(n, (b - a) * 1e3) for n, a, b in self.marks]

    def fill(self, rounds, pending):
        """Write each round's stage times (ms) into its record: `pending[i]` holds round i's marks,
        ("stage", start, end) device intervals or ("stage", ms) host figures."""
        for marks in pending:
            for m in marks:
                if len(m) == 3:
                    self.add(*m)
        resolved = iter(self.resolve())
        for rec, marks in zip(rounds, pending):
            for m in marks:
                rec.times_ms[m[0]] = m[1] if len(m) == 2 else next(resolved)[1]


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)

"""Stages of a split target: contiguous layer blocks, each on a device, and the hook the pieces of
a round call at every stage boundary.

A stage is one entry of --devices. Two stages may share a device ("cuda:0,cuda:0"): they are
treated exactly like two devices (own state groups, own graph segments, hand-overs between them),
except that a hand-over on one device moves nothing. Stage 0 holds the embedding; the last stage
the final norm and lm_head, and it is the round's home: the tree slots, the walk, the committed
length and the packet the host reads live there.

Code that runs on a stage first calls `enter(j, *tensors)`: from there on its work is stage j's,
and the tensors it names come back on stage j's device. Eagerly (`StageHook`) that is a
non-blocking `.to`; under CUDA graphs the graph runner's hook ends the current graph segment there
and starts stage j's (ddtree.decode.graphs). A tensor handed over is read, not written, and only
until the next boundary: on one device the consumer reads the producer's tensor itself, across
devices a copy of it made at the boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Stage:
    """Layers [start, end) of the target on `device`."""

    index: int
    device: torch.device
    start: int
    end: int


def stages_of(layer_devices: list[torch.device], layer_stages: list[int] | None = None) -> list[Stage]:
    """The stages of a placement: runs of equal layer_stages entries (default: runs of equal
    devices, which merges two stages on one device into one), numbered from 0."""
    if not layer_devices:
        return []
    marks = layer_stages if layer_stages is not None else layer_devices
    if len(marks) != len(layer_devices):
        raise ValueError(f"{len(marks)} stage entries for {len(layer_devices)} layers")
    out, start = [], 0
    for i in range(1, len(marks) + 1):
        if i == len(marks) or marks[i] != marks[start]:
            devs = set(layer_devices[start:i])
            if len(devs) != 1:
                raise ValueError(f"stage {len(out)} (layers {start}..{i - 1}) spans devices {sorted(map(str, devs))}")
            out.append(Stage(len(out), torch.device(layer_devices[start]), start, i))
            start = i
    if layer_stages is not None and len({m for m in marks}) != len(out):
        raise ValueError(f"stage entries {marks} are not contiguous")
    return out


class StageHook:
    """Eager hand-overs: tensors move with non-blocking copies (nothing at all on the same device)."""

    def __init__(self, stages: list[Stage]):
        self.devices = [s.device for s in stages]

    def enter(self, j: int, tensors) -> list:
        dev = self.devices[j]
        return [t.to(dev, non_blocking=True) if t is not None and t.device != dev else t for t in tensors]

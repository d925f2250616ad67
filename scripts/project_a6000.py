#!/usr/bin/env python3
"""Project Qwen3.6-27B decode speed on 2x RTX A6000 (768 GB/s each, PCIe) from H200 measurements.

Model of one decode step, fitted on the H200 run (results/engine-h200.json):
    step = bytes / (copy bandwidth x f) + L
with f the fraction of copy bandwidth a streaming GEMV reaches (0.9 assumed, as plain graphed
linears reached 90.5% on the H200 in ../shared/notes/anchors.md) and L the launch-bound rest,
which is the same absolute time on any GPU (it is kernel count x per-kernel latency).
On the A6000s:
    layer split: the whole step's bytes at one card's bandwidth (cards take turns) + L
    TP=2:        half the bytes per card + L (every rank runs every layer's kernels)
                 + 2 all-reduces per layer + 1 logits gather over PCIe (latency c each)
Speculative rounds scale the same way: a round costs about (verify / step) x step, and yields the
mean acceptance length in tokens.

    python scripts/project_a6000.py [--engine results/engine-h200.json] [--f 0.9] [--collective-us 15]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.model.config import TargetConfig  # noqa: E402
from ddtree.model.presets import qwen36_27b_config  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default=str(Path(__file__).resolve().parents[1] / "results/engine-h200.json"))
    ap.add_argument("--f", type=float, default=0.9, help="fraction of copy bandwidth a GEMV stream reaches")
    ap.add_argument("--a6000-GBps", type=float, default=768.0)
    ap.add_argument("--collective-us", type=float, default=15.0, help="latency of one small all-reduce over PCIe")
    ap.add_argument("--accept", type=float, default=None,
                    help="mean acceptance length for the DDTree line (default: none printed)")
    a = ap.parse_args()
    eng = json.loads(Path(a.engine).read_text())
    r = eng["main"]["ctx1024"]
    cfg = TargetConfig.from_dict(qwen36_27b_config())
    bw_h200 = eng["copy_GBps"] * 1e9
    step_ms = r["ar_ms_per_token"]
    bytes_tok = r["bytes_per_token"]
    L = step_ms - bytes_tok / (bw_h200 * a.f) * 1e3  # launch-bound rest, ms
    bw = a.a6000_GBps * 1e9 * a.f
    split_ms = bytes_tok / bw * 1e3 + L
    coll = (2 * cfg.num_layers + 1) * a.collective_us * 1e-3
    tp_ms = bytes_tok / 2 / bw * 1e3 + L + coll
    tp_ideal = bytes_tok / 2 / bw * 1e3 + coll
    v32 = r["verify_over_step"]["32"]
    print(f"H200 fit: step {step_ms:.2f} ms = {bytes_tok / 1e9:.1f} GB at {a.f:.0%} of {bw_h200 / 1e9:.0f} GB/s "
          f"({bytes_tok / (bw_h200 * a.f) * 1e3:.2f} ms) + launch-bound rest L = {L:.2f} ms")
    print(f"2x RTX A6000 ({a.a6000_GBps:.0f} GB/s each, {a.f:.0%} reached, all-reduce {a.collective_us:.0f} us):")
    print(f"  layer split (graphed per device): {split_ms:6.1f} ms/token = {1e3 / split_ms:5.1f} tok/s")
    print(f"  TP=2:                              {tp_ms:6.1f} ms/token = {1e3 / tp_ms:5.1f} tok/s "
          f"({split_ms / tp_ms:.2f}x the split)")
    print(f"  TP=2 with L removed (fused kernels): {tp_ideal:5.1f} ms/token = {1e3 / tp_ideal:5.1f} tok/s")
    if a.accept:
        print(f"  DDTree budget 32 on TP=2 (verify = {v32:.2f}x step, acceptance {a.accept:.2f}): "
              f"{a.accept * 1e3 / (tp_ms * v32 + 0.11 * tp_ms):.1f} tok/s")


if __name__ == "__main__":
    main()

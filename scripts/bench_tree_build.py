#!/usr/bin/env python
"""Time one round's device tree build: the Triton kernel (ddtree.ops.tree_kernel.build_tree_kernel)
and its torch twin (ddtree.ops.tree.build_tree_device), each replayed from a CUDA graph as the
decoder runs them, for budgets B with top-k = B over 15 depths (Qwen3.6's DFlash block of 16).

    python scripts/bench_tree_build.py                     # budgets 8,16,32,64; a GPU
    python scripts/bench_tree_build.py --budgets 32 --out results/tree-build-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddtree.ops.tree import build_tree_device  # noqa: E402
from ddtree.ops.tree_kernel import build_tree_kernel  # noqa: E402


def graph_us(fn, reps: int) -> float:
    """Mean microseconds of fn replayed from a CUDA graph (captured after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(10):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="8,16,32,64")
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: needs a CUDA GPU (the builders are timed from CUDA graphs)", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for B in (int(b) for b in a.budgets.split(",")):
        logits = torch.randn(a.depth, 8192, device=dev, generator=g) * 3
        lp, ids = torch.log_softmax(logits, -1).topk(B, -1)
        root = torch.tensor(5, device=dev)
        kernel = graph_us(lambda: build_tree_kernel(root, lp, ids, B), a.reps)
        twin = graph_us(lambda: build_tree_device(root, lp, ids, B), a.reps)
        rows.append({"budget": B, "kernel_us": kernel, "torch_us": twin})
        print(f"budget {B:>3}: kernel {kernel:8.1f} us   torch twin {twin:8.1f} us", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "depth": a.depth, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

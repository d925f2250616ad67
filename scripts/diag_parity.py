#!/usr/bin/env python3
"""Diagnose a CUDA parity gap: our model and transformers', each on CPU and CUDA, same weights (fp32).

Prints the max error of every pair relative to the logit scale, with TF32 state printed, so a gap
can be put on the right side (ours vs the reference's kernels). Usage: python scripts/diag_parity.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.model.synthetic import build_random_target, hf_reference, tiny_hybrid_config  # noqa: E402


def main():
    print("allow_tf32", torch.backends.cuda.matmul.allow_tf32, "precision", torch.get_float32_matmul_precision())
    raw = tiny_hybrid_config()
    toks = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(0))
    out = {}
    for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
        m = build_random_target(raw, device=dev)
        hf = hf_reference(m, raw).to(dev)
        with torch.no_grad():
            out[f"hf-{dev}"] = hf(toks[None].to(dev)).logits[0].float().cpu()
            m.reset()
            out[f"ours-{dev}"] = m.forward_chain(toks, 0)[0].float().cpu()
    scale = out["hf-cpu"].abs().max()
    keys = list(out)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            print(f"{a:10s} vs {b:10s} max rel err {float((out[a] - out[b]).abs().max() / scale):.2e}")
    if "ours-cuda" in out:
        print("ours-cuda row errors vs hf-cpu (first, middle, last):",
              [f"{float((out['ours-cuda'][r] - out['hf-cpu'][r]).abs().max() / scale):.1e}" for r in (0, 35, 69)])


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Our float32 forward against transformers' model in float64, beside transformers' own float32
forward: how far each is from the fp64 logits (max abs difference over the largest fp64 logit), on
the tiny random hybrid (ddtree.model.synthetic.tiny_hybrid_config) for chains of each length and
each seed's tokens (the first T of 70 draws). Our forward takes the device's fast paths (CUDA: the
Triton tree kernels at DDTREE_TREE_PRECISION; CPU: the torch twins, or with --interpret the same
kernels under Triton's interpreter, whose dots are IEEE). tests/test_gpu.py's logits test
asserts 1e-4 on seeds 0..3; this prints the error on any seed and how it compares with
transformers' own.

    python scripts/check_logits_error.py                      # CUDA, seeds 0..7, T = 17, 33, 70
    python scripts/check_logits_error.py --device cpu --interpret --lengths 17 --seeds 5,6,7
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seeds", default="0,1,2,3,4,5,6,7")
    ap.add_argument("--lengths", default="17,33,70")
    ap.add_argument("--interpret", action="store_true", help="CPU: the Triton kernels under the interpreter")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args()
    if a.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton's import
    import torch

    from ddtree.model.synthetic import build_random_target, hf_reference, tiny_hybrid_config
    from ddtree.options import Options

    raw = tiny_hybrid_config()
    model = build_random_target(raw, device=a.device)
    if a.interpret:
        model.use(Options(triton_on_cpu=True))
    hf32 = hf_reference(model, raw).to("cpu")
    hf64 = copy.deepcopy(hf32).to(torch.float64)
    rows = []
    for T in (int(x) for x in a.lengths.split(",")):
        for seed in (int(x) for x in a.seeds.split(",")):
            toks = torch.randint(0, 97, (70,), generator=torch.Generator().manual_seed(seed))[:T]
            with torch.no_grad():
                r64 = hf64(toks[None]).logits[0]
                r32 = hf32(toks[None]).logits[0].double()
                model.reset()
                ours = model.forward_chain(toks, 0)[0].cpu().double()
            scale = r64.abs().max()
            rows.append(dict(T=T, seed=seed, ours=float((ours - r64).abs().max() / scale),
                             transformers_fp32=float((r32 - r64).abs().max() / scale)))
            r = rows[-1]
            print(f"T={T:3d} seed={seed}: ours {r['ours']:.1e}  transformers fp32 {r['transformers_fp32']:.1e}"
                  f"  ({r['ours'] / r['transformers_fp32']:.1f}x)", flush=True)
    print(f"worst: ours {max(r['ours'] for r in rows):.1e}, transformers fp32 {max(r['transformers_fp32'] for r in rows):.1e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=a.device, interpret=a.interpret, kernels=str(model.kernels), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

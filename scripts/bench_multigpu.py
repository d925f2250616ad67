#!/usr/bin/env python3
"""Two GPUs: one GPU vs layer split vs tensor parallelism (TP=2), random weights of a preset's
exact shape. Prints AR tok/s and DDTree round time for each, the TP speedup, the greedy-output
agreement with one GPU, and a projection for 2x RTX A6000 from the measured bytes per token.

    python scripts/bench_multigpu.py --preset qwen3.6-27b --out results/multigpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.config import TargetConfig  # noqa: E402
from ddtree.decoding import Decoder  # noqa: E402
from ddtree.presets import PRESETS  # noqa: E402
from ddtree.target import weight_bytes_per_token  # noqa: E402
from ddtree.testing import build_random_on_devices  # noqa: E402
from ddtree import tp  # noqa: E402


def jobs_for(prompt, n):
    # each job twice: the first captures graphs, the second is timed
    js = []
    for method, b in (("ar", 1), ("ddtree", 32)):
        js += [dict(method=method, budget=b, prompt_ids=prompt, max_new_tokens=n)] * 2
    return js


def summarize(recs) -> dict:
    ar, dd = recs[1], recs[3]
    return {"ar_tok_s": (ar.new_tokens - 1) / ar.decode_s, "ar_ms_per_token": ar.decode_s * 1e3 / (ar.new_tokens - 1),
            "ddtree32_round_ms": dd.decode_s * 1e3 / len(dd.rounds), "ar_tokens": ar.token_ids, "ddtree_tokens": dd.token_ids}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.6-27b", choices=sorted(PRESETS))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--a6000-GBps", type=float, default=768.0)
    ap.add_argument("--out", default="results/multigpu.json")
    a = ap.parse_args()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    mk_t, mk_d = PRESETS[a.preset]
    raw_t, raw_d = mk_t(), mk_d()
    cfg = TargetConfig.from_dict(raw_t)
    prompt = torch.randint(10, 1000, (a.ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    max_len = a.ctx + a.tokens + 512
    out = {"gpu": torch.cuda.get_device_name(0), "n_gpus": torch.cuda.device_count(), "date": time.strftime("%Y-%m-%d")}
    res = {}
    for name, devs in (("1 GPU", ["cuda:0"]), ("layer split", ["cuda:0", "cuda:1"])):
        t, d = build_random_on_devices(raw_t, raw_d, devs, torch.bfloat16, max_len)
        dec = Decoder(t, d)
        res[name] = summarize([dec.generate(**tp._gen_kwargs({}, j)) for j in jobs_for(prompt, a.tokens)])
        print(name, {k: v for k, v in res[name].items() if "tokens" not in k}, file=sys.stderr, flush=True)
        del dec, t, d
        torch.cuda.empty_cache()
    recs = tp.run_tp(2, tp.bench_worker, raw_t, raw_d, "bfloat16", jobs_for(prompt, a.tokens), max_len, 0, None,
                     device_type="cuda")
    res["TP=2"] = summarize(recs)
    print("TP=2", {k: v for k, v in res["TP=2"].items() if "tokens" not in k}, file=sys.stderr, flush=True)
    one = res["1 GPU"]
    for name, r in res.items():
        r["ar_same_tokens_as_1gpu"] = r["ar_tokens"] == one["ar_tokens"]
        r["ddtree_same_tokens_as_1gpu"] = r["ddtree_tokens"] == one["ddtree_tokens"]
        r["ar_speedup_vs_1gpu"] = r["ar_tok_s"] / one["ar_tok_s"]
    for r in res.values():
        del r["ar_tokens"], r["ddtree_tokens"]
    # projection for 2x RTX A6000 (768 GB/s each): per-rank bytes / bandwidth at the efficiency we
    # measured on one H200 (achieved / copy bandwidth), plus the collectives' latency over PCIe.
    wb = weight_bytes_per_token(cfg)
    shard = tp.rank_bytes_per_token(cfg, 2)
    from scripts.bench_engine import copy_bandwidth

    out["copy_GBps"] = copy_bandwidth() / 1e9
    eff = (wb / (one["ar_ms_per_token"] * 1e-3)) / (out["copy_GBps"] * 1e9)
    coll_us = 12.0  # assumed small-message all-reduce latency over PCIe (NCCL, 2 ranks)
    proj_tp = 1e3 / (shard["weight_bytes"] / (a.a6000_GBps * 1e9 * eff) * 1e3 + shard["collectives"] * coll_us * 1e-3)
    proj_split = 1e3 / (wb / (a.a6000_GBps * 1e9 * eff) * 1e3)
    out["results"] = res
    out["projection_2xA6000"] = {
        "assumptions": f"per-rank weight bytes / ({a.a6000_GBps:.0f} GB/s x {eff:.2f} efficiency measured on H200); "
                       f"{shard['collectives']} collectives per token at {coll_us:.0f} us each over PCIe; bf16 weights "
                       f"({wb / 1e9:.1f} GB: needs both 48 GB cards)",
        "layer_split_ar_tok_s": proj_split, "tp2_ar_tok_s": proj_tp,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"\n== {out['gpu']} x{out['n_gpus']}  {out['date']}  {a.preset}, {a.ctx} context, random bf16 weights")
    print(f"{'setup':12s} {'AR tok/s':>9s} {'ms/tok':>7s} {'x 1 GPU':>8s} {'DDTree-32 round ms':>19s} {'same greedy tokens':>19s}")
    for name, r in res.items():
        print(f"{name:12s} {r['ar_tok_s']:9.1f} {r['ar_ms_per_token']:7.2f} {r['ar_speedup_vs_1gpu']:8.2f} "
              f"{r['ddtree32_round_ms']:19.2f} {str(r['ar_same_tokens_as_1gpu']) + '/' + str(r['ddtree_same_tokens_as_1gpu']):>19s}")
    p = out["projection_2xA6000"]
    print(f"projection 2x RTX A6000: layer split {p['layer_split_ar_tok_s']:.1f} tok/s, TP=2 {p['tp2_ar_tok_s']:.1f} tok/s "
          f"({p['assumptions']})")


if __name__ == "__main__":
    main()

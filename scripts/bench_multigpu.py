#!/usr/bin/env python3
"""The layer split and tensor parallelism against one GPU: random weights of a preset's exact shapes
(bf16, Qwen3.6-27B by default) at one context. Per setup: AR ms a step and tok/s, dflash and
DDTree-32 ms a round (each method run twice: the first captures, the second is timed), and the
ratio of one GPU's time to the setup's; then a float32 check on a small random pair that the split
(graphed and eager) and TP=2 give one GPU's greedy tokens for ar, dflash and ddtree.

Setups: one GPU; the target's layers split over --split-devices in CUDA-graph segments (the
default) and eagerly (DDTREE_EAGER_SPLIT=1, its twin); TP=2 over NCCL, and through symmetric
memory. One model is alive at a time. With --split-devices cuda:0,cuda:0 both stages share one
GPU: the split's cost less the copies between cards, on a one-GPU machine (the TP rows are
skipped; the graphed split's target: >= 0.97x one GPU).

Feeds docs/PERFORMANCE.md's "Two GPUs" table (results/multigpu-h200x2.json, which
scripts/project_a6000.py reads) and "The layer split on one GPU" (results/split-h200.json).

    python scripts/bench_multigpu.py --out results/multigpu-h200x2.json                           # two GPUs
    python scripts/bench_multigpu.py --split-devices cuda:0,cuda:0 --out results/split-h200.json   # one GPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.decode.decoder import Decoder  # noqa: E402
from ddtree.model.presets import PRESETS  # noqa: E402
from ddtree.options import Options  # noqa: E402
from ddtree.model.synthetic import build_random_on_devices  # noqa: E402
from ddtree.parallel.launch import run_tp  # noqa: E402
from ddtree.parallel.workers import bench_worker, gen_kwargs, run_generate_tp_jobs  # noqa: E402


METHODS = (("ar", 1), ("dflash", 1), ("ddtree", 32))
TIMED = ("ar_ms_per_token", "dflash_round_ms", "ddtree32_round_ms")


def jobs_for(prompt, n):
    # each job twice: the first captures graphs, the second is timed
    js = []
    for method, b in METHODS:
        js += [dict(method=method, budget=b, prompt_ids=prompt, max_new_tokens=n)] * 2
    return js


def summarize(recs) -> dict:
    ar, df, dd = recs[1], recs[3], recs[5]
    return {"ar_tok_s": (ar.new_tokens - 1) / ar.decode_s, "ar_ms_per_token": ar.decode_s * 1e3 / (ar.new_tokens - 1),
            "dflash_round_ms": df.decode_s * 1e3 / len(df.rounds), "ddtree32_round_ms": dd.decode_s * 1e3 / len(dd.rounds),
            "ar_tokens": ar.token_ids, "ddtree_tokens": dd.token_ids}


def exactness(devices=("cuda:0", "cuda:1"), device_type: str = "cuda", new_tokens: int = 32, symm: bool = True,
              tp: bool = True) -> dict:
    """Greedy tokens in float32 on a small random hybrid pair (near-ties, which make bf16 runs of
    random weights disagree across reduction orders, are negligible there): the layer split vs one
    device (same weights), and `--tp 2` (shards loaded from a checkpoint written in the released
    layout) vs one device with those weights (tp=False: the split only). -> {setup: {method: equal}}."""
    import tempfile

    from ddtree.model.checkpoint import save_checkpoint
    from ddtree.model.synthetic import build_random_drafter, build_random_target, tiny_drafter_config, tiny_hybrid_config

    raw_t = tiny_hybrid_config(vocab=128, layers=("linear_attention",) * 3 + ("full_attention",)
                               + ("linear_attention",) * 3 + ("full_attention",))  # every dim divisible by 2
    raw_d = tiny_drafter_config(raw_t, block_size=8)
    prompt = torch.randint(2, 128, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    jobs = [dict(method=m, budget=b, prompt_ids=prompt, max_new_tokens=new_tokens)
            for m, b in (("ar", 1), ("dflash", 1), ("ddtree", 8))]
    names = [f"{j['method']}" + (f"-{j['budget']}" if j["method"] == "ddtree" else "") for j in jobs]

    def tokens(dec):
        return [dec.generate(**gen_kwargs({}, j)).token_ids for j in jobs]

    opts = Options.from_env()  # the environment's switches, as the command line reads them
    one = tokens(Decoder(*build_random_on_devices(raw_t, raw_d, list(devices[:1]), torch.float32, 512, seed=3), options=opts))
    pair = build_random_on_devices(raw_t, raw_d, list(devices), torch.float32, 512, seed=3)
    split = tokens(Decoder(*pair, use_graphs=False, options=opts))  # the eager split
    split_graphed = tokens(Decoder(*pair, use_graphs=True, options=opts)) if device_type == "cuda" else None
    res = {"layer split = 1 device": dict(zip(names, (a == b for a, b in zip(one, split)))),
           **({"layer split graphed = 1 device": dict(zip(names, (a == b for a, b in zip(one, split_graphed))))}
              if split_graphed is not None else {})}
    if not tp:
        return res
    target = build_random_target(raw_t, device=devices[0], seed=3, max_len=512)
    drafter = build_random_drafter(raw_d, target, device=devices[0], seed=4, max_len=512)
    ref = tokens(Decoder(target, drafter, 512, options=opts))
    with tempfile.TemporaryDirectory() as tmp:
        tdir = save_checkpoint({k: v.cpu() for k, v in target.state_dict().items()}, raw_t, Path(tmp) / "target",
                               layout="conditional", shards=2)
        ddir = save_checkpoint({k: v.cpu() for k, v in drafter.state_dict().items()}, raw_d, Path(tmp) / "drafter",
                               layout="drafter")
        common = dict(target=str(tdir), drafter=str(ddir), seed=0, dtype="float32", max_length=512, stop_ids=[],
                      tp=2, device_type=device_type)
        recs = run_generate_tp_jobs(common, jobs)
        res["TP=2 = 1 device"] = dict(zip(names, (r.token_ids == b for r, b in zip(recs, ref))))
        if symm and device_type == "cuda":  # the same through symmetric-memory all-reduces (must set up)
            os.environ["DDTREE_TP_SYMM"] = "require"
            try:
                recs = run_generate_tp_jobs(common, jobs)
                res["TP=2 symm = 1 device"] = dict(zip(names, (r.token_ids == b for r, b in zip(recs, ref))))
            except Exception as e:
                res["TP=2 symm = 1 device"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            finally:
                os.environ["DDTREE_TP_SYMM"] = "0"
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-27b", choices=sorted(PRESETS))
    ap.add_argument("--split-devices", default="cuda:0,cuda:1", help="the layer split's stages (cuda:0,cuda:0: one GPU)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--out", default="results/multigpu.json")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager split's timing (its exactness still runs)")
    ap.add_argument("--no-exactness", action="store_true", help="skip the float32 token-equality check")
    ap.add_argument("--no-symm", action="store_true", help="skip the TP=2 row with symmetric-memory all-reduces")
    a = ap.parse_args()
    from ddtree.app.cli import setup_logging

    setup_logging(False)  # INFO: loguru's default sink would time auto's per-round debug lines
    if not torch.cuda.is_available():
        sys.exit("bench_multigpu.py needs a CUDA GPU")
    devices = [d.strip() for d in a.split_devices.split(",")]
    one_gpu = len(set(devices)) == 1  # stages on one GPU: no TP rows
    if len(devices) < 2:
        sys.exit("--split-devices needs two stages, e.g. cuda:0,cuda:1 or cuda:0,cuda:0")
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v
    opts = Options.from_env()  # DDTREE_BLAS and the other switches, as the command line reads them
    mk_t, mk_d = PRESETS[a.preset]
    raw_t, raw_d = mk_t(), mk_d()
    prompt = torch.randint(10, 1000, (a.ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    max_len = a.ctx + a.tokens + 512
    out = {"gpu": torch.cuda.get_device_name(0), "n_gpus": torch.cuda.device_count(), "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "preset": a.preset, "ctx": a.ctx, "tokens": a.tokens, "split_devices": devices}
    res = {}
    # the split in graph segments (the default), then eagerly (DDTREE_EAGER_SPLIT=1's path)
    for name, devs, graphed in (("1 GPU", devices[:1], (None,)),
                                ("layer split", devices, (True,) if a.no_eager else (True, False))):
        t, d = build_random_on_devices(raw_t, raw_d, devs, torch.bfloat16, max_len)
        for g in graphed:
            row = {None: name, True: f"{name} graphed", False: name}[g]
            dec = Decoder(t, d, use_graphs=g, options=opts)
            res[row] = summarize([dec.generate(**gen_kwargs({}, j)) for j in jobs_for(prompt, a.tokens)])
            res[row]["graphs"] = dec.use_graphs
            print(row, {k: v for k, v in res[row].items() if "tokens" not in k}, file=sys.stderr, flush=True)
            del dec
            gc.collect()
        del t, d
        gc.collect()
        torch.cuda.empty_cache()
    # TP=2 with NCCL's all-reduce, then through symmetric memory (DDTREE_TP_SYMM; workers inherit it)
    for name, symm in (("TP=2", "0"), ("TP=2 symm", "1")):
        if one_gpu or (symm == "1" and a.no_symm):
            continue
        os.environ["DDTREE_TP_SYMM"] = symm
        try:
            recs = run_tp(2, bench_worker, raw_t, raw_d, "bfloat16", jobs_for(prompt, a.tokens), max_len, 0,
                          None, device_type="cuda")
        except Exception as e:  # report, do not hide: the NCCL row stands
            print(f"{name} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            continue
        res[name] = summarize(recs)
        print(name, {k: v for k, v in res[name].items() if "tokens" not in k}, file=sys.stderr, flush=True)
    os.environ["DDTREE_TP_SYMM"] = "0"
    one = res["1 GPU"]
    for name, r in res.items():  # TP's random shards are drawn per rank: other weights, nothing to compare
        same = not name.startswith("TP=2")
        r["ar_same_tokens_as_1gpu"] = r["ar_tokens"] == one["ar_tokens"] if same else None
        r["ddtree_same_tokens_as_1gpu"] = r["ddtree_tokens"] == one["ddtree_tokens"] if same else None
        r["ar_speedup_vs_1gpu"] = r["ar_tok_s"] / one["ar_tok_s"]
        r["x_1gpu"] = {k: one[k] / r[k] for k in TIMED}
    for r in res.values():
        del r["ar_tokens"], r["ddtree_tokens"]
    from scripts.bench_engine import copy_bandwidth, git_commit

    out["commit"], out["command"] = git_commit(), "python scripts/bench_multigpu.py " + " ".join(sys.argv[1:])
    out["copy_GBps"] = copy_bandwidth() / 1e9  # scripts/project_a6000.py derates by the efficiency against it
    out["results"] = res
    if not a.no_exactness:
        out["exact_fp32"] = exactness(devices, symm=not a.no_symm, tp=not one_gpu)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"\n== {out['gpu']} x{out['n_gpus']}  {out['date']}  {a.preset}, {a.ctx} context, random bf16 weights, "
          f"split over {','.join(devices)}")
    print(f"{'setup':20s} {'AR tok/s':>9s} {'AR ms':>7s} {'dflash ms':>10s} {'DDTree-32 ms':>13s} "
          f"{'x 1 GPU (ar / dflash / ddtree-32)':>34s} {'bf16 tokens = 1 GPU':>20s}")
    for name, r in res.items():
        x = " / ".join(f"{r['x_1gpu'][k]:.3f}" for k in TIMED)
        print(f"{name:20s} {r['ar_tok_s']:9.1f} {r['ar_ms_per_token']:7.2f} {r['dflash_round_ms']:10.2f} "
              f"{r['ddtree32_round_ms']:13.2f} {x:>34s} "
              f"{str(r['ar_same_tokens_as_1gpu']) + '/' + str(r['ddtree_same_tokens_as_1gpu']):>20s}")
    worst = min(res["layer split graphed"]["x_1gpu"].values())
    print(f"graphed split against one GPU: worst {worst:.3f}x" + (
        f" ({'PASS' if worst >= 0.97 else 'MISS'} the >= 0.97x target for stages on one GPU)" if one_gpu else ""))
    print("(bf16 on random weights: logit gaps of a few ulps, so another reduction order may flip a token; TP's random "
          "shards are other weights (None); exactness of both is checked in float32 below)")
    for name, eq in out.get("exact_fp32", {}).items():
        print(f"float32 greedy tokens, {name}: " + ", ".join(
            f"{m} {ok}" if m == "error" else f"{m} {'same' if ok else 'DIFFER'}" for m, ok in eq.items()))
    if not one_gpu:
        print(f"2x RTX A6000 projection: python scripts/project_a6000.py ENGINE.json {a.out} [TP_RANK.json]")


if __name__ == "__main__":
    main()

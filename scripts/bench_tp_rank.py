#!/usr/bin/env python3
"""One tensor-parallel rank's share of the work, measured on ONE GPU, and the TP=W step it implies.

Builds rank 0's shard of the random-weight target for TP=W without a process group
(ddtree.parallel.sharding.random_target_shard(install_hooks=False) + comm.install_rank_stand_ins:
the identity in place of each all-reduce, the rank's logits repeated W times in place of the
all-gather), plus the replicated drafter, in a Decoder (CUDA graphs, compiled layers: the same
code path as a TP rank), and times it through Decoder.generate on a random prompt at each context:

  * AR step: ms/token over --tokens new tokens (the second run: the first captures the graphs)
  * a dflash round and a ddtree round at --budget: ms/round (second run)

What the shard computes and reads is what one rank does; the collectives are then ADDED as a
stated cost: 2 x layers + 1 per AR step (an all-reduce after each mixer and MLP, one logits
all-gather), 2 x layers + 2 per speculative round (the drafter's logits are gathered too), times a
per-collective cost from PUBLISHED figures for an all-reduce of ~8-10 KB inside CUDA graphs
(../shared/notes/anchors.md: NCCL ~20 us over PCIe, a one-shot kernel ~5 us over PCIe, ~6 us
over NVLink), not measured here. A verify's all-reduces carry T rows (T x 10 KB), so for rounds
the figure is a lower bound. --full also times the unsharded model's AR step in the same run
(one GPU; 54 GB bf16, built after the shard is freed): the TP=W speedup over one GPU.

Prints a short table last and writes JSON (--out; rewritten after every part, so a run cut short
keeps what it measured): the "TP rank" figure of docs/PERFORMANCE.md. On an H200 (~3 min):

    python scripts/bench_tp_rank.py --full --out results/tp-rank-h200.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.decode.decoder import Decoder  # noqa: E402
from ddtree.model.config import TargetConfig  # noqa: E402
from ddtree.model.presets import PRESETS  # noqa: E402
from ddtree.model.synthetic import build_random_on_devices  # noqa: E402
from ddtree.parallel.comm import install_rank_stand_ins  # noqa: E402
from ddtree.parallel.sharding import random_drafter, random_target_shard, rank_bytes_per_token  # noqa: E402
from ddtree.options import Options  # noqa: E402

# Published per-collective costs (us) for an all-reduce of ~8-10 KB inside CUDA graphs
# (../shared/notes/anchors.md); NOT measured by this script.
ALLREDUCE_US = {"nvlink": 6.0, "oneshot-pcie": 5.0, "nccl-pcie": 20.0}
COST_SOURCE = "published figures for an ~8-10 KB all-reduce inside CUDA graphs (anchors.md), not measured here"


def parse_costs(spec: str) -> dict[str, float]:
    """'nvlink,nccl-pcie,12' -> {'nvlink': 6.0, 'nccl-pcie': 20.0, '12us': 12.0}; 'name=us' names a value."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item in ALLREDUCE_US:
            out[item] = ALLREDUCE_US[item]
        elif "=" in item:
            name, us = item.split("=", 1)
            out[name] = float(us)
        else:
            try:
                out[f"{float(item):g}us"] = float(item)
            except ValueError:
                raise SystemExit(f"--allreduce-us: {item!r} is neither a number nor one of {', '.join(ALLREDUCE_US)}")
    return out


def log(msg: str, t0: float):
    print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def time_methods(dec: Decoder, prompt: list[int], methods: list[str], tokens: int, budget: int) -> dict:
    """Each method twice through Decoder.generate (the first captures / compiles); the second's
    ms per AR token or per speculative round (random weights: ~1 token a round, so the round
    count is what matters, not the acceptance)."""
    r: dict = {}
    for m in methods:
        kw = dict(method=m, budget=budget, max_new_tokens=tokens if m == "ar" else max(tokens // 2, 8), seed=0)
        dec.generate(prompt, **kw)
        rec = dec.generate(prompt, **kw)
        if m == "ar":
            r["ar_ms_per_token"] = rec.decode_s * 1e3 / max(rec.new_tokens - 1, 1)  # token 1 comes from the prefill
            r["ar_tok_s"] = 1e3 / r["ar_ms_per_token"]
        else:
            r[f"{m}_round_ms"] = rec.decode_s * 1e3 / max(len(rec.rounds), 1)
            r[f"{m}_rounds"] = len(rec.rounds)
        r["prefill_s"] = rec.prefill_s
    return r


def _safe(fn, what: str, t0: float) -> dict:
    try:
        return fn()
    except Exception as e:  # report, do not hide: the other parts still run
        log(f"{what} failed: {type(e).__name__}: {str(e)[:300]}", t0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def measure(raw_t: dict, raw_d: dict, world: int, contexts: list[int], tokens: int, budget: int, full: bool,
            device: str = "cuda", compile_layers: bool = True, save=lambda res: None) -> dict:
    """The measurements (no projection): {'shard': {ctxN: {...}}, 'full': {ctxN: {...}} or absent}."""
    t0 = time.perf_counter()
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    max_len = max(contexts) + tokens + 2 * (budget + 1) + 256  # prompt + new tokens + a tree, bucket room
    gen = torch.Generator().manual_seed(0)
    hi = min(1000, TargetConfig.from_dict(raw_t).vocab_size)  # ordinary token ids, as bench_engine.py draws them
    prompts = {c: torch.randint(min(10, hi - 1), hi, (c,), generator=gen).tolist() for c in contexts}
    dec_kw = dict(use_graphs=cuda, compile=compile_layers and cuda, options=Options.from_env())
    res: dict = {"shard": {}}

    target = random_target_shard(raw_t, 0, world, dev, dtype, max_len, install_hooks=False)
    install_rank_stand_ins(target, world)  # before the Decoder: it copies gather_logits into the drafter
    drafter = random_drafter(raw_d, target, dev, dtype, max_len)
    if cuda:
        log(f"rank 0 of {world} built; GPU memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB", t0)
    dec = Decoder(target, drafter, max_len, **dec_kw)
    for c in contexts:
        log(f"shard ctx {c}: ar, dflash, ddtree-{budget}, each twice (every run prefills {c} tokens)", t0)
        res["shard"][f"ctx{c}"] = _safe(lambda: time_methods(dec, prompts[c], ["ar", "dflash", "ddtree"], tokens, budget),
                                        f"shard ctx {c}", t0)
        log(f"shard ctx {c}: {res['shard'][f'ctx{c}']}", t0)
        save(res)
    del dec, target, drafter
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    if full:
        res["full"] = {}
        target, _ = build_random_on_devices(raw_t, None, [dev], dtype, max_len)
        if cuda:
            log(f"unsharded target built; GPU memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB", t0)
        dec = Decoder(target, None, max_len, **dec_kw)
        for c in contexts:
            res["full"][f"ctx{c}"] = _safe(lambda: time_methods(dec, prompts[c], ["ar"], tokens, budget),
                                           f"one GPU ctx {c}", t0)
            log(f"one GPU ctx {c}: {res['full'][f'ctx{c}']}", t0)
            save(res)
        del dec, target
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return res


def project(res: dict, cfg: TargetConfig, world: int, costs: dict[str, float], copy_GBps: float | None) -> dict:
    """Bytes, bandwidth reached, and the projected TP=world step / rounds for each collective cost."""
    n_step = 2 * cfg.num_layers + 1  # all-reduce after each mixer and MLP, one logits gather
    n_round = n_step + 1  # + the drafter's logits gather
    out = {}
    for key, s in res["shard"].items():
        ctx = int(key[3:])
        f = (res.get("full") or {}).get(key) or {}
        row: dict = {}
        if "ar_ms_per_token" in s:
            b = rank_bytes_per_token(cfg, world, context=ctx)["step_bytes"]
            row["shard_bytes_per_token"] = b
            row["shard_achieved_GBps"] = b / (s["ar_ms_per_token"] * 1e-3) / 1e9
            if copy_GBps:
                row["shard_efficiency"] = row["shard_achieved_GBps"] / copy_GBps
        if "ar_ms_per_token" in f:
            b = rank_bytes_per_token(cfg, 1, context=ctx)["step_bytes"]
            row["full_bytes_per_token"] = b
            row["full_achieved_GBps"] = b / (f["ar_ms_per_token"] * 1e-3) / 1e9
            if copy_GBps:
                row["full_efficiency"] = row["full_achieved_GBps"] / copy_GBps
            if "ar_ms_per_token" in s:
                row["shard_over_full"] = s["ar_ms_per_token"] / f["ar_ms_per_token"]
        proj = {}
        for name, us in costs.items():
            p: dict = {"allreduce_us": us}
            if "ar_ms_per_token" in s:
                p["ar_ms_per_token"] = s["ar_ms_per_token"] + n_step * us * 1e-3
                p["ar_tok_s"] = 1e3 / p["ar_ms_per_token"]
                if "ar_ms_per_token" in f:
                    p["ar_speedup_vs_1gpu"] = f["ar_ms_per_token"] / p["ar_ms_per_token"]
            for m in ("dflash", "ddtree"):
                if f"{m}_round_ms" in s:
                    p[f"{m}_round_ms"] = s[f"{m}_round_ms"] + n_round * us * 1e-3
            proj[name] = p
        row["projected"] = proj
        out[key] = row
    return {"collectives_per_step": n_step, "collectives_per_round": n_round, "contexts": out}


def fmt(v, spec: str) -> str:
    """format(v, spec), or a '-' as wide when v is missing."""
    if isinstance(v, (int, float)):
        return format(v, spec)
    return "-".rjust(int(spec.split(".")[0] or 0))


def report(doc: dict):
    W, b = doc["world"], doc["budget"]
    bw = doc.get("copy_GBps")
    print(f"\n== {doc['gpu']}  {doc['date']}  {doc['preset']}: rank 0 of TP={W} on one GPU, random bf16 weights"
          + (f", copy {bw:.0f} GB/s" if bw else ""))
    print("measured (the collectives replaced by identity; drafter replicated):")
    print(f"{'ctx':>6s} {'shard AR ms':>11s} {'GB/s':>6s} {'eff':>5s} {'dflash ms/rd':>12s} {f'ddtree-{b} ms/rd':>16s} "
          f"{'1 GPU AR ms':>11s} {'shard/1 GPU':>11s}")
    for key, s in doc["shard"].items():
        pr = doc["projection"]["contexts"].get(key, {})
        f = (doc.get("full") or {}).get(key) or {}
        print(f"{key[3:]:>6s} {fmt(s.get('ar_ms_per_token'), '11.2f')} {fmt(pr.get('shard_achieved_GBps'), '6.0f')} "
              f"{fmt(pr.get('shard_efficiency'), '5.2f')} {fmt(s.get('dflash_round_ms'), '12.2f')} "
              f"{fmt(s.get('ddtree_round_ms'), '16.2f')} {fmt(f.get('ar_ms_per_token'), '11.2f')} "
              f"{fmt(pr.get('shard_over_full'), '11.2f')}" + (f"  ERROR {s['error']}" if "error" in s else ""))
    n1, n2 = doc["projection"]["collectives_per_step"], doc["projection"]["collectives_per_round"]
    print(f"PROJECTED TP={W} = shard + {n1} collectives per AR step ({n2} per round) x cost ({COST_SOURCE}):")
    print(f"{'ctx':>6s} {'cost':>18s} {'AR ms/tok':>9s} {'tok/s':>6s} {'x 1 GPU':>7s} {'dflash ms/rd':>12s} "
          f"{f'ddtree-{b} ms/rd':>16s}")
    for key, row in doc["projection"]["contexts"].items():
        for name, p in row["projected"].items():
            label = f"{name} {p['allreduce_us']:g}us"
            print(f"{key[3:]:>6s} {label:>18s} "
                  f"{fmt(p.get('ar_ms_per_token'), '9.2f')} {fmt(p.get('ar_tok_s'), '6.1f')} "
                  f"{fmt(p.get('ar_speedup_vs_1gpu'), '7.2f')} {fmt(p.get('dflash_round_ms'), '12.2f')} "
                  f"{fmt(p.get('ddtree_round_ms'), '16.2f')}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-27b", choices=sorted(PRESETS))
    ap.add_argument("--world", type=int, default=2, help="TP degree W whose rank 0 is measured")
    ap.add_argument("--contexts", default="1024,32768")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens of the AR runs (rounds: half as many)")
    ap.add_argument("--budget", type=int, default=32, help="ddtree budget")
    ap.add_argument("--full", action="store_true", help="also time the unsharded model's AR step (one GPU)")
    ap.add_argument("--allreduce-us", default="nvlink,oneshot-pcie,nccl-pcie",
                    help=f"per-collective costs: presets {ALLREDUCE_US} (published, not measured), numbers, or name=us")
    ap.add_argument("--eager-layers", action="store_true", help="no torch.compile (graphs still on)")
    ap.add_argument("--out", default="results/tp-rank.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_tp_rank.py needs a CUDA GPU")
    costs = parse_costs(a.allreduce_us)
    mk_t, mk_d = PRESETS[a.preset]
    raw_t, raw_d = mk_t(), mk_d()
    cfg = TargetConfig.from_dict(raw_t)
    contexts = [int(x) for x in a.contexts.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    from scripts.bench_engine import copy_bandwidth, git_commit

    doc: dict = {"kind": "tp_rank", "gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"),
                 "commit": git_commit(), "torch": torch.__version__, "preset": a.preset, "world": a.world, "rank": 0, "budget": a.budget,
                 "tokens": a.tokens, "contexts": contexts, "compiled_layers": not a.eager_layers,
                 "allreduce_us": costs, "allreduce_us_source": COST_SOURCE,
                 "rank_bytes": rank_bytes_per_token(cfg, a.world), "full_bytes": rank_bytes_per_token(cfg, 1)}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(res=None):
        if res is not None:
            doc.update(res)
        out.write_text(json.dumps(doc, indent=2, default=str))

    doc["copy_GBps"] = copy_bandwidth() / 1e9
    save()
    res = measure(raw_t, raw_d, a.world, contexts, a.tokens, a.budget, a.full, "cuda", not a.eager_layers, save)
    doc.update(res)
    doc["projection"] = project(res, cfg, a.world, costs, doc["copy_GBps"])
    save()
    report(doc)


if __name__ == "__main__":
    main()

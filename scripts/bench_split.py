#!/usr/bin/env python3
"""The graphed layer split on one GPU: random-weight Qwen3.6-27B + DFlash (exact shapes, bf16) at a
1K context, unsplit vs the target in two stages (--devices, default cuda:0,cuda:0: both stages on
one GPU, graphed in segments) vs the same split run eagerly (its twin). Per setup: AR ms/step and
dflash / ddtree-32 ms/round through Decoder.generate (each method run twice: the first compiles
and captures, the second is timed) and the ratio of the unsplit time to the setup's (the graphed
split's target: >= 0.97x). One model is alive at a time (54 GB each): build, measure, free, build
the next. Then float32 exactness on a tiny random pair: greedy tokens of the graphed split, the
eager split and one stage for every method. Prints a table last; JSON with --out.

    python scripts/bench_split.py --out results/split-h200.json
    python scripts/bench_split.py --devices cuda:0,cuda:1      # two GPUs
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
from ddtree.model.presets import PRESETS  # noqa: E402
from ddtree.model.synthetic import build_random_on_devices  # noqa: E402

METHODS = (("ar", 1), ("dflash", 1), ("ddtree", 32))


def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def name_of(method: str, budget) -> str:
    return f"ddtree-{budget}" if method == "ddtree" else method


def measure(dec: Decoder, prompt: list[int], tokens: int) -> dict:
    """ms per round (AR: per step) of each method, timed on its second run; its segments per piece."""
    out = {}
    for method, budget in METHODS:
        t0 = time.perf_counter()
        dec.generate(prompt, method, budget=budget, max_new_tokens=tokens)  # compiles, captures
        rec = dec.generate(prompt, method, budget=budget, max_new_tokens=tokens)
        n = max(len(rec.rounds), 1)
        out[name_of(method, budget)] = {"ms": rec.decode_s * 1e3 / n, "rounds": n,
                                        "accepted_per_round": sum(r.accepted for r in rec.rounds) / n}
        log(f"  {name_of(method, budget)}: {out[name_of(method, budget)]['ms']:.2f} ms/round "
            f"({time.perf_counter() - t0:.0f} s with the warm-up)")
    seg: dict = {}
    for key in dec.graphs._graphs:
        seg.setdefault(type(key).__name__, set()).add(dec.graphs.segments(key))
    out["segments"] = {k: sorted(v) for k, v in seg.items()}
    return out


def free() -> float:
    """Collect what the caller dropped (a Decoder and its graph runner reference each other). -> GiB still allocated."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**30


def bench(preset: str, devices: list[str], ctx: int, tokens: int, eager: bool = True) -> dict:
    mk_t, mk_d = PRESETS[preset]
    raw_t, raw_d = mk_t(), mk_d()
    prompt = torch.randint(10, 1000, (ctx,), generator=torch.Generator().manual_seed(0)).tolist()
    max_len = ctx + tokens + 512
    res = {}
    for setup, devs in (("unsplit", devices[:1]), ("split", devices)):
        t0 = time.perf_counter()
        target, drafter = build_random_on_devices(raw_t, raw_d, devs, torch.bfloat16, max_len)
        log(f"{setup} on {','.join(devs)}: built in {time.perf_counter() - t0:.0f} s, stages "
            f"{[(s.start, s.end) for s in target.stages]}, drafter on stage {drafter.stage}; "
            f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated")
        stages = [[s.start, s.end] for s in target.stages]
        if setup == "unsplit":
            dec = Decoder(target, drafter)
            res["unsplit"] = dict(measure(dec, prompt, tokens), graphs=dec.use_graphs, stages=stages)
        else:
            dec = Decoder(target, drafter, use_graphs=True)  # the graph segments (a split's default on CUDA)
            assert dec.use_graphs and dec.split, "the split should run graphed segments"
            res["split graphed"] = dict(measure(dec, prompt, tokens), graphs=True, stages=stages)
            if eager:
                del dec
                free()  # its graphs
                log("  the eager split (its twin):")
                dec = Decoder(target, drafter, use_graphs=False)
                res["split eager"] = dict(measure(dec, prompt, tokens), graphs=False, stages=stages)
        del dec, target, drafter
        left = free()
        log(f"  freed: {left:.1f} GiB still allocated")
    base = res["unsplit"]
    for r in res.values():
        r["x_unsplit"] = {m: base[m]["ms"] / r[m]["ms"] for m in (name_of(*mb) for mb in METHODS)}
    return res


def exactness(devices: list[str], new_tokens: int = 32) -> dict:
    """float32 greedy tokens on a small random pair: the graphed split and the eager split against
    one stage (same weights), every method, over eager layers (no compiles for these shapes: the
    segments do not depend on them; tests/decode/test_split_gpu.py runs them compiled).
    -> {method: {"graphed": same, "eager": same}}."""
    from ddtree.model.synthetic import tiny_drafter_config, tiny_hybrid_config

    raw_t = tiny_hybrid_config(layers=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
                               + ("full_attention",))
    raw_d = tiny_drafter_config(raw_t, block_size=8)
    prompt = torch.randint(2, 97, (250,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = (("ar", 1), ("dflash", 1), ("ddtree", 8), ("ddtree", 64), ("ddtree", "auto"))
    one = Decoder(*build_random_on_devices(raw_t, raw_d, devices[:1], torch.float32, 512, seed=3), compile=False)
    ref = {name_of(m, b): one.generate(prompt, m, budget=b, max_new_tokens=new_tokens).token_ids for m, b in runs}
    target, drafter = build_random_on_devices(raw_t, raw_d, devices, torch.float32, 512, seed=3)
    graphed = Decoder(target, drafter, use_graphs=True, compile=False)
    eager = Decoder(target, drafter, use_graphs=False, compile=False)
    assert graphed.use_graphs and graphed.split
    out = {}
    for m, b in runs:
        k = name_of(m, b)
        out[k] = {"graphed": graphed.generate(prompt, m, budget=b, max_new_tokens=new_tokens).token_ids == ref[k],
                  "eager": eager.generate(prompt, m, budget=b, max_new_tokens=new_tokens).token_ids == ref[k]}
    out["segments"] = {type(key).__name__: graphed.graphs.segments(key) for key in graphed.graphs._graphs}
    del one, graphed, eager, target, drafter
    free()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-27b", choices=sorted(PRESETS))
    ap.add_argument("--devices", default="cuda:0,cuda:0", help="the split's stages (repeats: stages on one GPU)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per timed generation")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager split's timing (its exactness still runs)")
    ap.add_argument("--no-exactness", action="store_true", help="skip the float32 token-equality check")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args()
    from ddtree.app.cli import setup_logging

    setup_logging(False)  # INFO: loguru's default sink would time auto's per-round debug lines
    if not torch.cuda.is_available():
        sys.exit("bench_split.py needs a CUDA GPU")
    devices = [d.strip() for d in a.devices.split(",")]
    if len(devices) < 2:
        sys.exit("--devices needs at least two stages, e.g. cuda:0,cuda:0")
    t0 = time.perf_counter()
    out = {"gpu": torch.cuda.get_device_name(0), "n_gpus": torch.cuda.device_count(), "date": time.strftime("%Y-%m-%d"),
           "torch": torch.__version__, "preset": a.preset, "devices": devices, "ctx": a.ctx, "tokens": a.tokens}

    def save():
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(out, indent=2))

    out["results"] = bench(a.preset, devices, a.ctx, a.tokens, eager=not a.no_eager)
    save()
    if not a.no_exactness:
        log("float32 exactness on a tiny pair")
        t1 = time.perf_counter()
        out["exact_fp32"] = exactness(devices)
        log(f"  done in {time.perf_counter() - t1:.0f} s")
        save()
    out["wall_s"] = time.perf_counter() - t0
    save()
    res = out["results"]
    names = [name_of(*mb) for mb in METHODS]
    print(f"\n== {out['gpu']}  {out['date']}  {a.preset} random bf16, {a.ctx} context, split over {','.join(devices)}"
          f"  ({out['wall_s']:.0f} s)")
    print(f"{'setup':15s} " + " ".join(f"{n + ' ms':>13s} {'x':>5s}" for n in names) + "  segments per piece")
    for setup, r in res.items():
        segs = ", ".join(f"{k.replace('Key', '')} {'/'.join(map(str, v))}" for k, v in sorted(r["segments"].items()))
        print(f"{setup:15s} " + " ".join(f"{r[n]['ms']:13.2f} {r['x_unsplit'][n]:5.2f}" for n in names)
              + f"  {segs if r['graphs'] else '(eager)'}")
    worst = min(res["split graphed"]["x_unsplit"].values())
    print(f"graphed split vs unsplit: worst {worst:.3f}x ({'PASS' if worst >= 0.97 else 'MISS'} the >= 0.97x target)")
    if "exact_fp32" in out:
        ex = {k: v for k, v in out["exact_fp32"].items() if k != "segments"}
        print("float32 greedy tokens = one stage (tiny pair, eager layers): graphed split " + ", ".join(
            f"{k} {'same' if v['graphed'] else 'DIFFER'}" for k, v in ex.items()))
        print("                                                    eager split   " + ", ".join(
            f"{k} {'same' if v['eager'] else 'DIFFER'}" for k, v in ex.items()))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Where a round's device time goes: kernels per round and their time, per method.

Loads a target + drafter (default: the codepair fixture), decodes one prompt per method once to
capture the graphs, then decodes it again under torch.profiler and prints, per method: rounds,
kernels per round, summed kernel time per round, wall time per round (the difference is the
device idling on the host or on launch gaps), and the kernels that cost the most per round.
On a small target every kernel launch counts; this shows which pieces to fuse. `--graphs` also
replays every captured graph on its own (verify per tree size, the step after it) with its
kernels; `--preset qwen3.6-27b` profiles random full-size weights instead; `--prefill 8192,32768`
profiles the prefill at those prompt lengths instead of rounds (kernel time per category). Feeds docs/PERFORMANCE.md's "Where the time goes" (the prefill) and the codepair profile.
Example:
    python scripts/profile_round.py --target ../shared/fixtures/codepair/target \
        --drafter ../shared/fixtures/codepair/drafter --methods ar,dflash,ddtree:16 --out results/profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.model.checkpoint import load_drafter, load_target  # noqa: E402
from ddtree.decode.decoder import Decoder  # noqa: E402
from ddtree.model.presets import PRESETS  # noqa: E402
from ddtree.options import Options  # noqa: E402
from ddtree.app.prompts import load_prompts  # noqa: E402
from ddtree.model.synthetic import build_random_on_devices  # noqa: E402
from bench_engine import kernel_times  # noqa: E402  (scripts/ is sys.path[0])


def graph_table(dec: Decoder, prof_cls, top: int) -> list[dict]:
    """Each captured graph replayed on its own: median ms over 20 replays (the state restored after
    each, so replays that commit do not run off the end), kernels in one replay, its top kernels."""
    from torch.profiler import ProfilerActivity

    snap = dec.graphs.snapshot()
    rows = []
    for key, g in list(dec.graphs._graphs.items()):
        times = []
        for _ in range(20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            g.replay()
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1))
            dec.graphs.restore(snap)
        with prof_cls(activities=[ProfilerActivity.CUDA]) as prof:
            g.replay()
            torch.cuda.synchronize()
        dec.graphs.restore(snap)
        per = kernel_times(prof, 90)
        name = type(key).__name__ + "/" + "/".join(str(x) for x in vars(key).values() if not hasattr(x, "__dict__"))[:60]
        rows.append({"key": name, "ms": sorted(times)[len(times) // 2], "kernels": sum(n for n, _ in per.values()),
                     "kernel_us": sum(us for _, us in per.values()),
                     "top": [{"name": k, "n": v[0], "us": v[1]} for k, v in sorted(per.items(), key=lambda kv: -kv[1][1])]})
        row = rows[-1]
        print(f"  graph {name:40s} {row['ms'] * 1e3:8.1f} us/replay  {row['kernels']:4d} kernels  "
              f"kernel time {row['kernel_us']:8.1f} us")
        for t in row["top"][:top]:
            print(f"      {t['us']:8.1f} us  x{t['n']:3d}  {t['name']}")
    return rows


# kernel-name fragments -> what the prefill profile sums them under (first match wins)
CATEGORIES = (("attention (flash)", ("flash", "fmha", "attn")),
              ("GDN (fla)", ("chunk", "gated_delta", "solve_tril", "recompute_w_u", "kkt", "cumsum", "l2norm", "wy")),
              ("GEMM", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90", "sm80")),
              ("norm / reduce", ("norm", "reduce")),
              ("copy / cat", ("copy", "cat", "index", "gather", "scatter")),
              ("elementwise", ("elementwise", "vectorized", "triton")))


def category(name: str) -> str:
    low = name.lower()
    return next((c for c, keys in CATEGORIES if any(k in low for k in keys)), "other")


def prefill_profile(dec: Decoder, lengths: list[int], top: int, vocab: int) -> dict:
    """Each prompt length prefilled once warm, then once under the profiler: wall time, summed
    kernel time, the kernels that cost most and the time per category (CATEGORIES)."""
    from torch.profiler import ProfilerActivity, profile

    from ddtree.decode.sampling import SamplingParams

    out = {}
    for L in lengths:
        ids = torch.randint(10, min(vocab, 50000), (L,), generator=torch.Generator().manual_seed(L)).tolist()
        job = dec.job("ddtree", 32, SamplingParams(), 8, 0, False, L)
        dec.prefill(ids, job)  # warm: JIT and allocator
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pre = dec.prefill(ids, job)
        wall = time.perf_counter() - t0
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            dec.prefill(ids, job)
            torch.cuda.synchronize()
        per = kernel_times(prof, 100)
        busy = sum(v[1] for v in per.values()) / 1e3
        cats = collections.defaultdict(float)
        for name, (_, us) in per.items():
            cats[category(name)] += us / 1e3
        r = out[L] = {"ttft_s": pre.ttft_s, "wall_s": wall, "kernel_ms": busy, "tok_s": L / wall,
                      "chunk": dec.target.prefill_chunk(),
                      "categories_ms": dict(sorted(cats.items(), key=lambda kv: -kv[1])),
                      "top": [{"name": k, "n": v[0], "ms": v[1] / 1e3} for k, v in sorted(per.items(), key=lambda kv: -kv[1][1])[:top]]}
        print(f"== prefill {L} tokens (chunk {r['chunk']}): wall {wall:.3f} s ({L / wall:.0f} tok/s), "
              f"kernel time {busy / 1e3:.3f} s")
        for c, ms in r["categories_ms"].items():
            print(f"   {ms:9.1f} ms  {100 * ms / busy:5.1f}%  {c}")
        for t in r["top"]:
            print(f"   {t['ms']:9.2f} ms  x{t['n']:5d}  {t['name']}")
    return out


def main():
    root = Path(__file__).resolve().parents[1]
    fx = root.parent / "shared" / "fixtures" / "codepair"
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(fx / "target"))
    ap.add_argument("--drafter", default=str(fx / "drafter"))
    ap.add_argument("--prompts", default=None, help="prompts.jsonl (default: the target's sibling prompts.jsonl)")
    ap.add_argument("--methods", default="ar,dflash,ddtree:16,ddtree:auto")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--out", default=None)
    ap.add_argument("--eager", action="store_true",
                    help="also run each method once without CUDA graphs and print the kernels per op and input shape")
    ap.add_argument("--graphs", action="store_true",
                    help="also time every captured graph on its own (replay ms, kernels per replay, top kernels)")
    ap.add_argument("--preset", default=None, choices=sorted(PRESETS),
                    help="random weights of a full-size preset instead of --target/--drafter (a random prompt)")
    ap.add_argument("--context", type=int, default=1024, help="prompt length with --preset")
    ap.add_argument("--prefill", default=None,
                    help="comma-separated prompt lengths: profile the prefill at each (kernels, categories) instead of rounds")
    a = ap.parse_args()
    from ddtree.app.cli import setup_logging

    setup_logging(False)  # INFO: loguru's default sink would time auto's per-round debug lines
    if not torch.cuda.is_available():
        sys.exit("profile_round.py needs a CUDA GPU")
    from torch.profiler import ProfilerActivity, profile

    from ddtree.app.setup import load_tokenizer

    dev = torch.device("cuda:0")
    if a.preset:
        mk_t, mk_d = PRESETS[a.preset]
        longest = max([a.context] + [int(x) for x in (a.prefill or "0").split(",")])
        target, drafter = build_random_on_devices(mk_t(), mk_d(), [dev], torch.bfloat16, longest + 512)
        ids = torch.randint(10, 1000, (a.context,)).tolist()
    else:
        target, _ = load_target(a.target, [dev], torch.bfloat16, 4096)
        drafter, _ = load_drafter(a.drafter, target, torch.bfloat16, 4096)
        tok = load_tokenizer(Path(a.target))  # as ddtree tokenizes (the checkpoint's tokenizer.json)
        prompts = a.prompts or str(Path(a.target).parent / "prompts.jsonl")
        ids = tok(load_prompts(prompts)[0].text)["input_ids"][:512]
    dec = Decoder(target, drafter, options=Options.from_env())  # the environment's switches, as the CLI
    report = {}
    if a.prefill:
        report["prefill"] = prefill_profile(dec, [int(x) for x in a.prefill.split(",")], a.top, target.cfg.vocab_size)
        if a.out:
            Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "report": report}, indent=1))
        return
    for spec in a.methods.split(","):
        method, _, b = spec.partition(":")
        budget = (b if b == "auto" else int(b)) if b else 32
        for _ in range(2):  # capture, then a warm pass
            dec.generate(ids, method=method, budget=budget, max_new_tokens=a.tokens)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            rec = dec.generate(ids, method=method, budget=budget, max_new_tokens=a.tokens)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        rounds = max(len(rec.rounds), 1)
        per = kernel_times(prof, 90)
        n = sum(v[0] for v in per.values())
        busy_us = sum(v[1] for v in per.values())
        top = sorted(per.items(), key=lambda kv: -kv[1][1])
        report[spec] = {"rounds": rounds, "tokens": rec.new_tokens, "wall_ms_per_round": wall * 1e3 / rounds,
                        "kernels_per_round": n / rounds, "kernel_ms_per_round": busy_us / 1e3 / rounds,
                        "top": [{"name": k, "per_round": v[0] / rounds, "us_per_round": v[1] / rounds} for k, v in top]}
        r = report[spec]
        print(f"== {spec}: {rounds} rounds, {rec.new_tokens} tokens, wall {r['wall_ms_per_round']:.3f} ms/round, "
              f"{r['kernels_per_round']:.0f} kernels/round, kernel time {r['kernel_ms_per_round']:.3f} ms/round")
        for t in r["top"][: a.top]:
            print(f"   {t['us_per_round']:8.1f} us  x{t['per_round']:5.1f}  {t['name']}")
        if a.graphs:
            r["graphs"] = graph_table(dec, prof_cls=profile, top=min(a.top, 14))
            dec.graphs._graphs.clear()  # the next method's table shows only its own graphs
            dec.graphs._outs.clear()
        if a.eager:  # which op (and shapes) launched what: graphs hide that
            dec.use_graphs = dec.graphs.use_graphs = False
            dec.generate(ids, method=method, budget=budget, max_new_tokens=8)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                rec = dec.generate(ids, method=method, budget=budget, max_new_tokens=16)
                torch.cuda.synchronize()
            dec.use_graphs = dec.graphs.use_graphs = True
            print(f"-- {spec} eager, {len(rec.rounds)} rounds: ops by device time")
            print(prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=45,
                                                                     max_name_column_width=40, max_shapes_column_width=70))
    if a.out:
        Path(a.out).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "report": report}, indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Engine benchmark at full size with random weights (cost does not depend on weight values).

Measures, in one run on one GPU (or a layer split over several with --devices):
  * copy bandwidth (device-to-device, bytes read + written) -> the HBM roofline
  * AR decode: ms/step and tok/s (graphed round through Decoder.generate), bytes/token, achieved BW
  * verify time for N = 1, 8, 16, 32, 64, 128 tree nodes at 1k and 8k context, commit time, drafter time
  * per-round overhead outside the target and drafter forwards (host tree build, upload, sync)
  * DFlash chain and DDTree rounds (budget sweep) with random weights: round time
  * transformers' own forward per token on the same weights (--hf)
  * the dense Qwen3-8B + DFlash-b16 DDTree round at budget 32, 512 context (--dense)
  * real acceptance and tok/s of ar / dflash / ddtree (8..64, auto) on the codepair pair (--codepair DIR)

Prints one table, then issue #6's targets with the measured figure and pass/fail, and writes JSON
(--out). Example:
    python scripts/bench_engine.py --hf --dense --codepair ../shared/fixtures/codepair --out results/engine.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.model.config import TargetConfig  # noqa: E402
from ddtree.decode.decoder import Decoder, _bucket  # noqa: E402
from ddtree.model.presets import PRESETS  # noqa: E402
from ddtree.model.target import weight_bytes_per_token  # noqa: E402
from ddtree.model.synthetic import build_random_on_devices  # noqa: E402
from ddtree.ops.tree import build_tree  # noqa: E402


def event_time(fn, reps=20, warmup=3) -> float:
    """Median ms of fn() on the device."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth(gb: float = 4.0) -> float:
    n = int(gb * 2**30)
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = event_time(lambda: b.copy_(a), reps=20)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n / (ms * 1e-3)  # bytes/s, read + write


def random_tree(T: int, vocab: int, depth: int = 15, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = max(T - 1, 1)
    lp = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 3, -1).topk(k, -1)
    return build_tree(5, lp.values, lp.indices, T - 1)


def time_verify(dec: Decoder, T: int, start: int, taps: bool = True):
    """Replay time of the graphed verify for a T-node tree at committed length `start`."""
    tree = random_tree(T, dec.target.cfg.vocab_size)
    slot = dec._slot(T)
    slot.load(tree)
    dec.start_d.fill_(start)
    kv = _bucket(start + T, dec.bucket)
    key = ("verify", T, kv, True, taps)
    dec._run(key, lambda: dec._verify(slot, kv, True, taps))
    return event_time(lambda: dec._graphs[key].replay()), key, slot


def time_commit_draft(dec: Decoder, key, slot, start: int, P: int, k: int):
    """Replay times of the draft graph (walk + drafter; None without a drafter: then the walk
    alone) and of the commit graph after the verify `key`, state restored after each replay."""
    from ddtree.decode.sampling import SamplingParams

    sp = SamplingParams()
    snap = dec._snapshot()
    _, _, _, _, taps_on = key
    dkv = _bucket(start + P, dec.bucket)
    taps = dec._outs[key][1] if dec.drafter is not None else None
    dkey = ("draft", key, P, dkv, k, sp)
    dec._run(dkey, lambda: dec._draft(slot, taps, P, dkv, k, sp))

    def draft_once():
        dec._graphs[dkey].replay()
        dec.drafter is not None and dec.drafter.ctx_len.fill_(start)  # keep the context length fixed

    draft_ms = event_time(draft_once) if dec.drafter is not None else None
    ckey = ("commit", key, P)
    dec._run(ckey, lambda: dec._commit(P))

    def commit_once():
        dec._graphs[ckey].replay()
        dec.start_d.fill_(start)

    commit_ms = event_time(commit_once)
    dec._restore(snap)
    return commit_ms, draft_ms


def hf_ms_per_token(target, raw_cfg: dict, ctx: int, steps: int = 5) -> float | None:
    """transformers' own Qwen3_5ForCausalLM / Qwen3ForCausalLM sharing our weight tensors."""
    from ddtree.model.synthetic import hf_class_and_config, hf_state_dict

    try:
        cls, hf_cfg = hf_class_and_config(raw_cfg, attn="sdpa")
        with torch.device("meta"):
            hf = cls(hf_cfg)
        hf.load_state_dict(hf_state_dict(target), strict=False, assign=True)
        hf.model.rotary_emb.to_empty(device=target.device)
        hf.model.rotary_emb.__init__(hf_cfg, device=target.device)
        hf.eval()
        ids = torch.randint(10, 1000, (1, ctx), device=target.device)
        with torch.no_grad():
            out = hf(ids, use_cache=True)
            cache = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = hf(tok, past_key_values=cache, use_cache=True)
                tok = out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
        del hf, out, cache
        return statistics.median(times[1:])
    except Exception as e:  # report, do not hide
        print(f"transformers baseline failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


def profile_eager(dec: Decoder, start: int):
    from torch.profiler import ProfilerActivity, profile

    for T in (1, 64):
        tree = random_tree(T, dec.target.cfg.vocab_size)
        slot = dec._slot(T)
        slot.load(tree)
        dec.start_d.fill_(start)
        kv = _bucket(start + T, dec.bucket)
        dec._verify(slot, kv, True, True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            dec._verify(slot, kv, True, True)
            torch.cuda.synchronize()
        print(f"--- eager verify N={T}", file=sys.stderr)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=22, max_name_column_width=60), file=sys.stderr)


def bench_preset(name: str, devices: list[str], contexts: list[int], budgets: list[int], sizes: list[int],
                 hf: bool, gen_tokens: int, profile: bool = False) -> dict:
    mk_t, mk_d = PRESETS[name]
    raw_t, raw_d = mk_t(), mk_d()
    cfg = TargetConfig.from_dict(raw_t)
    max_len = max(contexts) + 512
    t0 = time.perf_counter()
    target, drafter = build_random_on_devices(raw_t, raw_d, devices, torch.bfloat16, max_len)
    print(f"[{name}] built in {time.perf_counter() - t0:.1f}s; GPU mem {torch.cuda.memory_allocated() / 2**30:.1f} GiB",
          file=sys.stderr)
    dec = Decoder(target, drafter)
    res: dict = {"preset": name, "devices": devices, "weight_bytes_per_token": weight_bytes_per_token(cfg)}
    gdn_state = sum(1 for t in cfg.layer_types if t == "linear_attention") * cfg.gdn_num_v_heads * cfg.gdn_k_dim * cfg.gdn_v_dim * 4
    for ctx in contexts:
        prompt = torch.randint(10, 1000, (ctx,)).tolist()
        r: dict = {}
        # --- AR through the real decoder loop (graphs, one sync per token)
        rec = dec.generate(prompt, "ar", max_new_tokens=gen_tokens)
        rec = dec.generate(prompt, "ar", max_new_tokens=gen_tokens)  # graphs captured: measure the second
        ms_step = rec.decode_s * 1e3 / max(rec.new_tokens - 1, 1)
        kv_bytes = sum(1 for t in cfg.layer_types if t == "full_attention") * (ctx + gen_tokens // 2) * cfg.num_kv_heads * cfg.head_dim * 2 * 2
        bytes_tok = res["weight_bytes_per_token"] + kv_bytes + 2 * gdn_state
        r["ar_ms_per_token"] = ms_step
        r["ar_tok_s"] = 1e3 / ms_step
        r["bytes_per_token"] = bytes_tok
        r["ar_achieved_GBps"] = bytes_tok / (ms_step * 1e-3) / 1e9
        r["ar_prefill_s"] = rec.prefill_s
        r["ar_stages_ms"] = {st: statistics.mean(x.times_ms.get(st, 0.0) for x in rec.rounds[1:])
                             for st in ("tree", "verify", "draft", "host")}  # draft = walk + commit + pack here
        # --- verify / commit / draft per tree size (graph replays, state fixed)
        dec.generate(prompt, "ar", max_new_tokens=2)  # committed prefix of ctx (+1) tokens
        start = ctx + 1
        if profile:
            profile_eager(dec, start)
        r["verify_ms"], r["commit_ms"], r["draft_ms"] = {}, {}, {}
        for T in sizes:
            ms, key, slot = time_verify(dec, T, start)
            r["verify_ms"][T] = ms
            cm, dm = time_commit_draft(dec, key, slot, start, drafter.cfg.block_size, max(T - 1, 1))
            r["commit_ms"][T], r["draft_ms"][T] = cm, dm
        step_ms = r["verify_ms"][sizes[0]] + r["commit_ms"][sizes[0]]
        r["verify_over_step"] = {T: (r["verify_ms"][T]) / step_ms for T in sizes}
        # --- speculative rounds with random weights (acceptance is meaningless; round cost is not)
        rounds = {}
        for method, b in [("dflash", 15)] + [("ddtree", b) for b in budgets]:
            dec.generate(prompt, method, budget=b, max_new_tokens=gen_tokens // 2)
            rec = dec.generate(prompt, method, budget=b, max_new_tokens=gen_tokens // 2)
            n = len(rec.rounds)
            st = {s: statistics.mean(x.times_ms.get(s, 0.0) for x in rec.rounds) for s in ("tree", "verify", "commit", "draft", "host")}
            round_ms = rec.decode_s * 1e3 / n
            # everything but the two forwards: the drafter's forward is its graph timed alone above
            # (with the rounds ahead, the round's "draft" stage also holds the walk, the commit and
            # the device tree build, which count as overhead here)
            drafter_ms = statistics.median([x for x in r["draft_ms"].values() if x])
            rounds[f"{method}:{b}"] = {
                "round_ms": round_ms, **{f"{s}_ms": v for s, v in st.items()},
                "overhead_ms": round_ms - st["verify"] - drafter_ms,
            }
        r["rounds"] = rounds
        if hf:
            r["hf_ms_per_token"] = hf_ms_per_token(target, raw_t, ctx)
            if r["hf_ms_per_token"]:
                r["ar_speedup_vs_hf"] = r["hf_ms_per_token"] / ms_step
        res[f"ctx{ctx}"] = r
        print(json.dumps({name: {f"ctx{ctx}": r}}, default=str), file=sys.stderr)
    del dec, target, drafter
    gc.collect()
    torch.cuda.empty_cache()
    return res


def codepair_bench(d: Path, device: str, limit: int, out: str, budgets: str = "8,16,32,64,auto") -> dict:
    """`ddtree bench` on the real trained pair: tok/s per method, each as a ratio to ar in this run."""
    from ddtree.app.bench import run_bench

    doc = run_bench(str(d / "target"), str(d / "drafter"), prompts=str(d / "prompts.jsonl"), raw=True,
                    budgets=budgets, devices=device, limit=limit, max_new_tokens=192, progress=False,
                    out=str(Path(out).with_name(Path(out).stem + "-codepair.json")))
    res = {}
    for run in doc["runs"]:
        key = run["method"] + ("" if run["method"] != "ddtree" else f":{run.get('budget_setting') or run['budget']}")
        agg = run["aggregate"]
        res[key] = {"tok_s": agg["decode_tok_s"], "accept": agg["mean_acceptance_length"],
                    "speedup_vs_ar": run.get("speedup_vs_ar"), "exact": run.get("exact_match_vs_ar"),
                    "first_divergences": run.get("first_divergences", [])}
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-27b", choices=sorted(PRESETS))
    ap.add_argument("--devices", default="cuda:0")
    ap.add_argument("--contexts", default="1024,8192")
    ap.add_argument("--sizes", default="1,8,16,32,64,128")
    ap.add_argument("--budgets", default="8,16,32,64")
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--hf", action="store_true", help="also time transformers' own forward on the same weights")
    ap.add_argument("--dense", action="store_true", help="also run the Qwen3-8B + DFlash-b16 round at 512 context")
    ap.add_argument("--profile", action="store_true", help="print the top kernels of one eager verify (N=1, 64)")
    ap.add_argument("--codepair", type=Path, default=None,
                    help="codepair fixture dir (target/, drafter/, prompts.jsonl): real-acceptance bench")
    ap.add_argument("--codepair-limit", type=int, default=8, help="prompts of the codepair bench")
    ap.add_argument("--codepair-budgets", default="8,16,32,64,auto", help="ddtree budgets of the codepair bench")
    ap.add_argument("--out", default="results/engine.json")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_engine.py needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    from ddtree.ops import gdn_kernels as triton_gdn

    out = {"gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "triton_gdn": triton_gdn.ENABLED, "triton_tree_verify": triton_gdn.ENABLED and triton_gdn.TREE_MAX_NODES,
           "tree_prologue": triton_gdn.ENABLED and triton_gdn.TREE_PROLOGUE}  # DDTREE_TREE_PROLOGUE=1
    out["copy_GBps"] = copy_bandwidth() / 1e9
    print(f"copy bandwidth {out['copy_GBps']:.0f} GB/s", file=sys.stderr)
    sizes = [int(x) for x in a.sizes.split(",")]
    budgets = [int(x) for x in a.budgets.split(",")]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)

    def save():  # after every part, so a run cut short keeps what it measured
        Path(a.out).write_text(json.dumps(out, indent=2, default=str))

    out["main"] = bench_preset(a.preset, a.devices.split(","), [int(x) for x in a.contexts.split(",")], budgets,
                               sizes, a.hf, a.gen_tokens, a.profile)
    save()
    if a.dense:
        out["dense"] = bench_preset("qwen3-8b", a.devices.split(",")[:1], [512], [32], [1, 33], a.hf, a.gen_tokens)
        save()
    if a.codepair is not None:
        out["codepair"] = codepair_bench(a.codepair, a.devices.split(",")[0], a.codepair_limit, a.out, a.codepair_budgets)
    report(out)  # also adds out["targets"]
    save()


def report(out: dict):
    bw = out["copy_GBps"]
    print(f"\n== {out['gpu']}  {out['date']}  torch {out['torch']}  copy {bw:.0f} GB/s"
          + ("  (DDTREE_TREE_PROLOGUE=1)" if out.get("tree_prologue") else ""))
    for part in ("main", "dense"):
        if part not in out:
            continue
        res = out[part]
        wb = res["weight_bytes_per_token"]
        print(f"-- {res['preset']} on {','.join(res['devices'])}: weights/token {wb / 1e9:.2f} GB, "
              f"roofline {bw * 1e9 / wb:.1f} tok/s")
        for key, r in res.items():
            if not key.startswith("ctx"):
                continue
            roof = bw * 1e9 / r["bytes_per_token"]
            print(f"  [{key}] AR {r['ar_ms_per_token']:.2f} ms/tok = {r['ar_tok_s']:.1f} tok/s "
                  f"({100 * r['ar_tok_s'] / roof:.0f}% of roofline {roof:.1f}); achieved {r['ar_achieved_GBps']:.0f} GB/s"
                  + (f"; transformers {r['hf_ms_per_token']:.1f} ms/tok -> {r['ar_speedup_vs_hf']:.1f}x"
                     if r.get("hf_ms_per_token") else ""))
            if "ar_stages_ms" in r:
                a = r["ar_stages_ms"]
                print(f"  AR step: verify {a['verify']:.2f}, walk+commit {a['draft']:.2f}, host {a['host']:.2f} ms "
                      f"(host tree {a['tree']:.2f})")
            print("     N     verify ms  x step   commit ms  draft ms")
            for T, ms in r["verify_ms"].items():
                print(f"  {T:5d}  {ms:10.2f}  {r['verify_over_step'][T]:6.2f}  {r['commit_ms'][T]:9.3f}  "
                      f"{(r['draft_ms'][T] or 0):8.2f}")
            print("     round           round ms  tree  verify  commit  draft  host  overhead")
            for m, x in r["rounds"].items():
                print(f"  {m:16s} {x['round_ms']:8.2f} {x['tree_ms']:5.2f} {x['verify_ms']:7.2f} {x['commit_ms']:7.2f} "
                      f"{x['draft_ms']:6.2f} {x.get('host_ms', 0):5.2f} {x['overhead_ms']:8.2f}")
    if "codepair" in out:
        print("-- codepair (real trained pair, bf16, greedy)")
        for k, x in out["codepair"].items():
            print(f"  {k:12s} {x['tok_s']:8.1f} tok/s  accept {x['accept']:.2f}  x{(x['speedup_vs_ar'] or 1):.2f} vs ar"
                  f"  exact {x['exact']}")
    targets(out)


def targets(out: dict):
    """Issue #6's targets, each with its measured figure."""
    rows = []
    main_ = out.get("main", {})
    r = main_.get("ctx1024")
    if r:
        roof = out["copy_GBps"] * 1e9 / r["bytes_per_token"]
        rows.append(("1 AR >= 80% of roofline (1k ctx)", f"{r['ar_tok_s']:.1f} tok/s = {100 * r['ar_tok_s'] / roof:.0f}% "
                     f"of {roof:.1f}", r["ar_tok_s"] >= 0.8 * roof))
        step = r["ar_ms_per_token"]
        v = r["verify_ms"]
        for T, lim in ((33, 1.3), (32, 1.3), (65, 1.5), (64, 1.5)):
            if T in v:
                bare = v[1] + r["commit_ms"][1] if 1 in v else float("nan")
                rows.append((f"2 verify {T} nodes <= {lim}x AR step", f"{v[T]:.2f} ms = {v[T] / step:.2f}x of {step:.2f} "
                             f"({v[T] / bare:.2f}x of the bare step {bare:.2f})", v[T] <= lim * step))
        dm = statistics.median([x for x in r["draft_ms"].values() if x])
        rows.append(("2 drafter forward <= 0.15x AR step", f"{dm:.2f} ms = {dm / step:.2f}x", dm <= 0.15 * step))
        for key in ("ddtree:32", "dflash:15"):
            x = r["rounds"].get(key)
            if x:
                rows.append((f"3 round outside forwards <= 0.5 ms ({key})",
                             f"{x['overhead_ms']:.2f} ms (tree {x['tree_ms']:.2f}, commit {x['commit_ms']:.2f})",
                             x["overhead_ms"] <= 0.5))
        if r.get("ar_speedup_vs_hf"):
            rows.append(("5 AR >= 5x transformers", f"{r['ar_speedup_vs_hf']:.1f}x ({r['hf_ms_per_token']:.0f} ms/token)",
                         r["ar_speedup_vs_hf"] >= 5))
    cp = out.get("codepair")
    if cp:
        trees = {k: x for k, x in cp.items() if k.startswith("ddtree")}
        best = max(trees, key=lambda k: trees[k]["tok_s"])
        ar, df, au = cp["ar"]["tok_s"], cp["dflash"]["tok_s"], cp.get("ddtree:auto", {}).get("tok_s", 0)
        rows.append(("4 codepair ddtree(best) >= dflash >= ar", f"{best} {trees[best]['tok_s']:.0f} / dflash {df:.0f} / "
                     f"ar {ar:.0f} tok/s ({trees[best]['tok_s'] / ar:.2f}x, {df / ar:.2f}x)", trees[best]["tok_s"] >= df >= ar))
        rows.append(("4 codepair ddtree auto >= dflash", f"{au:.0f} vs {df:.0f} tok/s ({au / df:.2f}x)", au >= 0.97 * df))
    d = out.get("dense", {}).get("ctx512")
    if d:
        x = d["rounds"].get("ddtree:32")
        rows.append(("6 Qwen3-8B round @32 <= 44/5 = 8.8 ms", f"{x['round_ms']:.2f} ms ({44 / x['round_ms']:.1f}x faster)",
                     x["round_ms"] <= 8.8))
    print("\n-- issue #6 targets")
    for name, fig, ok in rows:
        print(f"  {'PASS' if ok else 'MISS'}  {name:44s} {fig}")
    out["targets"] = [{"target": n, "measured": f, "pass": bool(ok)} for n, f, ok in rows]


if __name__ == "__main__":
    main()

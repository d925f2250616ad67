#!/usr/bin/env python
"""--budget auto against every fixed method on the codepair pair: drafters x dtypes, one process.

    python scripts/bench_auto.py                                   # GPU: 3 drafters x bf16, float32
    python scripts/bench_auto.py --devices cpu --dtypes float32    # CPU (OMP_NUM_THREADS=1 for the reference rows)
    python scripts/bench_auto.py --fixture .fixture/codepair --drafters drafter-distilled --out-dir /root/out

Each row is one `ddtree bench` (ar, dflash, ddtree 8/15/16/31/32/63/64 and auto; 8 prompts x 128 new tokens,
greedy, raw prompts, one warm-up; the runs interleaved prompt by prompt) whose document lands in --out-dir as
codepair-<drafter>-<dtype>.json; the table says decode tok/s per method, the best fixed method,
auto's ratio to it (the target: at least 0.97), how often auto took a plain step, the graph pieces
captured or compiled inside timed prompts (per method; 0 where the warm-up covered every key), and
whether every method equalled ar (float32 rows). A summary JSON (bench-auto.json) holds the table.
Feeds docs/PERFORMANCE.md's "codepair on one GPU" and "codepair on a CPU" tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.simulate_auto import FIXED_BUDGETS  # noqa: E402

BUDGETS = ",".join(map(str, FIXED_BUDGETS)) + ",auto"  # the simulation's: both sides of each tile edge


def fixed_methods(budgets: str) -> tuple[str, ...]:
    return ("ar", "dflash") + tuple(f"ddtree-{b}" for b in budgets.split(",") if b != "auto")


def label(run: dict) -> str:
    if run["method"] != "ddtree":
        return run["method"]
    return "ddtree-auto" if run.get("budget_setting") == "auto" else f"ddtree-{run['budget']}"


def summarise(doc: dict, fixed_names: tuple[str, ...]) -> dict:
    runs = {label(r): r for r in doc["runs"]}
    tok_s = {k: r["aggregate"]["decode_tok_s"] for k, r in runs.items()}
    fixed = {k: v for k, v in tok_s.items() if k in fixed_names}
    best = max(fixed, key=fixed.get)
    auto = runs.get("ddtree-auto")
    hist = auto["aggregate"].get("tree_size", {}).get("histogram", {}) if auto else {}
    n = sum(hist.values()) or 1
    exact = [r.get("exact_match_vs_ar") for r in doc["runs"] if r["method"] != "ar"]
    return {"tok_s": tok_s, "best_fixed": best, "auto_vs_best": tok_s.get("ddtree-auto", 0.0) / fixed[best],
            "auto_plain_share": hist.get("0", 0) / n, "auto_histogram": hist,
            "captures": {k: r["aggregate"].get("captures") for k, r in runs.items()},
            "all_exact": None if any(e is None for e in exact) else all(exact)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", type=Path, default=ROOT.parent / "shared" / "fixtures" / "codepair")
    ap.add_argument("--drafters", default="drafter,drafter-distilled,drafter-large")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--devices", default="auto")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--budgets", default=BUDGETS)
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                    help="time the runs prompt by prompt in turn (ddtree bench --interleave), so a slow spell of the "
                         "machine hits every method alike")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "results")
    args = ap.parse_args(argv)
    from ddtree.app.cli import setup_logging

    setup_logging(False)  # INFO: loguru's default sink would time auto's per-round debug lines
    from ddtree.app.bench import run_bench

    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    t_all = time.perf_counter()
    for dtype in args.dtypes.split(","):
        for name in args.drafters.split(","):
            t0 = time.perf_counter()
            out = args.out_dir / f"codepair-{name}-{dtype}.json"
            doc = run_bench(str(args.fixture / "target"), str(args.fixture / name), prompts=str(args.fixture / "prompts.jsonl"),
                            methods="ar,dflash,ddtree", budgets=args.budgets, max_new_tokens=args.max_new_tokens,
                            dtype=dtype, devices=args.devices, raw=True, limit=args.limit, interleave=args.interleave, out=out,
                            progress=False, print_table=False)
            row = summarise(doc, fixed_methods(args.budgets))
            row.update(drafter=name, dtype=dtype, device=doc["metadata"].get("devices"), seconds=time.perf_counter() - t0)
            rows.append(row)
            print(f"{name} {dtype}: " + ", ".join(f"{k} {v:.0f}" for k, v in row["tok_s"].items())
                  + f"; auto / {row['best_fixed']} {row['auto_vs_best']:.3f}, plain {row['auto_plain_share']:.0%}, "
                  f"captures in timed prompts {sum(v or 0 for v in row['captures'].values())}, "
                  f"exact {row['all_exact']} ({row['seconds']:.0f} s)", flush=True)
    FIXED = fixed_methods(args.budgets)
    head = ["drafter", "dtype"] + list(FIXED) + ["auto", "best fixed", "auto / best", "plain", "captures", "exact"]
    print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        t = r["tok_s"]
        print("| " + " | ".join([r["drafter"], r["dtype"]] + [f"{t.get(k, 0):.0f}" for k in FIXED + ("ddtree-auto",)]
                                + [r["best_fixed"], f"{r['auto_vs_best']:.3f}", f"{r['auto_plain_share']:.0%}",
                                   str(sum(v or 0 for v in r["captures"].values())), str(r["all_exact"])]) + " |")
    from scripts.bench_engine import git_commit

    meta = doc["metadata"]  # the last run's: every run shares the machine and the code
    where = {"gpu": ", ".join(meta.get("gpus") or []) or "CPU", "torch": meta.get("torch_version"),
             "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "command": "python scripts/bench_auto.py " + " ".join(argv or sys.argv[1:])}
    (args.out_dir / "bench-auto.json").write_text(json.dumps({**where, "rows": rows, "seconds": time.perf_counter() - t_all},
                                                             indent=1))
    print(f"\n{time.perf_counter() - t_all:.0f} s in all; wrote {args.out_dir / 'bench-auto.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

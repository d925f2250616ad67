#!/usr/bin/env python
"""--budget auto of two commits against `ar`, alternated on a quiet CPU: the A/B that a policy change
to auto needs where single runs differ by a few percent.

    python scripts/auto_ab.py --commits 01724fa,HEAD --reps 3 --out results/auto-ab-cpu.json

Each commit is checked out once (a git worktree under --work, removed at the end); then, rep by rep and drafter by drafter,
each commit runs `OMP_NUM_THREADS=1 python -m ddtree bench --methods ar,ddtree --budgets auto --interleave` on the
codepair fixture (8 prompts x 128 new tokens, float32, greedy) in a fresh process, the commits in
turn, so a slow spell of the machine hits both. The document: per commit and drafter, each rep's ar
and auto decode tok/s, auto / ar, auto's plain-step share, and the median of auto / ar.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.bench_auto import summarise  # noqa: E402


def checkout(ref: str, work: Path) -> tuple[str, Path]:
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", ref], capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = work / sha
    if not tree.exists():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), sha], check=True,
                       capture_output=True)
    return sha, tree


def bench(tree: Path, fixture: Path, drafter: str, out: Path, limit: int, tokens: int) -> dict:
    cmd = [sys.executable, "-m", "ddtree", "bench", "--target", str(fixture / "target"), "--drafter",
           str(fixture / drafter), "--prompts", str(fixture / "prompts.jsonl"), "--raw", "--devices", "cpu",
           "--dtype", "float32", "--temperature", "0", "--limit", str(limit), "--max-new-tokens", str(tokens),
           "--methods", "ar,ddtree", "--budgets", "auto", "--interleave", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(tree))
    subprocess.run(cmd, cwd=tree, env=env, check=True, capture_output=True)
    s = summarise(json.loads(out.read_text()))
    ar, auto = s["tok_s"]["ar"], s["tok_s"]["ddtree-auto"]
    return {"ar_tok_s": round(ar, 2), "auto_tok_s": round(auto, 2), "auto_vs_ar": round(auto / ar, 4),
            "auto_plain_share": round(s["auto_plain_share"], 3), "exact": s["all_exact"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--commits", default="HEAD~1,HEAD", help="two (or more) git refs, compared in turn")
    ap.add_argument("--fixture", type=Path, default=ROOT.parent / "shared" / "fixtures" / "codepair")
    ap.add_argument("--drafters", default="drafter,drafter-distilled,drafter-large")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "ddtree-auto-ab")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "auto-ab-cpu.json")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    trees = [checkout(ref, args.work) for ref in args.commits.split(",")]
    fixture = args.fixture.resolve()
    runs: dict[tuple[str, str], list] = {}
    try:
        for rep in range(1, args.reps + 1):
            for drafter in args.drafters.split(","):
                for sha, tree in trees:
                    t0 = time.perf_counter()
                    got = bench(tree, fixture, drafter, args.work / f"{sha}-{drafter}-{rep}.json", args.limit,
                                args.max_new_tokens)
                    runs.setdefault((sha, drafter), []).append(dict(rep=rep, **got))
                    print(f"rep {rep} {drafter} {sha}: ar {got['ar_tok_s']:.1f}, auto {got['auto_tok_s']:.1f} tok/s, "
                          f"auto / ar {got['auto_vs_ar']:.3f}, plain {got['auto_plain_share']:.0%} "
                          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    finally:  # the bench documents stay in --work; the checkouts leave the repository's worktree list
        for _, tree in trees:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], capture_output=True)
    rows = [{"code": sha, "drafter": d, "runs": rs, "median_auto_vs_ar": statistics.median(r["auto_vs_ar"] for r in rs)}
            for (sha, d), rs in runs.items()]
    print("\n| drafter | " + " | ".join(sha for sha, _ in trees) + " |\n|---|" + "---|" * len(trees))
    for d in args.drafters.split(","):
        cells = [next(r for r in rows if r["code"] == sha and r["drafter"] == d) for sha, _ in trees]
        print(f"| `{d}/` | " + " | ".join(f"{c['median_auto_vs_ar']:.3f} ("
                                          + ", ".join(f"{r['auto_vs_ar']:.3f}" for r in c["runs"]) + ")" for c in cells) + " |")
    import torch

    doc = {"kind": "auto-cpu", "device": f"cpu: {os.cpu_count()} cores, one thread per run", "torch": torch.__version__,
           "date": time.strftime("%Y-%m-%d"), "command": "python scripts/auto_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "rows": rows}
    args.out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

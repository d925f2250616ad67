#!/usr/bin/env python
"""--budget auto's plain step against an `ar` step, alternated in one process (CPU float32).

    OMP_NUM_THREADS=1 python scripts/bench_auto_plain.py --out results/auto-plain-step-cpu.json

auto is held to plain steps (its chooser answers every round with a plain step; no probe before
the generation ends), so each of its rounds does what an `ar` round does plus auto's own work:
the verify returns the drafter's tap rows, the step keeps them aside for the next drafting step,
the packet carries the per-budget summary, and the host runs the policy. Generations of `ar` and
of that auto alternate prompt by prompt (the order flipped every pass), so the machine's drift
hits both; per round: the verify and step stages (medians) and decode time over rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", type=Path, default=ROOT.parent / "shared" / "fixtures" / "codepair")
    ap.add_argument("--drafter", default="drafter")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=60, help="new tokens per generation (below the first probe)")
    ap.add_argument("--passes", type=int, default=4, help="timed passes over the prompts (after one untimed)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch
    from loguru import logger

    logger.remove()
    torch.set_num_threads(1)
    from ddtree.app.setup import load_tokenizer
    from ddtree.decode import budget
    from ddtree.decode.decoder import Decoder
    from ddtree.model.checkpoint import load_drafter, load_target

    assert args.tokens < budget.PLAIN_PROBE_MAX, "a generation must end before auto's plain steps would have to draft"
    prompts = [json.loads(x) for x in (args.fixture / "prompts.jsonl").read_text().splitlines() if x.strip()][:args.limit]
    tok = load_tokenizer(args.fixture / "target")
    encoded = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    target, _ = load_target(str(args.fixture / "target"), [torch.device("cpu")], torch.float32, 1024)
    drafter, _ = load_drafter(str(args.fixture / args.drafter), target, torch.float32, 1024)
    dec = Decoder(target, drafter)
    budget.BudgetChooser.pick_eq = lambda self, eq: (0, 0.0)  # every round a plain step
    budget.PLAIN_PROBE = 10 ** 6  # ... and no probe
    stats = {"ar": {"verify": [], "step": [], "round": []}, "auto": {"verify": [], "step": [], "round": []}}
    t0 = time.perf_counter()
    for rep in range(args.passes + 1):
        for ids in encoded:
            runs = (("ar", 1), ("ddtree", "auto")) if rep % 2 == 0 else (("ddtree", "auto"), ("ar", 1))
            for method, b in runs:
                rec = dec.generate(ids, method, b, max_new_tokens=args.tokens)
                assert all(r.tree_size == 0 for r in rec.rounds), "auto verified a tree"
                if rep:
                    s = stats["ar" if method == "ar" else "auto"]
                    s["verify"] += [r.times_ms["verify"] for r in rec.rounds[1:]]
                    s["step"] += [r.times_ms["draft"] for r in rec.rounds[1:]]
                    s["round"].append(rec.decode_s * 1e3 / len(rec.rounds))
    out = {k: {f"{m}_ms": round(statistics.median(v), 4) for m, v in s.items()} for k, s in stats.items()}
    paired = [a / b for a, b in zip(stats["auto"]["round"], stats["ar"]["round"])]
    doc = {"what": "auto held to plain steps against ar, alternated in one process (scripts/bench_auto_plain.py)",
           "device": "cpu", "dtype": "float32", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "drafter": args.drafter, "prompts": len(encoded), "tokens": args.tokens, "passes": args.passes,
           "medians": out, "auto_over_ar_per_round": round(statistics.median(paired), 4),
           "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(doc, indent=1))
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

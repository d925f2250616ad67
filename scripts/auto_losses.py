#!/usr/bin/env python
"""Where --budget auto's decode time goes against `ar`'s, from `ddtree bench` documents that hold
an `ar` run and an auto run over the same prompts (as scripts/bench_auto.py writes them).

    python scripts/auto_losses.py DIR/codepair-drafter-float32.json ... [--out results/auto-losses-cpu.json]

Each auto round is put in one kind:

    plain        a plain step whose step does not draft
    probe        a plain step whose step drafts (the round after it verifies that tree: a sample)
    tree         a tree round followed by another tree round
    tree->plain  a tree round followed by a plain step (the tree its step drafted is not verified)

A kind's cost is its rounds' verify and step stages; against `ar`, that cost less its committed
tokens at `ar`'s stage time per token (`over_ar_ms`; negative: the kind beat `ar`). What the stages
leave out (the host's work between them: the policy, the packet, the prefix copy) is `host`. The
kinds' and the host's `over_ar_ms` add up to auto's decode time less `ar`'s, and `share` is each as
a fraction of `ar`'s decode time. Stage times are the round's own on a CPU (a round runs when it is
queued); on a GPU they are the host's queueing times, and this breakdown does not apply.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

KINDS = ("plain", "probe", "tree", "tree->plain")


def kind_of(sizes: list[int], i: int) -> str:
    """The kind of round i of a generation from its rounds' tree sizes (0: a plain step)."""
    nxt = sizes[i + 1] if i + 1 < len(sizes) else None
    if sizes[i] == 0:
        return "probe" if nxt else "plain"
    return "tree" if nxt else "tree->plain"


def stage_ms(prompt: dict, i: int) -> float:
    t = prompt["rounds"]["times_ms"]
    return t["verify"][i] + t["draft"][i]


def losses(doc: dict) -> dict:
    """One document's breakdown (see the module docstring)."""
    from scripts.bench_auto import label

    runs = {label(r): r for r in doc["runs"]}
    ar, auto = runs["ar"], runs["ddtree-auto"]
    ar_decode = sum(p["decode_s"] for p in ar["prompts"]) * 1e3
    ar_stages = sum(stage_ms(p, i) for p in ar["prompts"] for i in range(p["num_rounds"]))
    ar_tokens = sum(sum(p["rounds"]["committed"]) for p in ar["prompts"])
    per_token = ar_stages / ar_tokens
    kinds = {k: {"rounds": 0, "ms": 0.0, "tokens": 0} for k in KINDS}
    for p in auto["prompts"]:
        sizes = p["rounds"]["tree_size"]
        for i in range(len(sizes)):
            k = kinds[kind_of(sizes, i)]
            k["rounds"] += 1
            k["ms"] += stage_ms(p, i)
            k["tokens"] += p["rounds"]["committed"][i]
    auto_decode = sum(p["decode_s"] for p in auto["prompts"]) * 1e3
    auto_stages = sum(k["ms"] for k in kinds.values())
    for k in kinds.values():
        k["over_ar_ms"] = k["ms"] - k["tokens"] * per_token
        k["share"] = k["over_ar_ms"] / ar_decode
    host_over = (auto_decode - auto_stages) - (ar_decode - ar_stages)
    return {"drafter": Path(doc["metadata"]["drafter"]).name, "dtype": doc["metadata"]["dtype"],
            "auto_vs_ar": ar_decode / auto_decode * sum(p["new_tokens"] for p in auto["prompts"])
            / sum(p["new_tokens"] for p in ar["prompts"]),
            "ar_decode_ms": ar_decode, "auto_decode_ms": auto_decode, "ar_ms_per_token": per_token,
            "kinds": kinds, "host": {"ar_ms": ar_decode - ar_stages, "auto_ms": auto_decode - auto_stages,
                                     "over_ar_ms": host_over, "share": host_over / ar_decode}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("docs", type=Path, nargs="+", help="ddtree bench documents (an ar run and an auto run)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = []
    for path in args.docs:
        row = losses(json.loads(path.read_text()))
        row["document"] = str(path)
        rows.append(row)
        parts = ", ".join(f"{k} {v['share']:+.1%} ({v['rounds']})" for k, v in row["kinds"].items())
        print(f"{row['drafter']} {row['dtype']}: auto / ar {row['auto_vs_ar']:.3f}; against ar: {parts}, "
              f"host {row['host']['share']:+.1%}")
    if args.out:
        args.out.write_text(json.dumps({"what": "auto's decode time against ar's by round kind (scripts/auto_losses.py)",
                                        "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

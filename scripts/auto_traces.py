"""Per-round acceptance traces of the codepair drafters (for scripts/simulate_auto.py).

A greedy round that starts at position t of the target's greedy continuation g (root g[t]) drafts
the same block whatever came before it: the drafter's context is the target's tap rows of the
committed tokens, and those are the prompt and g[:t] for every method. So one drafter forward per
position says what every arm would accept there. For each position t this records:

    acc[arm]   draft tokens the arm's tree accepts against g[t+1:] (chain: the top-1 chain of the
               block; "t<b>": the best-first tree of b draft nodes, k = b columns as `ddtree
               --budget b` builds it; "a<b>": auto's tree of b nodes, k = AUTO_TOPK columns)
    eq[b]      E_q(b) of auto's tree (its first b path probabilities summed), b in AUTO_BUDGETS

Float32 on the CPU; eos does not stop a continuation (every prompt runs the full length).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from ddtree.decode.budget import AUTO_BUDGETS, AUTO_TOPK
from ddtree.ops.tree import build_tree

FIXED_BUDGETS = (8, 16, 32, 64)


def accepted(tree, cont: list[int]) -> int:
    """Draft tokens the walk accepts when the target's tokens after the root are cont."""
    children: dict[int, dict[int, int]] = {}
    toks, parents = tree.tokens.tolist(), tree.parents.tolist()
    for i in range(1, len(toks)):
        children.setdefault(parents[i], {})[toks[i]] = i
    node, n = 0, 0
    for t in cont:
        node = children.get(node, {}).get(t)
        if node is None:
            return n
        n += 1
    return n


def position_trace(root: int, lp: np.ndarray, ids: np.ndarray, cont: list[int]) -> dict:
    """One position's outcomes: lp, ids [D, K] (K >= 64) sorted descending; cont: g[t+1 : t+1+D]."""
    chain = 0
    for d in range(len(cont)):
        if ids[d, 0] != cont[d]:
            break
        chain += 1
    acc = {"chain": chain}
    for b in FIXED_BUDGETS:
        acc[f"t{b}"] = accepted(build_tree(root, lp[:, :b], ids[:, :b], b), cont)
    auto = build_tree(root, lp[:, :AUTO_TOPK], ids[:, :AUTO_TOPK], max(AUTO_BUDGETS))
    probs = [math.exp(s) for s in auto.scores[1:]]
    for b in AUTO_BUDGETS:
        acc[f"a{b}"] = accepted(auto.truncate(b + 1), cont)
    eq = {str(b): round(sum(probs[:b]), 4) for b in AUTO_BUDGETS}
    return {"acc": acc, "eq": eq}


@torch.no_grad()
def record(fixture: Path, drafters: list[str], limit: int, tokens: int, log=print) -> dict:
    """{drafter: [{prompt, positions: {field: [per position]}}]} for the first `limit` prompts."""
    from transformers import AutoTokenizer

    from ddtree.decode.decoder import Decoder
    from ddtree.model.checkpoint import load_drafter, load_target

    prompts = [json.loads(x) for x in (fixture / "prompts.jsonl").read_text().splitlines() if x.strip()][:limit]
    tok = AutoTokenizer.from_pretrained(str(fixture / "target"))
    encoded = [tok(p["prompt"], add_special_tokens=False)["input_ids"] for p in prompts]
    D = 16  # the drafters' block less its root (checked below)
    max_len = -(-(max(map(len, encoded)) + tokens + 2 * D + 8) // 256) * 256
    target, _ = load_target(str(fixture / "target"), [torch.device("cpu")], torch.float32, max_len)
    out: dict = {}
    conts: dict[str, list[int]] = {}
    for name in drafters:
        drafter, _ = load_drafter(str(fixture / name), target, torch.float32, max_len)
        dec = Decoder(target, drafter)
        assert drafter.cfg.block_size == D, drafter.cfg.block_size
        runs = []
        for p, ids in zip(prompts, encoded):
            t0 = time.perf_counter()
            if p["id"] not in conts:  # the target's greedy continuation, D past the traced length
                conts[p["id"]] = dec.generate(ids, "ar", max_new_tokens=tokens + D).token_ids
            g = conts[p["id"]]
            L = len(ids)
            target.reset()
            _, taps = target.prefill(torch.tensor(ids + g[: tokens - 1]), want_taps=True)  # [L + tokens - 1, W]
            drafter.reset()
            drafter.add_context(taps[:L])
            fields: dict[str, list] = {}
            for t in range(tokens):  # the round whose root is g[t]: the context holds prompt + g[:t]
                lp, top = drafter.draft_topk(torch.tensor(g[t]), dec.kv_len(L + t + D), 64)
                rec = position_trace(g[t], lp.numpy(), top.numpy(), g[t + 1 : t + D])
                for group in ("acc", "eq"):
                    for k, v in rec[group].items():
                        fields.setdefault(f"{group}:{k}", []).append(v)
                if t + 1 < tokens:
                    drafter.add_context(taps[L + t : L + t + 1])
            runs.append({"prompt": p["id"], "positions": fields})
            log(f"{name} {p['id']}: {tokens} positions in {time.perf_counter() - t0:.1f}s; mean accepted "
                + ", ".join(f"{k[4:]} {np.mean(v):.2f}" for k, v in fields.items() if k.startswith("acc:")))
        out[name] = runs
    return out

"""The host-tree round loop: the reference twin of the device pipeline (ddtree.decode.round).

Each round the host builds the tree (the heap of ddtree.ops.tree.build_tree, with --top1-first
if asked), uploads it, and the device runs verify -> walk -> drafter context -> draft; after the
round's one device-to-host copy the commit is queued, so it runs while the host builds the next
tree. It serves `--top1-first` and `DDTREE_HOST_ROUNDS=1`, and the tests compare the pipeline with
it (tests/decode/test_decoder.py, tests/decode/test_budget_auto.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ddtree.decode.budget import BudgetChooser
from ddtree.decode.graphs import HostCommitKey, HostDraftKey
from ddtree.decode.round import emit
from ddtree.ops.tree import Tree, build_tree
from ddtree.stats import RoundRecord


@dataclass
class Draft:
    """The drafter's proposal as the host reads it (once per round)."""

    bonus: int
    topk_lp: np.ndarray | None  # [D, K] float32 (a view of the round's one host copy)
    topk_ids: np.ndarray | None  # [D, K] int64


def host_tree(method: str, bonus: int, draft: Draft | None, budget: int, top1_first: bool) -> Tree:
    if method == "ar":
        return Tree.chain(torch.tensor([bonus]))
    if method == "dflash":
        return Tree.chain([bonus] + draft.topk_ids[:, 0].tolist())
    return build_tree(bonus, draft.topk_lp, draft.topk_ids, budget, top1_first=top1_first)


def host_draft(dec, slot, taps, P: int, draft_kv: int, k: int, sampling) -> torch.Tensor:
    """After a verify: walk; drafter context += accepted rows; draft the next block (the commit
    comes after the host sync). Without taps (ar): walk and commit. On a split target it starts and
    ends at home (ddtree.decode.decoder's table).
    -> packed floats for the host: [n, bonus, path_nodes (P), topk logprobs (D*k), topk ids (D*k)]."""
    path, n, bonus = dec.walk(slot, P)
    parts = [n.view(1).float(), bonus.view(1).float(), path.float()]
    if taps is None:  # ar: no drafter, so no host work to overlap: commit here,
        dec.commit(path, n)
        slot.tokens[:1].copy_(bonus.view(1))  # and the bonus is the next step's token, on the device
    else:
        dec.drafter.add_context(taps, n, rows=path)
        lp, ids = dec.target.enter(dec.home, *dec.draft_topk(bonus, draft_kv, k, sampling))
        parts += [lp.flatten(), ids.flatten().float()]
    return torch.cat(parts)


def run_host_rounds(dec, method: str, budget: int, draft: Draft | None, chooser: BudgetChooser | None,
                    out: list[int], start: int, max_new: int, stop_ids, sampling, gen, top1_first: bool, k: int,
                    on_tokens, clock, rounds: list, pending: list):
    """The rounds of one generation with host-built trees (see the module docstring)."""
    taps_on = method != "ar"
    P = 1 if method == "ar" else dec.block_size
    depth = dec.block_size - 1
    bonus, stopped = out[-1], out[-1] in stop_ids
    backlog = None  # the last round's bookkeeping: done while the device runs the next round

    def book(toks, tree, path, n, T, marks) -> bool:  # -> on_tokens' True: end the generation
        halt = bool(on_tokens(toks)) if on_tokens else False
        ranks = tree.ranks.tolist()
        rounds.append(RoundRecord(tree_size=T - 1, tree_depth=max(tree.depths.tolist()), accepted=n - 1,
                                  accepted_ranks=[ranks[i] for i in path[1:]], committed=len(toks), times_ms={}))
        pending.append(marks)
        return halt

    halt = False
    while len(out) < max_new and not stopped and not halt:
        # ---------------- tree (host) and upload into the static slot
        h0 = time.perf_counter()
        tree = host_tree(method, bonus, draft, budget, top1_first)
        if chooser is not None:
            b, predicted = chooser.pick(tree.scores)
            tree = tree.truncate(b + 1)
        T = tree.num_nodes
        slot = dec.slot(T)
        slot.load(tree)
        host_tree_ms = (time.perf_counter() - h0) * 1e3
        kv_len = dec.kv_len(start + T)
        draft_kv = dec.kv_len(start + P)
        # ---------------- verify (+ choice), then walk and draft the next block
        e0 = clock.now()
        vkey, taps = dec.verify(slot, kv_len, sampling, gen, taps_on)
        e1 = clock.now()
        packed = dec.graphs.run(HostDraftKey(vkey, P, draft_kv, k, sampling.temperature_or_none),
                                lambda: host_draft(dec, slot, taps, P, draft_kv, k, sampling))
        e2 = clock.now()
        if backlog is not None:  # the device is busy: the host catches up on the last round
            halt = book(*backlog)
        w0 = time.perf_counter()
        host = packed.cpu().numpy()  # the round's one device-to-host sync; host work below is numpy/lists
        wait_s = time.perf_counter() - w0
        # ---------------- commit: queued now, it runs on the device while the host builds the next tree
        e3 = clock.now()
        if taps_on:
            dec.graphs.run(HostCommitKey(vkey, P), lambda: dec.commit(*dec.statics.walk(P)[:2]))
        e4 = clock.now()
        n, bonus = int(host[0]), int(host[1])
        if chooser is not None:
            chooser.update(T - 1, predicted, n - 1, (time.perf_counter() - h0) * 1e3)
        path = host[2 : 2 + n].astype(np.int64).tolist()
        if taps_on:
            o = 2 + P
            draft = Draft(bonus, host[o : o + depth * k].reshape(depth, k),
                          host[o + depth * k :].reshape(depth, k).astype(np.int64))
        start += n
        # ---------------- emit: accepted draft tokens, then the new bonus
        tree_tokens = tree.tokens.tolist()
        toks, stopped = emit([tree_tokens[i] for i in path[1:]] + [bonus], max_new - len(out), stop_ids)
        out.extend(toks)
        marks = [("tree", host_tree_ms), ("verify", e0, e1), ("draft", e1, e2)] + ([("commit", e3, e4)] if taps_on else [])
        # host: the round's wall time minus the wait in the sync (what the device may idle on)
        backlog = (toks, tree, path, n, T, marks + [("host", (time.perf_counter() - h0 - wait_s) * 1e3)])
    if backlog is not None:
        book(*backlog)

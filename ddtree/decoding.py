"""One round structure for the three decoders: `ar`, `dflash` (a chain) and `ddtree` (a tree).

A round, with everything that depends on acceptance kept on the device:

    tree (host) --H2D--> target verify --> choose per node --> walk --> commit --> drafter
         ^                                                                        |
         +------------- ONE device-to-host copy: accepted path, bonus, top-k -----+

`ar` is the same round with a one-node tree and no drafter. The walk starts at the root, takes the
target's own token at the current node (greedy: argmax; sampling: a fresh sample), moves to the
child holding it and stops where no child does; that token is the next bonus. Outputs therefore
equal the target's own decoding: token for token when greedy, in distribution when sampling.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from ddtree.drafter import DFlashDrafter
from ddtree.errors import DDTreeError
from ddtree.sampling import SamplingParams, choose
from ddtree.stats import GenerationRecord, RoundRecord
from ddtree.target import TargetModel
from ddtree.tree import Tree, build_tree

METHODS = ("ar", "dflash", "ddtree")


def walk(tokens, parents, depths, path_mask, choice, P: int):
    """Accepted path of a verified tree, on the device (no host sync).

    tokens/parents/depths/choice [T]; path_mask [T, T]. A node is accepted when every node on its
    path holds the token its parent's choice picked. Siblings hold distinct tokens, so the
    accepted nodes form one path. Returns last accepted node (0-dim), its node count n (0-dim,
    root included) and path_nodes [P] (root first, padded with the last node).
    """
    T = tokens.shape[0]
    idx = torch.arange(T, device=tokens.device)
    match = (tokens == choice[parents.clamp(min=0)]) | (idx == 0)
    accepted = ~(path_mask & ~match[None, :]).any(1)
    last = torch.where(accepted, depths, -1).argmax()
    d_last = depths[last]
    d = torch.arange(P, device=tokens.device)
    on_path = path_mask[last][None, :] & (depths[None, :] == d[:, None])  # [P, T]
    path_nodes = torch.where(d <= d_last, on_path.to(torch.int32).argmax(1), last)
    return last, d_last + 1, path_nodes


class StageClock:
    """Per-stage times without host syncs: CUDA events on GPU (read once at the end), wall time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object, object]] = []

    def now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def add(self, name, t0, t1):
        self.marks.append((name, t0, t1))

    def resolve(self) -> list[tuple[str, float]]:
        if self.cuda:
            torch.cuda.synchronize()
            return [(n, a.elapsed_time(b)) for n, a, b in self.marks]
        return [(n, (b - a) * 1e3) for n, a, b in self.marks]


def sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Draft:
    """What the host reads once per round."""

    n: int  # nodes committed (root + accepted)
    path: list[int]  # tree node indices root-first
    bonus: int
    topk_lp: torch.Tensor | None  # [D, K] CPU
    topk_ids: torch.Tensor | None


class Decoder:
    """Runs `ar`, `dflash` or `ddtree` on a loaded target (+ drafter)."""

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None = None, max_len: int | None = None):
        self.target, self.drafter = target, drafter
        self.max_len = max_len or target.max_len
        if drafter is not None:
            target.tap_layers = list(drafter.cfg.target_layer_ids)
            drafter.attach(target.embed_tokens, target.lm_head)

    @property
    def block_size(self) -> int:
        return self.drafter.cfg.block_size if self.drafter is not None else 1

    # ------------------------------------------------------------------ pieces of a round
    def _draft_topk(self, bonus: torch.Tensor, kv_len: int, k: int, sp: SamplingParams):
        logits = self.drafter.draft_logits(bonus, kv_len)  # [B-1, V]
        if not sp.greedy:
            logits = logits / sp.temperature
        lp = torch.log_softmax(logits, -1)
        return lp.topk(k, dim=-1)  # values, indices: [B-1, k]

    def _tree(self, method: str, bonus: int, draft: _Draft | None, budget: int, top1_first: bool) -> Tree:
        if method == "ar":
            return Tree.chain(torch.tensor([bonus]))
        if method == "dflash":
            return Tree.chain(torch.cat([torch.tensor([bonus]), draft.topk_ids[:, 0]]))
        return build_tree(bonus, draft.topk_lp, draft.topk_ids, budget, top1_first=top1_first)

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        method: str = "ddtree",
        budget: int = 32,
        sampling: SamplingParams = SamplingParams(),
        max_new_tokens: int = 128,
        stop_ids: set[int] | frozenset = frozenset(),
        seed: int | None = 0,
        top1_first: bool = False,
        on_tokens: Callable[[list[int]], None] | None = None,
        prompt_id: str = "",
        decode_text: Callable[[list[int]], str] | None = None,
    ) -> GenerationRecord:
        if method not in METHODS:
            raise DDTreeError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
        if method != "ar" and self.drafter is None:
            raise DDTreeError(f"--method {method} needs a drafter: pass --drafter REF")
        if not prompt_ids:
            raise DDTreeError("empty prompt: pass a non-empty prompt (argument, '-' for stdin, or a prompt file)")
        if budget < 1:
            raise DDTreeError(f"--budget {budget} must be at least 1")
        tgt, dev = self.target, self.target.device
        depth = self.block_size - 1
        n_max = {"ar": 1, "dflash": depth + 1, "ddtree": budget + 1}[method]
        need = len(prompt_ids) + max_new_tokens + n_max
        if need > self.max_len:
            raise DDTreeError(
                f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens {max_new_tokens} + tree ({n_max}) exceeds "
                f"the maximum length {self.max_len}: raise --max-length or shorten the prompt"
            )
        gen = None
        if seed is not None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(seed)
        k = min(budget, tgt.cfg.vocab_size) if method == "ddtree" else 1
        tgt.reset()
        if self.drafter is not None:
            self.drafter.reset()

        # ---------------- prefill
        sync(dev)
        t0 = time.perf_counter()
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
        if self.drafter is not None:
            tgt.tap_layers = list(self.drafter.cfg.target_layer_ids) if method != "ar" else []
        logits, taps = tgt.prefill(prompt)
        bonus_d = choose(logits[None], sampling, gen)[0]
        draft = None
        if method != "ar":
            self.drafter.add_context(taps)
            lp, ids = self._draft_topk(bonus_d, len(prompt_ids), k, sampling)
            host = torch.cat([bonus_d.view(1).float(), lp.flatten(), ids.flatten().float()]).cpu()
            D = lp.shape[0]
            draft = _Draft(0, [], int(host[0]), host[1 : 1 + D * k].view(D, k), host[1 + D * k :].view(D, k).long())
            bonus = draft.bonus
        else:
            bonus = int(bonus_d)  # the one sync of the prefill
        ttft = time.perf_counter() - t0

        out = [bonus]
        stopped = bonus in stop_ids
        if on_tokens:
            on_tokens([bonus])
        start = len(prompt_ids)
        start_d = torch.tensor(start, device=dev)
        clock = StageClock(dev)
        rounds: list[RoundRecord] = []
        pending_times: list[list] = []
        t_dec = time.perf_counter()
        while len(out) < max_new_tokens and not stopped:
            # ---------------- tree (host) and upload
            h0 = time.perf_counter()
            tree = self._tree(method, bonus, draft, budget, top1_first)
            T = tree.num_nodes
            dmax = int(tree.depths.max())
            td = tree.to(dev)
            parents = td.parents
            host_tree_ms = (time.perf_counter() - h0) * 1e3
            # ---------------- verify + walk
            e0 = clock.now()
            logits, taps = tgt.forward(td.tokens, start_d + td.depths, td.ancestor_mask, parents, start_d,
                                       start + T, want_taps=method != "ar")
            choice = choose(logits, sampling, gen)
            last, n_d, path_nodes = walk(td.tokens, parents, td.depths, td.ancestor_mask, choice, dmax + 1)
            e1 = clock.now()
            # ---------------- commit
            tgt.commit(path_nodes, n_d, start_d)
            new_bonus = choice[last]
            e2 = clock.now()
            # ---------------- draft the next block
            if method != "ar":
                self.drafter.add_context(taps.index_select(0, path_nodes.to(taps.device)), n_d)
                lp, ids = self._draft_topk(new_bonus, start + dmax + 1, k, sampling)
                parts = [n_d.view(1).float(), new_bonus.view(1).float(), path_nodes.float(), lp.flatten(), ids.flatten().float()]
            else:
                parts = [n_d.view(1).float(), new_bonus.view(1).float(), path_nodes.float()]
            e3 = clock.now()
            start_d = start_d + n_d
            host = torch.cat([p.to(dev) for p in parts]).cpu()  # the round's one device-to-host sync
            n, bonus = int(host[0]), int(host[1])
            path = host[2 : 3 + dmax].long().tolist()[:n]
            if method != "ar":
                D = lp.shape[0]
                o = 3 + dmax
                draft = _Draft(n, path, bonus, host[o : o + D * k].view(D, k), host[o + D * k :].view(D, k).long())
            start += n
            # ---------------- emit: accepted draft tokens, then the new bonus
            toks = tree.tokens[path[1:]].tolist() + [bonus]
            toks = toks[: max_new_tokens - len(out)]
            for i, t in enumerate(toks):
                if t in stop_ids:
                    toks, stopped = toks[: i + 1], True
                    break
            out.extend(toks)
            if on_tokens:
                on_tokens(toks)
            ranks = tree.ranks[path[1:]].tolist()
            rounds.append(RoundRecord(tree_size=T - 1, tree_depth=dmax, accepted=n - 1, accepted_ranks=ranks,
                                      committed=len(toks), times_ms={}))
            pending_times.append([("tree", host_tree_ms), ("verify", e0, e1), ("commit", e1, e2), ("draft", e2, e3)])
        sync(dev)
        decode_s = time.perf_counter() - t_dec
        self._fill_times(clock, rounds, pending_times, method)
        return GenerationRecord(
            prompt_id=prompt_id, prompt_tokens=len(prompt_ids), new_tokens=len(out), token_ids=out,
            text=decode_text(out) if decode_text else "", prefill_s=ttft, decode_s=decode_s, ttft_s=ttft,
            method=method, budget=budget if method == "ddtree" else None, rounds=rounds,
        )

    @staticmethod
    def _fill_times(clock: StageClock, rounds, pending, method):
        for rec, marks in zip(rounds, pending):
            for m in marks:
                if len(m) == 2:
                    rec.times_ms[m[0]] = m[1]
                else:
                    clock.add(*m)
        resolved = clock.resolve()
        i = 0
        for rec, marks in zip(rounds, pending):
            for m in marks:
                if len(m) == 3:
                    name, ms = resolved[i]
                    i += 1
                    if not (method == "ar" and name == "draft"):
                        rec.times_ms[name] = ms

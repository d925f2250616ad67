"""Offline tree-shape evaluation for scripts/acceptance.py --offline (greedy, codepair fixture).

Under greedy decoding every method commits the target's own greedy continuation x, so a round that
starts with the bonus at position p accepts the longest path of its tree that spells
x[p+1], x[p+2], ..., and the next round starts at p + accepted + 1. The drafter's block at p
depends only on x[:p+1] (its context is the target's taps of x[:p], its block [x[p], mask...]).
So each drafter's per-position block distributions are recorded ONCE (`record`: one `ar` run and
one target prefill per prompt, one drafter forward per position), and any tree builder is scored
against them by replaying the rounds (`replay`), with no model in the loop: cheap enough to try
many shapes. A round cut by the token limit commits what fits, as the decoder does.

Recorded per start position p (depth d = 1..D, the block's positions p+1..p+D):
  top [D, K] logits (descending) and ids, logz [D, G] = logsumexp(logits / T) for T in TEMPS,
  true [D] the logit of the token the target wrote at p+d (nan past the continuation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from ddtree.ops.tree import build_tree

TEMPS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.25, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0)  # the calibration grid
ONE = TEMPS.index(1.0)
RECORD_K = 64  # top-k recorded per depth (the largest budget's width)


@dataclass
class Recording:
    """One prompt's continuation and its drafter's blocks at every start position."""

    prompt_len: int
    seq: list[int]  # prompt + ar's new tokens
    top: np.ndarray  # [P, D, K] float32 logits, P = len(seq) - prompt_len start positions
    ids: np.ndarray  # [P, D, K] int64
    logz: np.ndarray  # [P, D, G] float32
    true: np.ndarray  # [P, D] float32


@torch.no_grad()
def record(dec, drafters: dict, prompt_ids: list[int], max_new: int, stop) -> dict:
    """-> {drafter name: Recording} for one prompt (one ar run, one prefill of prompt + continuation)."""
    new = dec.generate(prompt_ids, "ar", max_new_tokens=max_new, stop_ids=stop).token_ids
    seq = list(prompt_ids) + list(new)
    L, N = len(prompt_ids), len(seq)
    tgt = dec.target
    kept = tgt.tap_layers
    tgt.tap_layers = layers = sorted({i for d in drafters.values() for i in d.cfg.target_layer_ids})
    tgt.reset()
    _, every = tgt.prefill(torch.tensor(seq, dtype=torch.long, device=tgt.device))  # [N, layers*hidden], layer order
    tgt.tap_layers = kept
    every = every.view(N, len(layers), -1)
    temps = torch.tensor(TEMPS)
    out = {}
    for name, drafter in drafters.items():
        D = drafter.cfg.block_size - 1
        taps = every[:, [layers.index(i) for i in sorted(drafter.cfg.target_layer_ids)]].reshape(N, -1)  # its taps, as the target emits them
        top = np.zeros((N - L, D, RECORD_K), np.float32)
        ids = np.zeros((N - L, D, RECORD_K), np.int64)
        logz = np.zeros((N - L, D, len(TEMPS)), np.float32)
        true = np.full((N - L, D), np.nan, np.float32)
        drafter.reset()
        drafter.add_context(taps[:L])
        for i, p in enumerate(range(L, N)):
            logits = drafter.draft_logits(torch.tensor(seq[p], device=drafter.device), dec.kv_len(p)).float().cpu()  # [D, V]
            v, k = logits.topk(RECORD_K, -1)
            top[i], ids[i] = v.numpy(), k.numpy()
            logz[i] = torch.logsumexp(logits[:, None, :] / temps[None, :, None], -1).numpy()
            for d in range(min(D, N - 1 - p)):
                true[i, d] = float(logits[d, seq[p + 1 + d]])
            if p < N - 1:
                drafter.add_context(taps[p : p + 1])
        out[name] = Recording(L, seq, top, ids, logz, true)
    return out


@dataclass
class Variant:
    """A tree builder: best-first over (possibly recalibrated) log-probs, with a shape limit."""

    name: str
    chain: bool = False  # the DFlash chain: the top-1 token at every depth (budget ignored)
    top1_first: bool = False
    depth_cap: int | None = None  # at most this many draft depths
    width: int | None = None  # at most this many ranks per depth (the drafter's top-k)
    calibrate: str | None = None  # None | "online" (per-depth temperature from the rounds so far) | "fit" (from all)
    #                               | "factor" (per-depth top-1 hit rate over predicted, from the rounds so far)
    min_obs: int = 16  # online: observations a depth needs before its temperature moves from 1 (factor: the prior's weight)


@dataclass
class Calibration:
    """Per-depth NLL of the target's tokens under each temperature of TEMPS, summed over observations."""

    D: int
    nll: np.ndarray = field(default=None)
    n: np.ndarray = field(default=None)

    def __post_init__(self):
        self.nll = np.zeros((self.D, len(TEMPS)))
        self.n = np.zeros(self.D, np.int64)
        self.hits = np.zeros(self.D)  # rounds whose top-1 token at depth d was the target's
        self.pred = np.zeros(self.D)  # the drafter's top-1 probability summed over the same rounds

    def add(self, rec: Recording, i: int, upto: int):
        """The target's tokens at depths 1..upto of round i's block (those the round saw: its
        accepted path and the bonus)."""
        t = np.asarray(TEMPS)
        p = rec.prompt_len + i
        for d in range(min(upto, self.D)):
            z = rec.true[i, d]
            if not math.isnan(z):
                self.nll[d] += rec.logz[i, d] - z / t
                self.n[d] += 1
                self.hits[d] += rec.ids[i, d, 0] == rec.seq[p + 1 + d]
                self.pred[d] += math.exp(rec.top[i, d, 0] - rec.logz[i, d, ONE])

    def log_factor(self, prior: float) -> np.ndarray:
        """[D] log of (hits + prior) / (predicted + prior): how much likelier the top-1 token is than
        the drafter says, at each depth, given that the round got that far."""
        return np.log((self.hits + prior) / (self.pred + prior))

    def temps(self, min_obs: int) -> np.ndarray:
        """[D] grid index per depth: the NLL minimiser, or T = 1 with too few observations."""
        best = self.nll.argmin(1)
        return np.where(self.n >= min_obs, best, ONE)


def _accepts(tokens, parents, seq, p) -> int:
    """Longest path of the tree (flat arrays, parents first) spelling seq[p+1], seq[p+2], ..."""
    kids: dict[tuple[int, int], int] = {}
    for n in range(1, len(tokens)):
        kids[(parents[n], tokens[n])] = n
    node, a = 0, 0
    while p + 1 + a < len(seq):
        node = kids.get((node, seq[p + 1 + a]))
        if node is None:
            break
        a += 1
    return a


def replay(rec: Recording, v: Variant, budget: int, max_new: int, fitted: np.ndarray | None = None) -> tuple[int, int]:
    """Rounds of one generation with variant v at `budget`. -> (committed tokens, rounds)."""
    L, seq = rec.prompt_len, rec.seq
    D = rec.top.shape[1]
    Dc = min(D, v.depth_cap or D)
    K = min(RECORD_K, v.width or RECORD_K, budget)
    cal = Calibration(D) if v.calibrate in ("online", "factor") else None
    new, p, committed, rounds = 1, L, 0, 0  # the prefill chose the first token
    while new < max_new and p < len(seq) - 1:
        i = p - L
        if v.chain:
            a = 0
            while a < D and p + 1 + a < len(seq) and rec.ids[i, a, 0] == seq[p + 1 + a]:
                a += 1
        else:
            g = np.full(Dc, ONE) if v.calibrate in (None, "factor") else (fitted[:Dc] if v.calibrate == "fit" else cal.temps(v.min_obs)[:Dc])
            t = np.asarray(TEMPS)[g][:, None]
            lp = rec.top[i, :Dc, :K] / t - rec.logz[i, np.arange(Dc), g][:, None]  # [Dc, K] log-probs at T_d
            if v.calibrate == "factor":  # scaled per depth, capped at probability 1
                lp = np.minimum(lp + cal.log_factor(v.min_obs)[:Dc, None], 0.0)
            tree = build_tree(seq[p], lp, rec.ids[i, :Dc, :K], budget, top1_first=v.top1_first)
            a = _accepts(tree.tokens.tolist(), tree.parents.tolist(), seq, p)
        if cal is not None:
            cal.add(rec, i, a + 1)
        c = min(a + 1, max_new - new)
        new += c
        committed += c
        rounds += 1
        p += a + 1
    return committed, rounds


def fit_temps(recs: list[Recording], max_new: int) -> np.ndarray:
    """Per-depth temperatures fitted on every prompt's rounds of the plain best-first tree at budget 32
    (the depths each round saw): the 'fit' variant's ceiling for what a per-depth temperature can do."""
    D = recs[0].top.shape[1]
    cal = Calibration(D)
    base = Variant("tree")
    for rec in recs:
        L, seq, p, new = rec.prompt_len, rec.seq, rec.prompt_len, 1
        while new < max_new and p < len(seq) - 1:
            i = p - L
            tree = build_tree(seq[p], rec.top[i, :, :32] - rec.logz[i, :, ONE][:, None], rec.ids[i, :, :32], 32,
                              top1_first=base.top1_first)
            a = _accepts(tree.tokens.tolist(), tree.parents.tolist(), seq, p)
            cal.add(rec, i, a + 1)
            new += min(a + 1, max_new - new)
            p += a + 1
    return cal.temps(1)


VARIANTS = [
    Variant("chain", chain=True),
    Variant("tree"),
    Variant("top1-first", top1_first=True),
    Variant("depth<=4", depth_cap=4), Variant("depth<=6", depth_cap=6), Variant("depth<=8", depth_cap=8),
    Variant("top-k 2", width=2), Variant("top-k 4", width=4), Variant("top-k 8", width=8),
    Variant("temp/depth online", calibrate="online"),
    Variant("temp/depth fit", calibrate="fit"),
    Variant("depth factor online", calibrate="factor", min_obs=4),
]


def evaluate(recs: list[Recording], budgets, max_new: int, variants=VARIANTS) -> dict:
    """-> {variant: {budget: {"tokens_per_forward", "committed", "rounds"}}} pooled over the prompts
    (committed / rounds, as ddtree's summary line), plus the fitted temperatures under "_fit"."""
    fitted = fit_temps(recs, max_new)
    out: dict = {"_fit_temps": [TEMPS[g] for g in fitted]}
    for v in variants:
        row = {}
        for b in ([1] if v.chain else budgets):
            c = r = 0
            for rec in recs:
                ci, ri = replay(rec, v, b, max_new, fitted)
                c += ci
                r += ri
            row[str(b)] = {"tokens_per_forward": c / max(r, 1), "committed": c, "rounds": r}
        out[v.name] = row
    return out

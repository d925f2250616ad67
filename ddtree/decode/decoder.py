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

import math
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ddtree.ops import gdn_kernels as triton_gdn
from ddtree.model.drafter import DFlashDrafter
from ddtree.errors import DDTreeError
from ddtree.decode.sampling import SamplingParams, choose
from ddtree.stats import GenerationRecord, RoundRecord
from ddtree.model.target import TargetModel
from ddtree.ops.tree import Tree, build_tree, build_tree_device, device_tree_fits
from ddtree.ops.tree_kernel import build_tree_kernel, tree_summary, walk_kernel

from ddtree.decode.methods import METHODS  # defined without torch: the CLI checks --method before importing it
WALK_KERNEL = os.environ.get("DDTREE_TORCH_WALK") != "1"  # the walk in one Triton kernel where available
TREE_KERNEL = {"ok": True}  # False after the Triton tree kernel failed once in this process (torch ops then)


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
    # gather/index_select, not tensor[last]: a 0-dim index would read `last` back to the host
    d_last = depths.gather(0, last.view(1))[0]
    d = torch.arange(P, device=tokens.device)
    on_path = path_mask.index_select(0, last.view(1)) & (depths[None, :] == d[:, None])  # [P, T]
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
    """The drafter's proposal as the host reads it (once per round)."""

    bonus: int
    topk_lp: np.ndarray | None  # [D, K] float32 (a view of the round's one host copy)
    topk_ids: np.ndarray | None  # [D, K] int64


AUTO_BUDGETS = (4, 8, 15, 32, 64)  # 15 draft nodes = the block-16 chain's verify size
PLAIN_PROBE = 16  # --budget auto: after this many plain steps in a row, one drafts again (fresh E_q)
AUTO_TOPK = 32  # drafter top-k columns of auto's trees (a 64-node tree rarely needs a 33rd token per position)
CLIMB_EVERY = 8  # --budget auto: two rounds in this many stage a tree one budget above the choice


class BudgetChooser:
    """`--budget auto`: each round, the budget that maximises expected tokens per millisecond.

    Expected tokens of a best-first tree of budget b = 1 + r * E_q(b), where E_q(b) is the sum of
    the drafter's path probabilities over its first b nodes (the expected accepted length if the
    drafter were calibrated) and r the observed/predicted acceptance ratio so far. Cost of a
    round = verify(b + 1), timed once per generation, + a fixed part (drafter, commit, host)
    learnt from the rounds' wall times. The pop order of a best-first tree is the same for every
    budget, so the tree of budget b is the first b + 1 nodes of the largest one.

    With plain_ms (rounds ahead), budget 0 is a candidate too: a plain step (the bonus token
    alone, no drafter), 1 token per plain_ms + its own fixed part. It wins where trees cannot pay
    (a small target whose step is launch-bound, a drafter that is rarely right).
    """

    def __init__(self, verify_ms: dict[int, float], decay: float = 0.9, plain_ms: float | None = None):
        self.verify_ms = verify_ms  # budget -> ms of one verify of budget + 1 nodes
        self.decay = decay
        self.acc = self.pred = 1.0  # prior: the drafter's probabilities are honest
        self.fixed_ms = 0.0
        self.n = 0
        self.plain_ms = plain_ms  # verify of the bonus alone with taps, or None: trees only
        self.fixed_plain_ms = 0.0
        self.n_plain = 0
        bs = sorted(verify_ms)
        self.last_tree = bs[min(2, len(bs) - 1)] if bs else 0  # the last tree budget chosen (15 by default)

    def pick(self, scores: list[float]) -> tuple[int, float]:
        """scores: path log-probabilities of a best-first tree's nodes (root first).
        -> (budget, its predicted accepted length E_q)."""
        return self.pick_eq(expected_accepts(scores, self.verify_ms))

    def pick_eq(self, eq: dict[int, float], cap: int | None = None) -> tuple[int, float]:
        """eq: budget -> E_q(budget) of the tree at hand (or the latest one seen); the candidates are
        the budgets it covers, up to cap (the budget of the tree that will be truncated)."""
        r = self.acc / self.pred
        rate = {b: (1 + r * eq[b]) / (self.verify_ms[b] + self.fixed_ms) for b in self.verify_ms
                if b in eq and (cap is None or b <= cap)}  # tokens / ms
        best = max(rate, key=rate.get)
        if self.plain_ms is not None and 1.0 / (self.plain_ms + self.fixed_plain_ms) > rate[best]:
            return 0, 0.0
        return best, eq[best]

    def build_for(self, b: int, r: int) -> int:
        """Rounds ahead: the budget of the tree round r's step stages for round r + 1, given round
        r's own budget b (0: a plain step). Building bigger than the choice costs more drafting
        work than it returns, so it is b itself, except in two consecutive rounds of every
        CLIMB_EVERY, one budget above b (the next round then sees a bigger tree's E_q and may
        truncate it: the choice can climb); after plain steps, the last tree budget chosen."""
        if b == 0:
            return self.last_tree
        self.last_tree = b
        up = [x for x in sorted(self.verify_ms) if x > b]
        return up[0] if up and r % CLIMB_EVERY < 2 else b

    def update_plain(self, wall_ms: float):
        """A plain step's wall time (rounds ahead: the time between two reads)."""
        fixed = max(wall_ms - self.plain_ms, 0.0)
        d = self.decay
        self.fixed_plain_ms = fixed if self.n_plain == 0 else d * self.fixed_plain_ms + (1 - d) * fixed
        self.n_plain += 1

    def update(self, budget: int, predicted: float, accepted: int, wall_ms: float):
        d = self.decay
        self.acc, self.pred = d * self.acc + accepted, d * self.pred + max(predicted, 1e-6)
        fixed = max(wall_ms - self.verify_ms[budget], 0.0)
        self.fixed_ms = fixed if self.n == 0 else d * self.fixed_ms + (1 - d) * fixed
        self.n += 1


def expected_accepts(scores: list[float], budgets) -> dict[int, float]:
    """E_q(b): the sum of the first b draft nodes' path probabilities (scores: root first)."""
    probs = [math.exp(x) for x in scores[1:]]
    return {b: sum(probs[:b]) for b in sorted(budgets)}


_COMPILE_NOTICE: list = []  # the compile notice is logged once per process


def _bucket(n: int, size: int) -> int:
    return -(-n // size) * size


def _emit(toks: list[int], room: int, stop_ids) -> tuple[list[int], bool]:
    """A round's tokens as emitted: at most `room`, cut after the first stop token. -> (tokens, stopped)."""
    toks = toks[:room]
    for i, t in enumerate(toks):
        if t in stop_ids:
            return toks[: i + 1], True
    return toks, False


class _HostRing:
    """Two pinned host buffers and their events: round r's packed output is copied out right
    after its graphs (`put`) and read after round r + 1 is queued (`get`: the round's one sync)."""

    def __init__(self, n: int, dev: torch.device):
        cuda = dev.type == "cuda"
        self.bufs = [torch.zeros(n, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]

    def put(self, r: int, packed: torch.Tensor):
        self.bufs[r % 2].copy_(packed, non_blocking=True)
        if self.events[r % 2] is not None:
            self.events[r % 2].record()

    def get(self, r: int) -> list[float]:
        if self.events[r % 2] is not None:
            self.events[r % 2].synchronize()
        return self.bufs[r % 2].tolist()


class _Slot:
    """Static device buffers for one tree size T (graph inputs are written in place).

    tokens, depths and parents share one [3, T] buffer and the ancestor mask has its own, so a
    tree goes up in two copies; on CUDA from pinned host buffers, so the copies are asynchronous.
    """

    def __init__(self, T: int, dev):
        self.ints = torch.zeros(3, T, dtype=torch.long, device=dev)
        self.tokens, self.depths, self.parents = self.ints[0], self.ints[1], self.ints[2]
        self.mask = torch.zeros(T, T, dtype=torch.bool, device=dev)
        self.choice = torch.zeros(T, dtype=torch.long, device=dev)
        self.ranks = torch.zeros(T, dtype=torch.long, device=dev)  # written by device-built trees (rounds ahead)
        pin = torch.device(dev).type == "cuda"
        self.host_ints = torch.zeros(3, T, dtype=torch.long, pin_memory=pin)
        self.host_mask = torch.zeros(T, T, dtype=torch.bool, pin_memory=pin)
        self._ints_np, self._mask_np = self.host_ints.numpy(), self.host_mask.numpy()  # views: ~1 us writes
        self._shape = (None, None)  # (parents, mask) tensors of the last tree loaded (held, so compared by identity)

    def load(self, tree: Tree):
        # The previous round's single sync has completed every copy from these host buffers.
        self._ints_np[0] = tree.tokens.numpy()
        if tree.parents is self._shape[0] and tree.ancestor_mask is self._shape[1]:
            # same shape tensors (chains share theirs: Tree.chain): only the tokens go up
            self.ints[:1].copy_(self.host_ints[:1], non_blocking=True)
            return
        self._ints_np[1] = tree.depths.numpy()
        self._ints_np[2] = tree.parents.numpy()
        self._mask_np[:] = tree.ancestor_mask.numpy()
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.mask.copy_(self.host_mask, non_blocking=True)
        self._shape = (tree.parents, tree.ancestor_mask)


class Decoder:
    """Runs `ar`, `dflash` or `ddtree` on a loaded target (+ drafter).

    A round is three fixed-shape functions over static buffers: `_verify` (target forward, greedy
    choice), `_draft` (walk, drafter, pack for the host) and, after the round's one host sync,
    `_commit` (the target's state; it runs on the GPU while the host builds the next tree). On
    CUDA each is captured once per (tree size, context bucket) as a CUDA graph and replayed; on
    CPU they run eagerly. The committed length lives on the device (`start_d`), advanced in place.
    """

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None = None, max_len: int | None = None,
                 use_graphs: bool | None = None, bucket: int = 256, compile: bool | None = None):
        self.target, self.drafter = target, drafter
        self.max_len = max_len or target.max_len
        dev = target.device
        # One CUDA graph cannot span devices: a layer split runs eagerly.
        single = len({d for d in target.layer_devices} | {target.out_device}) == 1
        self.use_graphs = (dev.type == "cuda" and single) if use_graphs is None else use_graphs
        self.bucket = bucket
        # Compiled layers (ddtree.model.target.compiled_layer) by default wherever rounds are graphed, and
        # for a layer split over GPUs (no graphs there: fewer, fused kernels keep the host ahead of
        # the GPUs); DDTREE_NO_COMPILE=1 or compile=False keeps the eager layers.
        if compile is None:
            split = dev.type == "cuda" and not single
            compile = (self.use_graphs or split) and os.environ.get("DDTREE_NO_COMPILE") != "1"
        self.compile = compile
        self._seen: set = set()  # eager rounds: keys already run once (a compile failure falls back there)
        self.start_d = torch.zeros((), dtype=torch.long, device=dev)
        self._slots: dict[int, _Slot] = {}
        self._graphs: dict = {}
        self._outs: dict = {}
        self._vsteps: dict = {}  # verify key -> {device: GDNGroup.step of that verify}
        self._walks: dict = {}  # static buffers of the step graphs: walk outputs per P, pack headers, constants
        self._verify_cost: dict = {}  # --budget auto: (context bucket, greedy, near the end) -> {budget: verify ms}
        # ar: launch step r + 1 before reading step r (see _ar_rounds). dflash / fixed-budget ddtree:
        # the next tree is built on the device and round r + 1 is launched before round r is read
        # (see _ahead_rounds). False (or DDTREE_HOST_ROUNDS=1): the host-tree round loop, their twin.
        self.pipeline_ar = self.rounds_ahead = os.environ.get("DDTREE_HOST_ROUNDS") != "1"
        if drafter is not None:
            target.tap_layers = list(drafter.cfg.target_layer_ids)
            drafter.attach(target.embed_tokens, target.lm_head)
            drafter.gather_logits = target.gather_logits

    @property
    def block_size(self) -> int:
        return self.drafter.cfg.block_size if self.drafter is not None else 1

    # ------------------------------------------------------------------ pieces of a round
    def _draft_topk(self, bonus: torch.Tensor, kv_len: int, k: int, sp: SamplingParams):
        """[B-1, k] top-k log-probs and ids of the drafter's block (top-k of the logits = of the log-probs)."""
        return self.drafter.draft_topk(bonus, kv_len, k, None if sp.greedy else sp.temperature)

    def _tree(self, method: str, bonus: int, draft: _Draft | None, budget: int, top1_first: bool) -> Tree:
        if method == "ar":
            return Tree.chain(torch.tensor([bonus]))
        if method == "dflash":
            return Tree.chain([bonus] + draft.topk_ids[:, 0].tolist())
        return build_tree(bonus, draft.topk_lp, draft.topk_ids, budget, top1_first=top1_first)

    def _slot(self, T: int) -> _Slot:
        if T not in self._slots:
            self._slots[T] = _Slot(T, self.target.device)
        return self._slots[T]

    def _stage(self, T: int) -> _Slot:
        """Auto's staging tree of T nodes (rounds ahead): never verified itself, only copied from."""
        if -T not in self._slots:
            self._slots[-T] = _Slot(T, self.target.device)
            # a valid tree from the start: a plain step writes only the root's token into it, and the
            # root's parent must be the committed prefix (-1), not node 0
            self._slots[-T].load(Tree.chain(torch.zeros(T, dtype=torch.long)))
            self._slots[-T]._shape = (None, None)
        return self._slots[-T]

    def _verify(self, slot: _Slot, kv_len: int, greedy: bool, taps: bool):
        """Target forward over the tree in `slot`. -> (logits [T, V], taps [T, *] | None)."""
        start = self.start_d
        logits, tap = self.target.forward(slot.tokens, start + slot.depths, slot.mask, slot.parents, start,
                                          kv_len, want_taps=taps)
        if greedy:
            slot.choice.copy_(logits.argmax(-1))
        return logits, tap

    def _verify_choose(self, slot: _Slot, kv_len: int, sampling: SamplingParams, gen, taps_on: bool):
        """The verify graph of `slot`'s tree (greedy choice inside it; a sampled choice after it).
        -> (its graph key, logits, taps)."""
        vkey = ("verify", slot.tokens.shape[0], kv_len, sampling.greedy, taps_on)
        logits, taps = self._run(vkey, lambda: self._verify(slot, kv_len, sampling.greedy, taps_on))
        if not sampling.greedy:
            slot.choice.copy_(choose(logits, sampling, gen))
        return vkey, logits, taps

    def _walk_buf(self, P: int):
        """Static (path_nodes [P], n 0-dim, bonus 0-dim) the walk writes and the commit reads."""
        buf = self._walks.get(P)
        if buf is None:
            dev = self.target.device
            buf = self._walks[P] = (torch.zeros(P, dtype=torch.long, device=dev),
                                    torch.ones((), dtype=torch.long, device=dev), torch.zeros((), dtype=torch.long, device=dev))
        return buf

    def _full(self, n: int, x: float) -> torch.Tensor:
        """A static fp32 [n] holding x: graphs read it and nothing writes it, so a graph that packs a
        constant (a chain's depth, zero padding) has no fill kernel per replay."""
        c = self._walks.get(("full", n, x))
        if c is None:
            c = self._walks[("full", n, x)] = torch.full((n,), x, device=self.target.device)
        return c

    def _pack_buf(self, P: int) -> torch.Tensor:
        """Static fp32 [2 + 2P]: the header of a rounds-ahead step's packed output (see _accept)."""
        buf = self._walks.get(("pack", P))
        if buf is None:
            buf = self._walks[("pack", P)] = torch.zeros(2 + 2 * P, device=self.target.device)
        return buf

    def _walk(self, slot: _Slot, P: int, pack: torch.Tensor | None = None):
        """Accepted path of the verified tree in `slot`, into the static walk buffers.
        -> (path_nodes [P], n 0-dim, bonus 0-dim). With `pack` (fp32 [2 + 2 PK], PK >= P) the host's
        header goes into it too: [n, bonus, path tokens (PK), path ranks (PK)], zeros past P."""
        path, n, bonus = self._walk_buf(P)
        if WALK_KERNEL and triton_gdn.available(slot.tokens):  # one kernel instead of ~15 (twin: walk)
            walk_kernel(slot.tokens, slot.parents, slot.depths, slot.mask, slot.choice, P, (path, n, bonus),
                        ranks=None if pack is None else slot.ranks, pack=pack)
            return path, n, bonus
        last, n_d, path_nodes = walk(slot.tokens, slot.parents, slot.depths, slot.mask, slot.choice, P)
        path.copy_(path_nodes)
        n.copy_(n_d)
        bonus.copy_(slot.choice.gather(0, last.view(1))[0])
        if pack is not None:
            pad = self._full((pack.shape[0] - 2) // 2 - P, 0.0)
            pack.copy_(torch.cat([n.view(1).float(), bonus.view(1).float(), slot.tokens.index_select(0, path).float(),
                                  pad, slot.ranks.index_select(0, path).float(), pad]))
        return path, n, bonus

    def _commit(self, P: int):
        """Commit the walked path into the target's state and advance start_d. Runs after the
        round's host sync, so it overlaps the host's work on the next tree."""
        path, n, _ = self._walk_buf(P)
        self.target.commit(path, n, self.start_d)
        self.start_d.add_(n)

    def _draft(self, slot: _Slot, taps, P: int, draft_kv: int, k: int, sp: SamplingParams):
        """Walk; drafter context += accepted rows; draft the next block (the target's commit comes
        after the host sync). Without taps (ar): walk and commit.

        -> packed floats for the host: [n, bonus, path_nodes (P), topk logprobs (D*k), topk ids (D*k)].
        """
        path_nodes, n_d, bonus = self._walk(slot, P)
        parts = [n_d.view(1).float(), bonus.view(1).float(), path_nodes.float()]
        if taps is None:  # ar: no drafter, so no host work to overlap: commit in this graph,
            self._commit(P)
            slot.tokens[:1].copy_(bonus.view(1))  # and the bonus is the next step's token, on the device
        else:
            self.drafter.add_context(taps, n_d, rows=path_nodes)
            lp, ids = self._draft_topk(bonus, draft_kv, k, sp)
            parts += [lp.flatten().to(bonus.device), ids.flatten().float().to(bonus.device)]
        return torch.cat(parts)

    def _run(self, key, fn, keep=()):
        """Run fn() eagerly, or through a CUDA graph captured on first use of `key`.

        A commit (in a "commit" graph, or inside ar's "draft" and the rounds-ahead "ahead" graphs) reads, at capture time, what its verify left in the GDN groups' `step` (tree size,
        conv windows, path mask). Under graphs the last verify *executed in Python* need not be the
        one being committed (--budget auto captures every size up front; replays run no Python),
        so each verify key keeps its own step and its commit runs with it."""
        if key[0] in ("commit", "ahead", "draft", "plain"):  # every graph that may commit (ar's "draft", "ahead", "plain")
            for dev, st in self._vsteps.get(key[1], {}).items():
                self.target.gdn_groups[dev].step = st
        out = self._run_fn(key, fn, keep)
        if key[0] == "verify" and (not self.use_graphs or key not in self._vsteps):
            self._vsteps[key] = {dev: g.step for dev, g in self.target.gdn_groups.items()}
        return out

    def _compile_failed(self, e: Exception):
        from loguru import logger

        logger.warning(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); "
                       "using the eager layers (set DDTREE_NO_COMPILE=1 to skip compiling)")
        self.compile = self.target.compile_layers = False
        if self.drafter is not None:
            self.drafter.compile_layers = False

    def _compile_notice(self):
        if self.target.compile_layers and not _COMPILE_NOTICE:
            from loguru import logger

            _COMPILE_NOTICE.append(True)
            logger.info("compiling the layers for this GPU (first use in this process; inductor caches it on disk; "
                        "DDTREE_NO_COMPILE=1 skips it)")

    def _run_fn(self, key, fn, keep=()):
        if not self.use_graphs:
            if not self.target.compile_layers or key in self._seen:
                return fn()
            # first run of this piece with compiled layers, eager rounds (a layer split): a compile
            # failure restores the state and runs it with the eager layers, as under graphs
            self._compile_notice()
            snap = self._snapshot(keep)
            try:
                out = fn()
            except Exception as e:
                self._compile_failed(e)
                self._restore(snap)
                out = fn()
            self._seen.add(key)
            return out
        if key not in self._graphs:
            self._compile_notice()
            # Warm up on a side stream (allocator, cuBLAS handles), then capture. The warm-up
            # mutates state, so it is run on snapshots: capture only reads buffers' addresses.
            snap = self._snapshot(keep)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                try:
                    fn()  # also where the compiled layers compile, on their first use
                except Exception as e:
                    if not self.target.compile_layers:
                        raise
                    self._compile_failed(e)
                    self._restore(snap)
                    fn()
            torch.cuda.current_stream().wait_stream(s)
            self._restore(snap)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                out = fn()
            self._restore(snap)  # capture also ran nothing, but keep the state exact
            self._graphs[key], self._outs[key] = g, out
        self._graphs[key].replay()
        return self._outs[key]

    def _calibrate(self, start: int, greedy: bool, plain: bool = False) -> BudgetChooser:
        """Time one verify per candidate budget on the live state (verify commits nothing); once
        per context bucket and decoder (the cost does not depend on the tokens)."""
        dev = self.target.device
        key = (min(_bucket(start + max(AUTO_BUDGETS) + 1, self.bucket), self.max_len), greedy,
               start + max(AUTO_BUDGETS) + 1 + self.block_size > self.max_len)
        if key in self._verify_cost:
            cost = dict(self._verify_cost[key])
            plain_ms = cost.pop(0, None)
            return BudgetChooser(cost, plain_ms=plain_ms if plain else None)
        verify_ms = {}
        for b in (0,) + AUTO_BUDGETS:  # 0: the bonus alone (a plain step of --budget auto)
            T = b + 1
            if start + T + self.block_size > self.max_len:
                continue
            slot = self._slot(T)
            slot.load(Tree.chain(torch.zeros(T, dtype=torch.long)))
            kv = min(_bucket(start + T, self.bucket), self.max_len)
            fn = lambda: self._run(("verify", T, kv, greedy, True), lambda: self._verify(slot, kv, greedy, True))  # noqa: E731
            fn()
            times = []
            for _ in range(3):
                sync(dev)
                t0 = time.perf_counter()
                fn()
                sync(dev)
                times.append((time.perf_counter() - t0) * 1e3)
            verify_ms[b] = sorted(times)[1]
        if not key[2]:  # near max_len some budgets were left out: not cached
            self._verify_cost[key] = dict(verify_ms)
        plain_ms = verify_ms.pop(0, None)
        return BudgetChooser(verify_ms, plain_ms=plain_ms if plain else None)

    def _snapshot(self, keep=()):
        """Everything a round mutates: start_d, GDN states, the drafter's length, and the K/V
        slots a tree or commit can touch (the commit move is not idempotent: run twice, it
        reads slots its first run overwrote); plus `keep`, inputs a piece rewrites itself
        (the rounds-ahead step writes the next tree into its own slot)."""
        tgt = self.target
        tensors = [self.start_d]
        for group in tgt.gdn_groups.values():
            tensors += [group.state, group.conv]
        start = int(self.start_d)  # capture time only (outside the hot path)
        end = min(start + tgt.tree_capacity, tgt.max_len)
        for kc, vc in tgt.kv_stacks.values():
            tensors += [kc[:, start:end], vc[:, start:end]]
        if self.drafter is not None:
            tensors.append(self.drafter.ctx_len)
        tensors += list(keep)
        return [(t, t.clone()) for t in tensors]

    @staticmethod
    def _restore(snap):
        for t, c in snap:
            t.copy_(c)

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[int],
        method: str = "ddtree",
        budget: int | str = 32,
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
        auto = budget == "auto"
        if auto:
            budget = max(AUTO_BUDGETS)
        if isinstance(budget, str) or budget < 1:
            raise DDTreeError(f"--budget {budget} must be a positive integer or 'auto'")
        tgt, dev = self.target, self.target.device
        depth = self.block_size - 1
        n_max = {"ar": 1, "dflash": depth + 1, "ddtree": budget + 1}[method]
        P = 1 if method == "ar" else depth + 1  # path length buffers: fixed per method
        need = len(prompt_ids) + max_new_tokens + max(n_max, P)
        if need > self.max_len:
            raise DDTreeError(
                f"prompt ({len(prompt_ids)} tokens) + --max-new-tokens {max_new_tokens} + tree ({n_max}) exceeds "
                f"the maximum length {self.max_len}: raise --max-length or shorten the prompt"
            )
        gen = None
        if seed is not None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(seed)
        k = min(AUTO_TOPK if auto else budget, tgt.cfg.vocab_size) if method == "ddtree" else 1
        taps_on = method != "ar"
        tgt.reset()
        tgt.compile_layers = self.compile
        if self.drafter is not None:
            self.drafter.reset()
            self.drafter.compile_layers = tgt.compile_layers

        # ---------------- prefill
        sync(dev)
        t0 = time.perf_counter()
        prompt = torch.tensor(prompt_ids, dtype=torch.long, device=dev)
        logits, taps = tgt.prefill(prompt, chunk=256 if dev.type == "cuda" else 64, want_taps=taps_on)
        bonus_d = choose(logits[None], sampling, gen)[0]
        draft = None
        if taps_on:
            self.drafter.add_context(taps)
            lp, ids = self._draft_topk(bonus_d, min(_bucket(len(prompt_ids), self.bucket), self.max_len), k, sampling)
            host = torch.cat([bonus_d.view(1).float(), lp.flatten(), ids.flatten().float()]).cpu().numpy()
            D = lp.shape[0]
            draft = _Draft(int(host[0]), host[1 : 1 + D * k].reshape(D, k),
                           host[1 + D * k :].reshape(D, k).astype(np.int64))
            bonus = draft.bonus
        else:
            bonus = int(bonus_d)  # the one sync of the prefill
        ttft = time.perf_counter() - t0

        out = [bonus]
        stopped = bonus in stop_ids
        if on_tokens:
            on_tokens([bonus])
        start = len(prompt_ids)
        self.start_d.fill_(start)
        ahead_ok = self.rounds_ahead and not top1_first  # (the rounds-ahead loop also needs a device-sized tree)
        chooser = self._calibrate(start, sampling.greedy, plain=ahead_ok) if auto and method == "ddtree" else None
        clock = StageClock(dev)
        rounds: list[RoundRecord] = []
        pending_times: list[list] = []
        t_dec = time.perf_counter()
        if method == "ar" and self.pipeline_ar and not stopped:
            self._ar_rounds(out, start, max_new_tokens, stop_ids, sampling, gen, on_tokens, clock, rounds, pending_times)
            stopped = True  # done: skip the round loop below
        elif (method in ("dflash", "ddtree") and self.rounds_ahead and not stopped and not top1_first
              and len(out) < max_new_tokens and (chooser is None or chooser.verify_ms)
              and (method == "dflash" or device_tree_fits(depth, k, max(chooser.verify_ms) if auto else budget))):
            tree = self._tree(method, bonus, draft, budget, False)
            if chooser is not None:
                tree = tree.truncate(max(chooser.verify_ms) + 1)
            self._ahead_rounds(method, budget, tree, out, start, max_new_tokens, stop_ids, sampling, gen, on_tokens,
                               clock, rounds, pending_times, k, chooser)
            stopped = True
        backlog = None  # the last round's bookkeeping: done while the device runs the next round
        if chooser is not None:
            chooser.plain_ms = None  # the host-tree loop below has no plain steps

        def book(toks, tree, path, n, T, marks):
            if on_tokens:
                on_tokens(toks)
            ranks = tree.ranks.tolist()
            rounds.append(RoundRecord(tree_size=T - 1, tree_depth=max(tree.depths.tolist()), accepted=n - 1,
                                      accepted_ranks=[ranks[i] for i in path[1:]], committed=len(toks), times_ms={}))
            pending_times.append(marks)

        while len(out) < max_new_tokens and not stopped:
            # ---------------- tree (host) and upload into the static slot
            h0 = time.perf_counter()
            tree = self._tree(method, bonus, draft, budget, top1_first)
            if chooser is not None:
                b, predicted = chooser.pick(tree.scores)
                tree = tree.truncate(b + 1)
            T = tree.num_nodes
            slot = self._slot(T)
            slot.load(tree)
            host_tree_ms = (time.perf_counter() - h0) * 1e3
            kv_len = min(_bucket(start + T, self.bucket), self.max_len)
            draft_kv = min(_bucket(start + P, self.bucket), self.max_len)
            # ---------------- verify (+ greedy choice)
            e0 = clock.now()
            vkey, _, taps = self._verify_choose(slot, kv_len, sampling, gen, taps_on)
            e1 = clock.now()
            # ---------------- walk and draft the next block (graph keys chain: they read the verify's buffers)
            packed = self._run(("draft", vkey, P, draft_kv, k, sampling),
                               lambda: self._draft(slot, taps, P, draft_kv, k, sampling))
            e2 = clock.now()
            if backlog is not None:  # the device is busy: the host catches up on the last round
                book(*backlog)
            w0 = time.perf_counter()
            host = packed.cpu().numpy()  # the round's one device-to-host sync; host work below is numpy/lists
            wait_s = time.perf_counter() - w0
            # ---------------- commit: queued now, it runs on the device while the host builds the next tree
            e3 = clock.now()
            if taps_on:
                self._run(("commit", vkey, P), lambda: self._commit(P))
            e4 = clock.now()
            n, bonus = int(host[0]), int(host[1])
            if chooser is not None:
                chooser.update(T - 1, predicted, n - 1, (time.perf_counter() - h0) * 1e3)
            path = host[2 : 2 + n].astype(np.int64).tolist()
            if taps_on:
                D, o = depth, 2 + P
                draft = _Draft(bonus, host[o : o + D * k].reshape(D, k), host[o + D * k :].reshape(D, k).astype(np.int64))
            start += n
            # ---------------- emit: accepted draft tokens, then the new bonus
            tree_tokens = tree.tokens.tolist()
            toks, stopped = _emit([tree_tokens[i] for i in path[1:]] + [bonus], max_new_tokens - len(out), stop_ids)
            out.extend(toks)
            marks = [("tree", host_tree_ms), ("verify", e0, e1), ("draft", e1, e2)] + ([("commit", e3, e4)] if taps_on else [])
            # host: the round's wall time minus the wait in the sync (what the device may idle on)
            backlog = (toks, tree, path, n, T, marks + [("host", (time.perf_counter() - h0 - wait_s) * 1e3)])
        if backlog is not None:
            book(*backlog)
        sync(dev)
        decode_s = time.perf_counter() - t_dec
        self._fill_times(clock, rounds, pending_times)
        return GenerationRecord(
            prompt_id=prompt_id, prompt_tokens=len(prompt_ids), new_tokens=len(out), token_ids=out,
            text=decode_text(out) if decode_text else "", prefill_s=ttft, decode_s=decode_s, ttft_s=ttft,
            method=method, budget=(budget if not auto else None) if method == "ddtree" else None, rounds=rounds,
        )

    def _ar_rounds(self, out, start, max_new_tokens, stop_ids, sampling, gen, on_tokens, clock, rounds, pending_times):
        """Autoregressive steps launched one ahead: the step's own graph writes the chosen token into
        the next step's input on the device, so step r + 1 is queued before the host reads step r
        (through a pinned buffer and an event: still one device-to-host sync per step). The host's
        work then overlaps the device's instead of adding to it. Same kernels as the round loop."""
        slot = self._slot(1)
        slot.load(Tree.chain(torch.tensor([out[-1]])))
        ring = _HostRing(3, self.target.device)
        steps = max_new_tokens - len(out)  # each step adds one token

        def launch(r: int):
            kv_len = min(_bucket(start + r + 1, self.bucket), self.max_len)
            e0 = clock.now()
            vkey, _, _ = self._verify_choose(slot, kv_len, sampling, gen, False)
            e1 = clock.now()
            packed = self._run(("draft", vkey, 1, kv_len, 1, sampling), lambda: self._draft(slot, None, 1, kv_len, 1, sampling))
            e2 = clock.now()
            ring.put(r, packed)
            return [("verify", e0, e1), ("draft", e1, e2)]

        marks = launch(0) if steps > 0 else None
        for r in range(steps):
            h0 = time.perf_counter()
            nxt = launch(r + 1) if r + 1 < steps else None  # queued behind step r
            w0 = time.perf_counter()
            h = ring.get(r)  # the step's one device-to-host sync
            wait_s = time.perf_counter() - w0
            tok = int(h[1])
            stopped = tok in stop_ids
            out.append(tok)
            if on_tokens:
                on_tokens([tok])
            rounds.append(RoundRecord(tree_size=0, tree_depth=0, accepted=0, accepted_ranks=[], committed=1, times_ms={}))
            pending_times.append(marks + [("host", (time.perf_counter() - h0 - wait_s) * 1e3)])
            marks = nxt
            if stopped:
                break

    def _step_ahead(self, slot: _Slot, taps, P: int, draft_kv: int, k: int, sp: SamplingParams, budget: int | None,
                    into: _Slot | None = None, auto_budgets: tuple = ()):
        """Everything after a verify when rounds run ahead, in one graph: walk, commit, drafter,
        and the next tree written into `into` (default `slot`) on the device (budget None: the
        DFlash chain). auto_budgets: `into` is one of auto's staging trees (of budget B = `budget`); each
        prefix of b = 1..B draft nodes (the best-first tree of budget b) is summarised for the host,
        zero-padded to the largest of auto_budgets.
        -> packed floats: [n, bonus, path tokens (P), path ranks (P), next tree's depth], or with
        auto_budgets [..., E_q(b) for b = 1..B, depth of b's prefix for b = 1..B] in place of the depth."""
        into = slot if into is None else into
        slot._shape = into._shape = (None, None)  # rewritten on the device: no upload shortcut for a host load
        head, n, bonus = self._accept(slot, taps, P, P)
        lp, ids = self._draft_topk(bonus, draft_kv, k, sp)
        ids = ids.to(into.tokens.device)
        if budget is None:  # the chain: bonus, then the drafter's top-1 per position (shape unchanged)
            torch.cat([bonus.view(1), ids[:, 0]], out=into.tokens)
            depth = self._full(1, float(into.tokens.shape[0] - 1))
        else:
            lp = lp.to(ids.device)
            # auto: per prefix of b draft nodes, E_q(b) and its depth, for the host's choice of budget
            summary = (torch.empty(budget, device=lp.device), torch.empty(budget, dtype=torch.long, device=lp.device)) \
                if auto_budgets else None
            kernel = triton_gdn.available(lp) and TREE_KERNEL["ok"]
            if kernel:  # one kernel, straight into the slot (twin: the torch builder below)
                depth = torch.empty(1, dtype=torch.long, device=lp.device)
                try:
                    build_tree_kernel(bonus, lp, ids, budget, out=(into.tokens, into.depths, into.parents, into.ranks,
                                                                   into.mask, depth), summary=summary)
                except Exception as e:  # first use is eager (before any capture): fall back for good
                    if lp.is_cuda and torch.cuda.is_current_stream_capturing():
                        raise
                    from loguru import logger

                    logger.warning(f"the Triton tree kernel failed ({type(e).__name__}: {str(e)[:200]}); building trees "
                                   "with torch ops instead (DDTREE_NO_TRITON=1 skips the kernels)")
                    TREE_KERNEL["ok"] = kernel = False
            if not kernel:
                tokens, depths, parents, ranks, mask, d = build_tree_device(bonus, lp, ids, budget)
                into.ints.copy_(torch.stack([tokens, depths, parents]))
                into.ranks.copy_(ranks)
                into.mask.copy_(mask)
                depth = d.view(1)
                if summary is not None:
                    summary = tree_summary(lp, depths, ranks, mask)
            if summary is not None:
                pad = [self._full(auto_budgets[-1] - budget, 0.0)] if auto_budgets[-1] > budget else []
                depth = torch.cat([summary[0], *pad, summary[1].float(), *pad])
        return torch.cat([head, depth.float()])

    def _accept(self, slot: _Slot, taps, P_walk: int, P: int):
        """The start of every rounds-ahead step: walk a path of P_walk nodes, commit it, and add its
        rows to the drafter's context. -> (the packed header [n, bonus, path tokens (P), path ranks
        (P)], zeros past P_walk; n; bonus)."""
        pack = self._pack_buf(P)
        path, n, bonus = self._walk(slot, P_walk, pack=pack)
        self._commit(P_walk)
        self.drafter.add_context(taps, n, rows=path)
        return pack, n, bonus

    def _step_plain(self, slot: _Slot, taps, P: int, stage: _Slot, nb: int):
        """--budget auto's plain step (after a verify of the bonus alone): walk, commit, the drafter's
        context += the accepted row, and no drafter forward; the chosen token becomes the staging
        tree's root (the next round is plain too, or its tree is drafted from it). Packed as
        `_step_ahead` packs, with an empty summary."""
        head, n, bonus = self._accept(slot, taps, 1, P)  # one node: a path of one (fewer rows to commit and add)
        stage.tokens[:1].copy_(bonus.view(1))
        return torch.cat([head, self._full(2 * nb, 0.0)])

    def _trunc(self, stage: _Slot, slot: _Slot):
        """Auto's tree for this round: the first T nodes of the staging tree (a best-first tree's
        prefix is the best-first tree of that budget)."""
        T = slot.tokens.shape[0]
        slot.ints.copy_(stage.ints[:, :T])
        slot.ranks.copy_(stage.ranks[:T])
        slot.mask.copy_(stage.mask[:T, :T])

    def _ahead_rounds(self, method, budget, tree: Tree, out, start, max_new_tokens, stop_ids, sampling, gen,
                      on_tokens, clock, rounds, pending_times, k: int, chooser: BudgetChooser | None = None):
        """`dflash` and `ddtree` with the tree built on the device: round r + 1 is queued before the
        host reads round r (one pinned copy + event per round, as in `_ar_rounds`), so the host's
        work overlaps the device's. Reference twin: the round loop (rounds_ahead=False).

        --budget auto (chooser): every drafting round builds a best-first tree into a staging slot
        of its build budget; the host picks round r + 1's budget when it queues it (from the
        acceptance seen in the rounds read so far and the latest tree's E_q curve, among the
        budgets the staged tree covers) and a tiny graph copies that prefix into the budget's own
        slot. The build budget comes from BudgetChooser.build_for: the round's own budget, one
        budget up in two rounds of every CLIMB_EVERY (so the choice can climb), and after plain
        steps the last tree budget chosen."""
        P = self.block_size
        budgets = tuple(sorted(chooser.verify_ms)) if chooser is not None else ()
        if budgets:
            stage = self._stage(budgets[-1] + 1)
            stage.load(tree)
            stage.ranks.copy_(tree.ranks.to(stage.ranks.device))
            stage._shape = (None, None)
            # per round: (E_q per budget, depth per budget) of its tree; round 0's from the host tree
            summary = {0: (expected_accepts(tree.scores, budgets), {b: int(tree.depths[: b + 1].max()) for b in budgets})}
            T0 = None
            built = {-1: budgets[-1]}  # round -> build budget of the tree its step staged (-1: the host's tree)
        else:
            T0 = tree.num_nodes
            slot = self._slot(T0)
            slot.load(tree)
            slot.ranks.copy_(tree.ranks.to(slot.ranks.device))
            b_build = None if method == "dflash" else budget
            if b_build is not None:
                slot._shape = (None, None)  # the device will rewrite the tree's shape: no upload shortcut later
            summary = {0: int(tree.depths.max())}  # per round: its tree's depth
        nb = budgets[-1] if budgets else 0  # auto: the summary covers every prefix of the staged tree
        ring = _HostRing(2 + 2 * P + max(1, 2 * nb), self.target.device)
        sizes: dict = {}  # round -> its tree size
        latest = [summary[0][0] if budgets else None]  # auto: E_q per budget of the newest tree the host has read
        drafted = {-1: True}  # round -> did its step draft the next tree (auto: not after a plain step)
        plain_run = [0]  # consecutive plain steps: every PLAIN_PROBE-th one drafts, to re-measure the trees

        def launch(r: int, start_bound: int):
            plain = False
            b_build, k_r = (None if method == "dflash" else budget), k
            if budgets:  # round r's budget, from what the host knows now (round r's own tree may still be in flight)
                src = built[r - 1]  # the staged tree this round truncates
                b = chooser.pick_eq(latest[0], cap=src)[0] if drafted[r - 1] else 0
                plain, T = b == 0, b + 1
                slot = self._slot(T)
                slot._shape = (None, None)
                src_stage = self._stage(src + 1)
                self._run(("trunc", T, src), lambda: self._trunc(src_stage, slot))
                plain_run[0] = plain_run[0] + 1 if plain else 0
                b_build = built[r] = chooser.build_for(b, r)
                built.pop(r - 2, None)
                into = self._stage(b_build + 1)
                k_r = min(k, b_build)  # a best-first tree of B nodes takes at most the top B per depth
            else:
                T, slot = T0, self._slot(T0)
                into = slot
            sizes[r] = T
            kv_len = min(_bucket(start_bound + T, self.bucket), self.max_len)
            draft_kv = min(_bucket(start_bound + P, self.bucket), self.max_len)
            e0 = clock.now()
            vkey, _, taps = self._verify_choose(slot, kv_len, sampling, gen, True)
            e1 = clock.now()
            drafted[r] = not plain or plain_run[0] % PLAIN_PROBE == 0
            if drafted[r]:
                packed = self._run(("ahead", vkey, P, draft_kv, k_r, sampling, b_build, into.tokens.shape[0], budgets),
                                   lambda: self._step_ahead(slot, taps, P, draft_kv, k_r, sampling, b_build, into, budgets),
                                   keep=(into.ints, into.mask, into.ranks))  # the step rewrites its own inputs
            else:  # the bonus becomes the root of the staged tree the next (plain) round truncates
                packed = self._run(("plain", vkey, P, nb, into.tokens.shape[0]),
                                   lambda: self._step_plain(slot, taps, P, into, nb), keep=(into.ints,))
            drafted.pop(r - 1, None)
            e2 = clock.now()
            ring.put(r, packed)
            return [("verify", e0, e1), ("draft", e1, e2)]

        T_max = budgets[-1] + 1 if budgets else T0
        marks = {0: launch(0, start)}
        r, t_last = 0, time.perf_counter()
        while True:
            h0 = time.perf_counter()
            # round r + 1 may start at most P past round r's start: launch it now if that fits
            ahead = len(out) + 1 < max_new_tokens and start + P + T_max + P <= self.max_len
            if ahead:
                marks[r + 1] = launch(r + 1, start + P)
            w0 = time.perf_counter()
            h = ring.get(r)  # the round's one device-to-host sync
            wait_s = time.perf_counter() - w0
            n, bonus = int(h[0]), int(h[1])
            path_tok = [int(x) for x in h[2 : 2 + n]]
            ranks = [int(x) for x in h[2 + P + 1 : 2 + P + n]]
            T, o = sizes.pop(r), 2 + 2 * P
            if budgets:  # this round's outcome against its tree's prediction; the next tree's summary
                eq, depth_of = summary.pop(r) or ({}, {})
                now = time.perf_counter()
                if T == 1:  # a plain step
                    depth = 0
                    chooser.update_plain((now - t_last) * 1e3)
                else:
                    depth = depth_of[T - 1]
                    chooser.update(T - 1, eq[T - 1], n - 1, (now - t_last) * 1e3)
                t_last = now
                if h[o + nb] >= 1:  # the step drafted a tree (its depth-of-one-node prefix is 1)
                    cover = [b for b in budgets if b <= built[r]]
                    summary[r + 1] = ({b: h[o + b - 1] for b in cover}, {b: int(h[o + nb + b - 1]) for b in cover})
                    latest[0] = summary[r + 1][0]
                else:
                    summary[r + 1] = None
            else:
                depth = summary.pop(r)
                summary[r + 1] = int(h[o])
            start += n
            toks, stopped = _emit(path_tok[1:] + [bonus], max_new_tokens - len(out), stop_ids)
            out.extend(toks)
            if on_tokens:
                on_tokens(toks)
            rounds.append(RoundRecord(tree_size=T - 1, tree_depth=depth, accepted=n - 1, accepted_ranks=ranks,
                                      committed=len(toks), times_ms={}))
            pending_times.append(marks.pop(r) + [("host", (time.perf_counter() - h0 - wait_s) * 1e3)])
            if stopped or len(out) >= max_new_tokens:
                return
            if not ahead:
                marks[r + 1] = launch(r + 1, start)
            r += 1

    @staticmethod
    def _fill_times(clock: StageClock, rounds, pending):
        for marks in pending:
            for m in marks:
                if len(m) == 3:
                    clock.add(*m)
        resolved = iter(clock.resolve())
        for rec, marks in zip(rounds, pending):
            for m in marks:
                rec.times_ms[m[0]] = m[1] if len(m) == 2 else next(resolved)[1]

"""The Decoder: runs `ar`, `dflash` or `ddtree` on a loaded target (+ drafter).

`generate` = prefill, then the rounds: the device pipeline (ddtree.decode.round) under a budget
policy (ddtree.decode.budget), or the host-tree loop (ddtree.decode.reference, its twin; it also
serves --top1-first). This module holds the pieces both call: verify, walk, commit, draft, tree
build, and the static slots. State lives in buffers allocated once; each piece has fixed shapes
per graph key (ddtree.decode.graphs), and the committed length lives on the device (`start_d`).
On a split target (ddtree.model.stages) the slots, the walk, `start_d` and the packet live on the
home stage (the last: the lm_head's), and each piece calls `target.enter` at its stage boundaries:

    verify        stage 0, 1, .., last (the embedding first; logits, the greedy choice at home)
    step          home (walk) -> 0 (commit, the draft block's embedding) -> .. -> last (commit,
                  start_d, drafter context and draft when the drafter is there, next tree, packet)
    host draft    home (walk) -> drafter (context) -> 0 (block embedding) -> drafter (draft) -> home
                  (packet); ar: the step's order
    host commit   0 -> .. -> last
    prefix copy   home
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ddtree.decode import auto as auto_budget
from ddtree.decode.budget import AUTO_BUDGETS, AUTO_TOPK, BudgetChooser
from ddtree.decode.buffers import Slot, Statics
from ddtree.decode.clock import StageClock, sync
from ddtree.decode.graphs import GraphRunner, VerifyKey, bucket, mutable_state
from ddtree.decode.reference import Draft, host_tree, run_host_rounds
from ddtree.decode.round import AHEAD_MARGIN, Pipeline
from ddtree.decode.sampling import SamplingParams, choose
from ddtree.decode.startup import StartupClock
from ddtree.errors import DDTreeError, TooLongError
from ddtree.model.drafter import DFlashDrafter
from ddtree.model.target import TargetModel
from ddtree.ops.dispatch import Kernels, resolve
from ddtree.ops.tree import Tree, build_tree_device
from ddtree.ops.tree_kernel import build_tree_kernel, tree_summary
from ddtree.ops.walk import walk, walk_kernel
from ddtree.options import DEFAULT_BUDGET, Options
from ddtree.stats import GenerationRecord, RoundRecord

from ddtree.decode.methods import METHODS  # defined without torch: the CLI checks --method before importing it


@dataclass(frozen=True)
class Job:
    """A generation's validated settings (Decoder.job)."""

    method: str
    budget: int  # draft nodes (auto: the largest candidate)
    auto: bool  # --budget auto
    k: int  # drafter top-k columns
    sampling: SamplingParams
    max_new_tokens: int
    seed: int | None
    top1_first: bool


@dataclass
class Prefilled:
    """The state after a prefill (Decoder.prefill): the target and the drafter hold the prompt."""

    prompt_len: int
    bonus: int  # the first new token
    draft: Draft | None  # the drafter's first block (job.k columns)
    ttft_s: float  # to the first token on the host (before the drafter's first block where it was shown early)
    gen: torch.Generator | None  # the sampling generator, carried on into decode
    prefill_s: float = 0.0  # the whole prefill, the drafter's first block included
    shown: bool = False  # the first token went to on_first already (decode does not emit it again)
    halt: bool = False  # on_first returned True: decode runs no round


def _log():
    from loguru import logger

    return logger


class Decoder:
    """Runs `ar`, `dflash` or `ddtree` on a loaded target (+ drafter); see the module docstring.

    options: the engine switches (ddtree.options; default: Options()). use_graphs: CUDA graphs
    (default: on CUDA, a split's pieces as one segment per stage visit unless options.split_graphs
    is off; False: the eager split, their twin). compile: compiled layers (default: where rounds
    are graphed or split over GPUs, unless options.compile is off). bucket: context-length
    granularity of the graph keys."""

    chooser_class = BudgetChooser  # --budget auto's cost model (tests substitute a forced one)

    def __init__(self, target: TargetModel, drafter: DFlashDrafter | None = None, max_len: int | None = None,
                 options: Options | None = None, use_graphs: bool | None = None, compile: bool | None = None,
                 bucket: int = 256):
        self.target, self.drafter = target, drafter
        self.max_len = max_len or target.max_len
        self.options = options or Options()
        self.home = target.home  # the stage of the slots, the walk and the packet (the lm_head's)
        dev = self.device = target.out_device
        cuda = all(st.device.type == "cuda" for st in target.stages)
        # A split's pieces are graphed in segments, one per stage visit (ddtree.decode.graphs), unless
        # options.split_graphs is off (DDTREE_EAGER_SPLIT=1: the eager split, their twin).
        split = len(target.stages) > 1
        self.use_graphs = (cuda and (not split or self.options.split_graphs)) if use_graphs is None else use_graphs
        self.bucket = bucket
        # Compiled layers wherever rounds are graphed, and for an eager split over GPUs (fewer,
        # fused kernels keep the host ahead of the GPUs).
        if compile is None:
            compile = self.options.compile and (self.use_graphs or (cuda and len(target.stages) > 1))
        self.compile = compile
        target.use(self.options)
        self.kernels: Kernels = target.kernels[self.home]
        self.tree_kernel_ok = True  # False after the Triton tree kernel failed once (torch ops then)
        self.start_d = torch.zeros((), dtype=torch.long, device=dev)
        self.statics = Statics(dev)
        self._slots: dict[int, Slot] = {}
        self._chain_stages: dict[int, Slot] = {}
        self._verify_cost: dict = {}  # auto.calibrate: (bucket, greedy, near the end) -> (verify ms, draft ms, AutoMemory)
        self.deferred = None  # auto's deferred drafter context (ddtree.decode.round.DeferredContext), made on first use
        self._compile_noticed = False
        self.startup = StartupClock()  # compile, capture and prefill seconds (ddtree.decode.startup)
        self.graphs = GraphRunner(target, self.use_graphs, lambda: mutable_state(self), self._compile_failed,
                                  log=lambda m: _log().debug(m), clock=self.startup)
        if drafter is not None:
            target.tap_layers = list(drafter.cfg.target_layer_ids)
            drafter.attach(target.embed_tokens, target.lm_head, target.enter, _drafter_stage(target, drafter),
                           0, target.home)
            drafter.gather_logits = target.gather_logits
            hd = drafter.cfg.head_dim
            kn = resolve(self.options, drafter.device)
            drafter.kernels = kn if hd >= 16 and hd & (hd - 1) == 0 else dataclasses.replace(kn, attention="sdpa")

    @property
    def block_size(self) -> int:
        return self.drafter.cfg.block_size if self.drafter is not None else 1

    def kv_len(self, n: int) -> int:
        """The context bound of a graph key for n visible positions. The dense-mask twin pays for
        every row of its [T, kv_len] mask, so its bound is n in steps of `bucket`; the attention
        kernel reads only up to the true length (the bound sizes its grid), so it takes powers of
        two: far fewer graph keys as a generation crosses lengths, so fewer captures mid-run."""
        b = bucket(n, self.bucket)
        if self.kernels.attention == "kernel":
            b = max(b, 1 << (n - 1).bit_length())
        return min(b, self.max_len)

    def start_floor(self, kv_len: int, T: int) -> int:
        """A lower bound on the committed length of any T-node verify under a graph key of bound
        kv_len (the attention's fused prefix reads below it: Step.floor): the least n that
        kv_len(n) maps to this bound, less T, less what a round still in flight may commit
        (rounds are queued one ahead with their start's upper bound: ddtree.decode.round)."""
        lo, hi = 1, kv_len  # kv_len(n) is non-decreasing: the least n with kv_len(n) >= kv_len
        while lo < hi:
            mid = (lo + hi) // 2
            if self.kv_len(mid) >= kv_len:
                hi = mid
            else:
                lo = mid + 1
        return max(0, lo - T - AHEAD_MARGIN)

    @property
    def split(self) -> bool:
        return len(self.target.stages) > 1

    # ------------------------------------------------------------------ static slots
    def slot(self, T: int) -> Slot:
        """The tree slot of T nodes a verify reads."""
        if T not in self._slots:
            self._slots[T] = Slot(T, self.device)
        return self._slots[T]

    def chain_stage(self, T: int) -> Slot:
        """--budget auto's staged chain of T nodes, whose shape stays a chain's (its steps write
        the tokens): never verified itself, only copied from (auto stages trees in their verify
        slots)."""
        if T not in self._chain_stages:
            s = self._chain_stages[T] = Slot(T, self.device)
            s.chain = True
            # a valid tree from the start (its root's parent is the committed prefix, -1)
            s.load(Tree.chain(torch.zeros(T, dtype=torch.long)))
            s.device_written()
        return self._chain_stages[T]

    # ------------------------------------------------------------------ the pieces of a round
    def verify(self, slot: Slot, kv_len: int, sampling: SamplingParams, gen, taps: bool):
        """The target's forward over slot's tree (greedy choice inside the graph; a sampled choice
        after it). -> (its graph key, taps [T, *] | None)."""
        key = VerifyKey(slot.T, kv_len, sampling.greedy, taps)
        logits, tap = self.graphs.run(key, lambda: self._verify(slot, key))
        if not sampling.greedy:
            slot.choice.copy_(choose(logits, sampling, gen))
        return key, tap

    def _verify(self, slot: Slot, key: VerifyKey):
        tgt = self.target
        tokens, depths, start = tgt.enter(0, slot.tokens, slot.depths, self.start_d)  # the positions on stage 0
        logits, tap = tgt.forward(tokens, start + depths, slot.mask, slot.parents, start, key.kv_len,
                                  want_taps=key.taps, floor=self.start_floor(key.kv_len, key.T))
        if key.greedy:  # the forward ends on the last stage: home
            slot.choice.copy_(logits.argmax(-1))
        return logits, tap

    def walk(self, slot: Slot, P: int, header: torch.Tensor | None = None):
        """The accepted path of slot's verified tree, into the static walk buffers (at most P
        nodes). With header (fp32 [2 + 2 PK], PK >= P) the packet's header goes into it too.
        -> (path_nodes [P], n 0-dim, bonus 0-dim)."""
        self.target.enter(self.home)
        path, n, bonus = self.statics.walk(P)
        if self.kernels.walk:  # one kernel instead of ~15 (twin: ddtree.ops.walk.walk)
            walk_kernel(slot.tokens, slot.parents, slot.depths, slot.mask, slot.choice, P, (path, n, bonus),
                        ranks=None if header is None else slot.ranks, pack=header)
            return path, n, bonus
        last, n_d, path_nodes = walk(slot.tokens, slot.parents, slot.depths, slot.mask, slot.choice, P)
        path.copy_(path_nodes)
        n.copy_(n_d)
        bonus.copy_(slot.choice.gather(0, last.view(1))[0])
        if header is not None:
            pad = self.statics.full((header.shape[0] - 2) // 2 - P, 0.0)
            header.copy_(torch.cat([n.view(1).float(), bonus.view(1).float(), slot.tokens.index_select(0, path).float(),
                                    pad, slot.ranks.index_select(0, path).float(), pad]))
        return path, n, bonus

    def commit(self, path: torch.Tensor, n: torch.Tensor, embed: torch.Tensor | None = None):
        """Keep path[:n] in the target's state and advance the committed length (stage by stage,
        ending at home). embed: tokens whose embedding rows to look up on the way
        (TargetModel.commit) -> those rows, or None."""
        rows = self.target.commit(path, n, self.start_d, embed=embed)
        self.target.enter(self.home)
        self.start_d.add_(n)
        return rows

    def draft_topk(self, bonus: torch.Tensor, kv_len: int, k: int, sampling: SamplingParams,
                   rows: torch.Tensor | None = None):
        """[B-1, k] top-k log-probs and ids of the drafter's block after `bonus` (on the home
        stage). rows: the block's embedding rows, when the commit looked them up."""
        if rows is not None:
            return self.drafter.draft_topk(bonus, kv_len, k, sampling.temperature_or_none, rows=rows)
        return self.drafter.draft_topk(bonus, kv_len, k, sampling.temperature_or_none)

    def copy_prefix(self, slot: Slot, src: Slot):
        """--budget auto: slot's tree = the first slot.T nodes of src's (on home)."""
        self.target.enter(self.home)
        slot.copy_prefix_(src)

    def build_tree(self, root, lp, ids, budget: int, into: Slot, summarise: bool):
        """The best-first tree of `budget` draft nodes, written into `into` on the device.
        -> (its depth 0-dim, (E_q [B], depth [B]) per prefix if summarise else None)."""
        lp, ids = self.target.enter(self.home, lp, ids)
        dev = lp.device
        summary = (torch.empty(budget, device=dev), torch.empty(budget, dtype=torch.long, device=dev)) \
            if summarise else None
        if self.kernels.triton and self.tree_kernel_ok:  # one kernel (twin: the torch builder below)
            depth = torch.empty(1, dtype=torch.long, device=dev)
            try:
                build_tree_kernel(root, lp, ids, budget, out=(into.tokens, into.depths, into.parents, into.ranks,
                                                              into.mask, depth), summary=summary)
                return depth, summary
            except Exception as e:  # first use is eager (before any capture): fall back for good
                if lp.is_cuda and torch.cuda.is_current_stream_capturing():
                    raise
                _log().warning(f"the Triton tree kernel failed ({type(e).__name__}: {str(e)[:200]}); building trees "
                               "with torch ops instead (DDTREE_NO_TRITON=1 skips the kernels)")
                self.tree_kernel_ok = False
        tokens, depths, parents, ranks, mask, d = build_tree_device(root, lp, ids, budget)
        into.ints.copy_(torch.stack([tokens, depths, parents]))
        into.ranks.copy_(ranks)
        into.mask.copy_(mask)
        if summarise:
            summary = tree_summary(lp, depths, ranks, mask)
        return d.view(1), summary

    # ------------------------------------------------------------------ capture support
    def _compile_failed(self, e: Exception):
        _log().warning(f"torch.compile failed ({type(e).__name__}: {str(e)[:200]}); "
                       "using the eager layers (set DDTREE_NO_COMPILE=1 to skip compiling)")
        self.compile = self.target.compile_layers = False
        if self.drafter is not None:
            self.drafter.compile_layers = False

    def use_compile(self, drafter: bool = True):
        """The target's and the drafter's layers compiled or not, as this decoder runs them (before
        a prefill or the rounds; drafter=False: the drafter eager, for a short prefill)."""
        self.target.compile_layers = self.compile
        if self.drafter is not None:
            self.drafter.compile_layers = self.compile and drafter
        if drafter:
            self._notice_compile()

    def _notice_compile(self):
        if self.compile and not self._compile_noticed:
            _log().info("compiling the layers for this GPU (first use in this process; inductor caches it on disk; "
                        "DDTREE_NO_COMPILE=1 skips it)")
        self._compile_noticed = True

    # ------------------------------------------------------------------ generate = prefill + decode
    @torch.no_grad()
    def generate(self, prompt_ids: list[int], method: str = "ddtree", budget: int | str = DEFAULT_BUDGET,
                 sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
                 stop_ids: set[int] | frozenset = frozenset(), seed: int | None = 0, top1_first: bool = False,
                 on_tokens: Callable[[list[int]], None] | None = None, prompt_id: str = "",
                 decode_text: Callable[[list[int]], str] | None = None) -> GenerationRecord:
        """prefill + decode; on_tokens gets the tokens as they come (the first one before the drafter's first block);
        its returning True ends the generation after that round (a stop string, a cancelled request)."""
        job = self.job(method, budget, sampling, max_new_tokens, seed, top1_first, len(prompt_ids))
        pre = self.prefill(prompt_ids, job, on_first=(lambda t: on_tokens([t])) if on_tokens else None)
        rec = self.decode(pre, job, stop_ids, on_tokens)
        rec.prompt_id, rec.text = prompt_id, decode_text(rec.token_ids) if decode_text else ""
        return rec

    def job(self, method: str = "ddtree", budget: int | str = DEFAULT_BUDGET, sampling: SamplingParams = SamplingParams(),
            max_new_tokens: int = 128, seed: int | None = 0, top1_first: bool = False, prompt_len: int = 1) -> Job:
        """Validate a generation's settings (one clear error each)."""
        if method not in METHODS:
            raise DDTreeError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
        if method != "ar" and self.drafter is None:
            raise DDTreeError(f"--method {method} needs a drafter: pass --drafter REF")
        if prompt_len < 1:
            raise DDTreeError("empty prompt: pass a non-empty prompt (argument, '-' for stdin, or a prompt file)")
        auto = budget == "auto"
        if auto:
            budget = max(AUTO_BUDGETS)
        if isinstance(budget, str) or budget < 1:
            raise DDTreeError(f"--budget {budget} must be a positive integer or 'auto'")
        depth = self.block_size - 1
        n_max = {"ar": 1, "dflash": depth + 1, "ddtree": budget + 1}[method]
        P = 1 if method == "ar" else depth + 1  # path length buffers: fixed per method
        if prompt_len + max_new_tokens + max(n_max, P) > self.max_len:
            raise TooLongError(
                f"prompt ({prompt_len} tokens) + --max-new-tokens {max_new_tokens} + tree ({n_max}) exceeds "
                f"the maximum length {self.max_len}: raise --max-length or shorten the prompt"
            )
        k = min(AUTO_TOPK if auto else budget, self.target.cfg.vocab_size) if method == "ddtree" else 1
        return Job(method, budget, auto, k, sampling, max_new_tokens, seed, top1_first)

    @torch.no_grad()
    def prefill(self, prompt_ids: list[int], job: Job, start: int = 0, taps: bool | None = None,
                fast: bool | None = None, on_first: Callable[[int], None] | None = None) -> Prefilled:
        """Reset the state, run the prompt through the target (in chunks; the drafter's context
        grows chunk by chunk), choose the first token and draft the first block. The generator
        (job's seed) carries on into `decode`.

        start > 0 continues from a kept state instead of a reset: the target's committed state
        holds prompt_ids[:start] (and the drafter's context, where taps are on, start rows), so
        only the rest is prefilled (ddtree.decode.conversation). taps: the drafter's context
        from the prompt (default: for every method but `ar`). fast: the compiled prefill layers,
        fla and the compiled drafter (True) or their eager twins (False); default the rule below.
        on_first(token): the first token, before the drafter's first block (a second sync: a user waits for it);
        its returning True ends the generation there (decode runs no round)."""
        tgt, dev = self.target, self.device
        drafts = job.method != "ar"
        taps_on = drafts if taps is None else taps and self.drafter is not None
        gen = None
        if job.seed is not None:
            gen = torch.Generator(device=dev)
            gen.manual_seed(job.seed)
        # A short prefill takes the eager prefill layers and the torch GDN chain, and the drafter's
        # context and first block run eagerly: compiling them and tuning fla's kernels would cost
        # more than they save on it (options.prefill_fast_min); the rounds compile what they need.
        # A continued conversation's turn takes the fast path once a fast prefill has run: nothing
        # is left to compile, and the eager twins cost several times more a token.
        if fast is None:
            fast = len(prompt_ids) - start >= self.options.prefill_fast_min or (start > 0 and tgt.fast_prefill_ran)
        self.use_compile(drafter=fast)
        if start == 0:
            tgt.reset()
            if self.drafter is not None:
                self.drafter.reset()
        sync(dev)
        t0 = time.perf_counter()
        with self.startup.phase("prefill"):
            prompt = torch.tensor(prompt_ids[start:], dtype=torch.long, device=dev)
            # no taps for `ar` (a drafter may be loaded for other methods): kept, they would be the whole prompt's
            logits, _ = tgt.prefill(prompt, start=start, want_taps=taps_on,
                                    on_taps=self.drafter.add_context if taps_on else None, fast=fast)
            bonus_d = choose(logits[None], job.sampling, gen)[0]
            draft, t_first, halt = None, None, False
            if drafts and on_first is not None:
                halt = bool(on_first(int(bonus_d)))
                t_first = time.perf_counter()
            if drafts:
                k = job.k
                lp, ids = self.draft_topk(bonus_d, self.kv_len(len(prompt_ids)), k, job.sampling)
                host = torch.cat([bonus_d.view(1).float(), lp.flatten(), ids.flatten().float()]).cpu().numpy()
                D = lp.shape[0]
                draft = Draft(int(host[0]), host[1 : 1 + D * k].reshape(D, k),
                              host[1 + D * k :].reshape(D, k).astype(np.int64))
                bonus = draft.bonus
            else:
                bonus = int(bonus_d)  # the one sync of the prefill
        t_end = time.perf_counter()
        return Prefilled(len(prompt_ids), bonus, draft, (t_first or t_end) - t0, gen, prefill_s=t_end - t0,
                         shown=t_first is not None, halt=halt)

    @torch.no_grad()
    def decode(self, pre: Prefilled, job: Job, stop_ids=frozenset(),
               on_tokens: Callable[[list[int]], None] | None = None) -> GenerationRecord:
        """The rounds after a prefill: the device pipeline under the job's policy, or the host-tree
        loop (--top1-first, DDTREE_HOST_ROUNDS=1, or a tree the device builder cannot fill)."""
        dev, method, sampling, gen = self.device, job.method, job.sampling, pre.gen
        out = [pre.bonus]
        halt = pre.halt or (bool(on_tokens([pre.bonus])) if on_tokens and not pre.shown else False)
        start = pre.prompt_len
        self.start_d.fill_(start)
        self.use_compile()  # (a short prefill ran the drafter eagerly)
        pipeline = auto_budget.pipelined(self, job)
        chooser = auto_budget.calibrate(self, start, sampling.greedy, plain=pipeline) if job.auto and method == "ddtree" else None
        clock = StageClock(dev)
        rounds: list[RoundRecord] = []
        pending: list[list] = []
        t_dec, keys0 = time.perf_counter(), self.graphs.new_keys
        if pre.bonus not in stop_ids and len(out) < job.max_new_tokens and not halt:
            policy = auto_budget.policy_for(self, method, job.budget, job.k, chooser) if pipeline else None
            if policy is not None:
                policy.begin(host_tree(method, pre.bonus, pre.draft, job.budget, False), self, pre.draft)
                Pipeline(self, policy, sampling, gen, clock).run(out, start, job.max_new_tokens, stop_ids, on_tokens,
                                                                 rounds, pending)
            else:
                if chooser is not None:
                    chooser.plain_ms = None  # the host-tree loop has no plain steps
                run_host_rounds(self, method, job.budget, pre.draft, chooser, out, start, job.max_new_tokens, stop_ids,
                                sampling, gen, job.top1_first, job.k, on_tokens, clock, rounds, pending)
        sync(dev)
        decode_s = time.perf_counter() - t_dec
        clock.fill(rounds, pending)
        return GenerationRecord(
            prompt_id="", prompt_tokens=pre.prompt_len, new_tokens=len(out), token_ids=out, text="",
            prefill_s=pre.prefill_s or pre.ttft_s, decode_s=decode_s, ttft_s=pre.ttft_s, method=method,
            budget=(job.budget if not job.auto else None) if method == "ddtree" else None, rounds=rounds,
            captures=self.graphs.new_keys - keys0,
        )


def _drafter_stage(target: TargetModel, drafter: DFlashDrafter) -> int:
    """The drafter's stage: the one its loader placed it on (stages may share a device), else the
    last stage on its device (the lm_head's, where the taps are, if it is there), else home."""
    stages = target.stages
    st = drafter.stage
    if st is not None and 0 <= st < len(stages) and stages[st].device == drafter.device:
        return st
    on = [s.index for s in stages if s.device == drafter.device]
    return on[-1] if on else target.home

"""--budget auto on a decoder: the calibration and the policy a generation runs under.

`calibrate` times one verify per candidate budget (once per context bucket and decoder) and hands
the generation a chooser (ddtree.decode.budget.BudgetChooser) that shares the decoder's
`AutoMemory` for that bucket: the whole-round costs and acceptance that earlier generations
measured. `policy_for` is the pipeline's budget policy for a method. `capture_ahead` captures
every graph piece a generation can reach before it runs (a benchmark's warm-up).
"""

from __future__ import annotations

import time

import torch
from loguru import logger

from ddtree.decode.budget import AUTO_BUDGETS, AUTO_TOPK, Auto, AutoMemory, BudgetChooser, Chain, PlainSteps
from ddtree.decode.clock import sync
from ddtree.decode.graphs import PrefixKey, VerifyKey
from ddtree.decode.sampling import SamplingParams
from ddtree.ops.tree import Tree, device_tree_fits


def timed_ms(dec, fn) -> float:
    """The median of three timed runs of fn (after one untimed: a capture or compile)."""
    fn()
    times = []
    for _ in range(3):
        sync(dec.device)
        t0 = time.perf_counter()
        fn()
        sync(dec.device)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def verify_costs(dec, start: int, greedy: bool) -> tuple[dict[int, float], float]:
    """-> (ms of one verify of b + 1 nodes for b in (0,) + AUTO_BUDGETS and the chain's b (0: the bonus alone) that
    fit before max_len, ms of one draft), on the live state (a verify commits nothing; a draft
    writes its block past the drafter's context). The draft is timed only where rounds are not
    graphed: eagerly on a GPU it would cost launches a graphed round does not pay (0 there)."""
    verify_ms = {}
    for b in sorted({0, *AUTO_BUDGETS, dec.block_size - 1}):  # (the chain's size too)
        T = b + 1
        if start + T + dec.block_size > dec.max_len:
            continue
        slot = dec.slot(T)
        slot.load(Tree.chain(torch.zeros(T, dtype=torch.long)))
        vkey = VerifyKey(T, dec.kv_len(start + T), greedy, True)
        verify_ms[b] = timed_ms(dec, lambda: dec.graphs.run(vkey, lambda: dec._verify(slot, vkey)))
    draft_ms = 0.0
    if not dec.use_graphs and start + 2 * dec.block_size <= dec.max_len:
        bonus = torch.zeros((), dtype=torch.long, device=dec.device)
        kv = dec.kv_len(start + dec.block_size)
        k = min(AUTO_TOPK, dec.target.cfg.vocab_size)
        draft_ms = timed_ms(dec, lambda: dec.draft_topk(bonus, kv, k, SamplingParams()))
    return verify_ms, draft_ms


def calibrate(dec, start: int, greedy: bool, plain: bool = False) -> BudgetChooser:
    """The chooser of a generation starting at committed length `start` (plain: plain steps are a
    candidate, as in the device pipeline, and the chain). Verify costs and the AutoMemory are kept per context
    bucket on the decoder (dec._verify_cost); near max_len, where some budgets do not fit, neither
    is kept."""
    big = start + max(AUTO_BUDGETS) + 1
    key = (dec.kv_len(big), greedy, big + dec.block_size > dec.max_len)
    if key in dec._verify_cost:
        verify_ms, draft_ms, memory = dec._verify_cost[key]
    else:
        (verify_ms, draft_ms), memory = verify_costs(dec, start, greedy), AutoMemory()
        if not key[2]:
            dec._verify_cost[key] = verify_ms, draft_ms, memory
    cost = dict(verify_ms)
    plain_ms = cost.pop(0, None)
    chain = dec.block_size - 1
    chain_ms = None if chain in AUTO_BUDGETS else cost.pop(chain, None)  # (a budget's: the chooser reads it there)
    logger.debug(f"--budget auto: verify ms per budget {', '.join(f'{b}: {ms:.2f}' for b, ms in cost.items())}; "
                 f"plain step {plain_ms if plain_ms is None else f'{plain_ms:.2f}'}; draft {draft_ms:.2f}; round ms "
                 f"measured {({b: round(ms, 2) for b, ms in sorted(memory.cost_ms.items())})}")
    # the chain arm where rounds run in the pipeline (the host-tree loop verifies trees only)
    return dec.chooser_class(cost, plain_ms=plain_ms if plain else None, memory=memory, draft_ms=draft_ms,
                             chain=chain if plain else None, chain_ms=chain_ms)


def forget(dec) -> None:
    """Drop what --budget auto has learnt on this decoder (every context bucket's calibration and
    AutoMemory); the graphs it captured stay. `ddtree bench` calls it after its warm-up, so the
    timed prompts start from what a fresh process knows, not from having seen them."""
    dec._verify_cost.clear()


def policy_for(dec, method: str, budget: int, k: int, chooser: BudgetChooser | None):
    """The pipeline's budget policy, or None where a round needs the host-tree loop (a fixed
    budget the device builder cannot fill: fewer rank prefixes than draft nodes)."""
    if method == "ar":
        return PlainSteps()
    if method == "dflash":
        return Chain(dec.block_size)
    if chooser is not None:
        if not chooser.verify_ms or not device_tree_fits(dec.block_size - 1, k, max(chooser.verify_ms)):
            return None
        return Auto(chooser, dec.block_size, k)
    if not device_tree_fits(dec.block_size - 1, k, budget):
        return None
    return Chain(dec.block_size, budget, k)


def pipelined(dec, job) -> bool:
    """Do a job's rounds run on the device pipeline? Not --top1-first ddtree, not under
    DDTREE_HOST_ROUNDS=1: the host-tree loop runs those."""
    return not dec.options.host_rounds and not (job.top1_first and job.method == "ddtree")


def capture_ahead(dec, job, prompt_len: int, eager: bool = False) -> int:
    """Capture every graph piece a generation of `job` (Decoder.job) from a prompt of prompt_len
    tokens can run, whatever --budget auto chooses: each plan its policy can return
    (Policy.every_plan: its prefix copy, verify and step) at the context buckets of every start
    its rounds can have. A warm-up made of generations reaches only the starts their acceptance
    met, and auto's choices follow round times: near a bucket's edge some (verify, drafter
    context) pairs last one token, and timed prompts met them (0 to 4 captures in a run of 8
    codepair prompts on an H100, 15 ms each).
    Call it right after that prompt's prefill (the drafter's context is then the prompt's); it
    changes no state (GraphRunner.ahead). Where rounds are not graphed it does nothing, unless
    `eager` (tests: each piece runs once, eagerly). -> pieces captured."""
    from ddtree.decode.round import Pipeline  # (the rounds' module imports this one's policies)

    if not (dec.use_graphs or eager) or not pipelined(dec, job):
        return 0
    sampling = job.sampling
    dec.start_d.fill_(prompt_len)
    dec.use_compile()
    chooser = calibrate(dec, prompt_len, sampling.greedy, plain=True) if job.auto and job.method == "ddtree" else None
    policy = policy_for(dec, job.method, job.budget, job.k, chooser)
    if policy is None:  # the host-tree loop runs these rounds
        return 0
    pipe = Pipeline(dec, policy, sampling, None, None)
    graphs, P, plans = dec.graphs, policy.P, policy.every_plan(dec)
    before, done, taps = graphs.new_keys, set(), {}

    def ahead(key, fn, keep=()):
        if key in done or (dec.use_graphs and graphs.captured(key)):
            return graphs.outputs(key) if dec.use_graphs else None
        done.add(key)
        return graphs.ahead(key, fn, keep)

    for plan in plans:  # auto's prefix copies (their keys hold no context bound)
        slot, src = plan.slot, plan.prefix_of
        if src is not None:
            ahead(PrefixKey(slot.T, src.T - 1, src.chain), lambda: dec.copy_prefix(slot, src))
    try:
        for s in range(prompt_len, prompt_len + job.max_new_tokens + P + 1):  # every start a round can be queued at
            dec.start_d.fill_(s)
            for plan in plans:
                slot = plan.slot
                if s + max(slot.T, P) > dec.max_len:
                    continue
                vkey = VerifyKey(slot.T, dec.kv_len(s + slot.T), sampling.greedy, policy.taps)
                out = ahead(vkey, lambda: dec._verify(slot, vkey))
                if out is not None:
                    taps[vkey] = out[1]
                draft_kv = dec.kv_len(s + P)
                ahead(pipe.step_key(plan, vkey, draft_kv), lambda: pipe.step(plan, taps[vkey], draft_kv), plan.keep)
    finally:
        dec.start_d.fill_(prompt_len)
    return graphs.new_keys - before

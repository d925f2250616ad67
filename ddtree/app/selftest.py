"""``ddtree selftest``: a tiny random Qwen3.6-style hybrid pair, decoded with ``ar``, ``dflash`` and
``ddtree`` (budgets 4 and 32) on one random prompt; every greedy output must equal ``ar``'s.
No download; a few seconds. The layers run eagerly unless ``--compiled`` (on a GPU the rounds are
still graphed and the Triton kernels run: what the check is about); the GPU tests cover the compiled
layers against the eager ones."""

from __future__ import annotations

import sys
import time
from typing import Callable

import typer

from ddtree.app.setup import LENGTH_SLACK, check_devices, positive_int
from ddtree.options import DEFAULT_BUDGET

SELFTEST_LAYERS = ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",)


def run_selftest(opts: dict, stage: Callable[[str], None]) -> None:
    from ddtree.options import Options

    check_devices(opts["devices"], one=True)
    n_new = positive_int(opts["max_new_tokens"], "--max-new-tokens")
    options = Options.from_env()  # the DDTREE_* switches, as for generate and bench (a bad value: one error line)
    import torch

    from ddtree.app.setup import parse_device_list

    dev = parse_device_list(opts["devices"])[0]
    stage("building the random pair")
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # a tiny model: more threads only add synchronisation
    try:
        _selftest(dev, n_new, stage, options, compiled=bool(opts.get("compiled")))
    finally:
        torch.set_num_threads(threads)


def _selftest(dev, n_new: int, stage: Callable[[str], None], options, compiled: bool = False) -> None:
    import torch

    from ddtree.decode.random_pair import build_random_pair
    from ddtree.stats import aggregate

    t0 = time.perf_counter()
    vocab, n_prompt = 24, 20  # a small vocabulary: random drafts are accepted often enough to exercise long paths
    decoder, _ = build_random_pair("hybrid", seed=0, dtype=torch.float32, device=dev,
                                   max_len=n_prompt + n_new + LENGTH_SLACK + 33, vocab=vocab, layers=SELFTEST_LAYERS,
                                   options=options if compiled else options.replace(compile=False))
    gen = torch.Generator().manual_seed(1234)
    prompt = torch.randint(2, vocab, (n_prompt,), generator=gen).tolist()
    # the environment's switches (the eager layers are --compiled's doing, said below)
    switches = " ".join(f"{k}={v}" for k, v in options.changed().items())
    print(f"selftest: tiny random Qwen3.6-style hybrid (8 layers: 3 Gated DeltaNet + 1 gated attention, x2; "
          f"vocab {vocab}) + 1-layer DFlash drafter (block {decoder.block_size}), {dev}, float32, "
          f"{n_prompt}-token prompt, {n_new} new tokens, greedy" + (f"; switches {switches}" if switches else ""),
          flush=True)
    runs = [("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 32)]
    stage("decoding the selftest prompt")
    for method, budget in runs:  # warm-up (kernels, allocator)
        decoder.generate(prompt, method=method, budget=budget or DEFAULT_BUDGET, max_new_tokens=min(8, n_new))
    results = {}
    for method, budget in runs:
        rec = decoder.generate(prompt, method=method, budget=budget or DEFAULT_BUDGET, max_new_tokens=n_new)
        results[(method, budget)] = rec
        a = aggregate([rec])
        label = method if budget is None else f"{method} {budget}"
        print(f"  {label:<10} {rec.decode_tok_s:8.1f} tok/s   {a['tokens_per_target_forward']:.2f} tokens per target forward"
              f"   mean acceptance length {a['mean_acceptance_length']:.2f} over {a['num_drafts']} drafted of "
              f"{a['rounds']} rounds", flush=True)
    ref = results[("ar", None)].token_ids
    bad = []
    for (method, budget), rec in results.items():
        if rec.token_ids != ref:
            first = next((i for i, (x, y) in enumerate(zip(rec.token_ids, ref)) if x != y), min(len(ref), len(rec.token_ids)))
            bad.append(f"{method}{'' if budget is None else ' ' + str(budget)} (first difference at token {first})")
    if len(ref) != n_new:
        bad.append(f"ar produced {len(ref)} tokens instead of {n_new}")
    if bad:
        print(f"selftest FAILED: greedy outputs differ from ar's: {'; '.join(bad)}", file=sys.stderr, flush=True)
        raise typer.Exit(1)
    print(f"selftest passed: every greedy output equals ar's ({time.perf_counter() - t0:.1f} s)", flush=True)

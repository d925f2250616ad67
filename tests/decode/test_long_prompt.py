"""Greedy exactness past one prefill chunk: a prompt that takes several prefill forwards (512
tokens each on the CPU) and, for a drafter with sliding-window layers, more than the window.
Every method's tokens equal ar's, on a random pair and on the trained codepair pair."""

from __future__ import annotations

import pytest
import torch

from conftest import FIXTURE_DIR, FIXTURE_REASON, have_fixture
from ddtree.decode.decoder import Decoder
from ddtree.model.synthetic import build_random_drafter, build_random_target, tiny_drafter_config, tiny_hybrid_config

NEW = 24


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py: tiny models run on one thread
    yield


def _methods(dec: Decoder, prompt: list[int], stop=None) -> dict[str, list[int]]:
    out = {}
    for name, method, budget in (("ar", "ar", None), ("dflash", "dflash", None), ("ddtree-4", "ddtree", 4),
                                 ("ddtree-16", "ddtree", 16)):
        rec = dec.generate(prompt, method, budget=budget or 32, max_new_tokens=NEW, stop_ids=stop or ())
        assert rec.prompt_tokens == len(prompt)
        out[name] = rec.token_ids
    return out


def test_random_pair_with_a_sliding_drafter_over_three_chunks():
    """1300 prompt tokens: three prefill chunks on the target, and a drafter whose two sliding
    layers (window 40) run their windowed path over a context 30x the window (the drafter's own
    windowed attention is checked against a cache-free reference in tests/model/test_drafter.py)."""
    raw = tiny_hybrid_config()
    target = build_random_target(raw, seed=3, max_len=1536)
    assert target.prefill_chunk() == 512
    draft_raw = tiny_drafter_config(raw, layers=3, sliding=40)
    drafter = build_random_drafter(draft_raw, target, seed=4, max_len=1536)
    assert drafter.cfg.sliding_window == [40, 40, None]
    dec = Decoder(target, drafter)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(2, target.cfg.vocab_size, (1300,), generator=g).tolist()
    out = _methods(dec, prompt)
    assert len(out["ar"]) == NEW
    for name, toks in out.items():
        assert toks == out["ar"], f"{name} differs from ar after a 1300-token prompt"


@pytest.mark.fixture
@pytest.mark.slow
@pytest.mark.skipif(not have_fixture(), reason=FIXTURE_REASON)
def test_codepair_fitted_to_1500_tokens():
    """The trained pair on a fixture prompt fitted to 1500 tokens (bench --prompt-tokens' rule):
    three prefill chunks; every method equals ar, and the drafter is still accepted into."""
    from types import SimpleNamespace

    from ddtree.app.prompts import load_prompts
    from ddtree.app.setup import fit_prompt, load_tokenizer
    from ddtree.model.checkpoint import load_drafter, load_target

    cpu = torch.device("cpu")
    target, _ = load_target(str(FIXTURE_DIR / "target"), [cpu], torch.float32, 1600)
    drafter, _ = load_drafter(str(FIXTURE_DIR / "drafter-distilled"), target, torch.float32, 1600)
    dec = Decoder(target, drafter)
    spec = SimpleNamespace(tokenizer=load_tokenizer(FIXTURE_DIR / "target"))
    prompt = fit_prompt(spec, load_prompts(str(FIXTURE_DIR / "prompts.jsonl"), 1)[0], True, False, 1500)
    stop = set(target.cfg.eos_token_ids)
    out = _methods(dec, prompt, stop)
    for name, toks in out.items():
        assert toks == out["ar"], f"{name} differs from ar after a 1500-token prompt"
    rec = dec.generate(prompt, "ddtree", budget=16, max_new_tokens=NEW, stop_ids=stop)
    if len(rec.rounds) > 1:
        assert rec.new_tokens / len(rec.rounds) > 1.2  # tokens per round: the long context did not break drafting

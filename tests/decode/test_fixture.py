"""The codepair fixture (a small trained Qwen3.5-layout pair): our greedy `ar` equals transformers'
greedy generate, and greedy `ddtree` / `dflash` equal our `ar`, on real prompts."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import FIXTURE_DIR as FIXTURE  # noqa: E402
NEW = 32
PROMPTS = 4

pytestmark = [
    pytest.mark.fixture,
    pytest.mark.slow,
    pytest.mark.skipif(not (FIXTURE / "target" / "config.json").is_file(),
                       reason=f"codepair fixture not found at {FIXTURE} (see ../shared/fixtures/codepair/README.md)"),
]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py: tiny models run on one thread
    yield


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(FIXTURE / "target"))
    rows = [json.loads(line) for line in (FIXTURE / "prompts.jsonl").read_text().splitlines() if line.strip()]
    picked = rows[:: len(rows) // PROMPTS][:PROMPTS]  # spread over the file
    return [(r["id"], tok(r["prompt"], add_special_tokens=False)["input_ids"]) for r in picked]


@pytest.fixture(scope="module")
def decoder():
    from ddtree.model.checkpoint import load_drafter, load_target
    from ddtree.decode.decoder import Decoder

    cpu = torch.device("cpu")
    target, _ = load_target(str(FIXTURE / "target"), [cpu], torch.float32, 512)
    drafter, _ = load_drafter(str(FIXTURE / "drafter"), target, torch.float32, 512)
    assert drafter.cfg.mask_token_id == 1 and drafter.cfg.target_layer_ids == [1, 4, 5]
    assert drafter.cfg.block_size == 16
    return Decoder(target, drafter)


@pytest.fixture(scope="module")
def ar_outputs(decoder, prompts):
    stop = set(decoder.target.cfg.eos_token_ids)
    return {pid: decoder.generate(ids, "ar", max_new_tokens=NEW, stop_ids=stop).token_ids for pid, ids in prompts}


def test_ar_equals_transformers_greedy(prompts, ar_outputs):
    from transformers import Qwen3_5ForCausalLM

    from ddtree.model.synthetic import torch_gdn_paths

    hf = Qwen3_5ForCausalLM.from_pretrained(str(FIXTURE / "target"), dtype=torch.float32).eval()
    torch_gdn_paths(hf)  # the pure-torch reference (with fla installed transformers would call its kernels)
    for pid, ids in prompts:
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          do_sample=False, max_new_tokens=NEW, eos_token_id=0, pad_token_id=0)
        ref = out[0, len(ids):].tolist()
        assert ar_outputs[pid] == ref, f"{pid}: ar differs from transformers greedy"
        assert len(ref) == NEW or ref[-1] == 0


def test_greedy_small_tree_equals_ar(decoder, prompts, ar_outputs):
    """Greedy ddtree at budget 4 (a tree below the drafter's block; the larger budgets and dflash:
    test_greedy_ddtree_equals_ar_with_every_drafter) gives ar's tokens."""
    method, budget = "ddtree", 4
    stop = set(decoder.target.cfg.eos_token_ids)
    accepted = rounds = 0
    for pid, ids in prompts:
        rec = decoder.generate(ids, method, budget=budget, max_new_tokens=NEW, stop_ids=stop)
        assert rec.token_ids == ar_outputs[pid], f"{pid}: {method} {budget} differs from ar"
        assert sum(r.committed for r in rec.rounds) == rec.new_tokens - 1
        accepted += sum(r.accepted for r in rec.rounds)
        rounds += len(rec.rounds)
    # a trained drafter is accepted into (README: chain ~1.65, tree 32 ~2.23 tokens per round)
    assert 1 + accepted / rounds > 1.2


DRAFTERS = ("drafter", "drafter-distilled", "drafter-large")


@pytest.fixture(scope="module")
def drafter_decoders(decoder):
    """name -> a Decoder of the fixture's target with that drafter (loaded on first use; a target
    each: a Decoder sets its target's tap layers from its drafter; `drafter`: the decoder fixture's)."""
    from ddtree.model.checkpoint import load_drafter, load_target
    from ddtree.decode.decoder import Decoder

    made = {"drafter": decoder}

    def get(name):
        if name not in made:
            target, _ = load_target(str(FIXTURE / "target"), [torch.device("cpu")], torch.float32, 512)
            drafter, _ = load_drafter(str(FIXTURE / name), target, torch.float32, 512)
            made[name] = Decoder(target, drafter)
        return made[name]
    return get


@pytest.mark.parametrize("name", DRAFTERS)
def test_greedy_ddtree_equals_ar_with_every_drafter(fixture_dir, drafter_decoders, prompts, ar_outputs, name):
    """Greedy ddtree at budgets 8 / 15 / 16 / 31 / 32 / 64 (verifies on both sides of 16 and 32 nodes;
    the device pipeline) and dflash give ar's tokens with each of the fixture's drafters, each
    round's committed tokens summing to the generation's; the deeper trees accept at least as
    much as the chain does."""
    if not (fixture_dir / name / "config.json").is_file():
        pytest.skip(f"{fixture_dir / name} not found")
    dec = drafter_decoders(name)
    stop = set(dec.target.cfg.eos_token_ids)
    per_round = {}
    for method, budget in (("dflash", 1), *(("ddtree", b) for b in (8, 15, 16, 31, 32, 64))):
        committed = rounds = 0
        for pid, ids in prompts:
            rec = dec.generate(ids, method, budget=budget, max_new_tokens=NEW, stop_ids=stop)
            assert rec.token_ids == ar_outputs[pid], f"{pid}: {name} {method} {budget} differs from ar"
            assert sum(r.committed for r in rec.rounds) == rec.new_tokens - 1
            committed += sum(r.committed for r in rec.rounds)
            rounds += len(rec.rounds)
        per_round[budget] = committed / rounds
    assert per_round[64] >= per_round[8] > 1.2, per_round

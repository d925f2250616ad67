"""One TP rank's shard without a process group (what scripts/bench_tp_rank.py measures on one GPU):
it runs through Decoder.generate, and its weights are the bytes rank_bytes_per_token accounts for."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddtree.decode.decoder import Decoder
from ddtree.model.config import TargetConfig
from ddtree.model.synthetic import tiny_drafter_config, tiny_hybrid_config
from ddtree.parallel.comm import install_rank_stand_ins
from ddtree.parallel.sharding import random_drafter, random_target_shard, rank_bytes_per_token

W = 2
VOCAB = 96
PROMPT = [5, 17, 33, 2, 71, 9, 40, 12, 88, 3, 27, 64]


def _raw():
    return tiny_hybrid_config(vocab=VOCAB, heads=4, kv_heads=2, gdn_k_heads=2, gdn_v_heads=4, inter=96)


def test_hookless_shard_generates(one_thread):
    raw = _raw()
    target = random_target_shard(raw, 0, W, "cpu", torch.float32, 256, install_hooks=False)
    assert not dist.is_initialized()  # built and run without a process group
    install_rank_stand_ins(target, W)
    drafter = random_drafter(tiny_drafter_config(raw), target, "cpu", torch.float32, 256)
    # the stand-in gather gives the decoder full-vocab rows from this rank's V/W block
    assert target.lm_head.weight.shape[0] == VOCAB // W
    assert target.gather_logits(torch.zeros(3, VOCAB // W)).shape == (3, VOCAB)
    dec = Decoder(target, drafter, 256)
    for method in ("ar", "dflash", "ddtree"):
        rec = dec.generate(PROMPT, method=method, budget=8, max_new_tokens=12, seed=0)
        assert len(rec.token_ids) == 12, method
        assert all(0 <= t < VOCAB for t in rec.token_ids), method
        assert rec.rounds and rec.decode_s > 0, method
        if method == "ddtree":
            assert max(r.tree_size for r in rec.rounds) == 8  # full budget-8 trees were verified


@pytest.mark.parametrize("world", [1, 2])
def test_shard_weight_bytes_match_accounting(world):
    """The matrices a decode step reads (every weight of 2+ dims but the embedding, whose one row
    per token is negligible) add up to rank_bytes_per_token's weight figure."""
    raw = _raw()
    cfg = TargetConfig.from_dict(raw)
    shard = random_target_shard(raw, world - 1, world, "cpu", torch.float32, 16, install_hooks=False)
    counted = sum(p.numel() * p.element_size() for name, p in shard.named_parameters()
                  if p.dim() >= 2 and name != "embed_tokens.weight")
    acc = rank_bytes_per_token(cfg, world, dtype_bytes=4)
    assert counted == acc["weight_bytes"]
    assert acc["step_bytes"] == acc["weight_bytes"] + acc["state_bytes"]  # context 0: no K/V
    if world == 2:
        full = rank_bytes_per_token(cfg, 1, dtype_bytes=4, context=100)
        half = rank_bytes_per_token(cfg, 2, dtype_bytes=4, context=100)
        assert half["kv_bytes"] * 2 == full["kv_bytes"] > 0 and half["state_bytes"] * 2 == full["state_bytes"]

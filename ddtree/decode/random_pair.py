"""A tiny random target + drafter pair wired into a Decoder: the self-test's and the tests' model
(the random models themselves: ddtree.model.synthetic)."""

from __future__ import annotations

import torch

from ddtree.decode.decoder import Decoder
from ddtree.model.synthetic import (build_random_drafter, build_random_target, tiny_dense_config, tiny_drafter_config,
                                    tiny_hybrid_config)


def build_random_pair(kind="hybrid", seed=0, dtype=torch.float32, device="cpu", max_len=512, options=None, **kw):
    """A tiny random target + drafter pair wired into a Decoder (options: ddtree.options.Options)
    -> (the Decoder, the target's raw config)."""
    raw = tiny_hybrid_config(**kw) if kind == "hybrid" else tiny_dense_config(**kw)
    target = build_random_target(raw, device=device, dtype=dtype, seed=seed, max_len=max_len)
    draft = build_random_drafter(tiny_drafter_config(raw), target, device=device, dtype=dtype, seed=seed + 1, max_len=max_len)
    return Decoder(target, draft, options=options), raw

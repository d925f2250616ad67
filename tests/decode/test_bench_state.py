"""scripts/bench_engine.py's save_state / restore_state: every measurement of a context starts from
the prefilled state although only the rows a decode can write are copied (at 128K a whole copy
would not fit beside the 27B shapes on an 80 GB card)."""

from __future__ import annotations

import torch

from ddtree.decode.decoder import Prefilled
from ddtree.decode.random_pair import build_random_pair
from ddtree.decode.sampling import SamplingParams
from scripts.bench_engine import restore_state, save_state
from tests.helpers import tiny_cpu_each_test  # noqa: F401  (autouse)


def whole_state(dec) -> list[torch.Tensor]:
    t = dec.target
    xs = [dec.start_d]
    for g in t.gdn_groups.values():
        xs += [g.state, g.conv]
    for kc, vc in t.kv_stacks.values():
        xs += [kc, vc]
    xs.append(dec.drafter.ctx_len)
    for layer in dec.drafter.layers:
        xs += [layer.self_attn.k_cache, layer.self_attn.v_cache]
    return [x.clone() for x in xs]


def test_restore_gives_back_the_whole_prefilled_state_after_every_method():
    dec, _ = build_random_pair("hybrid", seed=3, max_len=512)
    L, n = 300, 24
    prompt = torch.randint(10, 90, (L,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy = SamplingParams()
    pre = dec.prefill(prompt, dec.job("ddtree", 16, greedy, n, 0, False, L))
    before = whole_state(dec)
    saved = save_state(dec, L, min(L + 2048, dec.max_len), margin=8)
    copied = sum(c.numel() for _, c in saved)
    ctx = int(dec.drafter.ctx_len)
    prefix = (sum(2 * kc[:, :L - 8].numel() for kc, _ in dec.target.kv_stacks.values())
              + sum(2 * a.k_cache[:ctx - 8].numel() for a in (layer.self_attn for layer in dec.drafter.layers)))
    assert ctx > L // 2 and copied <= sum(x.numel() for x in before) - prefix  # no K/V prefix is copied
    outs = {}
    for method, budget in (("ar", 1), ("dflash", 15), ("ddtree", 16), ("ar", 1)):
        restore_state(saved)
        rec = dec.decode(Prefilled(L, pre.bonus, pre.draft, pre.ttft_s, None),
                         dec.job(method, budget, greedy, n, 0, False, L))
        outs.setdefault(method, []).append(rec.token_ids)
        after = whole_state(dec)
        assert any(not torch.equal(a, b) for a, b in zip(after, before)), "the decode changed nothing: no test"
        restore_state(saved)
        for i, (a, b) in enumerate(zip(whole_state(dec), before)):
            assert torch.equal(a, b), f"state tensor {i} differs after restore ({method})"
    assert outs["ar"][0] == outs["ar"][1] == outs["ddtree"][0] == outs["dflash"][0]  # same start, greedy: same tokens

"""The prefill's fla route (GPU only) commits through its final state; check that plumbing on CPU
with a torch stand-in for fla's chunk kernel (the GPU test compares the real kernel)."""

import torch

from ddtree.ops import gdn
from ddtree.model.synthetic import build_random_target, tiny_hybrid_config


def _fake_fla(q, k, v, g, beta, S0):
    o, S = gdn.chain_recurrent(q, k, v, g, beta, S0)  # token by token: an independent twin
    return o, S


def test_prefill_through_fla_route_equals_torch_route(monkeypatch):
    raw = tiny_hybrid_config()
    a = build_random_target(raw, seed=3)
    b = build_random_target(raw, seed=3)
    toks = torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(0))
    la, _ = a.prefill(toks[:100], chunk=32)
    monkeypatch.setattr(gdn, "fla_chain", _fake_fla)
    lb, _ = b.prefill(toks[:100], chunk=32)
    monkeypatch.undo()
    assert (la - lb).abs().max() < 1e-4 * la.abs().max()
    for ga, gb in zip(a.gdn_groups.values(), b.gdn_groups.values()):
        assert (ga.state - gb.state).abs().max() < 1e-4 * ga.state.abs().max()
        assert (ga.conv - gb.conv).abs().max() < 1e-4 * ga.conv.abs().max()  # inputs differ by rounding
    # decoding on from both states agrees
    ra, _ = a.forward_chain(toks[100:130], 100)
    rb, _ = b.forward_chain(toks[100:130], 100)
    assert (ra - rb).abs().max() < 1e-4 * ra.abs().max()


def test_fla_is_not_used_on_cpu():
    q = torch.randn(5, 2, 4)
    assert gdn.fla_chain(q, q, torch.randn(5, 2, 3), -torch.rand(5, 2), torch.rand(5, 2), torch.zeros(2, 4, 3)) is None

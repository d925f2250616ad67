"""The prefill's fla route (GPU only) commits through its final state; check that plumbing on CPU
with a torch stand-in for fla's chunk kernel (the GPU test compares the real kernel)."""

import dataclasses

import pytest
import torch

from ddtree.model.synthetic import build_random_target, tiny_hybrid_config
from ddtree.ops import fla, gdn


def _fake_fla(q, k, v, g, beta, S0):
    o, S = gdn.chain_recurrent(q, k, v, g, beta, S0)  # token by token: an independent twin
    return o, S


def test_prefill_through_fla_route_equals_torch_route(monkeypatch):
    raw = tiny_hybrid_config()
    a = build_random_target(raw, seed=3)
    b = build_random_target(raw, seed=3)
    toks = torch.randint(0, 97, (150,), generator=torch.Generator().manual_seed(0))
    la, _ = a.prefill(toks[:100], chunk=32)
    b.kernels = {d: dataclasses.replace(k, fla=True) for d, k in b.kernels.items()}  # the fla route ...
    monkeypatch.setattr(fla, "fla_chain", _fake_fla)  # ... with a stand-in for the library's kernel
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
    assert fla.fla_chain(q, q, torch.randn(5, 2, 3), -torch.rand(5, 2), torch.rand(5, 2), torch.zeros(2, 4, 3)) is None


def test_chunked_chain_equals_token_by_token():
    """chain_chunked (the prefill twin of fla's kernel) against the token-by-token recurrence, for
    chunk sizes that divide the length and ones that do not."""
    g = torch.Generator().manual_seed(3)
    T, H, dk, dv = 150, 3, 8, 6
    q = gdn.l2norm(torch.randn(T, H, dk, generator=g)) * dk**-0.5
    k = gdn.l2norm(torch.randn(T, H, dk, generator=g))
    v = torch.randn(T, H, dv, generator=g)
    gg, beta = gdn.gdn_gates(torch.randn(T, H, generator=g), torch.randn(T, H, generator=g), torch.zeros(H), torch.zeros(H))
    S0 = torch.randn(H, dk, dv, generator=g) * 0.3
    ref_o, ref_S = gdn.chain_recurrent(q, k, v, gg, beta, S0)
    for chunk in (1, 7, 32, 150, 200):
        o, S = gdn.chain_chunked(q, k, v, gg, beta, S0, chunk)
        assert (o - ref_o).abs().max() < 1e-5 * ref_o.abs().max(), chunk
        assert (S - ref_S).abs().max() < 1e-5 * ref_S.abs().max(), chunk


def test_fla_out_of_memory_frees_the_cache_and_retries_then_falls_back(monkeypatch):
    """A long prefill can leave torch's cache holding the GPU's free memory, and Triton then fails
    to load fla's kernels ("out of memory"): the cache is handed back and the chunk retried once;
    if it fails again the chunk takes the torch twin (None), and other errors still raise."""
    from ddtree.ops import fla

    calls, freed = [], []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: freed.append(1))

    def flaky(fn, *a):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Triton Error [CUDA]: out of memory")
        return "ran"

    monkeypatch.setattr(fla, "_run", flaky)
    assert fla._run_with_room(None, *[None] * 6) == "ran" and len(calls) == 2 and freed == [1]

    monkeypatch.setattr(fla, "available", lambda *a: True)
    monkeypatch.setattr(fla, "_kernel", lambda: None)
    monkeypatch.setattr(fla, "_run", lambda *a: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory")))
    S0 = torch.zeros(2, 4, 4)
    assert fla.fla_chain(S0, S0, S0, S0, S0, S0) is None and freed == [1, 1]

    monkeypatch.setattr(fla, "_run", lambda *a: (_ for _ in ()).throw(ValueError("a bug, not memory")))
    with pytest.raises(ValueError):
        fla.fla_chain(S0, S0, S0, S0, S0, S0)

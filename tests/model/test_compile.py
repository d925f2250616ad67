"""The compiled layer path (torch.compile / inductor) against the eager reference twin.

On CPU inductor emits C++ (needs a compiler); on a GPU tests/test_gpu.py checks the
Triton kernels the same way inside CUDA graphs. fp32, fresh random inputs, tight tolerances.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from ddtree.decode.random_pair import build_random_pair

pytestmark = pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
    reason="torch.compile on CPU needs a C++ compiler (g++/clang++), none on PATH",
)


def _random_tree(T: int, gen: torch.Generator):
    parents = torch.tensor([-1] + [int(torch.randint(0, n, (1,), generator=gen)) for n in range(1, T)])
    mask = torch.eye(T, dtype=torch.bool)
    for n in range(1, T):
        mask[n] |= mask[parents[n]]
    depth = mask.sum(1) - 1
    return parents, mask, depth


@torch.no_grad()
def check_compiled_matches_eager(device: str, tol: float = 5e-5, split: bool = False):
    """Forward + commit through compiled layers vs eager on random trees (shared with test_gpu).

    tol is relative to the largest value: inductor fuses and reorders fp32 reductions (the q.k
    sums, norms), measured at 1e-6 to 1e-5 here; a wrong mask, view or state is off by O(1).

    split: give every layer a non-identity `reduce` (a copy), which selects the tensor-parallel
    form (two compiled halves per layer, the reduce eager between them)."""
    dec, raw = build_random_pair("hybrid", 5, device=device)
    tgt = dec.target
    if split:
        for layer in tgt.layers:
            layer.reduce = torch.clone
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, raw["text_config"]["vocab_size"], (23,), generator=gen).to(device)
    for T in (1, 9, 16, 1, 24):  # T = 1 specialised; T > 1 compiled once as static, then dynamic
        parents, mask, depth = (t.to(device) for t in _random_tree(T, gen))
        toks = torch.randint(2, raw["text_config"]["vocab_size"], (T,), generator=gen).to(device)
        outs = []
        for compiled in (False, True):
            tgt.reset()
            tgt.compile_layers = False
            tgt.prefill(prompt, want_taps=False)
            tgt.compile_layers = compiled
            start = torch.tensor(len(prompt), device=device)
            logits, _ = tgt.forward(toks, start + depth, mask, parents, start, len(prompt) + T, want_taps=False)
            node = int(torch.randint(0, T, (1,), generator=gen)) if not compiled else outs[0][2]
            path = torch.nonzero(mask[node]).flatten()
            path_nodes = torch.cat([path, path[-1:].expand(16 - len(path))])
            tgt.commit(path_nodes, torch.tensor(len(path), device=device), start)
            g = next(iter(tgt.gdn_groups.values()))
            kc = next(iter(tgt.kv_stacks.values()))[0]
            outs.append((logits, g.state.clone(), node, g.conv.clone(), kc[:, : len(prompt) + len(path)].clone()))
        (l0, s0, _, c0, k0), (l1, s1, _, c1, k1) = outs
        scale = l0.abs().max()
        assert (l0 - l1).abs().max() <= tol * scale, f"T={T}: logits differ"
        assert (s0 - s1).abs().max() <= tol * s0.abs().max(), f"T={T}: recurrent states differ"
        assert (c0 - c1).abs().max() <= tol * c0.abs().max(), f"T={T}: conv states differ"
        assert (k0 - k1).abs().max() <= tol * k0.abs().max(), f"T={T}: K cache differs"
    tgt.compile_layers = False


@pytest.mark.parametrize("split", [False, True], ids=["whole-layer", "tp-halves"])
def test_compiled_layers_match_eager_forward_and_commit(one_thread, split):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    check_compiled_matches_eager("cpu", split=split)
    # No graph breaks (each would leave eager kernels between compiled pieces), and one graph per
    # layer kind (GDN, attention) for T = 1 and one for every T > 1; under TP the mixer half has
    # those four and the MLP half (the same for both kinds) two.
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == (6 if split else 4)


@torch.no_grad()
def test_compiled_greedy_ddtree_equals_eager_ar(one_thread):
    dec, raw = build_random_pair("hybrid", 2)
    prompt = [int(t) for t in torch.randint(2, raw["text_config"]["vocab_size"], (11,),
                                             generator=torch.Generator().manual_seed(1))]
    ar = dec.generate(prompt, "ar", max_new_tokens=40)
    dec.compile = True  # the decoder turns the target's compiled layers on for its rounds
    for method, budget in (("ar", 1), ("dflash", 1), ("ddtree", 7), ("ddtree", 32)):
        rec = dec.generate(prompt, method, budget=budget, max_new_tokens=40)
        assert rec.token_ids == ar.token_ids, f"compiled {method} {budget} differs from eager ar"
    dec.compile = False


def _written(layer, c, T: int) -> list[torch.Tensor]:
    """What a layer's prefill chunk writes: a GDN layer's conv and recurrent states, an attention
    layer's K/V rows of the chunk (views)."""
    m = layer.mixer
    if layer.kind == "linear_attention":
        return [m.conv_state, m.rec_state]
    return [m.k_cache[c.start:c.start + T], m.v_cache[c.start:c.start + T]]


@torch.no_grad()
def check_compiled_prefill_matches_eager(device: str, tol: float = 5e-5):
    """A prompt prefilled in chunks of several lengths and offsets (16, 16, 9 tokens) through the
    compiled prefill layers, each layer's chunk checked against its eager twin on the same input
    and state: its output and what it writes (GDN states and conv window, K/V rows), tol relative
    to the largest value (shared with test_gpu). Then the compiled run's last logits against an
    eager run's, to the same tol (its taps only finite: they are checked layer by layer above).

    Per layer, since the tiny random model carries a rounding-level difference far: every layer's
    input nudged by 1e-7 of its largest value moves the taps by ~1e-4, eager against eager. The GDN layers' per-head norms (q/k's
    l2norm, the gated RMS norm of the recurrence's output) rescale heads far smaller than the
    largest value, so an error at the largest value's rounding becomes one at the head's own scale
    (one layer: x20 on the CPU). A layer's own compiled-vs-eager difference is float32 rounding
    (2e-6 on the CPU), a wrong mask, view or state O(1). The end-to-end check is kept where the
    amplification is small: the last logits."""
    import ddtree.model.target as tm

    dec, raw = build_random_pair("hybrid", 5, device=device)
    tgt = dec.target
    prompt = torch.randint(2, raw["text_config"]["vocab_size"], (41,), generator=torch.Generator().manual_seed(3))
    tgt.reset()
    want, _ = tgt.prefill(prompt.to(device), chunk=16)  # eager
    compiled_layer = tm.TargetModel._prefill_layer
    worst: dict[str, float] = {}

    def checked(self, i, x, c):
        layer = self.layers[i]
        before = [t.clone() for t in _written(layer, c, x.shape[0])]
        out = compiled_layer(self, i, x, c)
        after = [t.clone() for t in _written(layer, c, x.shape[0])]
        for t, v in zip(_written(layer, c, x.shape[0]), before):
            t.copy_(v)
        ref = tm._prefill_layer(layer, x, c)  # the eager twin, same input and state
        for name, a, b in [("output", out, ref)] + list(zip(("state 0", "state 1"), after, _written(layer, c, x.shape[0]))):
            e = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
            worst[f"layer {i} ({layer.kind}) {name}"] = max(worst.get(f"layer {i} ({layer.kind}) {name}", 0.0), e)
        for t, v in zip(_written(layer, c, x.shape[0]), after):
            t.copy_(v)  # on with the compiled state
        return out

    tgt.reset()
    tgt.compile_layers = True
    tm.TargetModel._prefill_layer = checked
    try:
        logits, taps = tgt.prefill(prompt.to(device), chunk=16)
    finally:
        tm.TargetModel._prefill_layer = compiled_layer
        tgt.compile_layers = False
    assert not tgt._prefill_compile_failed, "the compiled prefill fell back to eager layers"
    assert len(worst) == 3 * len(tgt.layers), worst
    bad = {k: f"{v:.1e}" for k, v in worst.items() if not v <= tol}
    assert not bad, f"compiled prefill layers differ from their eager twins: {bad}"
    assert (logits - want).abs().max() <= tol * want.abs().max(), "compiled prefill: last logits differ"
    assert torch.isfinite(taps).all()


def test_compiled_prefill_matches_eager(one_thread):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    check_compiled_prefill_matches_eager("cpu")
    # the chunk's own kernels (attention, the GDN chain) are left out on purpose: torch.compiler.disable
    breaks = {k: v for k, v in counters["graph_break"].items() if "disable" not in k.lower()}
    assert not breaks, breaks


@torch.no_grad()
def test_prefill_compile_failure_falls_back_to_eager(monkeypatch):
    """A compile error in the prefill, raised after a compiled piece already moved the layer's
    GDN states (as a graph break's resume function can), ends in the eager result: the states
    are restored, the layer rerun eagerly, and later layers stay eager."""
    import ddtree.model.target as target_mod

    dec, raw = build_random_pair("hybrid", 5)
    tgt = dec.target
    prompt = torch.randint(2, raw["text_config"]["vocab_size"], (41,), generator=torch.Generator().manual_seed(4))
    tgt.reset()
    want, want_taps = tgt.prefill(prompt, chunk=16)
    g = next(iter(tgt.gdn_groups.values()))
    want_state, want_conv = g.state.clone(), g.conv.clone()

    calls = []

    def broken():
        def run(layer, x, c):
            calls.append(layer.kind)
            for name in ("conv_state", "rec_state"):  # a compiled piece that ran before the failure
                t = getattr(layer.mixer, name, None)
                if t is not None:
                    t.add_(1.0)
            raise torch._dynamo.exc.TorchDynamoException("inductor broke")  # the base of dynamo / inductor errors
        return run

    monkeypatch.setattr(target_mod, "prefill_layer", broken)
    tgt.reset()
    tgt.compile_layers = True
    got, got_taps = tgt.prefill(prompt, chunk=16)
    tgt.compile_layers = False
    assert calls == [tgt.layers[0].kind], calls  # one failure, then eager for good
    assert tgt._prefill_compile_failed
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(got_taps, want_taps, rtol=0, atol=0)
    torch.testing.assert_close(g.state, want_state, rtol=0, atol=0)
    torch.testing.assert_close(g.conv, want_conv, rtol=0, atol=0)

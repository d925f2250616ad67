"""The Triton GDN kernels (ddtree.ops.gdn_step, gdn_tree, commit) against their torch twins: compiled on a GPU, and on
machines without one under Triton's interpreter on CPU tensors (the same kernel source; the
interpreter is switched on by tests/conftest.py)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton", reason="triton not installed (pip install triton): its interpreter runs these on CPU")

from ddtree.options import Options  # noqa: E402
from ddtree.ops import commit, gdn, gdn_tree  # noqa: E402
from ddtree.decode.random_pair import build_random_pair  # noqa: E402
from ddtree.model.synthetic import build_random_target, tiny_hybrid_config  # noqa: E402
from ddtree.ops.tree import ancestor_mask_from_parents  # noqa: E402
from helpers import MaxErrors, assert_rel, kernel_device, rel_err, tiny_cpu_each_test  # noqa: E402,F401

DEV = kernel_device()
ERR = MaxErrors()

# tiny: non-power-of-two dv (masked lanes), 2 value heads per key head; wide: the 27B layout
# (3 value heads per key head, power-of-two dims).
CONFIGS = {
    "tiny": dict(),
    "wide": dict(hidden=96, gdn_k_heads=2, gdn_v_heads=6, gdn_k_dim=32, gdn_v_dim=32),
}


FAST = Options(triton_on_cpu=True)  # the kernels (under the interpreter on CPU)
TORCH = Options(triton=False)  # their torch twins


def _one_node_step(model, start: int):
    z = torch.zeros(1, dtype=torch.long, device=DEV)
    return model.make_step(z + start, torch.ones(1, 1, dtype=torch.bool, device=DEV), z - 1,
                           torch.tensor(start, device=DEV), start + 1, DEV)


def _random_inputs(model, trial: int):
    g = torch.Generator().manual_seed(trial)
    group = next(iter(model.gdn_groups.values()))
    return (torch.randn(group.state.shape, generator=g) * 0.5, torch.randn(group.conv.shape, generator=g),
            torch.randn(1, model.cfg.hidden_size, generator=g))


def _run_step(model, inputs, fast: bool):
    """One decode token through layer 0's GDN mixer, torch path or kernel.
    -> (output, k, U, c scratch at node 0, ext rows)."""
    state, conv, x = inputs
    group = next(iter(model.gdn_groups.values()))
    group.state.copy_(state)
    group.conv.copy_(conv.to(model.dtype))
    for b in (group.kbuf, group.ubuf, group.cbuf, group.ebuf):
        b.fill_(float("nan"))  # what is not written shows up
    model.use(FAST if fast else TORCH)
    layer = model.layers[0].linear_attn
    o = layer(x.to(DEV, model.dtype), _one_node_step(model, 7))
    kb, ub, cb = (t[:, :1].clone() for t in layer.wy_bufs)
    return o, kb, ub, cb, layer.ext_buf[: layer.width].clone()


def _tree_parents(T: int, g_, shape: str = "random") -> torch.Tensor:
    """Parents of a tree of T nodes rooted at node 0: a random earlier node each ("random": bushy),
    or a "chain" or "star". The random draw is made for every shape, so that the generator's
    sequence after it does not depend on the shape."""
    parents = torch.tensor([-1] + [int(torch.randint(0, n, (1,), generator=g_)) for n in range(1, T)])
    if shape == "chain":
        return torch.arange(T) - 1
    if shape == "star":
        return torch.tensor([-1] + [0] * (T - 1))
    return parents


def _random_tree_step(model, layer, T: int, g_, shape: str = "random"):
    """A tree of T nodes (_tree_parents), random conv and recurrent states in `layer`, a random
    input: -> (mask, x, step) at committed length 4."""
    parents = _tree_parents(T, g_, shape)
    mask = ancestor_mask_from_parents(parents).to(DEV)
    x = torch.randn(T, model.cfg.hidden_size, generator=g_).to(DEV)
    layer.conv_state.copy_(torch.randn(layer.conv_state.shape, generator=g_))
    layer.rec_state.copy_(torch.randn(layer.rec_state.shape, generator=g_) * 0.5)
    s = model.make_step(4 + mask.sum(1) - 1, mask, parents.to(DEV), torch.tensor(4, device=DEV), 4 + T, DEV)
    return mask, x, s


@functools.lru_cache(maxsize=None)
def _torch_path_tokens(prompt_seed: int, method: str, budget) -> list[int]:
    """Greedy tokens of the random hybrid pair (seed 3) on the torch path, every op on its twin:
    what each whole-decoder test's kernels must give (made once per worker and reused)."""
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(prompt_seed)).tolist()
    dec, _ = build_random_pair("hybrid", seed=3, device=DEV, options=TORCH)
    return dec.generate(prompt, method, budget=budget, max_new_tokens=12).token_ids


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_step_kernel_matches_torch_path(cfg):
    """float32: output, the commit scratch (k, U, c) and the conv rows equal the torch path's."""
    model = build_random_target(tiny_hybrid_config(**CONFIGS[cfg]), seed=4, device=DEV)
    for trial in range(3):
        inputs = _random_inputs(model, trial)
        ref = _run_step(model, inputs, False)
        got = _run_step(model, inputs, True)
        for name, a, b in zip(("out", "k", "U", "c", "ext"), got, ref):
            assert not a.isnan().any(), f"{name}: not written"
            ERR.note(f"step {name}", assert_rel(a, b, 1e-5 if name != "ext" else 1e-30, name))


@pytest.mark.skipif(DEV.type != "cuda", reason="bf16 roundings need the GPU: Triton's CPU interpreter truncates to bf16")
@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_step_kernel_bf16_as_close_to_fp32_as_torch_path(cfg):
    """bfloat16: the kernel rounds where the torch path rounds, so against the same model run in
    float32 it is as accurate as the torch path (mean over trials, within 25%)."""
    raw = tiny_hybrid_config(**CONFIGS[cfg])
    m16 = build_random_target(raw, seed=4, device=DEV, dtype=torch.bfloat16)
    m32 = build_random_target(raw, seed=4, device=DEV)
    for a, b in zip(m32.parameters(), m16.parameters()):
        a.copy_(b.float())  # the same (bf16-valued) weights
    m32.prepare()
    e_torch, e_kernel = [], []
    for trial in range(8):
        inputs = _random_inputs(m16, trial)
        inputs = (inputs[0], inputs[1].to(torch.bfloat16).float(), inputs[2].to(torch.bfloat16).float())
        truth = _run_step(m32, inputs, False)[0]
        e_torch.append(rel_err(_run_step(m16, inputs, False)[0], truth))
        e_kernel.append(rel_err(_run_step(m16, inputs, True)[0], truth))
    mt, mk = sum(e_torch) / len(e_torch), sum(e_kernel) / len(e_kernel)
    ERR.note("step bf16 kernel vs fp32", mk)
    ERR.note("step bf16 torch vs fp32", mt)
    assert mk <= 1.25 * mt, f"bf16 kernel error {mk:.3g} vs torch path {mt:.3g} (both against float32)"


@pytest.mark.parametrize("cfg", sorted(CONFIGS))
def test_commit_kernel_matches_commit_states(cfg):
    """The state pass over a random tree's accepted path, batched over layers, vs commit_states_."""
    model = build_random_target(tiny_hybrid_config(**CONFIGS[cfg]), seed=5, device=DEV)
    group = next(iter(model.gdn_groups.values()))
    L, H, dk, dv = group.state.shape
    g = torch.Generator().manual_seed(1)
    for T in (1, 5, 17):
        parents = _tree_parents(T, g)
        mask = ancestor_mask_from_parents(parents).to(DEV)
        for b in (group.kbuf, group.ubuf):
            b.copy_(torch.randn(b.shape, generator=g))
        group.cbuf.copy_(-torch.rand(group.cbuf.shape, generator=g).cumsum(-1))
        S0 = torch.randn(L, H, dk, dv, generator=g).to(DEV)
        for node in {0, T // 2, T - 1}:
            path = mask[node].nonzero()[:, 0]  # root first (ancestors have smaller indices)
            n = torch.tensor(path.shape[0], device=DEV)
            padded = torch.cat([path, path[-1:].expand(16 - path.shape[0])])  # as the walk pads it
            ref = gdn.commit_states_(S0.clone(), *group.wy(T), torch.tensor(node, device=DEV), mask)
            got = commit.gdn_commit_(S0.clone(), *group.wy(T), padded, n)
            ERR.note("commit", assert_rel(got, ref, 1e-6, f"T={T} node={node}"))


@pytest.mark.slow
@pytest.mark.parametrize("method,budget", [("ar", 1), ("dflash", 1), ("ddtree", 8), ("ddtree", "auto")])
def test_decoding_through_the_kernels_equals_torch_path(monkeypatch, method, budget):
    """Whole decoders: greedy tokens with the kernels (AR steps fused, every commit through the
    kernel, every tree verify's GDN prologue in Triton (inside the one-tile tree kernel up to its
    tile, ahead of the blocked one past it), ddtree's trees built by the tree kernel, every walk in
    the walk kernel) equal the torch path's."""
    from ddtree.decode import auto
    from ddtree.decode import decoder as decoding
    from helpers import forced_chooser

    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    kernel_trees, kernel_walks = [], []
    real, real_walk = decoding.build_tree_kernel, decoding.walk_kernel  # spies: which kernels ran
    monkeypatch.setattr(decoding, "build_tree_kernel", lambda *a, **k: kernel_trees.append(1) or real(*a, **k))
    monkeypatch.setattr(decoding, "walk_kernel", lambda *a, **k: kernel_walks.append(1) or real_walk(*a, **k))
    prologues = []
    for name in ("gdn_tree_prologue", "gdn_prologue"):  # the one-tile kernel with it inside; the one ahead of the blocked
        monkeypatch.setattr(gdn_tree, name, (lambda real: lambda *a, **k: prologues.append(1) or real(*a, **k))(
            getattr(gdn_tree, name)))

    def tokens(options):
        dec, _ = build_random_pair("hybrid", seed=3, device=DEV, options=options)
        if budget == "auto":  # on a GPU the timed choice may be plain steps throughout: force trees in
            dec.chooser_class = forced_chooser()
            # the forced choice reads no timing: the calibration's verifies run once each, not 4 times
            monkeypatch.setattr(auto, "timed_ms", lambda dec, fn: (fn(), 1.0)[1])
        return dec.generate(prompt, method, budget=budget, max_new_tokens=12).token_ids

    got = tokens(FAST)
    # the torch path's tokens: under auto through the same forced switches, else the shared reference
    assert got == (tokens(TORCH) if budget == "auto" else _torch_path_tokens(2, method, budget))
    assert bool(kernel_trees) == (method == "ddtree")  # ddtree builds its trees in the tree kernel
    assert kernel_walks  # every method walks its verified tree in the walk kernel
    assert bool(prologues) == (method != "ar")  # every tree verify's prologue in Triton (default tree_prologue)


TREE_KERNELS = {
    "gdn_tree": lambda *a: gdn_tree.gdn_tree(*a),  # tile_root's rule: 17 / 33 / 65 nodes fold the root
    "gdn_tree_root": lambda *a: gdn_tree.gdn_tree(*a, root=True),
    "gdn_tree_noroot": lambda *a: gdn_tree.gdn_tree(*a, root=False),
    "gdn_tree_blocked": lambda *a: gdn_tree.gdn_tree_blocked(*a),  # block_nodes' and fold_root's rules
    "gdn_tree_blocked16": lambda *a: gdn_tree.gdn_tree_blocked(*a, block=16, root=False),
    "gdn_tree_blocked16_root": lambda *a: gdn_tree.gdn_tree_blocked(*a, block=16, root=True),
    "gdn_tree_blocked64": lambda *a: gdn_tree.gdn_tree_blocked(*a, block=64, root=False),
    "gdn_tree_blocked64_root": lambda *a: gdn_tree.gdn_tree_blocked(*a, block=64, root=True),
    "gdn_tree_blocked64_unrolled": lambda *a: gdn_tree.gdn_tree_blocked(*a, block=64, root=False, loop=False),
    "gdn_tree_blocked16_chunk16": lambda *a: gdn_tree.gdn_tree_blocked(*a, block=16, root=False, chunk=16),
    "gdn_tree_blocked16_root_chunk16": lambda *a: gdn_tree.gdn_tree_blocked(*a, block=16, root=True, chunk=16),
}


# (nodes, shape) of each tree the kernels verify: "random" a random earlier parent per node (bushy);
# at each tile edge (16, 32, 64) one size short of it, the edge and one over, one shape each.
TREE_SIZES = ((1, "random"), (2, "random"), (3, "random"), (9, "star"), (15, "chain"), (16, "star"),
              (17, "random"), (31, "star"), (32, "chain"), (33, "random"), (50, "random"), (63, "random"),
              (64, "star"), (65, "chain"))


@pytest.mark.parametrize("kernel", list(TREE_KERNELS))
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_tree_kernel_matches_tree_wy(cfg, kernel):
    """The tree-verify kernel (whole tiles, with or without the root folded into the state first;
    by blocks of 16 or 64 nodes, the first pass per block
    or per head (its squarings unrolled or in a loop), its key products in chunks of the default width or of 16 channels, with or
    without the root folded into the state first) against gdn.tree_wy on
    trees of 1..65 nodes rooted at node 0: every size around 16, 32 and 64 (a block one short,
    full, one over: with the root folded 17 / 33 / 65 are whole blocks; 65 in blocks of 64 without
    the fold: the per-head pass's cross terms), chains, stars and bushy trees at each edge (TREE_SIZES),
    with the strided q / k / v views the layer passes (at 17 / 33 / 65 q contiguous: a row stride
    of its own): outputs and commit scratch."""
    model = build_random_target(tiny_hybrid_config(**CONFIGS[cfg]), seed=1, device=DEV)
    layer = next(m for m in model.layers if hasattr(m.mixer, "wy_bufs")).mixer
    g_ = torch.Generator().manual_seed(5)
    for T, shape in TREE_SIZES:
        parents = _tree_parents(T, g_, shape)
        mask = ancestor_mask_from_parents(parents).to(DEV)
        x = torch.randn(T, model.cfg.hidden_size, generator=g_).to(DEV)
        s = model.make_step(4 + mask.sum(1) - 1, mask, parents.to(DEV), torch.tensor(4, device=DEV), 4 + T, DEV)
        q, k, v, g, beta, z, ext = layer.qkvgb(x, s)
        if T in (17, 33, 65):  # q with its own row stride (k stays a view of the layer's buffer)
            q = q.contiguous()
            assert q.stride(0) != k.stride(0)
        S0 = torch.randn(layer.rec_state.shape, generator=g_).to(DEV) * 0.5
        scratch = [torch.zeros(layer.hv, T, d, device=DEV) for d in (layer.dk, layer.dv)] + [torch.zeros(layer.hv, T, device=DEV)]
        o_ref, _ = gdn.tree_wy(q, k, v, g, beta, S0, mask, out=scratch)
        got = [torch.full_like(t, float("nan")) for t in scratch]  # what is not written shows up
        o = TREE_KERNELS[kernel](q, k, v, g, beta, S0, mask, got)
        ERR.note(f"{kernel} verify", assert_rel(o, o_ref, 1e-5, f"T={T}"))
        for a_, b_ in zip(got, scratch):
            ERR.note(f"{kernel} verify scratch", assert_rel(a_, b_, 1e-5, f"T={T}"))


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_tree_prologue_kernel_matches_torch_prologue(cfg):
    """The tree kernel with the layer's prologue inside (tree convolution + SiLU from the conv
    inputs, q/k l2 norms, head repeat, gates from the projection) against qkvgb + tree_wy on random
    trees and random conv states, with and without the root folded into the state first: outputs,
    commit scratch, and the whole mixer's output."""
    model = build_random_target(tiny_hybrid_config(**CONFIGS[cfg]), seed=2, device=DEV)
    layer = next(m for m in model.layers if hasattr(m.mixer, "wy_bufs")).mixer
    g_ = torch.Generator().manual_seed(6)
    for T, shape in ((1, "random"), (2, "random"), (3, "random"), (9, "random"), (15, "star"), (16, "chain"),
                     (17, "random"), (31, "random"), (32, "star"), (33, "random")):  # 16: the DFlash block
        mask, x, s = _random_tree_step(model, layer, T, g_, shape)
        q, k, v, g, beta, z, ext = layer.qkvgb(x, s)
        scratch = [torch.zeros(layer.hv, T, d, device=DEV) for d in (layer.dk, layer.dv)] + [torch.zeros(layer.hv, T, device=DEV)]
        o_ref, _ = gdn.tree_wy(q, k, v, g, beta, layer.rec_state, mask, out=scratch)
        ref = [t.clone() for t in scratch]
        proj = layer.in_proj(x)
        for root in (None, True, False):  # tile_root's rule (17, 33: folded), always, never
            got = [torch.full_like(t, float("nan")) for t in scratch]  # what is not written shows up
            o = gdn_tree.gdn_tree_prologue(layer, proj, ext.clone(), s.window, layer.rec_state, mask, got, root=root)
            ERR.note("tree prologue", assert_rel(o, o_ref, 1e-5, f"T={T} root={root}"))
            for a, b in zip(got, ref):
                ERR.note("tree prologue scratch", assert_rel(a, b, 1e-5, f"T={T} root={root}"))
        want = layer.forward(x, s)  # the torch prologue (the model's default Kernels on CPU: no kernels) ...
        ERR.note("tree prologue mixer", assert_rel(layer._tree_fused(x, s), want, 1e-5, f"T={T}"))


@pytest.mark.parametrize("T,hv,dv", [(1, 2, 16), (17, 48, 128), (33, 6, 24), (65, 3, 100)])
def test_gated_norm_kernel_matches_gated_rms_norm(T, hv, dv):
    """The verify's gated norm kernel (ddtree.ops.gated_norm) against GatedRMSNorm on random
    outputs, gates and weights (z a column slice of a wider projection, as in a layer; dv 24 and
    100: masked lanes): float32 to rounding; in bfloat16 it rounds where the module rounds, so
    against the float32 result it is as accurate as the module in bfloat16 (within 25%)."""
    from ddtree.model.layers import GatedRMSNorm
    from ddtree.ops.gated_norm import gated_norm

    g_ = torch.Generator().manual_seed(T * 1000 + dv)
    w = torch.randn(dv, generator=g_) * 0.5 + 1.0
    o = (torch.randn(T, hv, dv, generator=g_) * 3.0).to(DEV)
    proj = torch.randn(T, 7 + hv * dv + 5, generator=g_).to(DEV)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        norm = GatedRMSNorm(dv, 1e-6).to(DEV, dtype)
        with torch.no_grad():
            norm.weight.copy_(w.to(dtype).float())  # the same (bf16-valued) weights in both dtypes
        z = proj.to(dtype)[:, 7 : 7 + hv * dv]
        got = gated_norm(o, z, norm.weight, norm.eps, dtype)
        want = norm(o.to(dtype), z.reshape(T, hv, dv)).reshape(T, hv * dv)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        out[dtype] = got, want
    ERR.note("gated norm fp32", assert_rel(*out[torch.float32], 1e-6, f"T={T}"))
    got, want = out[torch.bfloat16]
    # the float32 path on bf16-valued inputs: the truth both bf16 results are measured against
    norm = GatedRMSNorm(dv, 1e-6).to(DEV)
    with torch.no_grad():
        norm.weight.copy_(w.to(torch.bfloat16).float())
    z16 = proj.to(torch.bfloat16).float()[:, 7 : 7 + hv * dv]
    truth = norm(o.to(torch.bfloat16).float(), z16.reshape(T, hv, dv)).reshape(T, hv * dv)
    ek, et = rel_err(got, truth), rel_err(want, truth)
    ERR.note("gated norm bf16 kernel vs fp32", ek)
    if DEV.type == "cuda":
        assert 0 < ek <= 1.25 * et, f"T={T}: bf16 kernel error {ek:.3g} vs the module's {et:.3g} (both against float32)"
    else:  # Triton's interpreter casts to bf16 by truncation, not rtne: each of the 4 roundings may be 1 ulp off
        ulp = torch.finfo(torch.bfloat16).eps * want.float().abs()
        assert ((got.float() - want.float()).abs() <= 4 * ulp).all(), f"T={T}: more than 4 ulp from the module"


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_prologue_kernel_matches_qkvgb(cfg):
    """The blocked verify's prologue kernel (gdn_tree.gdn_prologue: tree convolution + SiLU, q/k
    l2 norms, head repeat, gates from the projection) against qkvgb on random trees of one to five
    16-node blocks (63 / 64 / 65 nodes: around the per-head pass's 64-node block, 64 a star) and
    random conv states; and the whole mixer through the Triton prologue path
    (_tree_fused: past 32 nodes here the prologue kernel and the blocks) against the torch path."""
    import dataclasses

    from ddtree.ops.dispatch import resolve

    model = build_random_target(tiny_hybrid_config(**CONFIGS[cfg]), seed=2, device=DEV)
    layer = next(m for m in model.layers if hasattr(m.mixer, "wy_bufs")).mixer
    g_ = torch.Generator().manual_seed(7)
    fast = resolve(FAST, DEV)
    for T in (2, 16, 17, 33, 50, 63, 64, 65):
        parents = _tree_parents(T, g_, "star" if T == 64 else "random")  # 64: the per-head pass's whole block
        mask = ancestor_mask_from_parents(parents).to(DEV)
        x = torch.randn(T, model.cfg.hidden_size, generator=g_).to(DEV)
        layer.conv_state.copy_(torch.randn(layer.conv_state.shape, generator=g_))
        layer.rec_state.copy_(torch.randn(layer.rec_state.shape, generator=g_) * 0.5)
        s = model.make_step(4 + mask.sum(1) - 1, mask, parents.to(DEV), torch.tensor(4, device=DEV), 4 + T, DEV)
        want = layer.qkvgb(x, s)[:5]
        proj, ext = layer.project(x)
        for name, a, b in zip("q k v g beta".split(), gdn_tree.gdn_prologue(layer, proj, ext, s.window), want):
            assert a.shape == b.shape, name
            ERR.note("prologue kernel", assert_rel(a, b.float(), 1e-5, f"{name} T={T}"))
        fused = dataclasses.replace(s, kernels=fast)
        assert fast.prologue(T, layer.dk) and fast.blocked(T, layer.dk) == (T > 33)  # (auto's one tile here: 32 nodes after a folded root)
        ERR.note("prologue kernel mixer", assert_rel(layer._tree_fused(x, fused), layer.forward(x, s), 1e-5, f"T={T}"))


@pytest.mark.parametrize("width", [3])  # (4, the models' width: every other prologue test)
def test_prologue_kernels_at_any_conv_width(width):
    """Both prologues (the blocked path's kernel and the one tile's) against qkvgb + tree_wy with
    a conv window of `width` taps: _conv_rows sums v's taps as a tensor padded to a power of two
    (width 3: one masked tap), q's and k's tap by tap; float32, random trees of 3 and 17 nodes."""
    cfg = tiny_hybrid_config()
    cfg["text_config"]["linear_conv_kernel_dim"] = width
    model = build_random_target(cfg, seed=2, device=DEV)
    layer = next(m for m in model.layers if hasattr(m.mixer, "wy_bufs")).mixer
    assert layer.width == width
    g_ = torch.Generator().manual_seed(8)
    for T in (3, 17):
        mask, x, s = _random_tree_step(model, layer, T, g_)
        q, k, v, g, beta, _, ext = layer.qkvgb(x, s)
        proj = layer.in_proj(x)
        for name, a, b in zip("q k v g beta".split(), gdn_tree.gdn_prologue(layer, proj, ext.clone(), s.window),
                              (q, k, v, g, beta)):
            ERR.note("prologue kernel", assert_rel(a, b.float(), 1e-5, f"{name} width={width} T={T}"))
        scratch = [torch.zeros(layer.hv, T, d, device=DEV) for d in (layer.dk, layer.dv)] + [torch.zeros(layer.hv, T, device=DEV)]
        o_ref, _ = gdn.tree_wy(q, k, v, g, beta, layer.rec_state, mask, out=scratch)
        o = gdn_tree.gdn_tree_prologue(layer, proj, ext.clone(), s.window, layer.rec_state, mask, scratch)
        ERR.note("tree prologue", assert_rel(o, o_ref, 1e-5, f"width={width} T={T}"))


@pytest.mark.parametrize("method,budget", [("dflash", 1), ("ddtree", 8)])
def test_decoding_through_the_tree_kernel_equals_torch_path(monkeypatch, method, budget):
    """Whole decoders with every tree verify's GDN recurrence in the kernel: greedy tokens
    equal the torch path's (tree_wy), and the kernel was used."""
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    calls, real = [], gdn_tree.gdn_tree
    monkeypatch.setattr(gdn_tree, "gdn_tree", lambda *a, **k: calls.append(1) or real(*a, **k))  # a spy
    # every size up to 128 nodes in the kernel (the prologue kernel off: this test is about gdn_tree)
    dec, _ = build_random_pair("hybrid", seed=3, device=DEV, options=FAST.replace(tree_kernel="on", tree_prologue=0))
    toks = dec.generate(prompt, method, budget=budget, max_new_tokens=12).token_ids
    assert toks == _torch_path_tokens(2, method, budget) and calls


@pytest.mark.slow
@pytest.mark.parametrize("prologue", [65, 0], ids=["prologue-kernel", "torch-prologue"])
def test_decoding_through_the_blocked_kernel_equals_torch_path(monkeypatch, prologue):
    """A 41-node tree (budget 40: past auto's one-tile sizes at this model's dk 8) verified by the
    blocked kernel in every GDN layer (on CPU, and on Hopper, one 64-node block; 16-node blocks
    elsewhere), after the prologue kernel or the torch prologue: greedy tokens equal the torch
    path's, and the kernels were used."""
    prompt = torch.randint(0, 97, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    calls, pro, real, real_pro = [], [], gdn_tree.gdn_tree_blocked, gdn_tree.gdn_prologue
    monkeypatch.setattr(gdn_tree, "gdn_tree_blocked", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))  # spies
    monkeypatch.setattr(gdn_tree, "gdn_prologue", lambda *a, **k: pro.append(a[1].shape[0]) or real_pro(*a, **k))
    dec, _ = build_random_pair("hybrid", seed=3, device=DEV, options=FAST.replace(tree_prologue=prologue))
    toks = dec.generate(prompt, "ddtree", budget=40, max_new_tokens=12).token_ids
    assert toks == _torch_path_tokens(4, "ddtree", 40) and calls and set(calls) == {41}
    assert set(pro) == ({41} if prologue else set())


@pytest.mark.parametrize("P,W", [(1, 128), (16, 128), (16, 1024), (4, 40), (7, 128)])
def test_kv_commit_kernel_matches_index_copy(P, W):
    """The attention K/V commit kernel against index_select + index_copy_ on random paths whose
    source rows overlap their destinations (node i's destination may be node j's source), bit-exact."""
    g_ = torch.Generator().manual_seed(P + W)
    L, max_len, hd = 3, 80, 8
    for trial in range(4):
        k = torch.randn(L, max_len, W // hd, hd, generator=g_).to(DEV, torch.bfloat16)
        v = torch.randn(L, max_len, W // hd, hd, generator=g_).to(DEV, torch.bfloat16)
        n = int(torch.randint(1, P + 1, (1,), generator=g_))
        nodes = torch.sort(torch.randperm(2 * P, generator=g_)[:n]).values  # ascending, as a tree's path is
        path = torch.cat([nodes, nodes[-1:].expand(P - n)]).to(DEV)  # padded with the last node
        start = torch.tensor(5 + trial, device=DEV)
        ref = []
        for c in (k.clone(), v.clone()):
            dst = start + torch.arange(P, device=DEV)
            c.index_copy_(1, dst, c.index_select(1, start + path))
            ref.append(c)
        commit.kv_commit_(k, v, path, start)
        assert torch.equal(k, ref[0]) and torch.equal(v, ref[1])


@pytest.mark.parametrize("T,C", [(1, 40), (17, 96), (5, 1500)])
def test_conv_commit_kernel_matches_index_select(T, C):
    """The conv pass of a commit against GDNGroup.commit's index_selects: every layer's conv rows
    become the newest inputs on the path of the walked path's last node (random trees, every n), bit-exact."""
    from ddtree.ops.gdn import conv_window_index

    g_ = torch.Generator().manual_seed(T * C)
    L, hist, cap = 3, 3, 20
    for trial in range(4):
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g_)) for i in range(1, T)])
        window = conv_window_index(parents, hist + 1).to(DEV)
        ebuf = torch.randn(L, hist + cap, C, generator=g_).to(DEV, torch.bfloat16)
        ext = ebuf[:, : hist + T]  # the group's view
        conv = torch.randn(L, hist, C, generator=g_).to(DEV, torch.bfloat16)
        P = 4
        last = int(torch.randint(0, T, (1,), generator=g_))
        n = int(torch.randint(1, P + 1, (1,), generator=g_))
        path = torch.full((P,), last, dtype=torch.long)
        path[: n - 1] = torch.randint(0, T, (n - 1,), generator=g_)  # only path[n - 1] may matter
        path, n_d = path.to(DEV), torch.tensor(n, device=DEV)
        ref = ext.index_select(1, window[last, 1:])
        commit.conv_commit_(conv, ext, window, path, n_d)
        assert torch.equal(conv, ref), (T, C, trial)


def test_report_max_errors():
    ERR.report("gdn kernels")

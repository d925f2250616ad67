"""The GDN tree math alone: tree-WY recurrence vs the parent-reload and chain references (and
transformers' own recurrent / chunked gated delta rule), tree convolution vs the per-path reference."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from ddtree.ops import gdn
from ddtree.ops.tree import ancestor_mask_from_parents
from helpers import tiny_cpu_each_test  # noqa: F401 (autouse fixture)
from helpers import MaxErrors, assert_rel, random_parents

H, DK, DV = 3, 8, 5
TOL = 1e-5  # relative to the largest reference magnitude, float32
MAX_ERR = MaxErrors()
_note = MAX_ERR.note


def rand_inputs(T: int, seed: int, decay: str = "mixed", heads: int = H):
    """Random GDN inputs in the model's conventions: q, k l2-normalised (q scaled), g <= 0, beta in (0, 1)."""
    g_ = torch.Generator().manual_seed(seed)
    q = gdn.l2norm(torch.randn(T, heads, DK, generator=g_)) * DK**-0.5
    k = gdn.l2norm(torch.randn(T, heads, DK, generator=g_))
    v = torch.randn(T, heads, DV, generator=g_)
    if decay == "strong":  # a_t = exp(g) down to ~e^-30
        g = -torch.rand(T, heads, generator=g_) * 30.0
    elif decay == "weak":
        g = -torch.rand(T, heads, generator=g_) * 0.05
    else:  # log-uniform over 1e-3 .. 20, plus some exact zeros (no decay)
        g = -torch.exp(torch.empty(T, heads).uniform_(-7, 3, generator=g_))
        g[torch.rand(T, heads, generator=g_) < 0.1] = 0.0
    beta = torch.rand(T, heads, generator=g_).clamp(0.02, 0.98)
    S0 = torch.randn(heads, DK, DV, generator=g_) * 2.0
    return q, k, v, g, beta, S0


TREE_CASES = [  # (kind, T, seed, decay)
    ("chain", 1, 0, "mixed"),
    ("chain", 16, 1, "mixed"),
    ("chain", 128, 2, "weak"),
    ("star", 9, 3, "mixed"),
    ("star", 64, 4, "strong"),
    ("deep", 48, 5, "weak"),
    ("deep", 128, 6, "mixed"),
    ("bushy", 40, 7, "mixed"),
    ("bushy", 128, 8, "strong"),
    ("random", 33, 9, "weak"),
    ("random", 128, 10, "mixed"),
    ("random", 100, 11, "strong"),
]


@pytest.mark.parametrize("kind,T,seed,decay", TREE_CASES)
def test_tree_wy_matches_parent_reload(kind, T, seed, decay):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    parents = torch.tensor(random_parents(kind, T, rng))
    pm = ancestor_mask_from_parents(parents)
    q, k, v, g, beta, S0 = rand_inputs(T, seed, decay)

    o, (kk, U, c) = gdn.tree_wy(q, k, v, g, beta, S0, pm)
    o_ref, states = gdn.tree_parent_reload(q, k, v, g, beta, S0, parents)
    assert o.dtype == torch.float32 and o.shape == (T, H, DV)
    _note("tree_wy output", assert_rel(o, o_ref, TOL, "tree_wy outputs vs parent reload"))

    nodes = sorted({0, T - 1, *rng.sample(range(T), min(T, 12))})
    for n in nodes:
        S = gdn.commit_state(S0, kk, U, c, torch.tensor(n), pm)
        assert S.shape == (H, DK, DV)
        _note("commit_state", assert_rel(S, states[n], TOL, f"commit_state(node {n})"))


@pytest.mark.parametrize("T,seed,decay", [(1, 0, "mixed"), (7, 1, "strong"), (64, 2, "mixed"), (128, 3, "weak")])
def test_chain_case_matches_chain_recurrent(T, seed, decay):
    torch.manual_seed(seed)
    q, k, v, g, beta, S0 = rand_inputs(T, seed, decay)
    pm = torch.ones(T, T, dtype=torch.bool).tril()
    o, (kk, U, c) = gdn.tree_wy(q, k, v, g, beta, S0, pm)
    o_ref, S_ref = gdn.chain_recurrent(q, k, v, g, beta, S0)
    _note("chain output", assert_rel(o, o_ref, TOL, "tree_wy chain vs chain_recurrent"))
    S = gdn.commit_state(S0, kk, U, c, torch.tensor(T - 1), pm)
    _note("chain state", assert_rel(S, S_ref, TOL, "final state"))
    # and the middle of the chain: state after token t == chain over the first t+1 tokens
    t = T // 2
    _, S_mid = gdn.chain_recurrent(q[: t + 1], k[: t + 1], v[: t + 1], g[: t + 1], beta[: t + 1], S0)
    assert_rel(gdn.commit_state(S0, kk, U, c, torch.tensor(t), pm), S_mid, TOL, "mid-chain state")


@pytest.mark.parametrize("T,seed,k_heads", [(1, 0, 3), (9, 1, 1), (37, 2, 3), (70, 3, 1)])
def test_chain_matches_transformers_gated_delta_rule(T, seed, k_heads):
    """transformers' token-by-token and chunked (chunk 64) torch references, incl. GQA in GDN
    (fewer q/k heads than value heads, repeat_interleave'd). Their torch functions themselves:
    transformers wraps them to call fla when it imports (fla's Triton kernels need a GPU), unless
    an earlier test's hf_reference already swapped the module's globals (torch_gdn_paths)."""
    import inspect

    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_mod

    torch_chunk_gated_delta_rule = inspect.unwrap(hf_mod.torch_chunk_gated_delta_rule)
    torch_recurrent_gated_delta_rule = inspect.unwrap(hf_mod.torch_recurrent_gated_delta_rule)

    torch.manual_seed(seed)
    g_ = torch.Generator().manual_seed(seed)
    qn = gdn.l2norm(torch.randn(T, k_heads, DK, generator=g_))  # unscaled: transformers scales
    kn = gdn.l2norm(torch.randn(T, k_heads, DK, generator=g_))
    v = torch.randn(T, H, DV, generator=g_)
    g = -torch.exp(torch.empty(T, H).uniform_(-5, 2, generator=g_))
    beta = torch.rand(T, H, generator=g_)
    S0 = torch.randn(H, DK, DV, generator=g_)
    rep = H // k_heads

    o_hf, S_hf = torch_recurrent_gated_delta_rule(
        qn[None], kn[None], v[None], g[None], beta[None], initial_state=S0[None].clone(), output_final_state=True,
    )
    oc_hf, Sc_hf = torch_chunk_gated_delta_rule(
        qn[None], kn[None], v[None], g[None], beta[None], initial_state=S0[None].clone(), output_final_state=True,
    )
    q = (qn * DK**-0.5).repeat_interleave(rep, dim=1)
    k = kn.repeat_interleave(rep, dim=1)
    pm = torch.ones(T, T, dtype=torch.bool).tril()
    o, (kk, U, c) = gdn.tree_wy(q, k, v, g, beta, S0, pm)
    S = gdn.commit_state(S0, kk, U, c, torch.tensor(T - 1), pm)
    _note("vs transformers recurrent", assert_rel(o, o_hf[0], TOL, "tree_wy vs torch_recurrent_gated_delta_rule"))
    assert_rel(S, S_hf[0], TOL, "final state vs torch_recurrent_gated_delta_rule")
    _note("vs transformers chunk", assert_rel(o, oc_hf[0], 1e-4, "tree_wy vs torch_chunk_gated_delta_rule"))
    assert_rel(S, Sc_hf[0], 1e-4, "final state vs torch_chunk_gated_delta_rule")
    o_ref, S_ref = gdn.chain_recurrent(q, k, v, g, beta, S0)
    assert_rel(o_ref, o_hf[0], TOL, "chain_recurrent vs transformers")
    assert_rel(S_ref, S_hf[0], TOL, "chain_recurrent state vs transformers")


def test_tree_wy_does_not_touch_inputs():
    q, k, v, g, beta, S0 = rand_inputs(12, 0)
    pm = ancestor_mask_from_parents(random_parents("random", 12, random.Random(0)))
    before = [t.clone() for t in (q, k, v, g, beta, S0, pm)]
    out, (kk, U, c) = gdn.tree_wy(q, k, v, g, beta, S0, pm)
    gdn.commit_state(S0, kk, U, c, torch.tensor(5), pm)
    for a, b in zip(before, (q, k, v, g, beta, S0, pm)):
        assert torch.equal(a, b)


def test_siblings_are_independent():
    """A node's output depends only on its path: appending siblings/cousins never changes it."""
    rng = random.Random(3)
    parents = random_parents("bushy", 30, rng)
    q, k, v, g, beta, S0 = rand_inputs(30, 3)
    pm = ancestor_mask_from_parents(parents)
    o_full, _ = gdn.tree_wy(q, k, v, g, beta, S0, pm)
    o_pre, _ = gdn.tree_wy(q[:10], k[:10], v[:10], g[:10], beta[:10], S0, pm[:10, :10])
    assert_rel(o_full[:10], o_pre, TOL, "prefix of the tree")


# ----------------------------------------------------------------------------- tree convolution
CONV_CASES = [  # (kind, T, width, seed)
    ("chain", 1, 4, 0),
    ("chain", 2, 4, 1),
    ("chain", 20, 4, 2),
    ("star", 17, 4, 3),
    ("deep", 64, 4, 4),
    ("bushy", 50, 4, 5),
    ("random", 128, 4, 6),
    ("random", 30, 3, 7),
    ("random", 30, 2, 8),
    ("deep", 25, 5, 9),
]


@pytest.mark.parametrize("kind,T,width,seed", CONV_CASES)
def test_tree_conv_matches_reference(kind, T, width, seed):
    torch.manual_seed(seed)
    rng = random.Random(seed)
    C = 6
    parents = torch.tensor(random_parents(kind, T, rng))
    ext = torch.randn(width - 1 + T, C)
    w = torch.randn(C, width)
    win = gdn.conv_window_index(parents, width)
    assert win.shape == (T, width) and win.dtype == torch.int64
    assert torch.equal(win[:, -1], torch.arange(T) + width - 1)  # last column = the node itself
    out = gdn.tree_conv(ext, win, w)
    ref = gdn.conv_reference(ext, parents, w)
    assert_rel(out, ref, 1e-6, "tree_conv vs conv_reference")

    # explicit window check: node n reads its (width-1) nearest ancestors, then the newest state rows
    hist = width - 1
    par = parents.tolist()
    for n in range(T):
        rows, cur, srow = [], n, hist - 1
        for _ in range(width):
            if cur >= 0:
                rows.append(hist + cur)
                cur = par[cur]
            else:
                rows.append(srow)
                srow -= 1
        assert win[n].tolist() == rows[::-1], f"window of node {n}"


def test_tree_conv_forest():
    """Several nodes hanging off the committed prefix (parents -1) each start from the conv state."""
    parents = torch.tensor([-1, 0, -1, 2, 1, -1, 5])
    ext = torch.randn(3 + 7, 5)
    w = torch.randn(5, 4)
    out = gdn.tree_conv(ext, gdn.conv_window_index(parents, 4), w)
    assert_rel(out, gdn.conv_reference(ext, parents, w), 1e-6, "forest")


@pytest.mark.parametrize("T,width", [(1, 4), (5, 4), (33, 4), (12, 2)])
def test_tree_conv_chain_matches_causal_conv1d(T, width):
    torch.manual_seed(T)
    C = 7
    ext = torch.randn(width - 1 + T, C)  # [conv state (width-1 rows, oldest first); inputs]
    w = torch.randn(C, width)
    parents = torch.arange(T) - 1
    out = gdn.tree_conv(ext, gdn.conv_window_index(parents, width), w)
    ref = F.silu(F.conv1d(ext.t()[None], w[:, None, :], groups=C))[0].t()  # [T, C]
    assert_rel(out, ref, 1e-6, "tree_conv chain vs F.conv1d")


def test_report_max_errors():
    """Prints the worst relative errors seen so far (run with -s)."""
    MAX_ERR.report("gdn")

"""Tree verify + commit on the target engine: ONE forward over a draft tree gives every node the
logits / tap hidden states of running its root-to-node path as a chain from the same committed
state; committing an accepted path leaves the engine exactly where step-by-step decoding of that
path leaves it (GDN conv / recurrent state, attention K/V), round after round."""

from __future__ import annotations

import random

import pytest
import torch

from ddtree.model.synthetic import tiny_dense_config, tiny_hybrid_config
from ddtree.ops.tree import Tree
from helpers import tiny_cpu_each_test  # noqa: F401 (autouse fixture)
from helpers import (
    MaxErrors,
    assert_rel,
    build_target,
    commit_path,
    compare_states,
    decode_step,
    leaves,
    random_tree,
    restore,
    snapshot,
    state_tensors,
    verify_tree,
)

TOL = 1e-4  # float32: max abs diff < TOL * max abs reference (logits, taps, states)
MAX_DEPTH = 16
# ddtree.model.synthetic.randomize_ as is (A in [1, 16], decay down to e^-30 per token): float32 rounding is
# amplified ~1e3x (see helpers.tame_decay_), so the bound is looser; measured max ~6e-5.
TOL_STRONG_DECAY = 3e-4
MAX_ERR = MaxErrors()
_note = MAX_ERR.note

G, A = "linear_attention", "full_attention"
MODELS = {
    "hybrid": lambda: tiny_hybrid_config(),  # G G A G, GQA, partial rotary 0.5, GDN 2 k / 4 v heads
    "hybrid-b": lambda: tiny_hybrid_config(  # A G G A G, MQA, partial 0.25, GDN 1 k / 3 v heads
        vocab=61, hidden=48, layers=(A, G, G, A, G), heads=4, kv_heads=1, head_dim=16, partial=0.25,
        gdn_k_heads=1, gdn_v_heads=3, gdn_k_dim=16, gdn_v_dim=8, inter=64),
    "dense": lambda: tiny_dense_config(),
    "hybrid-strong-decay": lambda: tiny_hybrid_config(),  # randomize_'s decay range, untamed
}
UNTAMED = {"hybrid-strong-decay"}


def _tol(name: str) -> float:
    return TOL_STRONG_DECAY if name in UNTAMED else TOL


def _setup(name: str, seed: int, prompt_len: int, dtype=torch.float32, max_len: int = 512):
    raw = MODELS[name]()
    model = build_target(raw, seed=seed, dtype=dtype, max_len=max_len, tame=name not in UNTAMED)
    L = model.cfg.num_layers
    model.tap_layers = sorted({0, L // 2, L - 1})
    prompt = torch.randint(0, model.cfg.vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(seed))
    model.reset()
    model.prefill(prompt, start=0, chunk=16)
    return model, raw, prompt


def _chain_reference(model, tree: Tree, start: int, snap):
    """Logits / taps of every node from running path(leaf) as a chain, for every leaf."""
    N = tree.num_nodes
    ref_logits = [None] * N
    ref_taps = [None] * N
    for leaf in leaves(tree):
        path = tree.path_to(leaf)
        restore(model, snap)
        lg, tp = model.forward_chain(tree.tokens[path], start)
        for r, node in enumerate(path):
            ref_logits[node], ref_taps[node] = lg[r], tp[r]
    restore(model, snap)
    assert all(x is not None for x in ref_logits)
    return torch.stack(ref_logits), torch.stack(ref_taps)


def _check_taps(model, got, ref, tol, what):
    Hd = model.cfg.hidden_size
    for j, layer in enumerate(model.tap_layers):
        sl = slice(j * Hd, (j + 1) * Hd)
        _note(f"taps ({str(got.dtype).removeprefix('torch.')})", assert_rel(got[:, sl].float(), ref[:, sl].float(), tol, f"{what}: tap layer {layer}"))


# ----------------------------------------------------------------------------- one verify == chains
TREES = [  # (kind, N, seed)
    ("chain", 1, 0),  # root only (an autoregressive step)
    ("chain", 2, 1),
    ("chain", 17, 2),  # depth 16
    ("star", 8, 3),
    ("star", 40, 4),
    ("deep", 24, 5),
    ("deep", 64, 6),
    ("bushy", 16, 7),
    ("bushy", 64, 8),
    ("random", 32, 9),
    ("random", 128, 10),
]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("kind,N,seed", TREES)
def test_tree_verify_equals_chain_per_path(name, kind, N, seed):
    tol = _tol(name)
    rng = random.Random(seed)
    start = rng.randrange(3, 40)
    model, _, _ = _setup(name, seed, start)
    tree = random_tree(kind, N, rng, model.cfg.vocab_size, MAX_DEPTH)
    assert int(tree.depths.max()) <= MAX_DEPTH
    snap = snapshot(model)

    logits, taps = verify_tree(model, tree, start)
    assert logits.shape == (N, model.cfg.vocab_size)
    assert taps.shape == (N, len(model.tap_layers) * model.cfg.hidden_size)
    # a verify forward must not touch the committed state (GDN states, K/V below start)
    after = state_tensors(model, start)
    for k, v in state_tensors(model, start).items():
        ref = snap[k][:start] if k.endswith((".k", ".v")) else snap[k]
        assert torch.equal(after[k], ref), f"verify changed committed state {k}"

    ref_logits, ref_taps = _chain_reference(model, tree, start, snap)
    _note(f"tree logits ({name})", assert_rel(logits, ref_logits, tol, f"{kind} N={N}: tree logits vs chain"))
    _check_taps(model, taps, ref_taps, tol, f"{kind} N={N}")

    # the same tree with a longer kv_len (fixed-shape buffers), and only some logit rows
    restore(model, snap)
    rows = torch.tensor(sorted(rng.sample(range(N), min(N, 5))))
    lg2, tp2 = verify_tree(model, tree, start, kv_extra=7, logit_rows=rows)
    assert_rel(lg2, ref_logits[rows], tol, "kv_len > start + N, logit_rows")
    _check_taps(model, tp2, ref_taps, tol, "kv_len > start + N")


@pytest.mark.parametrize("name", ["hybrid", "dense"])
def test_tree_fills_the_buffers_exactly(name):
    """A tree whose last node lands in the last K/V slot (kv_len == max_len), then commit."""
    rng = random.Random(21)
    start, N = 24, 16
    model, _, _ = _setup(name, 21, start, max_len=start + N)
    tree = random_tree("deep", N, rng, model.cfg.vocab_size, MAX_DEPTH)
    snap = snapshot(model)
    logits, taps = verify_tree(model, tree, start)
    ref_logits, ref_taps = _chain_reference(model, tree, start, snap)
    assert_rel(logits, ref_logits, TOL, "tree at the end of the buffers")
    _check_taps(model, taps, ref_taps, TOL, "tree at the end of the buffers")
    b, _, _ = _setup(name, 21, start, max_len=start + N)
    path = _pick_path(tree, "full", rng)
    verify_tree(model, tree, start)
    commit_path(model, path, start, pad_to=N)  # padding reaches the last slot too
    for i, node in enumerate(path):
        decode_step(b, int(tree.tokens[node]), start + i)
    compare_states(model, b, start + len(path), TOL)


# ----------------------------------------------------------------------------- commit
def _pick_path(tree: Tree, how: str, rng: random.Random) -> list[int]:
    if how == "root":
        return [0]
    if how == "full":
        return tree.path_to(int(tree.depths.argmax()))
    return tree.path_to(rng.randrange(tree.num_nodes))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("how,kind,N,seed", [
    ("root", "bushy", 20, 0),
    ("full", "deep", 40, 1),
    ("full", "chain", 17, 2),
    ("random", "random", 64, 3),
    ("random", "star", 12, 4),
])
def test_commit_equals_step_by_step(name, how, kind, N, seed):
    tol = _tol(name)
    rng = random.Random(100 + seed)
    start = rng.randrange(3, 30)
    a, _, _ = _setup(name, seed, start)
    b, _, _ = _setup(name, seed, start)  # identical weights and prompt
    tree = random_tree(kind, N, rng, a.cfg.vocab_size, MAX_DEPTH)
    path = _pick_path(tree, how, rng)
    L = len(path)

    tree_logits, tree_taps = verify_tree(a, tree, start)
    commit_path(a, path, start, pad_to=MAX_DEPTH + 1)
    for i, node in enumerate(path):  # b decodes the accepted tokens one by one
        lg, tp = decode_step(b, int(tree.tokens[node]), start + i)
        assert_rel(tree_logits[node], lg, tol, f"tree logits of accepted node {node} vs step")
        _check_taps(a, tree_taps[node : node + 1], tp, tol, f"accepted node {node}")
    new_start = start + L
    _note(f"state after commit ({name})", compare_states(a, b, new_start, tol))

    # next decode step
    tok = rng.randrange(a.cfg.vocab_size)
    la, _ = decode_step(a, tok, new_start)
    lb, _ = decode_step(b, tok, new_start)
    _note(f"next step after commit ({name})", assert_rel(la, lb, tol, "next step after commit"))

    # next tree verify
    tree2 = random_tree("random", 24, rng, a.cfg.vocab_size, 8)
    l2a, t2a = verify_tree(a, tree2, new_start + 1)
    l2b, t2b = verify_tree(b, tree2, new_start + 1)
    _note(f"next tree after commit ({name})", assert_rel(l2a, l2b, tol, "next tree verify after commit"))
    _check_taps(a, t2a, t2b, tol, "next tree verify")


@pytest.mark.parametrize("name", list(MODELS))
def test_rounds_no_drift(name):
    """24 rounds of verify(random tree) + commit(random accepted path) on one model vs a twin that
    decodes the accepted tokens step by step; compared every round and at the end."""
    tol = _tol(name)
    rng = random.Random(7)
    start = 11
    a, _, _ = _setup(name, 5, start)
    b, _, _ = _setup(name, 5, start)
    V = a.cfg.vocab_size
    hows = ["root", "full", "random", "root", "random", "full"] * 4
    accepted_lengths = []
    for r, how in enumerate(hows):
        kind = ["chain", "star", "deep", "bushy", "random"][r % 5]
        tree = random_tree(kind, rng.randrange(1, 33), rng, V, MAX_DEPTH)
        path = _pick_path(tree, how, rng)
        logits, _ = verify_tree(a, tree, start)
        commit_path(a, path, start, pad_to=rng.choice([len(path), MAX_DEPTH + 1]))
        for i, node in enumerate(path):
            lg, _ = decode_step(b, int(tree.tokens[node]), start + i)
            _note(f"rounds: per-node logits ({name})", assert_rel(logits[node], lg, tol, f"round {r} node {node}"))
        start += len(path)
        accepted_lengths.append(len(path))
    assert 1 in accepted_lengths and max(accepted_lengths) >= 8
    _note(f"rounds: final state ({name})", compare_states(a, b, start, tol))
    tok = rng.randrange(V)
    la, ta = decode_step(a, tok, start)
    lb, tb = decode_step(b, tok, start)
    _note(f"rounds: final step ({name})", assert_rel(la, lb, tol, "final step after 24 rounds"))
    _check_taps(a, ta, tb, tol, "final step after 24 rounds")


def test_rounds_equal_fresh_prefill():
    """After rounds of verify + commit, the next logits equal a fresh model prefilled with the
    committed token sequence in one go (guards against both twins drifting the same way)."""
    rng = random.Random(11)
    start = 9
    a, _, prompt = _setup("hybrid", 6, start)
    committed = prompt.tolist()
    V = a.cfg.vocab_size
    for r in range(20):
        tree = random_tree(["deep", "bushy", "random", "chain"][r % 4], rng.randrange(1, 25), rng, V, MAX_DEPTH)
        path = _pick_path(tree, ["random", "full", "root"][r % 3], rng)
        verify_tree(a, tree, start)
        commit_path(a, path, start)
        committed += [int(tree.tokens[n]) for n in path]
        start += len(path)
    tok = rng.randrange(V)
    la, _ = decode_step(a, tok, start)
    fresh = build_target(MODELS["hybrid"](), seed=6)
    fresh.tap_layers = list(a.tap_layers)
    ref, _ = fresh.prefill(torch.tensor(committed + [tok]), start=0, chunk=64)
    _note("rounds vs fresh prefill", assert_rel(la, ref, TOL, "after 20 rounds vs fresh prefill"))
    compare_states(a, fresh, start + 1, TOL)


# ----------------------------------------------------------------------------- bf16
BF16_TOL = 3e-2  # bf16 activations (GDN state math stays fp32): relative to the logit scale


@pytest.mark.parametrize("name", ["hybrid", "dense"])
@pytest.mark.parametrize("kind,N,seed", [("bushy", 24, 0), ("deep", 40, 1), ("random", 64, 2)])
def test_tree_verify_bf16(name, kind, N, seed):
    rng = random.Random(seed)
    start = rng.randrange(3, 30)
    model, _, _ = _setup(name, seed, start, dtype=torch.bfloat16)
    for layer in model.layers:  # recurrent state is fp32 whatever the weights' dtype
        if layer.kind == "linear_attention":
            assert layer.linear_attn.rec_state.dtype == torch.float32
    tree = random_tree(kind, N, rng, model.cfg.vocab_size, MAX_DEPTH)
    snap = snapshot(model)
    logits, taps = verify_tree(model, tree, start)
    assert logits.dtype == torch.bfloat16
    ref_logits, ref_taps = _chain_reference(model, tree, start, snap)
    _note("bf16 tree logits", assert_rel(logits.float(), ref_logits.float(), BF16_TOL, "bf16 tree vs chain"))
    _check_taps(model, taps, ref_taps, BF16_TOL, "bf16")

    # commit in bf16 vs step-by-step bf16
    b, _, _ = _setup(name, seed, start, dtype=torch.bfloat16)
    path = _pick_path(tree, "full", rng)
    verify_tree(model, tree, start)  # the chain references ran last: verify again, then commit
    commit_path(model, path, start)
    for i, node in enumerate(path):
        decode_step(b, int(tree.tokens[node]), start + i)
    tok = rng.randrange(model.cfg.vocab_size)
    la, _ = decode_step(model, tok, start + len(path))
    lb, _ = decode_step(b, tok, start + len(path))
    _note("bf16 next step", assert_rel(la.float(), lb.float(), BF16_TOL, "bf16 next step after commit"))


def test_report_max_errors():
    MAX_ERR.report("verify")


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("kind,N,seed", [("random", 40, 5), ("deep", 24, 6), ("chain", 1, 7)])
def test_stacked_commit_equals_layer_by_layer(name, kind, N, seed):
    """TargetModel.commit (stacked, a few kernels per device) vs commit_reference (per layer)."""
    rng = random.Random(300 + seed)
    start = rng.randrange(3, 30)
    a, _, _ = _setup(name, seed, start)
    b, _, _ = _setup(name, seed, start)
    tree = random_tree(kind, N, rng, a.cfg.vocab_size, MAX_DEPTH)
    path = _pick_path(tree, "random", rng)
    verify_tree(a, tree, start)
    verify_tree(b, tree, start)
    pad = path + [path[-1]] * (MAX_DEPTH + 1 - len(path))
    args = (torch.tensor(pad), torch.tensor(len(path)), torch.tensor(start))
    a.commit(*args)
    b.commit_reference(*args)
    for la, lb in zip(a.layers, b.layers):
        if la.kind == "linear_attention":
            assert torch.equal(la.linear_attn.conv_state, lb.linear_attn.conv_state)
            assert_rel(la.linear_attn.rec_state, lb.linear_attn.rec_state, 1e-6, "stacked vs per-layer GDN state")
        else:
            n = start + len(path)
            assert torch.equal(la.self_attn.k_cache[:n], lb.self_attn.k_cache[:n])
            assert torch.equal(la.self_attn.v_cache[:n], lb.self_attn.v_cache[:n])

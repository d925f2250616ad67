"""Logits parity of our compact target with transformers' own Qwen3_5ForCausalLM / Qwen3ForCausalLM
on several tiny random configs (float32), and prefill + step-by-step decoding == one full forward."""

from __future__ import annotations

import pytest
import torch

from ddtree.model.synthetic import hf_reference, tiny_dense_config, tiny_hybrid_config
from helpers import tiny_cpu_each_test  # noqa: F401 (autouse fixture)
from helpers import MaxErrors, assert_rel, build_target, decode_step

TOL = 1e-4  # max abs diff < TOL * max abs logit (taps: * max abs hidden)
MAX_ERR = MaxErrors()
_note = MAX_ERR.note

G, A = "linear_attention", "full_attention"
CONFIGS = {
    # the default tiny hybrid: GQA (4 heads / 2 kv), partial rotary 0.5, GDN 2 k heads / 4 v heads, dk 8
    "hybrid-default": lambda: tiny_hybrid_config(),
    # attention first, two attention layers, partial rotary 0.25, MQA (1 kv head), GDN 1 k head / 3 v heads
    "hybrid-attn-first": lambda: tiny_hybrid_config(
        vocab=101, hidden=48, layers=(A, G, A, G, G), heads=4, kv_heads=1, head_dim=16, partial=0.25,
        gdn_k_heads=1, gdn_v_heads=3, gdn_k_dim=16, gdn_v_dim=8, inter=64, theta=5000.0),
    # full rotary, no GQA anywhere, a run of 3 GDN layers then attention
    "hybrid-full-rope": lambda: tiny_hybrid_config(
        vocab=83, hidden=32, layers=(G, G, G, A), heads=2, kv_heads=2, head_dim=8, partial=1.0,
        gdn_k_heads=2, gdn_v_heads=2, gdn_k_dim=16, gdn_v_dim=8, inter=48),
    # alternating, head_dim 32 with partial 0.25 (rotary 8), GDN 2 k heads / 6 v heads
    "hybrid-alternating": lambda: tiny_hybrid_config(
        vocab=64, hidden=64, layers=(G, A, G, A), heads=4, kv_heads=2, head_dim=32, partial=0.25,
        gdn_k_heads=2, gdn_v_heads=6, gdn_k_dim=16, gdn_v_dim=6, inter=80),
    # no layer_types: the pattern comes from full_attention_interval (2 -> G A G A)
    "hybrid-interval": lambda: _without_layer_types(tiny_hybrid_config(layers=(G,) * 4), interval=2),
    "dense-gqa": lambda: tiny_dense_config(),
    # MQA, and Qwen3's real rope_theta (1e6) given the legacy way (top-level rope_theta)
    "dense-mqa": lambda: dict(tiny_dense_config(vocab=89, hidden=48, layers=2, heads=6, kv_heads=1, head_dim=8, inter=64),
                              rope_theta=1e6),
}


def _without_layer_types(raw: dict, interval: int) -> dict:
    del raw["text_config"]["layer_types"]
    raw["text_config"]["full_attention_interval"] = interval
    return raw


def _model(name: str, seed: int = 0, max_len: int = 256):
    raw = CONFIGS[name]()
    model = build_target(raw, seed=seed, max_len=max_len)
    hf = hf_reference(model, raw)
    return model, hf, raw


def _taps_for(model) -> list[int]:
    L = model.cfg.num_layers
    return sorted({0, L // 2, L - 1})


def _check_taps(model, taps: torch.Tensor, hf_hidden, rows: slice, what: str):
    """Our tap for layer i == HF hidden_states[i + 1] (HF's last entry is after the final norm)."""
    Hd = model.cfg.hidden_size
    L = model.cfg.num_layers
    for j, i in enumerate(model.tap_layers):
        ours = taps[:, j * Hd : (j + 1) * Hd]
        if i == L - 1:
            ours = model.norm(ours)
        _note("taps", assert_rel(ours, hf_hidden[i + 1][0, rows], TOL, f"{what}: tap layer {i}"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_full_forward_matches_transformers(name):
    model, hf, raw = _model(name)
    model.tap_layers = _taps_for(model)
    V = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(1)
    for T in (1, 7, 37, 65):
        tokens = torch.randint(0, V, (T,), generator=gen)
        model.reset()
        logits, taps = model.forward_chain(tokens, 0)
        out = hf(tokens[None], output_hidden_states=True)
        ref = out.logits[0].float()
        assert logits.shape == ref.shape == (T, V)
        _note(f"logits vs HF ({name})", assert_rel(logits, ref, TOL, f"{name} T={T} logits vs transformers"))
        assert taps.shape == (T, len(model.tap_layers) * model.cfg.hidden_size)
        _check_taps(model, taps, out.hidden_states, slice(0, T), f"{name} T={T}")


# (prompt length P, total length T, prefill chunk)
SCHEDULES = [(1, 9, 64), (7, 12, 8), (37, 65, 8), (37, 65, 64), (65, 70, 64), (64, 66, 8)]


@pytest.mark.parametrize("name", ["hybrid-default", "hybrid-attn-first", "hybrid-alternating", "dense-gqa"])
@pytest.mark.parametrize("P,T,chunk", SCHEDULES)
def test_prefill_then_decode_matches_full_forward_and_transformers(name, P, T, chunk):
    model, hf, raw = _model(name, seed=P + T)
    model.tap_layers = _taps_for(model)
    gen = torch.Generator().manual_seed(P * 100 + T)
    tokens = torch.randint(0, model.cfg.vocab_size, (T,), generator=gen)

    # references: one full forward through our engine, and transformers
    model.reset()
    full_logits, full_taps = model.forward_chain(tokens, 0)
    out = hf(tokens[None], output_hidden_states=True)
    hf_logits = out.logits[0].float()
    assert_rel(full_logits, hf_logits, TOL, "full forward vs transformers")

    # prefill P tokens in chunks, then decode the rest one node at a time
    model.reset()
    last, taps = model.prefill(tokens[:P], start=0, chunk=chunk)
    _note("prefill last logits", assert_rel(last, full_logits[P - 1], TOL, "prefill last logits vs full forward"))
    assert_rel(last, hf_logits[P - 1], TOL, "prefill last logits vs transformers")
    assert taps.shape[0] == P
    assert_rel(taps, full_taps[:P], TOL, "prefill taps vs full forward")
    _check_taps(model, taps, out.hidden_states, slice(0, P), "prefill")
    for pos in range(P, T):
        logits, tap = decode_step(model, int(tokens[pos]), pos)
        _note("step logits", assert_rel(logits, full_logits[pos], TOL, f"step {pos} logits vs full forward"))
        assert_rel(logits, hf_logits[pos], TOL, f"step {pos} logits vs transformers")
        assert_rel(tap[0], full_taps[pos], TOL, f"step {pos} taps vs full forward")
        _check_taps(model, tap, out.hidden_states, slice(pos, pos + 1), f"step {pos}")


def test_prefill_continues_from_start():
    """prefill(tokens, start) appends to a committed prefix: two prefills == one."""
    model, hf, _ = _model("hybrid-default", seed=3)
    tokens = torch.randint(0, model.cfg.vocab_size, (50,), generator=torch.Generator().manual_seed(3))
    ref = hf(tokens[None]).logits[0]
    model.reset()
    model.prefill(tokens[:21], start=0, chunk=8)
    last, _ = model.prefill(tokens[21:], start=21, chunk=16)
    assert_rel(last, ref[-1], TOL, "two prefills vs transformers")
    # forward_chain from a committed middle (40) sees exactly that prefix
    model.reset()
    model.prefill(tokens[:40], start=0)
    logits, _ = model.forward_chain(tokens[40:], 40)
    assert_rel(logits, ref[40:], TOL, "forward_chain after prefill vs transformers")


def test_config_layer_patterns():
    """The configs above really cover what they claim (layer orders, GQA, partial rotary, theta)."""
    seen = {}
    for name in CONFIGS:
        model, hf, _ = _model(name)
        cfg = model.cfg
        if cfg.is_hybrid:
            assert list(cfg.layer_types) == list(hf.config.layer_types)
        seen[name] = cfg
    assert seen["hybrid-interval"].layer_types == [G, A, G, A]
    assert seen["hybrid-attn-first"].layer_types[0] == A
    assert {c.rotary_dim / c.head_dim for c in seen.values() if c.is_hybrid} >= {0.25, 0.5, 1.0}
    assert any(c.num_kv_heads < c.num_heads for c in seen.values())
    assert any(c.gdn_num_k_heads < c.gdn_num_v_heads for c in seen.values())
    assert seen["dense-mqa"].rope_theta == 1e6


def test_logits_scale_is_meaningful():
    """Guard for the relative tolerance: random tiny models must not produce near-constant logits."""
    model, _, _ = _model("hybrid-default")
    logits, _ = model.forward_chain(torch.arange(20) % model.cfg.vocab_size, 0)
    assert logits.abs().max() > 0.5
    assert logits.std(-1).min() > 0.05


def test_report_max_errors():
    MAX_ERR.report("model")


def test_check_logits_error_script_runs_on_cpu(tmp_path):
    """scripts/check_logits_error.py (the GPU logits test's diagnostic) still matches the code: on
    CPU through the torch twins our fp32 forward is within the CPU tolerance of transformers' fp64
    logits, and the rows it writes say so."""
    import json
    import subprocess
    import sys

    from conftest import REPO, cli_env

    out = tmp_path / "err.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "check_logits_error.py"), "--device", "cpu",
                        "--lengths", "9,17", "--seeds", "0,7", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, env=cli_env())
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(x["T"], x["seed"]) for x in rows] == [(9, 0), (9, 7), (17, 0), (17, 7)]
    assert all(0 < x["ours"] < TOL and 0 < x["transformers_fp32"] < TOL for x in rows), rows
    assert "worst: ours" in r.stdout

"""Tiny checkpoints in the released layouts (Qwen3_5ForConditionalGeneration with vision tower and
MTP head, Qwen3_5ForCausalLM, dense Qwen3; one file or sharded with an index) load to exactly the
in-memory model; transformers reads the causal layouts to the same logits; bad checkpoints raise a
one-line DDTreeError; a DFlash drafter checkpoint loads via load_drafter."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from ddtree.model.checkpoint import load_drafter, load_target, save_checkpoint
from ddtree.errors import DDTreeError
from ddtree.model.synthetic import build_random_drafter, tiny_dense_config, tiny_drafter_config, tiny_hybrid_config
from helpers import tiny_cpu_each_test  # noqa: F401 (autouse fixture)
from helpers import assert_rel, build_target, tiny_cpu

CPU = [torch.device("cpu")]
MAX_LEN = 64
TOL = 1e-4  # transformers vs ours, relative to the logit scale


def _causal_config(raw: dict) -> dict:
    """The Qwen3_5ForCausalLM layout's config: the text_config itself."""
    cfg = copy.deepcopy(raw["text_config"])
    cfg["model_type"] = "qwen3_5_text"
    cfg["architectures"] = ["Qwen3_5ForCausalLM"]
    cfg["tie_word_embeddings"] = raw.get("tie_word_embeddings", False)
    return cfg


@pytest.fixture(scope="module")
def hybrid():
    with tiny_cpu():
        raw = tiny_hybrid_config()
        return build_target(raw, seed=3, max_len=MAX_LEN), raw


@pytest.fixture(scope="module")
def dense():
    with tiny_cpu():
        raw = tiny_dense_config()
        return build_target(raw, seed=4, max_len=MAX_LEN), raw


TOKENS = torch.tensor([5, 17, 3, 88, 41, 0, 9, 62, 33, 2, 71])


def _logits(model):
    model.reset()
    return model.forward_chain(TOKENS, 0)[0]


def _assert_same_model(loaded, ref):
    assert loaded.cfg == ref.cfg
    sd_l, sd_r = loaded.state_dict(), ref.state_dict()
    assert sd_l.keys() == sd_r.keys()
    for k in sd_r:
        assert sd_l[k].dtype == torch.float32 and sd_l[k].device.type == "cpu", k
        assert torch.equal(sd_l[k], sd_r[k]), f"weight {k} differs after loading"
    assert loaded.max_len == MAX_LEN
    assert torch.equal(_logits(loaded), _logits(ref)), "loaded model's logits differ from the in-memory model's"


def _keys(d):
    keys = set()
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            keys |= set(fh.keys())
    return keys


@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("layout", ["conditional", "causal"])
def test_hybrid_layouts_load_identical(hybrid, tmp_path, layout, shards):
    model, raw = hybrid
    config = raw if layout == "conditional" else _causal_config(raw)
    d = save_checkpoint(model.state_dict(), config, tmp_path / "ckpt", layout=layout, shards=shards)
    keys = _keys(d)
    if layout == "conditional":
        assert any(k.startswith("model.language_model.layers.") for k in keys)
        assert any(k.startswith("model.visual.") for k in keys) and any(k.startswith("mtp.") for k in keys)
    else:
        assert any(k.startswith("model.layers.") for k in keys) and not any("language_model" in k for k in keys)
    if shards > 1:
        index = json.loads((d / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == shards == len(list(d.glob("*.safetensors")))
    loaded, model_dir = load_target(str(d), CPU, torch.float32, MAX_LEN)
    assert model_dir == d
    _assert_same_model(loaded, model)


@pytest.mark.parametrize("shards", [1, 3])
def test_dense_loads_identical(dense, tmp_path, shards):
    model, raw = dense
    d = save_checkpoint(model.state_dict(), raw, tmp_path / "ckpt", layout="causal", shards=shards)
    loaded, _ = load_target(str(d), CPU, torch.float32, MAX_LEN)
    _assert_same_model(loaded, model)


def test_tied_embeddings_without_lm_head(dense, tmp_path):
    """Small Qwen3 checkpoints tie lm_head to the embedding and do not store lm_head.weight."""
    model, raw = dense
    raw = dict(raw, tie_word_embeddings=True)
    tied = copy.deepcopy(model)
    tied.cfg.tie_word_embeddings = True
    tied.lm_head.weight.data.copy_(tied.embed_tokens.weight.data)
    tied.allocate_state(MAX_LEN)
    state = {k: v for k, v in tied.state_dict().items() if k != "lm_head.weight"}
    d = save_checkpoint(state, raw, tmp_path / "ckpt", layout="causal")
    assert "lm_head.weight" not in _keys(d)
    loaded, _ = load_target(str(d), CPU, torch.float32, MAX_LEN)
    _assert_same_model(loaded, tied)


def test_load_to_bfloat16(hybrid, tmp_path):
    model, raw = hybrid
    d = save_checkpoint(model.state_dict(), raw, tmp_path / "ckpt", layout="conditional")
    loaded, _ = load_target(str(d), CPU, torch.bfloat16, MAX_LEN)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    for layer in loaded.layers:
        if layer.kind == "linear_attention":
            assert layer.linear_attn.rec_state.dtype == torch.float32  # recurrent state stays fp32
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k].to(torch.bfloat16)), k


# ----------------------------------------------------------------------------- transformers reads them too
@pytest.mark.parametrize("kind", ["hybrid-causal", "dense"])
def test_transformers_from_pretrained_same_logits(hybrid, dense, tmp_path, kind):
    import transformers

    if kind == "dense":
        (model, raw), cls = dense, transformers.Qwen3ForCausalLM
        config = raw
    else:
        (model, raw), cls = hybrid, transformers.Qwen3_5ForCausalLM
        config = _causal_config(raw)
    d = save_checkpoint(model.state_dict(), config, tmp_path / "ckpt", layout="causal", shards=3)
    try:
        hf, info = cls.from_pretrained(str(d), dtype=torch.float32, output_loading_info=True)
    except Exception as e:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"transformers {transformers.__version__} cannot read this checkpoint: {type(e).__name__}: {e}")
    missing = [k for k in info["missing_keys"] if "rotary" not in k]
    assert not missing and not info["unexpected_keys"] and not info["mismatched_keys"], info
    from ddtree.model.synthetic import torch_gdn_paths

    torch_gdn_paths(hf)  # the pure-torch reference (with fla installed transformers would call its kernels)
    ref = hf.eval()(TOKENS[None]).logits[0]
    loaded, _ = load_target(str(d), CPU, torch.float32, MAX_LEN)
    assert_rel(_logits(loaded), ref, TOL, f"{kind}: ours (loaded) vs transformers from_pretrained")


# ----------------------------------------------------------------------------- errors
def _expect_error(fn, *needles):
    with pytest.raises(DDTreeError) as ei:
        fn()
    msg = str(ei.value)
    assert "\n" not in msg and msg == ei.value.message and len(msg) < 400, msg
    for n in needles:
        assert n.lower() in msg.lower(), f"{n!r} not in {msg!r}"
    return msg


def _load(d):
    return lambda: load_target(str(d), CPU, torch.float32, MAX_LEN)


def test_error_missing_dir(tmp_path):
    _expect_error(_load(tmp_path / "does-not-exist"), "not found", "does-not-exist")


def test_error_dir_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    _expect_error(_load(tmp_path / "empty"), "config.json")


def test_error_file_instead_of_dir(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    _expect_error(_load(f), "config.json")


def test_error_malformed_json(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "qwen3_5", "text_config": {')
    _expect_error(_load(d), "malformed", "config.json")


@pytest.mark.parametrize("mt,arch", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"), (None, None)])
def test_error_unsupported_model_type(dense, tmp_path, mt, arch):
    model, raw = dense
    cfg = dict(raw, architectures=[arch] if arch else [])
    if mt is None:
        cfg.pop("model_type")
    else:
        cfg["model_type"] = mt
    d = save_checkpoint(model.state_dict(), cfg, tmp_path / "ckpt", layout="causal")
    _expect_error(_load(d), "unsupported", "qwen3")


def test_error_config_missing_field(dense, tmp_path):
    model, raw = dense
    cfg = {k: v for k, v in raw.items() if k != "hidden_size"}
    d = save_checkpoint(model.state_dict(), cfg, tmp_path / "ckpt", layout="causal")
    _expect_error(_load(d), "malformed", "hidden_size")


def test_error_layer_types_mismatch(hybrid, tmp_path):
    model, raw = hybrid
    cfg = copy.deepcopy(raw)
    cfg["text_config"]["layer_types"] = cfg["text_config"]["layer_types"][:-1]
    d = save_checkpoint(model.state_dict(), cfg, tmp_path / "ckpt")
    _expect_error(_load(d), "malformed", "layer_types")


@pytest.mark.parametrize("shards", [1, 3])
def test_error_missing_weight(hybrid, tmp_path, shards):
    model, raw = hybrid
    state = {k: v for k, v in model.state_dict().items() if k != "layers.1.linear_attn.A_log"}
    d = save_checkpoint(state, raw, tmp_path / "ckpt", shards=shards)
    _expect_error(_load(d), "lacks", "layers.1.linear_attn.A_log")


def test_error_misshaped_weight(hybrid, tmp_path):
    model, raw = hybrid
    state = dict(model.state_dict())
    state["layers.2.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    d = save_checkpoint(state, raw, tmp_path / "ckpt", layout="conditional")
    _expect_error(_load(d), "shape", "k_proj", "(8, 64)")


def test_error_config_disagrees_with_weights(hybrid, tmp_path):
    """config.json says a bigger hidden size than the weights have: a shape error, not a crash."""
    model, raw = hybrid
    cfg = copy.deepcopy(raw)
    cfg["text_config"]["hidden_size"] = 80
    d = save_checkpoint(model.state_dict(), cfg, tmp_path / "ckpt")
    _expect_error(_load(d), "shape")


def test_error_missing_shard(hybrid, tmp_path):
    model, raw = hybrid
    d = save_checkpoint(model.state_dict(), raw, tmp_path / "ckpt", shards=3)
    (d / "model-00002-of-00003.safetensors").unlink()
    _expect_error(_load(d), "model-00002-of-00003.safetensors", "missing")


def test_error_malformed_index(hybrid, tmp_path):
    model, raw = hybrid
    d = save_checkpoint(model.state_dict(), raw, tmp_path / "ckpt", shards=3)
    (d / "model.safetensors.index.json").write_text("{")
    _expect_error(_load(d), "malformed", "index")


def test_error_no_weights(hybrid, tmp_path):
    _, raw = hybrid
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    _expect_error(_load(d), "safetensors")


# ----------------------------------------------------------------------------- drafter
@pytest.fixture(scope="module")
def drafter_pair():
    with tiny_cpu():
        raw = tiny_hybrid_config()
        target = build_target(raw, seed=5, max_len=MAX_LEN)
        draw = tiny_drafter_config(raw, layers=2, block_size=4, mask_token_id=1, sliding=8)
        drafter = build_random_drafter(draw, target, seed=6, max_len=MAX_LEN)
        return target, raw, drafter, draw


def _draft(drafter, target):
    drafter.attach(target.embed_tokens, target.lm_head)
    drafter.reset()
    n_taps = len(drafter.cfg.target_layer_ids)
    taps = torch.randn(9, n_taps * target.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    drafter.add_context(taps)
    return drafter.draft_logits(torch.tensor(7), kv_len=9)


def test_drafter_checkpoint_loads_identical(drafter_pair, tmp_path):
    target, _, drafter, draw = drafter_pair
    d = save_checkpoint(drafter.state_dict(), draw, tmp_path / "draft", layout="drafter")
    assert not any(k.startswith("model.") for k in _keys(d))
    loaded, model_dir = load_drafter(str(d), target, torch.float32, MAX_LEN)
    assert model_dir == d
    assert loaded.cfg == drafter.cfg
    sd_l, sd_r = loaded.state_dict(), drafter.state_dict()
    assert sd_l.keys() == sd_r.keys()
    for k in sd_r:
        assert torch.equal(sd_l[k], sd_r[k]), k
    out_l, out_r = _draft(loaded, target), _draft(drafter, target)
    assert out_l.shape == (draw["block_size"] - 1, target.cfg.vocab_size)
    assert torch.equal(out_l, out_r)


def test_drafter_errors(drafter_pair, tmp_path):
    target, _, drafter, draw = drafter_pair
    state = drafter.state_dict()
    # taps beyond the target's layers
    bad = copy.deepcopy(draw)
    bad["dflash_config"]["target_layer_ids"] = [0, target.cfg.num_layers]
    d = save_checkpoint(state, bad, tmp_path / "taps", layout="drafter")
    _expect_error(lambda: load_drafter(str(d), target, torch.float32, MAX_LEN), "layers")
    # trained for another target (hidden size)
    other = build_target(tiny_hybrid_config(hidden=32, inter=48), seed=0, max_len=MAX_LEN)
    d = save_checkpoint(state, draw, tmp_path / "hidden", layout="drafter")
    _expect_error(lambda: load_drafter(str(d), other, torch.float32, MAX_LEN), "hidden size")
    # not a DFlash drafter
    bad = dict(draw, architectures=["Qwen3ForCausalLM"])
    d = save_checkpoint(state, bad, tmp_path / "arch", layout="drafter")
    _expect_error(lambda: load_drafter(str(d), target, torch.float32, MAX_LEN), "DFlash")
    # missing mask token id
    bad = copy.deepcopy(draw)
    bad["dflash_config"].pop("mask_token_id")
    d = save_checkpoint(state, bad, tmp_path / "mask", layout="drafter")
    _expect_error(lambda: load_drafter(str(d), target, torch.float32, MAX_LEN), "mask_token_id")
    # missing weight
    d = save_checkpoint({k: v for k, v in state.items() if k != "fc.weight"}, draw, tmp_path / "w", layout="drafter")
    _expect_error(lambda: load_drafter(str(d), target, torch.float32, MAX_LEN), "lacks", "fc.weight")
    # missing directory
    _expect_error(lambda: load_drafter(str(tmp_path / "nope"), target, torch.float32, MAX_LEN), "not found")

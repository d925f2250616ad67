"""DFlash drafter: config loader across z-lab revisions, RoPE (default / yarn), and a cache-free
reference twin of the forward pass that checks the incremental context K/V cache."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ddtree.model.config import DrafterConfig, default_target_layer_ids
from ddtree.model.drafter import drafter_rope
from ddtree.errors import DDTreeError
from ddtree.model.synthetic import build_random_drafter, build_random_target, tiny_drafter_config, tiny_hybrid_config


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py: tiny models run on one thread
    yield


# --------------------------------------------------------------------------------------------
# config revisions
# --------------------------------------------------------------------------------------------

def base_raw(**root) -> dict:
    """A z-lab style drafter config (Qwen3.6-27B-DFlash shapes, from the preset) without the fields
    that differ between its revisions; the caller places them."""
    from ddtree.model.presets import qwen36_27b_dflash_config

    revision = ("rope_theta", "layer_types", "sliding_window", "block_size", "num_target_layers", "dflash_config")
    raw = {k: v for k, v in qwen36_27b_dflash_config().items() if k not in revision}
    raw["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    raw.update(root)
    return raw


def test_published_27b_revision():
    raw = base_raw(rope_theta=1e7, block_size=16,
                   dflash_config={"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]})
    c = DrafterConfig.from_dict(raw, 64)
    assert c.block_size == 16 and c.mask_token_id == 248070
    assert c.target_layer_ids == [1, 16, 31, 46, 61]
    assert c.rope_theta == 1e7 and c.rope_scaling is None
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (5, 5120, 32, 8, 128)
    assert c.causal == [False] * 5 and c.sliding_window == [None] * 5  # no layer_types: all full, non-causal


def test_block_size_root_vs_dflash_config():
    dc = {"mask_token_id": 7, "target_layer_ids": [1, 2]}
    assert DrafterConfig.from_dict(base_raw(block_size=12, dflash_config=dc), 8).block_size == 12
    assert DrafterConfig.from_dict(base_raw(dflash_config={**dc, "block_size": 10}), 8).block_size == 10
    # dflash_config wins over the root when both are present
    assert DrafterConfig.from_dict(base_raw(block_size=12, dflash_config={**dc, "block_size": 10}), 8).block_size == 10
    assert DrafterConfig.from_dict(base_raw(dflash_config=dc), 8).block_size == 16  # published default


def test_mask_token_and_taps_placement():
    c = DrafterConfig.from_dict(base_raw(mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33]), 36)
    assert c.mask_token_id == 151669 and c.target_layer_ids == [1, 9, 17, 25, 33]
    c = DrafterConfig.from_dict(base_raw(dflash_config={"mask_token_id": 248070, "target_layer_ids": [2, 3]}), 64)
    assert c.mask_token_id == 248070 and c.target_layer_ids == [2, 3]
    # dflash_config is the newer place: it wins over stale root fields
    c = DrafterConfig.from_dict(base_raw(mask_token_id=5, target_layer_ids=[0],
                                         dflash_config={"mask_token_id": 6, "target_layer_ids": [4, 5]}), 8)
    assert c.mask_token_id == 6 and c.target_layer_ids == [4, 5]


def _zlab_default(L: int, k: int) -> list[int]:
    return [int(round(1 + i * (L - 4) / (k - 1))) for i in range(k)]


@pytest.mark.parametrize("L,k", [(64, 5), (32, 5), (36, 5), (8, 3), (48, 4), (9, 3), (40, 2)])
def test_default_taps_formula(L, k):
    assert default_target_layer_ids(L, k) == _zlab_default(L, k)
    raw = base_raw(num_hidden_layers=k, dflash_config={"mask_token_id": 1})
    assert DrafterConfig.from_dict(raw, L).target_layer_ids == _zlab_default(L, k)


def test_default_taps_match_published_pairs():
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.5/3.6-27B
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # Qwen3.5-4B
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    raw = base_raw(dflash_config={"mask_token_id": 248070})
    assert DrafterConfig.from_dict(raw, 64).target_layer_ids == [1, 16, 31, 46, 61]
    # a root num_target_layers (z-lab configs carry it) is the number the default is built from
    raw = base_raw(num_target_layers=32, dflash_config={"mask_token_id": 248070})
    assert DrafterConfig.from_dict(raw, 64).target_layer_ids == [1, 8, 15, 22, 29]


def test_rope_theta_root_vs_rope_parameters():
    dc = {"mask_token_id": 1, "target_layer_ids": [1]}
    assert DrafterConfig.from_dict(base_raw(rope_theta=1e7, dflash_config=dc), 8).rope_theta == 1e7
    c = DrafterConfig.from_dict(base_raw(rope_parameters={"rope_type": "default", "rope_theta": 5e6}, dflash_config=dc), 8)
    assert c.rope_theta == 5e6 and c.rope_scaling is None
    assert DrafterConfig.from_dict(base_raw(dflash_config=dc), 8).rope_theta == 10000.0


YARN = {"factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def _yarn_reference(theta, dim, factor, orig, beta_fast, beta_slow):
    """YaRN (Peng et al. 2023) inverse frequencies and attention factor, written out directly."""
    def corr_dim(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr_dim(beta_fast)), 0), min(math.ceil(corr_dim(beta_slow)), dim - 1)
    i = torch.arange(dim // 2, dtype=torch.float64)
    ramp = ((i - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    extra, inter = 1.0 / base, 1.0 / (factor * base)
    inv = inter * ramp + extra * (1 - ramp)
    return inv, 0.1 * math.log(factor) + 1.0


@pytest.mark.parametrize("where", ["rope_scaling", "rope_scaling_type_key", "rope_parameters"])
def test_yarn_rope(where):
    dc = {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]}
    if where == "rope_scaling":
        raw = base_raw(rope_theta=1e7, rope_scaling={"rope_type": "yarn", **YARN}, dflash_config=dc)
    elif where == "rope_scaling_type_key":  # older revisions: "type" instead of "rope_type"
        raw = base_raw(rope_theta=1e7, rope_scaling={"type": "yarn", **YARN}, dflash_config=dc)
    else:
        raw = base_raw(rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, **YARN}, dflash_config=dc)
    c = DrafterConfig.from_dict(raw, 64)
    assert c.rope_theta == 1e7 and c.rope_scaling is not None
    L = 9000
    cos, sin = drafter_rope(c, L, "cpu")
    plain = copy.copy(c)
    plain.rope_scaling = None
    cos0, sin0 = drafter_rope(plain, L, "cpu")
    assert cos.shape == cos0.shape == (L, 128)
    assert (cos - cos0).abs().max() > 0.1 and (sin - sin0).abs().max() > 0.1  # yarn is not ignored

    # 1) straight from the YaRN formula
    inv, att = _yarn_reference(1e7, 128, 64.0, 4096, 32.0, 1.0)
    pos = torch.arange(L, dtype=torch.float64)[:, None]
    emb = torch.cat([pos * inv, pos * inv], -1)
    # positions up to 9000 x inv_freq 1: fp32 angle rounding is ~1e-3 rad there
    torch.testing.assert_close(cos.double(), emb.cos() * att, atol=2e-3, rtol=0)
    torch.testing.assert_close(sin.double(), emb.sin() * att, atol=2e-3, rtol=0)

    # 2) transformers' own ROPE_INIT_FUNCTIONS['yarn'] and rotary embedding
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    hf_cfg = Qwen3Config(head_dim=128, hidden_size=5120, num_attention_heads=32, max_position_embeddings=262144,
                         rope_parameters={"rope_type": "yarn", "rope_theta": 1e7, **YARN})
    hf_inv, hf_att = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    torch.testing.assert_close(hf_inv.double(), inv, rtol=1e-5, atol=0)
    assert hf_att == pytest.approx(att)
    p = torch.arange(L)[None]
    hf_cos, hf_sin = Qwen3RotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), p)
    torch.testing.assert_close(cos, hf_cos[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(sin, hf_sin[0], atol=1e-5, rtol=0)


def test_default_rope_matches_formula():
    c = DrafterConfig.from_dict(base_raw(rope_theta=1e7, dflash_config={"mask_token_id": 1, "target_layer_ids": [1]}), 8)
    cos, sin = drafter_rope(c, 300, "cpu")
    inv = 1.0 / (1e7 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    ang = torch.arange(300, dtype=torch.float64)[:, None] * inv
    torch.testing.assert_close(cos.double(), torch.cat([ang, ang], -1).cos(), atol=5e-5, rtol=0)
    torch.testing.assert_close(sin.double(), torch.cat([ang, ang], -1).sin(), atol=5e-5, rtol=0)


def test_layer_types_sliding_and_full():
    # Qwen3.6-27B-DFlash: 4 sliding (causal, window 2048) then one full (non-causal)
    raw = base_raw(layer_types=["sliding_attention"] * 4 + ["full_attention"], sliding_window=2048,
                   use_sliding_window=True, dflash_config={"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]})
    c = DrafterConfig.from_dict(raw, 64)
    assert c.causal == [True, True, True, True, False]
    assert c.sliding_window == [2048, 2048, 2048, 2048, None]
    # Qwen3.5 drafters: all full, window field present but unused
    raw = base_raw(layer_types=["full_attention"] * 5, sliding_window=None, use_sliding_window=False,
                   dflash_config={"mask_token_id": 248070})
    c = DrafterConfig.from_dict(raw, 64)
    assert c.causal == [False] * 5 and c.sliding_window == [None] * 5


@pytest.mark.parametrize("override", ["is_causal", "dflash_config.causal"])
@pytest.mark.parametrize("value", [True, False])
def test_causal_overrides(override, value):
    dc = {"mask_token_id": 1, "target_layer_ids": [1]}
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    if override == "is_causal":
        raw = base_raw(num_hidden_layers=3, layer_types=types, sliding_window=64, is_causal=value, dflash_config=dc)
    else:
        raw = base_raw(num_hidden_layers=3, layer_types=types, sliding_window=64, dflash_config={**dc, "causal": value})
    c = DrafterConfig.from_dict(raw, 8)
    assert c.causal == [value] * 3
    assert c.sliding_window == [64, 64, None]  # the override changes causality, not the windows


def test_missing_mask_token_is_an_error():
    with pytest.raises(DDTreeError, match="mask_token_id"):
        DrafterConfig.from_dict(base_raw(dflash_config={"target_layer_ids": [1]}), 8)
    with pytest.raises(DDTreeError, match="mask_token_id"):
        DrafterConfig.from_dict(base_raw(), 8)


def test_non_dflash_architecture_is_an_error():
    raw = base_raw(dflash_config={"mask_token_id": 1})
    raw["architectures"] = ["Qwen3ForCausalLM"]
    with pytest.raises(DDTreeError, match="DFlash"):
        DrafterConfig.from_dict(raw, 8)


def test_layer_types_length_mismatch_is_an_error():
    with pytest.raises(DDTreeError):
        DrafterConfig.from_dict(base_raw(layer_types=["full_attention"] * 3, dflash_config={"mask_token_id": 1}), 8)


def test_error_messages_are_one_line():
    try:
        DrafterConfig.from_dict(base_raw(), 8)
    except DDTreeError as e:
        assert "\n" not in str(e) and str(e)


# --------------------------------------------------------------------------------------------
# reference twin: cache-free DFlash forward written from the formats note
# --------------------------------------------------------------------------------------------

def _rms(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def _rot(x, cos, sin):  # x [S, h, d]; cos/sin [S, d]; NeoX halves, full head dim
    x1, x2 = x.chunk(2, -1)
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


def reference_draft_logits(raw: dict, sd: dict, embed_w, head_w, all_taps, bonus: int, cos_table=None, sin_table=None):
    """Cache-free DFlash forward (float64).

    raw: drafter config dict; sd: drafter state dict; all_taps [P, k*H]: tap features of ALL
    committed positions 0..P-1; the block [bonus, mask x (B-1)] sits at positions P..P+B-1.
    Returns logits [B-1, V] of block slots 1..B-1.
    """
    dc = raw.get("dflash_config", {})
    B = dc.get("block_size", raw.get("block_size", 16))
    mask_id = dc.get("mask_token_id", raw.get("mask_token_id"))
    eps = raw["rms_norm_eps"]
    h, kvh, hd = raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]
    types = raw.get("layer_types") or ["full_attention"] * raw["num_hidden_layers"]
    window = raw.get("sliding_window")
    P = all_taps.shape[0]
    W = lambda name: sd[name].double()  # noqa: E731

    ctx = _rms(all_taps.double() @ W("fc.weight").t(), W("hidden_norm.weight"), eps)  # [P, H]
    block = torch.tensor([bonus] + [mask_id] * (B - 1))
    x = embed_w.double()[block]  # [B, H]
    pos = torch.arange(P + B)
    if cos_table is None:
        theta = raw.get("rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ang = pos.double()[:, None] * inv
        cos_table, sin_table = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    cos_all, sin_all = cos_table[: P + B].double(), sin_table[: P + B].double()
    qpos, kpos = pos[P:], pos
    for i, t in enumerate(types):
        pre = f"layers.{i}."
        hn = _rms(x, W(pre + "input_layernorm.weight"), eps)
        q = (hn @ W(pre + "self_attn.q_proj.weight").t()).view(B, h, hd)
        q = _rms(q, W(pre + "self_attn.q_norm.weight"), eps)
        q = _rot(q, cos_all[P:], sin_all[P:])
        kv_in = torch.cat([ctx, hn])  # [P + B, H]
        k = _rms((kv_in @ W(pre + "self_attn.k_proj.weight").t()).view(P + B, kvh, hd), W(pre + "self_attn.k_norm.weight"), eps)
        k = _rot(k, cos_all, sin_all)
        v = (kv_in @ W(pre + "self_attn.v_proj.weight").t()).view(P + B, kvh, hd)
        if t == "sliding_attention":  # causal + window over [context ; block]
            vis = (kpos[None] <= qpos[:, None]) & (qpos[:, None] - kpos[None] < window)
        else:  # full: non-causal, sees every context row and the whole block
            vis = torch.ones(B, P + B, dtype=torch.bool)
        rep = h // kvh
        kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # [S, h, hd]
        s = torch.einsum("qhd,khd->hqk", q, kr) / math.sqrt(hd)
        s = s.masked_fill(~vis[None], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), vr).reshape(B, h * hd)
        x = x + o @ W(pre + "self_attn.o_proj.weight").t()
        hn2 = _rms(x, W(pre + "post_attention_layernorm.weight"), eps)
        g = hn2 @ W(pre + "mlp.gate_proj.weight").t()
        u = hn2 @ W(pre + "mlp.up_proj.weight").t()
        x = x + (torch.nn.functional.silu(g) * u) @ W(pre + "mlp.down_proj.weight").t()
    return _rms(x[1:], W("norm.weight"), eps) @ head_w.double().t()


def _pair(drafter_kw, seed=0, max_len=256, rope=None):
    raw_t = tiny_hybrid_config()
    target = build_random_target(raw_t, seed=seed, max_len=max_len)
    raw_d = tiny_drafter_config(raw_t, **drafter_kw)
    if rope is not None:
        raw_d.update(rope)
    d = build_random_drafter(raw_d, target, seed=seed + 1, max_len=max_len)
    d.attach(target.embed_tokens, target.lm_head)
    return target, d, raw_d


def _close(got, ref, what):
    ref = ref.float()
    err = (got - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 1e-4 * scale + 1e-5, f"{what}: max |diff| {err:.3e} vs max |ref| {scale:.3e}"


CASES = {
    "one full layer": dict(layers=1, block_size=8),
    "3 layers, 2 sliding window 5": dict(layers=3, block_size=6, sliding=5),
    "2 full layers, block 4, mask 3": dict(layers=2, block_size=4, mask_token_id=3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_drafter_matches_cache_free_reference(case):
    target, d, raw_d = _pair(CASES[case])
    sd = {k: v.detach() for k, v in d.state_dict().items()}
    ntap = len(d.cfg.target_layer_ids) * d.cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    emb, head = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    d.reset()
    # prefill-sized context, then rounds with padded rows (n_valid < rows; junk in the padding)
    steps = [(9, None), (5, 1), (5, 3), (7, 7), (4, 2), (6, 1), (3, torch.tensor(2)), (8, 5)]
    committed = []
    for i, (rows, n_valid) in enumerate(steps):
        taps = torch.randn(rows, ntap, generator=g)
        n = rows if n_valid is None else int(n_valid)
        taps[n:] = 50.0 * torch.randn(rows - n, ntap, generator=g)  # must stay invisible
        d.add_context(taps, n_valid)
        committed.append(taps[:n])
        all_taps = torch.cat(committed)
        P = all_taps.shape[0]
        assert int(d.ctx_len) == P
        bonus = int(torch.randint(0, d.cfg.vocab_size, (1,), generator=g))
        kv_len = P + rows - n + 3  # read past ctx_len: the padding and stale rows must be masked
        got = d.draft_logits(torch.tensor(bonus), kv_len)
        assert got.shape == (d.cfg.block_size - 1, d.cfg.vocab_size) and got.dtype == torch.float32
        ref = reference_draft_logits(raw_d, sd, emb, head, all_taps, bonus)
        _close(got, ref, f"{case}, step {i} (context {P})")
        # the draft itself must not change the cache: drafting again gives the same logits
        torch.testing.assert_close(d.draft_logits(torch.tensor(bonus), kv_len), got, rtol=0, atol=0)


def test_sliding_window_is_applied():
    """With a window of 5 the sliding layers must not see old context: the twin without the
    window differs, the twin with it matches (guards against a reference that cannot tell)."""
    target, d, raw_d = _pair(dict(layers=2, block_size=4, sliding=5))
    sd = {k: v.detach() for k, v in d.state_dict().items()}
    ntap = len(d.cfg.target_layer_ids) * d.cfg.hidden_size
    taps = torch.randn(20, ntap, generator=torch.Generator().manual_seed(5))
    d.reset()
    d.add_context(taps)
    got = d.draft_logits(torch.tensor(11), 20)
    emb, head = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    _close(got, reference_draft_logits(raw_d, sd, emb, head, taps, 11), "windowed")
    no_window = dict(raw_d, sliding_window=10**6)
    assert (got - reference_draft_logits(no_window, sd, emb, head, taps, 11).float()).abs().max() > 1e-3


def test_drafter_yarn_matches_reference():
    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
                             "beta_fast": 32.0, "beta_slow": 1.0}}
    target, d, raw_d = _pair(dict(layers=1, block_size=5), rope=yarn)
    assert d.cfg.rope_scaling is not None
    inv, att = _yarn_reference(10000.0, 16, 8.0, 16, 32.0, 1.0)
    ang = torch.arange(200, dtype=torch.float64)[:, None] * inv
    cos_t, sin_t = torch.cat([ang, ang], -1).cos() * att, torch.cat([ang, ang], -1).sin() * att
    sd = {k: v.detach() for k, v in d.state_dict().items()}
    ntap = len(d.cfg.target_layer_ids) * d.cfg.hidden_size
    g = torch.Generator().manual_seed(9)
    emb, head = target.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    d.reset()
    committed = []
    for rows, n in [(30, 30), (5, 2), (5, 4)]:
        taps = torch.randn(rows, ntap, generator=g)
        d.add_context(taps, n)
        committed.append(taps[:n])
        all_taps = torch.cat(committed)
        got = d.draft_logits(torch.tensor(4), all_taps.shape[0] + 2)
        ref = reference_draft_logits(raw_d, sd, emb, head, all_taps, 4, cos_t, sin_t)
        _close(got, ref, f"yarn, context {all_taps.shape[0]}")


def test_slot0_is_the_bonus_embedding():
    """The drafter's slot 0 embeds the bonus token, not the mask token: changing the bonus changes
    the draft (and the twin agrees for both)."""
    target, d, raw_d = _pair(dict(layers=1, block_size=6))
    ntap = len(d.cfg.target_layer_ids) * d.cfg.hidden_size
    taps = torch.randn(7, ntap, generator=torch.Generator().manual_seed(2))
    d.reset()
    d.add_context(taps)
    a = d.draft_logits(torch.tensor(5), 7)
    b = d.draft_logits(torch.tensor(6), 7)
    assert (a - b).abs().max() > 1e-4


@torch.no_grad()
@pytest.mark.parametrize("k,temperature", [(1, None), (5, 0.7)])
def test_fused_draft_topk_equals_logits_then_topk(k, temperature):
    """The fused draft (one compiled function from the block's embedding to the top-k) against its
    twin, draft_logits + topk_logprobs, in float32 on fresh inputs: same ids, log-probs to 1e-5.
    Context rows go in through add_context's compiled row gather (rows=) on one side and an eager
    index_select on the other."""
    from ddtree.model.drafter import topk_logprobs

    target, d, raw_d = _pair(dict(layers=2, block_size=6))
    ntap = len(d.cfg.target_layer_ids) * d.cfg.hidden_size
    g = torch.Generator().manual_seed(k)
    taps = torch.randn(9, ntap, generator=g)
    rows = torch.tensor([0, 3, 4, 4, 4])
    want, got = [], []
    for fused in (False, True):
        d.reset()
        d.compile_layers = fused
        d.add_context(taps[:4])
        if fused:
            d.add_context(taps, torch.tensor(3), rows=rows)
        else:
            d.add_context(taps.index_select(0, rows), torch.tensor(3))
        assert d._fusable() == fused
        for bonus in (5, 9):
            out = d.draft_topk(torch.tensor(bonus), 12, k, temperature)
            (got if fused else want).append(out)
    d.compile_layers = False
    want_direct = topk_logprobs(d.draft_logits(torch.tensor(9), 12), k, temperature)
    assert torch.equal(want[1][1], want_direct[1])
    for (lw, iw), (lg, ig) in zip(want, got):
        assert torch.equal(iw, ig)
        torch.testing.assert_close(lg, lw, rtol=1e-5, atol=1e-5)

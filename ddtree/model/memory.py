"""Byte accounting from the configs alone: nothing is allocated, torch is not imported.

Three kinds of figures, kept apart because they are not equally certain:

* EXACT: the weights (the parameters TargetModel / DFlashDrafter register, in the load dtype), the
  constants `prepare()` derives from them, and the state buffers `allocate_state` makes. Tests
  compare them byte for byte with the tensors a built model holds (tests/model/test_memory.py).
* READ per decode step: what one target forward of a token (and one drafter round) streams from
  memory, for balancing a layer split.
* ESTIMATED transients: the peaks of one forward beyond the state (attention workspace, prefill
  taps, logits, activations), each formula derived from the code path it models and said so.

Notation in the formulas: H hidden, I intermediate, V vocab, nh/kvh/hd attention heads, KV heads
and head dim, hk/hv/dk/dv GDN key/value heads and dims, C = 2 hk dk + hv dv the GDN conv
channels, w the conv width, dt the bytes of the load dtype, S a context length, T the nodes of one
forward.
"""

from __future__ import annotations

from ddtree.model.config import DrafterConfig, TargetConfig

GDN, ATTN = "linear_attention", "full_attention"
F32 = 4
LONG = 8

_DTYPES = {"bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "half": 2, "float32": 4, "fp32": 4, "float": 4}


def dtype_bytes(dtype) -> int:
    """Bytes per element of a torch dtype or its name ('bfloat16', 'torch.float16', 'fp32', ...)."""
    name = str(dtype).replace("torch.", "").strip().lower()
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}")
    return _DTYPES[name]


# ============================================================================================
# weights (exact)
# ============================================================================================


def gdn_mixer_numel(cfg: TargetConfig) -> int:
    """GatedDeltaNet: in_proj_qkv [C, H], in_proj_z [hv dv, H], in_proj_b / in_proj_a [hv, H],
    conv1d [C, 1, w] (no bias), dt_bias / A_log [hv], gated norm [dv], out_proj [H, hv dv]."""
    H, C, hv, vd = cfg.hidden_size, cfg.gdn_conv_dim, cfg.gdn_num_v_heads, cfg.gdn_num_v_heads * cfg.gdn_v_dim
    return C * H + vd * H + 2 * hv * H + C * cfg.conv_kernel + 2 * hv + cfg.gdn_v_dim + H * vd


def attention_mixer_numel(cfg: TargetConfig) -> int:
    """Attention: q_proj [nh hd (x2 with the output gate), H], k/v_proj [kvh hd, H],
    o_proj [H, nh hd], q_norm / k_norm [hd]."""
    H, qd, kvd = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return qd * (2 if cfg.attn_output_gate else 1) * H + 2 * kvd * H + H * qd + 2 * cfg.head_dim


def mlp_numel(hidden: int, inter: int) -> int:
    """gate_proj / up_proj [I, H], down_proj [H, I]."""
    return 3 * hidden * inter


def layer_weight_numel(cfg: TargetConfig, kind: str) -> dict[str, int]:
    """One decoder layer by part: its mixer (GDN or attention), its MLP, its two RMSNorms [H]."""
    mixer = gdn_mixer_numel(cfg) if kind == GDN else attention_mixer_numel(cfg)
    return {"mixer": mixer, "mlp": mlp_numel(cfg.hidden_size, cfg.intermediate_size), "norms": 2 * cfg.hidden_size}


def layer_weight_bytes(cfg: TargetConfig, kind: str, dtype) -> int:
    return sum(layer_weight_numel(cfg, kind).values()) * dtype_bytes(dtype)


def embedding_bytes(cfg: TargetConfig, dtype) -> int:
    """embed_tokens [V, H], on the first device."""
    return cfg.vocab_size * cfg.hidden_size * dtype_bytes(dtype)


def head_bytes(cfg: TargetConfig, dtype) -> int:
    """Final norm [H] + lm_head [V, H] on the last device. A tied lm_head is the embedding's tensor
    (checkpoint.load_weights assigns the same tensor): only the norm is new."""
    lm = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
    return (cfg.hidden_size + lm) * dtype_bytes(dtype)


def target_weight_bytes(cfg: TargetConfig, dtype) -> int:
    return (sum(layer_weight_bytes(cfg, k, dtype) for k in cfg.layer_types)
            + embedding_bytes(cfg, dtype) + head_bytes(cfg, dtype))


def drafter_weight_numel(d: DrafterConfig) -> dict[str, int]:
    """DFlash drafter by part. Per layer: q_proj [nh hd, H], k/v_proj [kvh hd, H], o_proj [H, nh hd],
    q_norm / k_norm [hd], MLP, two RMSNorms [H]; then fc [H, taps H], hidden_norm and norm [H].
    No embedding and no lm_head: it borrows the target's."""
    H, qd, kvd = d.hidden_size, d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    attn = qd * H + 2 * kvd * H + H * qd + 2 * d.head_dim
    layer = attn + mlp_numel(H, d.intermediate_size) + 2 * H
    return {"layers": d.num_layers * layer, "fc": len(d.target_layer_ids) * H * H, "norms": 2 * H}


def drafter_weight_bytes(d: DrafterConfig, dtype) -> int:
    return sum(drafter_weight_numel(d).values()) * dtype_bytes(dtype)


# Constants prepare() derives from the weights (fp32 copies kept beside them; the fused projection
# weights are views, so they cost nothing). Exact.

def layer_prepared_bytes(cfg: TargetConfig, kind: str) -> int:
    """(1 + w) in fp32 for every x * (1 + w) RMSNorm (Qwen3.5: the layer's two [H], attention's
    q_norm / k_norm [hd]); a GDN layer's conv weight as fp32 [w, C] and -exp(A_log) fp32 [hv]."""
    n = 0
    if cfg.norm_plus_one:
        n += 2 * cfg.hidden_size + (2 * cfg.head_dim if kind == ATTN else 0)
    if kind == GDN:
        n += cfg.conv_kernel * cfg.gdn_conv_dim + cfg.gdn_num_v_heads
    return n * F32


def head_prepared_bytes(cfg: TargetConfig) -> int:
    """(1 + w) fp32 [H] of the final norm (Qwen3.5 norms only)."""
    return cfg.hidden_size * F32 if cfg.norm_plus_one else 0


# ============================================================================================
# state buffers (exact: TargetModel.allocate_state, GDNGroup, DFlashDrafter.allocate_state)
# ============================================================================================


def kv_cache_bytes(cfg: TargetConfig, n_attn: int, max_len: int, dtype) -> int:
    """K and V stacks of one device: 2 x [attention layers, max_len, kvh, hd] in the load dtype."""
    return 2 * n_attn * max_len * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)


def gdn_group_bytes(cfg: TargetConfig, n_gdn: int, dtype, tree_capacity: int) -> dict[str, int]:
    """A device's GDNGroup over n = n_gdn layers, cap = tree_capacity nodes:
    conv [n, w-1, C] dtype; recurrent state and a prefill chunk's final states, each fp32
    [n, hv, dk, dv]; tree-verify scratch: k [n, hv, cap, dk], U [n, hv, cap, dv], c [n, hv, cap]
    fp32 and the conv inputs ext [n, w-1+cap, C] dtype."""
    if n_gdn == 0:
        return {"conv": 0, "recurrent": 0, "scratch": 0}
    dt, hv, dk, dv, hist, C = (dtype_bytes(dtype), cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim,
                               cfg.conv_kernel - 1, cfg.gdn_conv_dim)
    return {
        "conv": n_gdn * hist * C * dt,
        "recurrent": 2 * n_gdn * hv * dk * dv * F32,
        "scratch": n_gdn * (hv * tree_capacity * (dk + dv + 1) * F32 + (hist + tree_capacity) * C * dt),
    }


def target_rope_bytes(cfg: TargetConfig, max_len: int) -> int:
    """cos and sin fp32 [max_len, rotary_dim], on every device that holds layers."""
    return 2 * max_len * cfg.rotary_dim * F32


def drafter_state_bytes(d: DrafterConfig, max_len: int, dtype) -> dict[str, int]:
    """Context K and V per layer [max_len + B, kvh, hd] in the load dtype (the block is written past
    the context); cos / sin fp32 [max_len + B, hd]; ctx_len, one long."""
    rows = max_len + d.block_size
    return {"kv": 2 * d.num_layers * rows * d.num_kv_heads * d.head_dim * dtype_bytes(dtype),
            "rope": 2 * rows * d.head_dim * F32 + LONG}


# ============================================================================================
# bytes read per decode step (one target forward of a token, one drafter round)
# ============================================================================================


def layer_read_bytes(cfg: TargetConfig, kind: str, context: int, dtype) -> int:
    """A layer's weights, plus for attention its K and V up to `context` (2 context kvh hd dt), for
    GDN its recurrent state read and written back (2 hv dk dv fp32) and its conv rows."""
    dt = dtype_bytes(dtype)
    w = layer_weight_bytes(cfg, kind, dtype)
    if kind == ATTN:
        return w + 2 * context * cfg.num_kv_heads * cfg.head_dim * dt
    return w + 2 * cfg.gdn_num_v_heads * cfg.gdn_k_dim * cfg.gdn_v_dim * F32 + 2 * (cfg.conv_kernel - 1) * cfg.gdn_conv_dim * dt


def head_read_bytes(cfg: TargetConfig, dtype) -> int:
    """lm_head [V, H] and the final norm (the embedding is read one row a token: not counted)."""
    return (cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) * dtype_bytes(dtype)


def drafter_read_bytes(d: DrafterConfig, context: int, dtype) -> int:
    """A drafter round: its weights, and every layer's context K and V up to `context` (sliding
    layers mask past their window but still read the whole slice today)."""
    return drafter_weight_bytes(d, dtype) + 2 * d.num_layers * context * d.num_kv_heads * d.head_dim * dtype_bytes(dtype)


# ============================================================================================
# transients (estimates: peaks of one forward beyond the state; each says what it is based on)
# ============================================================================================

#: SDPA backends a masked grouped-query attention can take. With a boolean mask and kv heads <
#: query heads, torch's flash kernel is ruled out (no mask) and its memory-efficient kernel too (no
#: GQA): it falls to `math` unless cuDNN attention is preferred (sm90 / sm100 with cuDNN > 9.15),
#: which is `fused` here. RTX A6000 (sm86) and A100 (sm80) take `math`.
ATTENTION_PATHS = ("math", "fused")


def sdpa_workspace_bytes(q_heads: int, kv_heads: int, head_dim: int, T: int, S: int, dtype, path: str) -> int:
    """Peak extra memory of one F.scaled_dot_product_attention over T queries and S keys with a
    boolean mask and enable_gqa.

    math (aten _scaled_dot_product_attention_math): q, k and v cast to fp32 (bf16/fp16 reduction
    in math SDPA is off by default), k and v repeat_interleave'd to the query heads, the boolean
    mask made additive in the input dtype [T, S], and scores [h, T, S] fp32. The peak is either the
    QK^T product (the scaled k^T copy [h, S, hd] and the scores) or _safe_softmax, which holds the
    scores, the softmax, the -inf test (bool) and the where() result at once: 13 bytes a score.
    Checked against the live bytes of torch's math path in tests/model/test_memory.py.
    fused (cuDNN): the additive mask [T, S] and contiguous copies of the k / v views."""
    dt = dtype_bytes(dtype)
    mask = T * S * dt
    if path == "fused":
        return mask + 2 * S * kv_heads * head_dim * dt
    if path != "math":
        raise ValueError(f"unknown attention path {path!r}")
    kv32 = 2 * S * kv_heads * head_dim * F32
    kv_rep = 2 * S * q_heads * head_dim * F32
    q32 = 2 * T * q_heads * head_dim * F32
    scores = T * q_heads * S * F32
    qk = S * q_heads * head_dim * F32 + scores
    softmax = 3 * scores + scores // 4 + q_heads * T  # + the all-masked rows [h, T, 1] bool
    return kv32 + kv_rep + q32 + mask + max(qk, softmax)


def step_mask_bytes(T: int, S: int) -> int:
    """TargetModel.make_step on each device: attention mask, tree visibility and the gathered path
    rows, bool [T, S] each, and three long index rows [S]."""
    return 3 * T * S + 3 * S * LONG


def widest_row(cfg: TargetConfig) -> int:
    """The widest activation row of one layer: the fused gate|up [2 I], the GDN input projection
    [C + hv dv + 2 hv] or the attention q|k|v [nh hd (x2) + 2 kvh hd]."""
    gdn = cfg.gdn_conv_dim + cfg.gdn_num_v_heads * cfg.gdn_v_dim + 2 * cfg.gdn_num_v_heads
    attn = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1) + 2 * cfg.num_kv_heads * cfg.head_dim
    return max(2 * cfg.intermediate_size, gdn if cfg.is_hybrid else 0, attn)


def activation_bytes(cfg: TargetConfig, T: int) -> int:
    """A bound on one layer's intermediates for T nodes (projections, norms in fp32, gates, the GDN
    recurrence's fp32 q / k / v / decay): 8 fp32 copies of its widest row per node."""
    return 8 * T * widest_row(cfg) * F32


def logits_bytes(cfg: TargetConfig, rows: int, dtype) -> int:
    """lm_head output [rows, V] in the load dtype and up to three fp32 copies of it (cast,
    softmax / top-p for sampling, the exponential race)."""
    return rows * cfg.vocab_size * (dtype_bytes(dtype) + 3 * F32)


def prefill_taps_bytes(cfg: TargetConfig, d: DrafterConfig, rows: int, dtype) -> int:
    """TargetModel.prefill keeps every chunk's taps [rows, taps H] for the drafter until the end
    of the prompt (then concatenates them: twice that, briefly)."""
    return rows * len(d.target_layer_ids) * cfg.hidden_size * dtype_bytes(dtype)


def drafter_context_bytes(cfg: TargetConfig, d: DrafterConfig, rows: int, dtype) -> int:
    """DFlashDrafter.add_context over `rows` context rows (the whole prompt after a prefill): the
    taps it reads [rows, taps H], fc's output [rows, H] and hidden_norm's fp32 input and normed
    rows (2 x [rows, H] fp32: torch's fused CUDA rms_norm; the composite one also squares). The
    per-layer k / v that follow are smaller ([rows, 2 kvh hd] and a few copies for norm and rope)."""
    return prefill_taps_bytes(cfg, d, rows, dtype) + rows * d.hidden_size * (dtype_bytes(dtype) + 2 * F32)


def drafter_round_bytes(cfg: TargetConfig, d: DrafterConfig, context: int, dtype, path: str) -> int:
    """One draft: attention over [context ; block] (the same SDPA path), its mask, the block's
    activations and the draft logits [B-1, V] (on the lm_head's device; counted there)."""
    B = d.block_size
    S = context + B
    attn = sdpa_workspace_bytes(d.num_heads, d.num_kv_heads, d.head_dim, B, S, dtype, path) + 3 * B * S
    return attn + 8 * B * 2 * d.intermediate_size * F32

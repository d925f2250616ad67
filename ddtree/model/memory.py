"""Byte accounting from the configs alone: nothing is allocated, torch is not imported.

Three kinds of figures, kept apart because they are not equally certain:

* EXACT: the weights (the parameters TargetModel / DFlashDrafter register, in the load dtype), the
  constants `prepare()` derives from them, and the state buffers `allocate_state` makes. Tests
  compare them byte for byte with the tensors a built model holds (tests/model/test_memory.py).
* READ per decode step: what one target forward of a token (and one drafter round) streams from
  memory, for balancing a layer split.
* ESTIMATED transients: the peaks of one piece of a generation beyond the state (a prefill chunk
  through a layer, the drafter's context of a chunk, a verify, a draft), each formula derived from
  the code path it models and said so; the prefill ones per token of a chunk, checked against the
  live bytes of those paths in tests/model/test_memory.py and on a GPU by
  scripts/check_memory_plan.py.

Notation in the formulas: H hidden, I intermediate, V vocab, nh/kvh/hd attention heads, KV heads
and head dim, hk/hv/dk/dv GDN key/value heads and dims, C = 2 hk dk + hv dv the GDN conv
channels, w the conv width, dt the bytes of the load dtype, S a context length, T the nodes (or
tokens) of one forward, B the drafter's block.
"""

from __future__ import annotations

from ddtree.model.config import DrafterConfig, TargetConfig
from ddtree.ops.split_rule import FUSED_MIN_ROWS, fused_prefix_plan, num_splits

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


# Constants prepare() derives from the weights (fp32 copies and the GDN conv weight's contiguous
# copy kept beside them; the fused projection weights are views, so they cost nothing). Exact.

def layer_prepared_bytes(cfg: TargetConfig, kind: str, dtype) -> int:
    """(1 + w) in fp32 for every x * (1 + w) RMSNorm (Qwen3.5: the layer's two [H], attention's
    q_norm / k_norm [hd]); a GDN layer's conv weight as fp32 [w, C], -exp(A_log) fp32 [hv], and
    the conv weight [w, C] contiguous in the model dtype `dtype` (in float32 the fp32 copy itself)."""
    n = 0
    if cfg.norm_plus_one:
        n += 2 * cfg.hidden_size + (2 * cfg.head_dim if kind == ATTN else 0)
    extra = 0
    if kind == GDN:
        n += cfg.conv_kernel * cfg.gdn_conv_dim + cfg.gdn_num_v_heads
        if dtype_bytes(dtype) != F32:
            extra = cfg.conv_kernel * cfg.gdn_conv_dim * dtype_bytes(dtype)
    return n * F32 + extra


def head_prepared_bytes(cfg: TargetConfig) -> int:
    """(1 + w) fp32 [H] of the final norm (Qwen3.5 norms only)."""
    return cfg.hidden_size * F32 if cfg.norm_plus_one else 0


# ============================================================================================
# state buffers (exact: TargetModel.allocate_state, GDNGroup, DFlashDrafter.allocate_state,
# ddtree.decode.round.DeferredContext)
# ============================================================================================

#: ddtree.model.drafter.DEFERRED_ROWS (= ddtree.decode.budget.PLAIN_PROBE_MAX): the context rows
#: --budget auto's plain steps may defer (mirrored here so that no torch import is needed; a test
#: keeps them equal)
DEFERRED_ROWS = 64


def kv_cache_bytes(cfg: TargetConfig, n_attn: int, max_len: int, dtype) -> int:
    """K and V stacks of one device: 2 x [attention layers, max_len, kvh, hd] in the load dtype."""
    return 2 * n_attn * max_len * cfg.num_kv_heads * cfg.head_dim * dtype_bytes(dtype)


def gdn_group_bytes(cfg: TargetConfig, n_gdn: int, dtype, tree_capacity: int) -> dict[str, int]:
    """A device's GDNGroup over n = n_gdn layers, cap = tree_capacity nodes:
    conv [n, w-1, C] dtype; recurrent state fp32 [n, hv, dk, dv]; tree-verify scratch (a verify's,
    not touched by the prefill): k [n, hv, cap, dk], U [n, hv, cap, dv], c [n, hv, cap] fp32 and
    the conv inputs ext [n, w-1+cap, C] dtype."""
    if n_gdn == 0:
        return {"conv": 0, "recurrent": 0, "scratch": 0}
    dt, hv, dk, dv, hist, C = (dtype_bytes(dtype), cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim,
                               cfg.conv_kernel - 1, cfg.gdn_conv_dim)
    return {
        "conv": n_gdn * hist * C * dt,
        "recurrent": n_gdn * hv * dk * dv * F32,
        "scratch": n_gdn * (hv * tree_capacity * (dk + dv + 1) * F32 + (hist + tree_capacity) * C * dt),
    }


#: ddtree.decode.conversation.SNAPSHOTS: the GDN state snapshots `ddtree chat` keeps (mirrored here so
#: that no torch import is needed; a test keeps them equal)
CHAT_SNAPSHOTS = 4


def gdn_snapshot_bytes(cfg: TargetConfig, n_gdn: int, dtype, snapshots: int) -> int:
    """ddtree.decode.conversation.Conversation's snapshots on a device: `snapshots` copies of its
    GDNGroup's conv [n, w-1, C] and fp32 recurrent states [n, hv, dk, dv] (no scratch)."""
    g = gdn_group_bytes(cfg, n_gdn, dtype, 0)
    return snapshots * (g["conv"] + g["recurrent"])


def target_rope_bytes(cfg: TargetConfig, max_len: int) -> int:
    """cos and sin fp32 [max_len, rotary_dim], on every device that holds layers."""
    return 2 * max_len * cfg.rotary_dim * F32


def drafter_cache_rows(d: DrafterConfig, max_len: int) -> int:
    """DFlashDrafter.cache_rows: max_len + DEFERRED_ROWS + B (a block's own rows, or a deferred
    context flush plus a block, are written past the context)."""
    return max_len + DEFERRED_ROWS + d.block_size


def drafter_state_bytes(d: DrafterConfig, max_len: int, dtype) -> dict[str, int]:
    """Context K and V per layer [cache_rows, kvh, hd] in the load dtype; cos / sin fp32
    [cache_rows, hd]; ctx_len, one long."""
    rows = drafter_cache_rows(d, max_len)
    return {"kv": 2 * d.num_layers * rows * d.num_kv_heads * d.head_dim * dtype_bytes(dtype),
            "rope": 2 * rows * d.head_dim * F32 + LONG}


def deferred_context_bytes(cfg: TargetConfig, d: DrafterConfig, dtype) -> int:
    """ddtree.decode.round.DeferredContext (made on the drafter's device when --budget auto runs):
    rows [DEFERRED_ROWS, taps H] in the target's dtype, count (one long), index [DEFERRED_ROWS] long."""
    return DEFERRED_ROWS * len(d.target_layer_ids) * cfg.hidden_size * dtype_bytes(dtype) + LONG + DEFERRED_ROWS * LONG


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
# transients (estimates: peaks of one piece of a generation beyond the state; each names the code
# it models). Eager code is modelled: compiled layers and CUDA graphs fuse, so they hold less.
# ============================================================================================

#: TargetModel.prefill_chunk's bounds and step (tokens of one prefill forward)
PREFILL_CHUNK_MIN, PREFILL_CHUNK_MAX, PREFILL_CHUNK_STEP = 256, 8192, 256
#: tokens per chunk of the GDN chain recurrence: gdn.chain_chunked's default and fla's chunk size
GDN_CHAIN_CHUNK = 64


def prefill_chunk_tokens(cfg: TargetConfig, free_bytes: int | None) -> int:
    """The chunk TargetModel.prefill_chunk picks on a GPU with free_bytes free on the first layer's
    device (None: not known here; the largest chunk, which bounds the others)."""
    if free_bytes is None:
        return PREFILL_CHUNK_MAX
    per_token = 4 * (3 * cfg.intermediate_size + 3 * max(cfg.gdn_conv_dim, 1) + 4 * cfg.hidden_size
                     + 3 * cfg.num_heads * cfg.head_dim)
    n = max(PREFILL_CHUNK_MIN, min(PREFILL_CHUNK_MAX, free_bytes // 4 // per_token))
    return int(n // PREFILL_CHUNK_STEP * PREFILL_CHUNK_STEP)


def norm_peak_bytes(rows: int, dim: int, dtype, fp32_weight: bool) -> int:
    """Peak bytes inside RMSNorm.forward over [rows, dim], its output included, as torch's
    composite rms_norm allocates them (the fused CUDA kernel allocates less): the fp32 input copy
    (none for an fp32 input), its square (then the normalised product), the per-row mean and
    rsqrt, and for x * (1 + w) norms the fp32 weight product beside them; the plain norm casts
    first and scales in the input dtype."""
    copy = F32 if dtype_bytes(dtype) < F32 else 0
    return rows * (dim * (copy + 2 * F32 if fp32_weight else 2 * F32) + 2 * F32)


def gated_norm_peak_bytes(n: int, dtype) -> int:
    """GatedRMSNorm.forward (the GDN output norm) over n elements, output included: the normed
    rows, w * them, z in fp32, silu(z) and their fp32 product (the rms_norm's own copies before)."""
    return n * (dtype_bytes(dtype) + 3 * F32)


def rope_peak_bytes(n_rows: int, heads: int, head_dim: int, rotary_dim: int, dtype) -> int:
    """layers.apply_rope over [n_rows, heads, head_dim], output included: x[:rd] * cos, rotate_half
    (the negated half, its cat), * sin, their sum, then the cat with the pass-through dims."""
    return n_rows * heads * dtype_bytes(dtype) * max(3 * rotary_dim, rotary_dim + head_dim)


def mlp_prefill_bytes(cfg: TargetConfig, T: int, dtype) -> int:
    """The MLP half of DecoderLayer.prefill over T tokens, beyond the layer's input x: the residual
    sum and its post-attention norm [T, H], then MLP.forward's fused gate|up [T, 2I], silu(gate)
    and its product with up [T, I] each (down_proj's [T, H] comes after silu(gate) is freed)."""
    dt = dtype_bytes(dtype)
    return T * dt * (2 * cfg.hidden_size + 4 * cfg.intermediate_size)


def gdn_prefill_bytes(cfg: TargetConfig, T: int, dtype, fla: bool) -> int:
    """GatedDeltaNet.prefill over a chunk of T tokens (its input, the layer's normed x, excluded).

    From the causal conv on, its locals live to the end: the input projection [T, C + hv dv + 2 hv],
    xc = [conv_state; qkv] [w-1+T, C], the fp32 conv accumulator acc [T, C], mixed [T, C], the
    repeated fp32 q|k [T, 2, hv, dk] and g, beta fp32 [T, hv]. The peak is the largest of:
      conv: acc, xc[j:j+T].float() and w[j] * it (3 x [T, C] fp32) before mixed exists;
      l2norm_qk over [T, 2, hk, dk] in fp32, then its rows beside their repeat to the value heads;
      recurrence, fla (ddtree.ops.fla.fla_chain -> chunk_gated_delta_rule): q and k made
        contiguous, v.float(), the cumulated g, the WY matrix A [T, hv, 64], w, u, the chunk
        states h [ceil(T/64), hv, dk, dv], v_new and o, all fp32, and the final state;
      recurrence, gdn.chain_chunked (no fla): the outputs of the 64-token chunks so far and their
        cat (2 x [T, hv, dv] fp32), a chunk's tree_wy temporaries (5 x [hv, 64, 64] and
        6 x [hv, 64, dv] fp32) and the carried state twice;
      the output norm: o fp32 and o.to(dtype) [T, hv, dv] and GatedRMSNorm's peak."""
    if not cfg.is_hybrid:
        return 0
    dt = dtype_bytes(dtype)
    C, hv, hk, dk, dv, hist = (cfg.gdn_conv_dim, cfg.gdn_num_v_heads, cfg.gdn_num_k_heads, cfg.gdn_k_dim,
                               cfg.gdn_v_dim, cfg.conv_kernel - 1)
    proj = T * (C + hv * dv + 2 * hv) * dt
    xc = (hist + T) * C * dt
    conv = proj + xc + 3 * T * C * F32
    held = proj + xc + T * C * (F32 + dt) + T * (2 * hv * dk + 2 * hv) * F32
    qk, rep = T * 2 * hk * dk * F32, T * 2 * hv * dk * F32
    l2 = held - rep + max(3 * qk, qk + rep)  # l2norm_qk's fp32 copy, square and normed rows; then beside their repeat
    state = hv * dk * dv * F32
    n = min(GDN_CHAIN_CHUNK, T)
    if fla:
        chunks = -(-T // GDN_CHAIN_CHUNK)
        rec = (T * (2 * hv * dk + hv * dv + hv + GDN_CHAIN_CHUNK * hv + hv * dk + 3 * hv * dv) * F32
               + chunks * state + state)
    else:
        rec = max(T * hv * dv * F32 + hv * (5 * n * n + 6 * n * dv) * F32, 2 * T * hv * dv * F32) + 2 * state
    norm = T * hv * dv * (F32 + dt) + gated_norm_peak_bytes(T * hv * dv, dtype) + state
    return max(conv, l2, held + rec, held + norm)


def prefill_attention_workspace_bytes(cfg: TargetConfig, T: int, S: int, sms: int = 148, bm: int = 128) -> int:
    """ddtree.ops.attention.prefill_attention's fallback where SDPA's flash kernel does not run
    (its "triton" backend: tree_attention over keys [0, S), causal): the split-KV workspace
    NS x KVH x T*G x (D + 2) fp32 when num_splits gives NS >= 2 (few query rows over a long
    prefix: a prompt's short last chunk). Bounded with the largest row tile (bm) and SM count
    (sms) of the GPUs it runs on. Flash itself keeps only its output and log-sum-exp."""
    kvh, G = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
    return _split_workspace(kvh, cfg.head_dim, T * G, S, sms, bm)


def _split_workspace(kv_heads: int, head_dim: int, rows: int, S: int, sms: int, bm: int) -> int:
    """fp32 partials of tree_attention's NS splits (ddtree.ops.split_rule.num_splits, one program
    per SM): NS x KVH x rows x (D + 2); none when it does not split."""
    return num_splits(S, rows, kv_heads, bm, sms) * kv_heads * rows * (head_dim + 2) * F32


def attention_prefill_bytes(cfg: TargetConfig, T: int, S: int, dtype) -> int:
    """Attention.prefill over a chunk of T tokens ending at key S (its input, the normed x, excluded):
    the fused q|k|v [T, nh hd (x2 gated) + 2 kvh hd] and the output gate's copy [T, nh hd], then the
    largest of q_norm's peak (over [T, nh, hd]), rope of q beside the normed q, and, once the
    roped q and k are held, prefill_attention's output [T, nh, hd] with its fp32 log-sum-exp
    [nh, T] (SDPA's flash kernel, no mask), sigmoid(gate) and o * it; or cuDNN's two calls (the
    prefix and the chunk's own block: two outputs, three log-sum-exps) and their fp32 merge
    (two [T, nh, hd] fp32 at its peak); or the triton fallback's workspace."""
    dt = dtype_bytes(dtype)
    q, kvd = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    gated = cfg.attn_output_gate
    base = T * (q * (2 if gated else 1) + 2 * kvd) * dt + (T * q * dt if gated else 0)
    qn = norm_peak_bytes(T * cfg.num_heads, cfg.head_dim, dtype, cfg.norm_plus_one)
    rope = T * q * dt + rope_peak_bytes(T, cfg.num_heads, cfg.head_dim, cfg.rotary_dim, dtype)
    held = T * (q + kvd) * dt  # roped q and k
    out = T * q * dt + T * cfg.num_heads * F32 + (2 * T * q * dt if gated else 0)
    out = max(out, T * q * dt + prefill_attention_workspace_bytes(cfg, T, S),
              2 * T * q * dt + 3 * T * cfg.num_heads * F32 + 2 * T * q * F32)
    return base + max(qn, rope, held + out)


def prefill_layer_bytes(cfg: TargetConfig, kind: str, T: int, S: int, dtype, fla: bool) -> int:
    """DecoderLayer.prefill over a chunk of T tokens (keys up to S), beyond its input x: the mixer
    half (input_layernorm's output [T, H] + the mixer's peak, or the norm's own peak) or the MLP
    half, whichever is larger."""
    dt = dtype_bytes(dtype)
    mixer = gdn_prefill_bytes(cfg, T, dtype, fla) if kind == GDN else attention_prefill_bytes(cfg, T, S, dtype)
    norm = norm_peak_bytes(T, cfg.hidden_size, dtype, cfg.norm_plus_one)
    return max(T * cfg.hidden_size * dt + mixer, norm, mlp_prefill_bytes(cfg, T, dtype))


def taps_bytes(cfg: TargetConfig, d: DrafterConfig, rows: int, dtype) -> int:
    """Tap rows [rows, taps H] in the target's dtype (TargetModel._prefill_chunk's cat of the
    tapped layers' outputs, the drafter's context input)."""
    return rows * len(d.target_layer_ids) * cfg.hidden_size * dtype_bytes(dtype)


def drafter_context_bytes(cfg: TargetConfig, d: DrafterConfig, rows: int, dtype) -> int:
    """DFlashDrafter.add_context of one prefill chunk's `rows` tap rows, on the drafter's device
    (the taps themselves excluded: they are the caller's): fc's output [rows, H] and hidden_norm's
    peak, or, with the normed rows h [rows, H], the slots and the rope rows (fp32 [rows, hd] x 2),
    one layer's k|v [rows, 2 kvh hd] with k_norm's or rope's peak over k."""
    dt = dtype_bytes(dtype)
    H, kvd = d.hidden_size, d.num_kv_heads * d.head_dim
    first = rows * H * dt + norm_peak_bytes(rows, H, dtype, False)
    k = max(norm_peak_bytes(rows * d.num_kv_heads, d.head_dim, dtype, False),
            rows * kvd * dt + rope_peak_bytes(rows, d.num_kv_heads, d.head_dim, d.head_dim, dtype))
    layer = rows * 2 * kvd * dt + k
    return max(first, rows * H * dt + rows * (LONG + 2 * d.head_dim * F32) + layer)


#: SDPA backends of the masked attention a verify (Attention.forward: SDPA with the dense
#: [T, kv_len] mask of TargetModel.make_step) and a draft (DraftAttention.forward) take. With a
#: boolean mask and kv heads < query heads, torch's flash kernel is ruled out (no mask) and its
#: memory-efficient kernel too (no GQA): it falls to `math` unless cuDNN attention is preferred
#: (sm90 / sm100 with cuDNN > 9.15), which is `fused` here. RTX A6000 (sm86) and A100 (sm80) take
#: `math`. (The prefill takes neither: ddtree.ops.attention.prefill_attention has no mask.)
#: `kernel`: ddtree.ops.attention.tree_attention (the default wherever Triton runs): no mask at
#: all, only its split-KV partials.
ATTENTION_PATHS = ("kernel", "math", "fused")


def tree_attention_workspace_bytes(q_heads: int, kv_heads: int, head_dim: int, T: int, S: int, sms: int = 132,
                                   bm: int = 128, dt: int = 2) -> int:
    """tree_attention's fp32 partials for T queries over S keys (_split_workspace; bm: the
    largest row tile of ddtree.ops.attention's table, which gives the most splits), and where
    the prefix may go through cuDNN (a verify's floor up to S) that part's too: the folded
    queries, their copy per range, each range's output and log-sum-exp (split_rule.fused_prefix_plan)."""
    rows = T * (q_heads // kv_heads)
    n = fused_prefix_plan(S, rows, kv_heads, sms)[0] if rows >= FUSED_MIN_ROWS else 0
    split = _split_workspace(kv_heads, head_dim, rows, S, sms, bm)
    if not n:
        return split
    # the kernel then always writes partials (at least one range) and cuDNN's own come beside them
    partials = max(split, kv_heads * rows * (head_dim + 2) * F32)
    return partials + kv_heads * rows * head_dim * dt * (1 + 2 * n) + n * kv_heads * rows * F32


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
    if path == "kernel":
        return tree_attention_workspace_bytes(q_heads, kv_heads, head_dim, T, S, dt=dt)
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
    """TargetModel.make_step on each device (a verify): the attention mask held through the forward,
    the tree visibility and the gathered path rows, bool [T, S] each, and three long index rows [S]."""
    return 3 * T * S + 3 * S * LONG


def widest_row(cfg: TargetConfig) -> int:
    """The widest activation row of one layer: the fused gate|up [2 I], the GDN input projection
    [C + hv dv + 2 hv] or the attention q|k|v [nh hd (x2) + 2 kvh hd]."""
    gdn = cfg.gdn_conv_dim + cfg.gdn_num_v_heads * cfg.gdn_v_dim + 2 * cfg.gdn_num_v_heads
    attn = cfg.num_heads * cfg.head_dim * (2 if cfg.attn_output_gate else 1) + 2 * cfg.num_kv_heads * cfg.head_dim
    return max(2 * cfg.intermediate_size, gdn if cfg.is_hybrid else 0, attn)


def activation_bytes(cfg: TargetConfig, T: int) -> int:
    """A bound on one layer's intermediates in a verify of T nodes (DecoderLayer.forward: the
    projections, norms in fp32, the tree conv's [T, w, C] fp32 window, tree_wy's fp32 q / k / v and
    [hv, T, T] terms or the Triton tree kernel's): 8 fp32 copies of the widest row per node. A
    prefill chunk takes the per-token model above (prefill_layer_bytes), not this bound."""
    return 8 * T * widest_row(cfg) * F32


def logits_bytes(cfg: TargetConfig, rows: int, dtype) -> int:
    """lm_head output [rows, V] in the load dtype and up to three fp32 copies of it (cast,
    softmax / top-p for sampling, the exponential race)."""
    return rows * cfg.vocab_size * (dtype_bytes(dtype) + 3 * F32)


def drafter_round_bytes(cfg: TargetConfig, d: DrafterConfig, context: int, dtype, path: str) -> int:
    """One draft (DFlashDrafter.draft_logits / draft_topk): per layer, DraftAttention.forward's SDPA
    over [context ; block] (S = context + B keys, the same masked SDPA path as the verify) and its
    mask (the key positions [S] long, the window's position differences [B, S] long and up to three
    bool [B, S] terms), and the block's activations; the draft logits [B-1, V] are on the lm_head's
    device (counted there)."""
    B = d.block_size
    S = context + B
    attn = sdpa_workspace_bytes(d.num_heads, d.num_kv_heads, d.head_dim, B, S, dtype, path)
    mask = S * LONG + B * S * (LONG + 3)
    return attn + mask + 8 * B * 2 * d.intermediate_size * F32

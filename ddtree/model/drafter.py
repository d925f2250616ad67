"""Our compact DFlash block-diffusion drafter (z-lab checkpoints).

One forward per round over the block [bonus, mask x (B-1)] at positions start..start+B-1. Keys and
values are [context rows ; block rows]: context rows come from the target's residual stream at
the tapped layers, `hidden_norm(fc(concat(taps)))`, projected by each layer's k/v (no input norm);
block rows from the layer's normed hidden state. Context K/V are cached (positions 0..start-1);
block K/V are recomputed every round, written past the context (the next context rows overwrite
them) so that the keys are one slice of the cache. The drafter has no embedding and no
lm_head: it borrows the target's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddtree.model.config import DrafterConfig
from ddtree.model.layers import MLP, RMSNorm, _identity, apply_rope, compiled, fused, residual
from ddtree.model.target import tree_attention
from ddtree.ops.eager import eager_name
from ddtree.ops.dispatch import REFERENCE

eager_name(globals(), "tree_attention")  # this module's copy of the name: eager inside compiled layers too


DEFERRED_ROWS = 64  # the most context rows --budget auto's plain steps defer (decode.budget.PLAIN_PROBE_MAX)


def _stay(j: int, *tensors) -> list:
    """A drafter not attached to a split target: no stage boundaries."""
    return list(tensors)


def drafter_rope(cfg: DrafterConfig, max_len: int, device):
    """cos/sin [max_len, head_dim]; yarn (rope_scaling) through transformers' own init functions."""
    scale = 1.0
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    rs = cfg.rope_scaling
    if rs and rs.get("rope_type", rs.get("type", "default")) not in ("default", None):
        from transformers import Qwen3Config
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        params = dict(rs)
        params["rope_type"] = params.pop("type", params.get("rope_type"))
        params.setdefault("rope_theta", cfg.rope_theta)
        hf = Qwen3Config(head_dim=cfg.head_dim, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
                         max_position_embeddings=cfg.max_position_embeddings, rope_parameters=params)
        inv, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * inv.float()[None]
    emb = torch.cat([freqs, freqs], -1)
    return (emb.cos() * scale).to(device), (emb.sin() * scale).to(device)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig, i: int):
        super().__init__()
        self.h, self.kvh, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.causal, self.window = cfg.causal[i], cfg.sliding_window[i]
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kvh * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.rms_eps, plus_one=False)
        self.k_norm = RMSNorm(self.hd, cfg.rms_eps, plus_one=False)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def _split(self, kv: torch.Tensor, cos, sin):
        R = kv.shape[0]
        k, v = kv.view(R, 2, self.kvh, self.hd).unbind(1)
        return apply_rope(self.k_norm(k), cos, sin), v

    def kv(self, h: torch.Tensor, cos, sin):
        """Context rows: k (normed, roped) and v [R, kvh, hd], one GEMM (k and v rows of the fused weight)."""
        w = fused(self, "_wqkv", self.q_proj, self.k_proj, self.v_proj)
        return self._split(F.linear(h, w[self.h * self.hd :]), cos, sin)

    def forward(self, x, cos, sin, ctx_len: torch.Tensor, kv_len: int, q_pos: torch.Tensor, kernel: bool = False):
        B = x.shape[0]
        q, kv = F.linear(x, fused(self, "_wqkv", self.q_proj, self.k_proj, self.v_proj)).split(
            [self.h * self.hd, 2 * self.kvh * self.hd], dim=-1)
        q = apply_rope(self.q_norm(q.reshape(B, self.h, self.hd)), cos, sin)
        kb, vb = self._split(kv, cos, sin)
        # The block's rows go into the cache at their positions ctx_len.. (past the context: the next
        # add_context overwrites them), so keys are one slice of the cache, key position = row:
        # no copy of the whole context per round.
        self.k_cache.index_copy_(0, q_pos, kb)
        self.v_cache.index_copy_(0, q_pos, vb)
        if kernel:  # the split-KV kernel; a sliding-window layer reads only its window's rows
            o = tree_attention(q, self.k_cache, self.v_cache, ctx_len, "causal" if self.causal else "full", kv_len + B,
                               q_pos=q_pos, window=self.window, causal=self.causal)
            return self.o_proj(o.reshape(B, -1))
        S = kv_len + B  # rows ctx_len + B .. S - 1 are stale: masked
        k, v = self.k_cache[:S], self.v_cache[:S]  # [S, kvh, hd]
        key_pos = torch.arange(S, device=x.device)
        mask = (key_pos < ctx_len + B)[None, :].expand(B, -1)
        if self.causal:
            mask = mask & (key_pos[None, :] <= q_pos[:, None])
        if self.window is not None:
            mask = mask & (q_pos[:, None] - key_pos[None, :] < self.window)
            if not self.causal:
                mask = mask & (key_pos[None, :] - q_pos[:, None] < self.window)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=mask[None, None], enable_gqa=self.h != self.kvh,
        )
        return self.o_proj(o[0].transpose(0, 1).reshape(B, -1))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, i: int):
        super().__init__()
        self.self_attn = DraftAttention(cfg, i)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, plus_one=False)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps, plus_one=False)


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([DraftLayer(cfg, i) for i in range(cfg.num_layers)])
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, plus_one=False)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps, plus_one=False)
        self.embed: nn.Embedding | None = None  # the target's (not registered: not ours to save)
        self.head: nn.Linear | None = None
        self.gather_logits = _identity  # set from the target (a vocab all-gather under tensor parallelism)
        self.ctx_len: torch.Tensor | None = None  # 0-dim long on the device: context rows cached
        self.compile_layers = False  # run the layers through torch.compile (set by the Decoder)
        self.kernels = REFERENCE  # the fast paths of its device (set by the Decoder: ddtree.ops.dispatch)
        # Its stage in the target's split and the stages of the embedding and lm_head it borrows, and
        # the target's stage hook (attach); a loader may set `stage` first (stages can share a device).
        self.stage: int | None = None
        self.embed_stage = self.head_stage = 0
        self.enter = _stay

    @property
    def device(self):
        return self.fc.weight.device

    def attach(self, embed: nn.Embedding, lm_head: nn.Linear, enter=None, stage: int = 0, embed_stage: int = 0,
               head_stage: int = 0):
        """Borrow the target's embedding and lm_head; on a split target also its stage hook
        (ddtree.model.stages) and the stages of the drafter, the embedding and the lm_head."""
        object.__setattr__(self, "embed", embed)
        object.__setattr__(self, "head", lm_head)
        self.enter = enter or _stay
        self.stage, self.embed_stage, self.head_stage = stage, embed_stage, head_stage

    def cache_rows(self, max_len: int) -> int:
        """Context cache rows for a committed length up to max_len: a fixed-shape write may touch
        rows past the context (a block's own rows, or a deferred context flush of up to
        DEFERRED_ROWS rows plus a block: ddtree.decode.round.DeferredContext)."""
        return max_len + DEFERRED_ROWS + self.cfg.block_size

    def allocate_state(self, max_len: int):
        dev, dt = self.device, self.fc.weight.dtype
        for layer in self.layers:
            a = layer.self_attn
            # + a block: the block's own rows are written past the context (see DraftAttention.forward)
            a.k_cache = torch.zeros(self.cache_rows(max_len), a.kvh, a.hd, device=dev, dtype=dt)
            a.v_cache = torch.zeros_like(a.k_cache)
        self.cos, self.sin = drafter_rope(self.cfg, self.cache_rows(max_len), dev)
        self.max_len = max_len
        self.ctx_len = torch.zeros((), dtype=torch.long, device=dev)
        self.prepare()

    def prepare(self):
        """Fuse the q/k/v and gate/up weights once (views: they follow in-place edits), before any
        compiled call could be the first to touch them."""
        for layer in self.layers:
            a = layer.self_attn
            fused(a, "_wqkv", a.q_proj, a.k_proj, a.v_proj)
            fused(layer.mlp, "_wgu", layer.mlp.gate_proj, layer.mlp.up_proj)

    def reset(self):
        self.ctx_len.zero_()

    @torch.no_grad()
    def add_context(self, taps: torch.Tensor, n_valid: torch.Tensor | int | None = None,
                    rows: torch.Tensor | None = None):
        """Cache context K/V for the rows taps[:n_valid] ([R, taps*hidden]) at positions ctx_len.. .
        rows ([R] long, optional): take taps[rows] instead (the accepted path of a tree; the
        gather runs inside the compiled function).

        Rows past n_valid are written but stay beyond ctx_len (invisible, overwritten later), so
        the shape is fixed whatever was accepted.
        """
        taps, rows, n_d = self.enter(self.stage, taps, rows, n_valid if torch.is_tensor(n_valid) else None)
        taps = taps.to(self.device, non_blocking=True)
        rows = None if rows is None else rows.to(self.device, non_blocking=True)
        (compiled(_add_context) if self.compile_layers else _add_context)(self, taps, rows)
        R = taps.shape[0] if rows is None else rows.shape[0]
        self.ctx_len += R if n_valid is None else n_d.to(self.device) if n_d is not None else n_valid

    def _fusable(self) -> bool:
        """Can a round's whole draft (block embedding to top-k) be one compiled function? Not under
        tensor parallelism (the vocab all-gather stays eager), nor with the embedding or lm_head on
        another stage (a split: `draft_topk` then starts from the block's embedding rows)."""
        return (self.compile_layers and self.gather_logits is _identity
                and self.embed_stage == self.head_stage == self.stage
                and self.embed.weight.device == self.head.weight.device == self.device)

    def _head_here(self) -> bool:
        """Can the draft from the block's rows to top-k be one compiled function (the lm_head on our stage)?"""
        return (self.compile_layers and self.gather_logits is _identity and self.head_stage == self.stage
                and self.head.weight.device == self.device)

    def block_tokens(self, bonus: torch.Tensor) -> torch.Tensor:
        """The block [bonus, mask x (B-1)] as tokens [B] on bonus's device."""
        return _block_tokens(self.cfg, bonus)

    @torch.no_grad()
    def draft_topk(self, bonus: torch.Tensor, kv_len: int, k: int, temperature: float | None = None,
                   rows: torch.Tensor | None = None):
        """Top-k log-probabilities (fp32 [B-1, k]) and ids ([B-1, k] long) of the block's positions
        (logits / temperature when given), on the lm_head's stage. With compiled layers one compiled
        function from the block's embedding to the top-k (the logit tail fuses into a reduction or
        two); its twin is draft_logits + topk_logprobs (used elsewhere, and by tests). rows: the
        block's embedding rows [B, hidden] when the caller looked them up already (a split's
        commit does, on the embedding's stage: TargetModel.commit)."""
        if rows is None and self._fusable():
            return compiled(_draft_topk)(self, bonus.to(self.device), kv_len, k, temperature)
        x = self._embedded(bonus, rows)
        if self._head_here():
            return compiled(_draft_topk_from)(self, x, kv_len, k, temperature)
        return topk_logprobs(self._logits_from(x, kv_len), k, temperature)

    @torch.no_grad()
    def draft_logits(self, bonus: torch.Tensor, kv_len: int) -> torch.Tensor:
        """bonus: 0-dim long token at position ctx_len. Returns logits [B-1, vocab] (fp32) for
        positions ctx_len+1 .. ctx_len+B-1. kv_len: host int >= ctx_len (context rows to read)."""
        return self._logits_from(self._embedded(bonus, None), kv_len)

    def _embedded(self, bonus: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """The block's embedding [B, hidden] on our stage (scaled): looked up on the embedding's
        stage unless `rows` are given."""
        if rows is None:
            b, = self.enter(self.embed_stage, bonus)
            b = b.to(self.embed.weight.device)
            rows = F.embedding(_block_tokens(self.cfg, b), self.embed.weight)
        x, = self.enter(self.stage, rows)
        return _embed_scale(self.cfg, x.to(self.device))

    def _logits_from(self, x: torch.Tensor, kv_len: int) -> torch.Tensor:
        h = (compiled(_block_hidden) if self.compile_layers else _block_hidden)(self, x, kv_len)
        h, = self.enter(self.head_stage, h)
        h = h.to(self.head.weight.device)
        return _logit_tail(self.cfg, self.gather_logits(self.head(h)))


def topk_logprobs(logits: torch.Tensor, k: int, temperature: float | None = None):
    """logits [R, V] -> top-k log-probabilities (fp32 [R, k]) and ids ([R, k] long); temperature
    scales the logits first. k = 1 (the chain) takes a max, not a radix select."""
    if temperature is not None:
        logits = logits / temperature
    vals, ids = logits.max(-1, keepdim=True) if k == 1 else logits.topk(k, dim=-1)
    return vals - torch.logsumexp(logits, -1, keepdim=True), ids  # no full [R, V] log_softmax


def _block_tokens(cfg: DrafterConfig, bonus: torch.Tensor) -> torch.Tensor:
    """[bonus, mask x (B-1)]: [B] long on bonus's device."""
    pos = torch.arange(cfg.block_size, device=bonus.device)
    return torch.where(pos == 0, bonus, torch.full_like(pos, cfg.mask_token_id))


def _embed_scale(cfg: DrafterConfig, x: torch.Tensor) -> torch.Tensor:
    return x * cfg.input_embedding_scale if cfg.input_embedding_scale != 1.0 else x


def _block_embedding(d: DFlashDrafter, bonus: torch.Tensor) -> torch.Tensor:
    """The block [bonus, mask x (B-1)] embedded: [B, hidden] on the drafter's device (one stage)."""
    block = _block_tokens(d.cfg, bonus)
    x = F.embedding(block.to(d.embed.weight.device), d.embed.weight).to(d.device)
    return _embed_scale(d.cfg, x)


def _logit_tail(cfg: DrafterConfig, logits: torch.Tensor) -> torch.Tensor:
    logits = logits.float() * cfg.output_multiplier
    if cfg.final_logit_softcapping:
        logits = torch.tanh(logits / cfg.final_logit_softcapping) * cfg.final_logit_softcapping
    return logits


def _draft_topk(d: DFlashDrafter, bonus: torch.Tensor, kv_len: int, k: int, temperature: float | None):
    """The whole draft of a round (compiled as one function; see DFlashDrafter.draft_topk)."""
    return _draft_topk_from(d, _block_embedding(d, bonus), kv_len, k, temperature)


def _draft_topk_from(d: DFlashDrafter, x: torch.Tensor, kv_len: int, k: int, temperature: float | None):
    """The draft from the block's embedding x [B, hidden] to the top-k (compiled as one function)."""
    h = _block_hidden(d, x, kv_len)
    return topk_logprobs(_logit_tail(d.cfg, d.head(h)), k, temperature)


def _add_context(d: DFlashDrafter, taps: torch.Tensor, rows: torch.Tensor | None = None):
    """Context K/V of taps [R, taps*hidden] (or taps[rows]) into every layer's cache at slots
    ctx_len.. (fixed shape)."""
    if rows is not None:
        taps = taps.index_select(0, rows)
    R = taps.shape[0]
    h = d.hidden_norm(d.fc(taps.to(d.fc.weight.dtype)))
    slots = d.ctx_len + torch.arange(R, device=taps.device)
    cos, sin = d.cos[slots], d.sin[slots]
    for layer in d.layers:
        k, v = layer.self_attn.kv(h, cos, sin)
        layer.self_attn.k_cache.index_copy_(0, slots, k)
        layer.self_attn.v_cache.index_copy_(0, slots, v)


def _block_hidden(d: DFlashDrafter, x: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The drafter's layers over the block x [B, hidden] -> final-normed hidden of rows 1.. [B-1, hidden]."""
    B = x.shape[0]
    q_pos = d.ctx_len + torch.arange(B, device=x.device)
    cos, sin = d.cos[q_pos], d.sin[q_pos]
    for layer in d.layers:
        x = residual(x, layer.self_attn(layer.input_layernorm(x), cos, sin, d.ctx_len, kv_len, q_pos,
                                        d.kernels.attention == "kernel"))
        x = residual(x, layer.mlp(layer.post_attention_layernorm(x)))
    return d.norm(x[1:])

"""Model configurations read from Hugging Face `config.json` files.

Target: Qwen3.5/3.6 Gated-DeltaNet hybrids (`qwen3_5`, nested `text_config` or flat `qwen3_5_text`)
and dense Qwen3 (`qwen3`). Drafter: z-lab DFlash checkpoints, whose fields move between revisions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ddtree.errors import DDTreeError

SUPPORTED_TARGETS = ("qwen3_5", "qwen3_5_text", "qwen3")


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise DDTreeError(f"{path} not found: point the model reference at a directory that holds config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DDTreeError(f"malformed config {path} (line {e.lineno}: {e.msg}): restore the file from the model repository")


def _need(cfg: dict, key: str, where: str):
    if key not in cfg:
        raise DDTreeError(f"malformed config {where}: missing '{key}'; restore config.json from the model repository")
    return cfg[key]


@dataclass
class TargetConfig:
    model_type: str  # 'qwen3_5' (hybrid) or 'qwen3' (dense)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: list[str]  # 'linear_attention' (GDN) | 'full_attention'
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_eps: float
    attn_output_gate: bool
    norm_plus_one: bool  # Qwen3.5 RMSNorm is x * (1 + w); Qwen3's is x * w
    tie_word_embeddings: bool
    max_position_embeddings: int
    # GDN
    conv_kernel: int = 4
    gdn_num_k_heads: int = 0
    gdn_num_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    eos_token_ids: list[int] = field(default_factory=list)
    rope_scaling: dict | None = None

    @property
    def is_hybrid(self) -> bool:
        return self.model_type == "qwen3_5"

    @property
    def gdn_conv_dim(self) -> int:
        return 2 * self.gdn_num_k_heads * self.gdn_k_dim + self.gdn_num_v_heads * self.gdn_v_dim

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "TargetConfig":
        mt = raw.get("model_type")
        if mt not in SUPPORTED_TARGETS:
            arch = raw.get("architectures", ["?"])
            raise DDTreeError(
                f"unsupported target model_type {mt!r} ({arch[0] if arch else '?'}) in {where}: "
                "ddtree runs Qwen3.5/3.6 hybrids (qwen3_5) and dense Qwen3 (qwen3)"
            )
        tc = raw.get("text_config", raw)  # Qwen3_5ForConditionalGeneration nests the text stack
        hybrid = mt in ("qwen3_5", "qwen3_5_text")
        num_layers = int(_need(tc, "num_hidden_layers", where))
        hidden = int(_need(tc, "hidden_size", where))
        heads = int(_need(tc, "num_attention_heads", where))
        head_dim = int(tc.get("head_dim") or hidden // heads)
        rope = tc.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", tc.get("rope_theta", 10000.0)))
        prf = float(rope.get("partial_rotary_factor", tc.get("partial_rotary_factor", 1.0)))
        if hybrid:
            lt = tc.get("layer_types")
            if lt is None:
                interval = int(tc.get("full_attention_interval", 4))
                lt = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
        else:
            lt = ["full_attention"] * num_layers
        if len(lt) != num_layers or any(t not in ("linear_attention", "full_attention") for t in lt):
            raise DDTreeError(f"malformed config {where}: layer_types must list {num_layers} entries of linear_attention/full_attention")
        eos = tc.get("eos_token_id", raw.get("eos_token_id"))
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = tc.get("rope_scaling")
        if rope.get("rope_type", "default") not in ("default", None) and not hybrid:
            rope_scaling = dict(rope)
        try:
            return cls(
                model_type="qwen3_5" if hybrid else "qwen3",
                vocab_size=int(_need(tc, "vocab_size", where)),
                hidden_size=hidden,
                intermediate_size=int(_need(tc, "intermediate_size", where)),
                num_layers=num_layers,
                layer_types=list(lt),
                num_heads=heads,
                num_kv_heads=int(tc.get("num_key_value_heads", heads)),
                head_dim=head_dim,
                rotary_dim=int(head_dim * prf),
                rope_theta=theta,
                rms_eps=float(tc.get("rms_norm_eps", 1e-6)),
                attn_output_gate=bool(tc.get("attn_output_gate", hybrid)),
                norm_plus_one=hybrid,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", tc.get("tie_word_embeddings", False))),
                max_position_embeddings=int(tc.get("max_position_embeddings", 32768)),
                conv_kernel=int(tc.get("linear_conv_kernel_dim", 4)),
                gdn_num_k_heads=int(tc.get("linear_num_key_heads", 0)),
                gdn_num_v_heads=int(tc.get("linear_num_value_heads", 0)),
                gdn_k_dim=int(tc.get("linear_key_head_dim", 0)),
                gdn_v_dim=int(tc.get("linear_value_head_dim", 0)),
                eos_token_ids=eos,
                rope_scaling=rope_scaling,
            )
        except (TypeError, ValueError) as e:
            raise DDTreeError(f"malformed config {where}: {e}; restore config.json from the model repository")

    @classmethod
    def from_file(cls, path: Path) -> "TargetConfig":
        return cls.from_dict(read_json(path), str(path))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps: spread from layer 1 to L-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    causal: list[bool]  # per layer: causal (sliding) or not (full, non-causal)
    sliding_window: list[int | None]  # per layer
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_dict(cls, raw: dict, num_target_layers: int, where: str = "config.json") -> "DrafterConfig":
        arch = (raw.get("architectures") or [""])[0]
        if arch and "DFlash" not in arch:
            raise DDTreeError(f"drafter {where} is a {arch}, not a DFlash drafter: pass a z-lab DFlash checkpoint as --drafter")
        dc = raw.get("dflash_config") or {}

        def pick(name, default=None):
            return dc.get(name, raw.get(name, default))

        n = int(_need(raw, "num_hidden_layers", where))
        hidden = int(_need(raw, "hidden_size", where))
        heads = int(_need(raw, "num_attention_heads", where))
        mask = pick("mask_token_id")
        if mask is None:
            raise DDTreeError(f"malformed drafter config {where}: no mask_token_id (root or dflash_config); restore it from the drafter repository")
        taps = pick("target_layer_ids") or default_target_layer_ids(int(raw.get("num_target_layers", num_target_layers)), n)
        rope = raw.get("rope_parameters") or {}
        theta = float(raw.get("rope_theta", rope.get("rope_theta", 10000.0)))
        scaling = raw.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = dict(rope)
        types = raw.get("layer_types") or ["full_attention"] * n
        if len(types) != n:
            raise DDTreeError(f"malformed drafter config {where}: layer_types has {len(types)} entries for {n} layers")
        override = raw.get("is_causal", dc.get("causal"))
        window = raw.get("sliding_window")
        causal = [(t == "sliding_attention") if override is None else bool(override) for t in types]
        windows = [int(window) if (t == "sliding_attention" and window) else None for t in types]
        softcap = pick("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            intermediate_size=int(_need(raw, "intermediate_size", where)),
            num_layers=n,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            vocab_size=int(raw.get("vocab_size", 0)),
            block_size=int(pick("block_size", 16)),
            mask_token_id=int(mask),
            target_layer_ids=[int(t) for t in taps],
            causal=causal,
            sliding_window=windows,
            input_embedding_scale=float(pick("input_embedding_scale", 1.0)),
            output_multiplier=float(pick("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    @classmethod
    def from_file(cls, path: Path, num_target_layers: int) -> "DrafterConfig":
        return cls.from_dict(read_json(path), num_target_layers, str(path))

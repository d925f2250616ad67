"""Exact shapes of the released models (from ../shared/notes/formats.md), for benchmarks with
random weights: the cost of a forward does not depend on weight values."""

from __future__ import annotations


def qwen36_27b_config() -> dict:
    """Qwen/Qwen3.6-27B (same text stack as Qwen3.5-27B), as its config.json nests it."""
    layers = ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": {
            "model_type": "qwen3_5_text",
            "vocab_size": 248320,
            "hidden_size": 5120,
            "intermediate_size": 17408,
            "num_hidden_layers": 64,
            "layer_types": layers,
            "full_attention_interval": 4,
            "num_attention_heads": 24,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "attn_output_gate": True,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 48,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 262144,
            "mamba_ssm_dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                "mrope_section": [11, 11, 10], "mrope_interleaved": True},
            "eos_token_id": 248044,
        },
    }


def qwen36_27b_dflash_config() -> dict:
    """z-lab/Qwen3.6-27B-DFlash: 4 sliding (causal, window 2048) + 1 full (non-causal) layer."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 5120,
        "intermediate_size": 17408,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "rope_theta": 10000000,
        "layer_types": ["sliding_attention"] * 4 + ["full_attention"],
        "sliding_window": 2048,
        "block_size": 16,
        "num_target_layers": 64,
        "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    }


def qwen3_8b_config() -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "eos_token_id": 151645,
    }


def qwen3_8b_dflash_config() -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 5,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "block_size": 16,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }


PRESETS = {
    "qwen3.6-27b": (qwen36_27b_config, qwen36_27b_dflash_config),
    "qwen3-8b": (qwen3_8b_config, qwen3_8b_dflash_config),
}

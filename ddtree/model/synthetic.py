"""Tiny random models for tests, the selftest and benchmarks (no download).

`tiny_hybrid_config` / `tiny_dense_config` give HF-style config dicts; `build_random_target` /
`build_random_drafter` make our target and drafter with random weights (`build_random_on_devices`
at full size, placed), and `ddtree.decode.random_pair.build_random_pair` wires a tiny pair into a
Decoder; `hf_reference` builds transformers' own model on the same weights for parity tests.
"""

from __future__ import annotations

import math

import torch

from ddtree.model.config import DrafterConfig, TargetConfig


def tiny_hybrid_config(
    vocab=97, hidden=64, layers=("linear_attention", "linear_attention", "full_attention", "linear_attention"),
    heads=4, kv_heads=2, head_dim=16, partial=0.5, gdn_k_heads=2, gdn_v_heads=4, gdn_k_dim=8, gdn_v_dim=12,
    inter=96, theta=10000.0,
) -> dict:
    """A Qwen3_5ForConditionalGeneration-style config: Qwen3.6-27B's (ddtree.model.presets), with
    the sizes scaled down."""
    from ddtree.model.presets import qwen36_27b_config

    cfg = qwen36_27b_config()
    tc = cfg["text_config"]
    tc.update({
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": len(layers),
        "layer_types": list(layers),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "linear_key_head_dim": gdn_k_dim,
        "linear_value_head_dim": gdn_v_dim,
        "linear_num_key_heads": gdn_k_heads,
        "linear_num_value_heads": gdn_v_heads,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "eos_token_id": 0,
        "tie_word_embeddings": False,
    })
    tc["rope_parameters"].update({
        "rope_theta": theta, "partial_rotary_factor": partial,
        "mrope_section": [1, 1, 0] if head_dim * partial <= 8 else [11, 11, 10],
    })
    return cfg


def tiny_dense_config(vocab=97, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=16, inter=96) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eos_token_id": 0,
    }


def tiny_drafter_config(target: dict, layers=1, block_size=8, mask_token_id=1, taps=None, sliding=None) -> dict:
    tc = target.get("text_config", target)
    n_target = tc["num_hidden_layers"]
    types = ["full_attention"] * layers
    if sliding:
        types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": tc["hidden_size"],
        "intermediate_size": 80,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "vocab_size": tc["vocab_size"],
        "layer_types": types,
        "sliding_window": sliding,
        "block_size": block_size,
        "num_target_layers": n_target,
        "dflash_config": {"mask_token_id": mask_token_id,
                          "target_layer_ids": taps if taps is not None else sorted({0, n_target // 2, n_target - 1})},
    }
    return cfg


def randomize_(module: torch.nn.Module, seed: int, std: float = 0.02):
    """Deterministic random init that keeps the hybrid numerically tame (norm weights near their
    identity, GDN decay parameters in their trained ranges)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        with torch.no_grad():
            if name.endswith("A_log"):
                vals = torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                vals = torch.empty(p.shape).uniform_(-1, 1, generator=gen)
            elif "norm" in name:
                vals = torch.randn(p.shape, generator=gen) * 0.1
                if not _plus_one_norm(module, name):
                    vals = vals + 1.0
            elif "conv1d" in name:
                vals = torch.randn(p.shape, generator=gen) * 0.3
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                vals = torch.randn(p.shape, generator=gen) * max(std, 1.0 / math.sqrt(fan_in))
            p.copy_(vals.to(p.dtype))
    return module


def _plus_one_norm(module, name: str) -> bool:
    # Our RMSNorm modules carry the flag; plain-weight norms (gated GDN norm, drafter) do not.
    obj = module
    for part in name.split(".")[:-1]:
        obj = getattr(obj, part)
    return bool(getattr(obj, "plus_one", False))


def build_random_target(raw_cfg: dict, device="cpu", dtype=torch.float32, seed=0, max_len=512):
    from ddtree.model.target import TargetModel

    cfg = TargetConfig.from_dict(raw_cfg)
    model = TargetModel(cfg)
    randomize_(model, seed)
    model.to(device=device, dtype=dtype)
    model.allocate_state(max_len)
    return model


def hf_class_and_config(raw_cfg: dict, attn: str = "eager"):
    """transformers' own CausalLM class and config for one of our raw config dicts."""
    import transformers

    if raw_cfg["model_type"] == "qwen3_5":
        hf_cfg = transformers.Qwen3_5TextConfig(**{k: v for k, v in raw_cfg["text_config"].items() if k != "model_type"})
        cls = transformers.Qwen3_5ForCausalLM
    else:
        hf_cfg = transformers.Qwen3Config(**{k: v for k, v in raw_cfg.items() if k not in ("model_type", "architectures")})
        cls = transformers.Qwen3ForCausalLM
    hf_cfg._attn_implementation = attn
    return cls, hf_cfg


def hf_state_dict(model) -> dict:
    """Our state dict under the names of transformers' CausalLM (`model.` prefix, lm_head as is)."""
    return {(k if k == "lm_head.weight" else "model." + k): v for k, v in model.state_dict().items()}


def hf_reference(model, raw_cfg: dict):
    """transformers' own CausalLM with our model's weights (float32, eager attention), on its
    pure-torch GDN functions: with flash-linear-attention installed, transformers wires fla's
    Triton kernels (and fused gated norm) in at construction, which are neither an exact fp32
    reference nor runnable on CPU tensors."""
    cls, hf_cfg = hf_class_and_config(raw_cfg)
    hf = cls(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    missing = [m for m in missing if "rotary" not in m]
    assert not missing and not unexpected, (missing, unexpected)
    torch_gdn_paths(hf)
    return hf.to(model.dtype)


def torch_gdn_paths(hf) -> None:
    """Point transformers' model at its pure-torch GDN functions. Two routes lead to fla: module
    attributes set at construction (use_kernelized_func) and the module-level functions themselves,
    which `use_kernel_func_from_hub_with_fallback` wraps to call fla when it is importable; the
    forward calls those globals by name, so they are replaced by the torch functions they wrap
    (functools.wraps keeps them as __wrapped__). Test processes only."""
    import importlib
    import inspect

    mod = importlib.import_module(type(hf).__module__)
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn", "causal_conv1d_update"):
        if hasattr(mod, name):
            setattr(mod, name, inspect.unwrap(getattr(mod, name)))
    torch_fns = {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
                 "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
                 "causal_conv1d_update": "torch_causal_conv1d_update"}
    gated_norm = next((getattr(mod, n) for n in dir(mod) if n.endswith("RMSNormGated") and not n.startswith("Fused")), None)
    for m in hf.modules():
        for attr, fn in torch_fns.items():
            if hasattr(m, attr) and hasattr(mod, fn):
                setattr(m, attr, getattr(mod, fn))
        if hasattr(m, "causal_conv1d_fn"):
            m.causal_conv1d_fn = None  # None selects nn.Conv1d
        norm = getattr(m, "norm", None)
        if norm is not None and type(norm).__name__ == "FusedRMSNormGated" and gated_norm is not None:
            ref = gated_norm(norm.weight.shape[0], eps=norm.eps)
            ref.weight = norm.weight
            m.norm = ref


def drafter_config(raw: dict, target_raw: dict) -> DrafterConfig:
    tc = target_raw.get("text_config", target_raw)
    return DrafterConfig.from_dict(raw, tc["num_hidden_layers"])


def build_random_drafter(draft_raw: dict, target, device="cpu", dtype=torch.float32, seed=1, max_len=512):
    from ddtree.model.config import DrafterConfig
    from ddtree.model.drafter import DFlashDrafter

    cfg = DrafterConfig.from_dict(draft_raw, target.cfg.num_layers)
    d = DFlashDrafter(cfg)
    randomize_(d, seed)
    d.to(device=device, dtype=dtype)
    d.allocate_state(max_len)
    return d


@torch.no_grad()
def init_on_device_(module: torch.nn.Module, seed: int = 0):
    """Random init of a module whose parameters already live on their devices (no host copy):
    for full-size benchmarks. Same recipe as `randomize_`, drawn on the device."""
    for i, (name, p) in enumerate(module.named_parameters()):
        gen = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(1.0, 16.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.uniform_(-1, 1, generator=gen)
        elif "norm" in name:
            p.normal_(0.0, 0.1, generator=gen)
            if not _plus_one_norm(module, name):
                p.add_(1.0)
        elif "conv1d" in name:
            p.normal_(0.0, 0.3, generator=gen)
        else:
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1] if p.dim() > 1 else 1), generator=gen)


def build_random_on_devices(raw_target: dict, raw_drafter: dict | None, devices, dtype=torch.bfloat16,
                            max_len: int = 4096, seed: int = 0):
    """Full-size random target (+ drafter) placed like load_target/load_drafter, without a checkpoint."""
    from ddtree.model.config import DrafterConfig
    from ddtree.model.drafter import DFlashDrafter
    from ddtree.model.checkpoint import NoInit
    from ddtree.model.placement import Workload, place
    from ddtree.model.target import TargetModel

    devices = [torch.device(d) for d in devices]
    cfg = TargetConfig.from_dict(raw_target)
    with torch.device("meta"), NoInit():
        target = TargetModel(cfg)
    target.to(dtype)  # cast on the meta device: materialised in float32 first, the 27B takes 108 GB
    dcfg = DrafterConfig.from_dict(raw_drafter, cfg.num_layers) if raw_drafter is not None else None
    split = place(cfg, dcfg, devices, Workload(max_len=max_len, dtype=dtype))
    placement = split.layer_devices
    target.embed_tokens.to_empty(device=devices[0])
    for layer, dev in zip(target.layers, placement):
        layer.to_empty(device=dev)
    target.norm.to_empty(device=devices[-1])
    target.lm_head.to_empty(device=devices[-1])
    init_on_device_(target, seed)
    for p in target.parameters():
        p.requires_grad_(False)
    target.layer_stages = split.layer_stages  # two stages on one device stay two
    target.allocate_state(max_len)
    drafter = None
    if raw_drafter is not None:
        with torch.device("meta"), NoInit():
            drafter = DFlashDrafter(dcfg)
        drafter.to(dtype)
        drafter.to_empty(device=split.drafter_device)
        drafter.stage = split.drafter_stage
        init_on_device_(drafter, seed + 1)
        for p in drafter.parameters():
            p.requires_grad_(False)
        drafter.allocate_state(max_len)
    return target, drafter

"""Model references and safetensors checkpoints.

A reference is a local directory or a Hugging Face repo id (resolved through the local cache;
downloaded when online). Tensors are read one at a time from the memory-mapped files and go
straight to their layer's device in the target dtype: the whole model is never copied to host
memory. Both target layouts are read: `Qwen3_5ForConditionalGeneration` (`model.language_model.*`,
vision tower and MTP head skipped) and `*ForCausalLM` (`model.*`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn as nn
from loguru import logger

from ddtree.model.config import DrafterConfig, TargetConfig
from ddtree.errors import DDTreeError

SKIP_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")


class NoInit:
    """Skip parameter init while building on meta (nn.Embedding's normal_ on meta imports
    torch._dynamo: seconds per worker start)."""

    CLASSES = (nn.Linear, nn.Embedding, nn.Conv1d)

    def __enter__(self):
        self.saved = [(c, c.reset_parameters) for c in self.CLASSES]
        for c in self.CLASSES:
            c.reset_parameters = lambda self: None
        return self

    def __exit__(self, *exc):
        for c, f in self.saved:
            c.reset_parameters = f


def resolve_model_dir(ref: str, what: str = "model") -> Path:
    """Local directory, or a hub repo id resolved through the local Hugging Face cache."""
    p = Path(ref).expanduser()
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise DDTreeError(f"{what} path {ref} has no config.json: pass a checkpoint directory or a Hugging Face repo id")
        return p
    looks_local = ref.startswith((".", "/", "~")) or ref.count("/") != 1 or os.sep in ref.replace("/", "", 1)
    if looks_local:
        raise DDTreeError(f"{what} path {ref} not found: pass an existing checkpoint directory or a repo id like Qwen/Qwen3.6-27B")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]
        try:
            return Path(snapshot_download(ref, allow_patterns=patterns, local_files_only=True))
        except Exception:
            if os.environ.get("HF_HUB_OFFLINE") == "1":
                raise
            logger.info(f"downloading {ref} from the Hugging Face Hub")
            return Path(snapshot_download(ref, allow_patterns=patterns))
    except Exception as e:  # offline, missing repo, gated repo: one line and the fix
        raise DDTreeError(
            f"{what} {ref!r} is not in the local Hugging Face cache and could not be downloaded "
            f"({type(e).__name__}): run `hf download {ref}` on a connected machine, or pass a local directory"
        ) from None


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise DDTreeError(f"malformed {index} ({e}): restore it from the model repository")
        files = sorted({model_dir / f for f in weight_map.values()})
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise DDTreeError(f"no safetensors weights in {model_dir}: download the checkpoint's *.safetensors files")
    for f in files:
        if not f.is_file():
            raise DDTreeError(f"checkpoint shard {f} is missing: download the whole checkpoint again")
    return files


def text_name(name: str) -> str | None:
    """Checkpoint key -> our parameter name (None = not part of the text model)."""
    if name.startswith(SKIP_PREFIXES):
        return None
    for p in TEXT_PREFIXES:
        if name.startswith(p):
            return name[len(p):]
    return name  # lm_head.weight, or a drafter's un-prefixed keys


def iter_checkpoint(model_dir: Path, wanted):
    """(file, open safetensors handle, checkpoint key, our name) for each text-model tensor named
    in `wanted`, one file open at a time (memory-mapped: nothing is read until asked for)."""
    from safetensors import safe_open

    for f in checkpoint_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for key in fh.keys():
                name = text_name(key)
                if name is not None and name in wanted:
                    yield f, fh, key, name


def load_weights(module: torch.nn.Module, model_dir: Path, dtype: torch.dtype, device_of) -> None:
    """Fill `module` (built on the meta device) from the checkpoint, tensor by tensor.

    device_of(param_name) -> torch.device. Raises DDTreeError on missing or mis-shaped tensors.
    """
    expected = dict(module.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    for f, fh, key, name in iter_checkpoint(model_dir, expected):
        t = fh.get_tensor(key)
        if tuple(t.shape) != tuple(expected[name].shape):
            raise DDTreeError(
                f"{key} in {f.name} has shape {tuple(t.shape)}, config.json implies {tuple(expected[name].shape)}: "
                "config.json and weights do not match"
            )
        loaded[name] = t.to(device=device_of(name), dtype=dtype, non_blocking=True)
    tied = getattr(getattr(module, "cfg", None), "tie_word_embeddings", False)
    if tied and "lm_head.weight" not in loaded and "embed_tokens.weight" in loaded:
        loaded["lm_head.weight"] = loaded["embed_tokens.weight"]
    assign_weights(module, loaded, model_dir)


def assign_weights(module: torch.nn.Module, loaded: dict[str, torch.Tensor], model_dir) -> None:
    """Put the loaded device tensors into a meta-built module; every parameter must be there."""
    missing = [n for n, _ in module.named_parameters() if n not in loaded]
    if missing:
        raise DDTreeError(
            f"checkpoint {model_dir} lacks {len(missing)} weights (first: {missing[0]}): "
            "it does not match config.json or is incomplete"
        )
    module.load_state_dict(loaded, assign=True, strict=True)
    for p in module.parameters():
        p.requires_grad_(False)


def parse_devices(devices: str | list | None) -> list[torch.device]:
    if devices is None or devices == "" or devices == "auto":
        return [torch.device("cuda:0" if torch.cuda.is_available() else "cpu")]
    items = devices.split(",") if isinstance(devices, str) else list(devices)
    out = []
    for d in items:
        try:
            dev = torch.device(str(d).strip())
        except RuntimeError:
            raise DDTreeError(f"bad device {d!r} in --devices: use e.g. cuda:0,cuda:1 or cpu") from None
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise DDTreeError(f"--devices asks for {dev} but CUDA is not available here: use --devices cpu")
            if (dev.index or 0) >= torch.cuda.device_count():
                raise DDTreeError(f"--devices asks for {dev} but only {torch.cuda.device_count()} GPU(s) are visible")
        out.append(dev)
    return out


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    table = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
             "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
    if name not in table:
        raise DDTreeError(f"unknown --dtype {name!r}: use bfloat16, float16 or float32")
    return table[name]


def load_target(ref: str, devices: list[torch.device], dtype: torch.dtype, max_len: int,
                layer_devices: list[torch.device] | None = None, layer_stages: list[int] | None = None):
    """-> (TargetModel with state allocated, model_dir). One stage per entry of devices (entries
    may repeat: two stages on one device). layer_stages: a stage index per layer (ddtree.app.plan's
    split), else ddtree.model.placement.split_stages; layer_devices alone: a stage per run of equal
    devices."""
    from ddtree.model.placement import split_stages
    from ddtree.model.target import TargetModel

    model_dir = resolve_model_dir(ref, "target")
    cfg = TargetConfig.from_file(model_dir / "config.json")
    with torch.device("meta"), NoInit():
        model = TargetModel(cfg)
    if layer_stages is None and layer_devices is None:
        layer_stages = split_stages(cfg, devices, max_len, dtype)
    placement = layer_devices or [devices[j] for j in layer_stages]
    model.layer_stages = layer_stages

    def device_of(name: str):
        if name.startswith("layers."):
            return placement[int(name.split(".")[1])]
        return devices[-1] if name.startswith(("lm_head", "norm")) else devices[0]

    load_weights(model, model_dir, dtype, device_of)
    model.allocate_state(max_len)
    return model, model_dir


def load_drafter(ref: str, target, dtype: torch.dtype, max_len: int, device: torch.device | None = None,
                 stage: int | None = None):
    """-> (DFlashDrafter with state allocated, model_dir). Placed with the target's lm_head by
    default; stage: the target stage it belongs to (the split's drafter_stage: stages may share a
    device)."""
    from ddtree.model.drafter import DFlashDrafter

    model_dir = resolve_model_dir(ref, "drafter")
    cfg = DrafterConfig.from_file(model_dir / "config.json", target.cfg.num_layers)
    if max(cfg.target_layer_ids) >= target.cfg.num_layers:
        raise DDTreeError(
            f"drafter taps target layers {cfg.target_layer_ids} but the target has {target.cfg.num_layers} layers: "
            "pass the drafter trained for this target"
        )
    if cfg.hidden_size != target.cfg.hidden_size:
        raise DDTreeError(
            f"drafter hidden size {cfg.hidden_size} != target hidden size {target.cfg.hidden_size}: "
            "pass the drafter trained for this target"
        )
    with torch.device("meta"), NoInit():
        d = DFlashDrafter(cfg)
    dev = device or target.out_device
    load_weights(d, model_dir, dtype, lambda _n: dev)
    d.stage = stage
    d.allocate_state(max_len)
    return d, model_dir


def save_checkpoint(state: dict[str, torch.Tensor], config: dict, out_dir: Path, layout: str = "conditional",
                    shards: int = 1) -> Path:
    """Write our state dict in a released layout (tests): 'conditional' (model.language_model.*),
    'causal' (model.*) or 'drafter' (no prefix). Sharded with an index when shards > 1."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    prefix = {"conditional": "model.language_model.", "causal": "model.", "drafter": ""}[layout]
    named = {}
    for k, v in state.items():
        key = k if (k == "lm_head.weight" or layout == "drafter") else prefix + k
        named[key] = v.detach().to("cpu").contiguous()
    if layout == "conditional":  # the released checkpoints carry these; a loader must skip them
        named["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
        named["mtp.fc.weight"] = torch.zeros(2, 2)
    keys = sorted(named)
    if shards <= 1:
        save_file({k: named[k] for k in keys}, str(out_dir / "model.safetensors"))
        return out_dir
    weight_map = {}
    for i in range(shards):
        part = keys[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: named[k] for k in part}, str(out_dir / fname))
        weight_map.update({k: fname for k in part})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return out_dir

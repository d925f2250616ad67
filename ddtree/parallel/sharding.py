"""How the target is divided among W tensor-parallel ranks, and building one rank's shard.

Every rank holds a contiguous block of heads / channels of each layer (Megatron style):

  * attention: q_proj/k_proj/v_proj row blocks of this rank's query / kv heads (q_proj rows are
    per head [query | gate] when attn_output_gate), o_proj the matching column block;
  * Gated DeltaNet: in_proj_qkv / conv1d rows [q heads | k heads | v heads] of this rank's k-head
    and v-head blocks (v head j reads k head j // (Hv/Hk), so contiguous blocks stay consistent),
    in_proj_z/b/a, A_log, dt_bias the v-head block, out_proj the matching column block;
  * MLP: gate/up row blocks, down_proj column block;
  * lm_head: a vocab row block; `TargetModel.gather_logits` all-gathers the full logits so every
    rank chooses the same tokens (and builds the same tree) without further communication;
  * embedding, layer norms, q/k norms, the GDN output norm: replicated.

The mixer and MLP outputs are partial sums: `DecoderLayer.reduce` all-reduces them in place (two
all-reduces of [T, hidden] per layer; ddtree.parallel.comm). The drafter is small and replicated
on every rank; its logits go through the target's sharded lm_head and the same all-gather.

`shard_plan` is the one source of truth for the slicing: checkpoints (`load_target_shard` reads
only this rank's rows / columns of each tensor), in-memory state dicts (`shard_state_dict`) and
the byte accounting (`rank_bytes_per_token`) all follow it or `shard_config`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from ddtree.errors import DDTreeError
from ddtree.model.checkpoint import NoInit as _NoInit  # shared with load_target
from ddtree.model.config import TargetConfig
from ddtree.parallel.comm import install_tp_hooks


def shard_config(cfg: TargetConfig, world: int) -> TargetConfig:
    """The per-rank config: head / channel counts divided by `world` (vocab stays full)."""
    if world < 1:
        raise DDTreeError(f"--tp {world} must be at least 1")
    counts = {
        "attention heads (num_attention_heads)": cfg.num_heads,
        "kv heads (num_key_value_heads)": cfg.num_kv_heads,
        "GDN key heads (linear_num_key_heads)": cfg.gdn_num_k_heads,
        "GDN value heads (linear_num_value_heads)": cfg.gdn_num_v_heads,
        "MLP width (intermediate_size)": cfg.intermediate_size,
        "vocabulary (vocab_size)": cfg.vocab_size,
    }
    for what, n in counts.items():
        if n % world:
            raise DDTreeError(f"--tp {world} does not divide the target's {what} = {n}: use a --tp that divides it (e.g. 1 or 2)")
    return dataclasses.replace(
        cfg,
        num_heads=cfg.num_heads // world,
        num_kv_heads=cfg.num_kv_heads // world,
        gdn_num_k_heads=cfg.gdn_num_k_heads // world,
        gdn_num_v_heads=cfg.gdn_num_v_heads // world,
        intermediate_size=cfg.intermediate_size // world,
    )


def shard_plan(name: str, cfg: TargetConfig, rank: int, world: int) -> tuple[int, list[tuple[int, int]]] | None:
    """How rank `rank` slices the full tensor `name` (our parameter name, full `cfg`).

    Returns None (replicated) or (dim, [(start, stop), ...]): the blocks along `dim`, concatenated
    in order, form this rank's tensor.
    """
    r, W = rank, world

    def block(unit: int, count: int, offset: int = 0) -> tuple[int, int]:
        n = count // W * unit
        return offset + r * n, offset + (r + 1) * n

    parts = name.split(".")
    leaf = ".".join(parts[-2:]) if len(parts) >= 2 else name
    if name == "lm_head.weight":
        return 0, [block(1, cfg.vocab_size)]
    if not name.startswith("layers."):
        return None  # embed_tokens, final norm
    hd = cfg.head_dim
    if ".self_attn." in name:
        qhd = hd * (2 if cfg.attn_output_gate else 1)
        if leaf == "q_proj.weight":
            return 0, [block(qhd, cfg.num_heads)]
        if leaf in ("k_proj.weight", "v_proj.weight"):
            return 0, [block(hd, cfg.num_kv_heads)]
        if leaf == "o_proj.weight":
            return 1, [block(hd, cfg.num_heads)]
        return None  # q_norm, k_norm
    if ".linear_attn." in name:
        kd, dv, hk, hv = cfg.gdn_k_dim, cfg.gdn_v_dim, cfg.gdn_num_k_heads, cfg.gdn_num_v_heads
        if leaf in ("in_proj_qkv.weight", "conv1d.weight"):
            return 0, [block(kd, hk), block(kd, hk, hk * kd), block(dv, hv, 2 * hk * kd)]
        if leaf == "in_proj_z.weight":
            return 0, [block(dv, hv)]
        if leaf in ("in_proj_b.weight", "in_proj_a.weight") or parts[-1] in ("A_log", "dt_bias"):
            return 0, [block(1, hv)]
        if leaf == "out_proj.weight":
            return 1, [block(dv, hv)]
        return None  # norm.weight (per dv)
    if ".mlp." in name:
        if leaf in ("gate_proj.weight", "up_proj.weight"):
            return 0, [block(1, cfg.intermediate_size)]
        if leaf == "down_proj.weight":
            return 1, [block(1, cfg.intermediate_size)]
    return None  # layer norms


def _take(src, plan) -> torch.Tensor:
    """Apply a plan to a torch tensor or a safetensors slice (reads only the blocks it needs)."""
    if plan is None:
        return src[:]
    dim, blocks = plan
    pieces = [src[a:b] if dim == 0 else src[:, a:b] for a, b in blocks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def shard_tensor(name: str, src, cfg: TargetConfig, rank: int, world: int) -> torch.Tensor:
    """This rank's block of the full tensor `name` (`src`: a tensor or a safetensors slice)."""
    return _take(src, shard_plan(name, cfg, rank, world))


def shard_state_dict(full_state: dict, cfg: TargetConfig, rank: int, world: int) -> dict:
    """Slice a full target state dict (our names, full `cfg`) into rank `rank`'s shard."""
    shard_config(cfg, world)  # divisibility check
    return {name: shard_tensor(name, t, cfg, rank, world).clone() for name, t in full_state.items()}


def load_target_shard(model_dir, rank: int, world: int, device, dtype: torch.dtype, max_len: int,
                      install_hooks: bool = True):
    """Build this rank's TargetModel on meta and fill it from the checkpoint, tensor by tensor,
    reading only this rank's rows / columns. Installs the TP hooks (a process group must be
    initialised when world > 1) and allocates the state buffers."""
    from safetensors import safe_open

    from ddtree.model.checkpoint import assign_weights, iter_checkpoint, parse_dtype
    from ddtree.model.target import TargetModel

    model_dir = Path(model_dir)
    device, dtype = torch.device(device), parse_dtype(dtype)
    cfg = TargetConfig.from_file(model_dir / "config.json")
    scfg = shard_config(cfg, world)
    with torch.device("meta"), _NoInit():
        full = TargetModel(cfg)  # shapes only, to validate the checkpoint
        model = TargetModel(scfg)
        model.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // world, bias=False)
    full_shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
    expected = {n: tuple(p.shape) for n, p in model.named_parameters()}
    del full

    loaded: dict[str, torch.Tensor] = {}
    embed_src: tuple[Path, str] | None = None

    def read(fh, key, name, fname):
        sl = fh.get_slice(key)
        shape = tuple(sl.get_shape())
        if shape != full_shapes[name]:
            raise DDTreeError(
                f"{key} in {fname} has shape {shape}, config.json implies {full_shapes[name]}: "
                "config.json and weights do not match"
            )
        t = shard_tensor(name, sl, cfg, rank, world)
        if tuple(t.shape) != expected[name]:  # a bug in the plan, not in the checkpoint
            raise AssertionError(f"TP shard of {name} has shape {tuple(t.shape)}, expected {expected[name]}")
        return t.to(device=device, dtype=dtype, non_blocking=True)

    for f, fh, key, name in iter_checkpoint(model_dir, expected):
        if name == "embed_tokens.weight":
            embed_src = (f, key)
        loaded[name] = read(fh, key, name, f.name)
    if cfg.tie_word_embeddings and "lm_head.weight" not in loaded and embed_src is not None:
        f, key = embed_src
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            loaded["lm_head.weight"] = read(fh, key, "lm_head.weight", f.name)
    assign_weights(model, loaded, model_dir)
    model.eval()
    if install_hooks and world > 1:
        install_tp_hooks(model, world)
    model.allocate_state(max_len)
    return model


def rank_bytes_per_token(cfg: TargetConfig, world: int, dtype_bytes: int = 2, context: int = 0) -> dict[str, int]:
    """Per-rank bytes of one decode step, and bytes each rank sends per decoded token.

    weight_bytes: this rank's layer weights + its lm_head block (the embedding row is negligible);
    kv_bytes: its K/V heads of every attention layer over `context` committed tokens;
    state_bytes: its GDN recurrent states (fp32), read and written once a step;
    step_bytes: the three together. world=1 gives the whole model's figures.
    allreduce_bytes: two all-reduces of one hidden row per layer; gather_bytes: its slice of the
    logits all-gather (one row); collectives: 2 x layers + 1."""
    from ddtree.model.target import layer_bytes

    s = shard_config(cfg, world)
    weights = sum(layer_bytes(s, dtype_bytes)) + dtype_bytes * (cfg.vocab_size // world) * cfg.hidden_size
    n_attn = sum(1 for t in cfg.layer_types if t == "full_attention")
    n_gdn = sum(1 for t in cfg.layer_types if t == "linear_attention")
    kv = n_attn * context * s.num_kv_heads * s.head_dim * 2 * dtype_bytes  # K and V
    state = 2 * n_gdn * s.gdn_num_v_heads * s.gdn_k_dim * s.gdn_v_dim * 4  # [Hv, dk, dv] fp32, read + write
    allreduce = 2 * cfg.num_layers * cfg.hidden_size * dtype_bytes
    return {"weight_bytes": weights, "kv_bytes": kv, "state_bytes": state, "step_bytes": weights + kv + state,
            "allreduce_bytes": allreduce, "gather_bytes": dtype_bytes * cfg.vocab_size // world,
            "collectives": 2 * cfg.num_layers + 1}


def _device_random_(module: nn.Module, seed: int, sharded: Callable[[str], bool] = lambda n: False, rank: int = 0):
    """Random weights drawn on the module's device (fast at 27B scale), tame like
    ddtree.model.synthetic.randomize_. Replicated tensors get the same values on every rank (each rank
    must compute the same residual stream and draft the same tree); sharded ones differ by rank."""
    from ddtree.model.synthetic import _plus_one_norm

    dev = next(module.parameters()).device
    gen = torch.Generator(device=dev)
    with torch.no_grad():
        for i, (name, p) in enumerate(module.named_parameters()):
            gen.manual_seed(seed * 1_000_003 + i * 7919 + (rank + 1) * 104_729 * int(sharded(name)))
            if name.endswith("A_log"):
                v = torch.empty(p.shape, device=dev).uniform_(0.0, 2.77, generator=gen)  # log U(1, 16)-like
            elif name.endswith("dt_bias"):
                v = torch.empty(p.shape, device=dev).uniform_(-1, 1, generator=gen)
            elif "norm" in name:
                v = torch.randn(p.shape, device=dev, generator=gen) * 0.1 + (0.0 if _plus_one_norm(module, name) else 1.0)
            elif "conv1d" in name:
                v = torch.randn(p.shape, device=dev, generator=gen) * 0.3
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                v = torch.randn(p.shape, device=dev, generator=gen) * max(0.02, fan_in ** -0.5)
            p.copy_(v.to(p.dtype))
            p.requires_grad_(False)
    return module


def random_target_shard(cfg: TargetConfig | dict, rank: int, world: int, device, dtype: torch.dtype, max_len: int,
                        seed: int = 0, install_hooks: bool = True):
    """This rank's shard of a target with random weights (benchmarks at the real shape: nothing
    is read from disk and the full model is never built). The TP hooks are installed when
    world > 1 and install_hooks (they need a process group); install_hooks=False leaves the
    identity hooks (or install ddtree.parallel.comm.install_rank_stand_ins: one rank on one GPU)."""
    from ddtree.model.checkpoint import parse_dtype
    from ddtree.model.target import TargetModel

    cfg = cfg if isinstance(cfg, TargetConfig) else TargetConfig.from_dict(cfg)
    scfg = shard_config(cfg, world)
    with torch.device("meta"), _NoInit():
        model = TargetModel(scfg)
        model.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size // world, bias=False)
    model = model.to(parse_dtype(dtype)).to_empty(device=torch.device(device))
    _device_random_(model, seed, lambda n: shard_plan(n, cfg, rank, world) is not None, rank)
    model.eval()
    if install_hooks and world > 1:
        install_tp_hooks(model, world)
    model.allocate_state(max_len)
    return model


def random_drafter(raw: dict, target, device, dtype: torch.dtype, max_len: int, seed: int = 1):
    """A DFlash drafter with random weights on `device`, identical on every rank."""
    from ddtree.model.checkpoint import parse_dtype
    from ddtree.model.config import DrafterConfig
    from ddtree.model.drafter import DFlashDrafter

    cfg = DrafterConfig.from_dict(raw, target.cfg.num_layers)
    with torch.device("meta"), _NoInit():
        d = DFlashDrafter(cfg)
    d = d.to(parse_dtype(dtype)).to_empty(device=torch.device(device))
    _device_random_(d, seed)
    d.eval()
    d.allocate_state(max_len)
    return d


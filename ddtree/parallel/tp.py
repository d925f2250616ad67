"""Tensor parallelism over W ranks (`ddtree generate --tp N`): NCCL on GPUs, gloo on CPU.

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
all-reduces of [T, hidden] per layer). The drafter is small and replicated on every rank; its
logits go through the target's sharded lm_head and the same all-gather. Every rank runs the same
host loop with the same seed and sees bit-identical logits, so their trees and walks agree.

`run_generate_tp(opts)` starts the worker processes itself (torch.multiprocessing.spawn, TCP
rendezvous on a free local port): no launcher is needed. `run_tp(world, fn, *args)` runs any
function under the same setup (benchmarks).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue as _queue
import socket
import sys
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ddtree.model.config import TargetConfig
from ddtree.errors import DDTreeError

# NVLink SHARP / multicast stays off: it needs fabric-manager support that lent machines lack.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


# ------------------------------------------------------------------------------------------
# sharding plan: one source of truth for checkpoints and in-memory state dicts
# ------------------------------------------------------------------------------------------


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


# ------------------------------------------------------------------------------------------
# collectives installed into the model's hooks
# ------------------------------------------------------------------------------------------


def _all_reduce_(x: torch.Tensor, group=None) -> torch.Tensor:
    dist.all_reduce(x, group=group)  # SUM, in place
    return x


def _all_gather_last(x: torch.Tensor, world: int, group=None, into_tensor: bool = True) -> torch.Tensor:
    """[..., V/W] per rank -> [..., V] on every rank (rank r's block at columns r*V/W ..)."""
    x = x.contiguous()
    if into_tensor:  # one collective into one buffer, then reorder [W, ..., V/W] -> [..., W*V/W]
        buf = torch.empty((world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(buf, x, group=group)
        return buf.movedim(0, -2).reshape(*x.shape[:-1], world * x.shape[-1])
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, -1)


class SymmAllReduce:
    """All-reduce of the small per-round activations through symmetric memory: every rank copies
    its partial sum into a buffer the peers can read over NVLink, and one kernel sums all ranks'
    buffers (torch's one-shot all-reduce). Two of them per layer, on the critical path of every
    token: NCCL's ring costs ~20 us each at these sizes, this should cost a few. Larger tensors
    (prefill chunks) and any failure to set it up take NCCL. Opt-in (DDTREE_TP_SYMM=1) until it is
    measured on a two-GPU machine; twin: NCCL (tests/test_gpu.py compares their greedy tokens)."""

    MAX_BYTES = 4 << 20

    def __init__(self, group, device: torch.device, dtype: torch.dtype):
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self.group_name = (group or dist.group.WORLD).group_name
        self.numel = self.MAX_BYTES // torch.empty((), dtype=dtype).element_size()
        self.buf = symm_mem.empty(self.numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buf, self.group_name)
        self.dtype = dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        if x.dtype != self.dtype or n > self.numel or not x.is_contiguous():
            dist.all_reduce(x, group=self.group)
            return x
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(self.buf[:n], x.view(-1), "sum", self.group_name)
        return out.view(x.shape)


def _symm_reduce(model, group):
    """SymmAllReduce for the model's device and dtype, or None (gloo, turned off, or unsupported)."""
    mode = os.environ.get("DDTREE_TP_SYMM", "0")  # "1": use it when it sets up; "require": or fail (tests)
    if mode not in ("1", "require") or dist.get_backend(group) != "nccl":
        return None
    try:
        reduce = SymmAllReduce(group, model.device, model.dtype)
        x = torch.ones(8, dtype=model.dtype, device=model.device)
        got = reduce(x)
        if not torch.equal(got, torch.full_like(x, dist.get_world_size(group))):
            raise RuntimeError(f"self-check summed to {got[0].item()}")
        return reduce
    except Exception as e:  # an older torch, no peer access: NCCL all the same
        if mode == "require":
            raise
        try:
            from loguru import logger

            logger.info(f"symmetric-memory all-reduce unavailable ({type(e).__name__}: {str(e)[:160]}); using NCCL's")
        except ImportError:
            pass
        return None


def install_tp_hooks(model, world: int, group=None) -> None:
    """All-reduce after every row-parallel projection, all-gather of the vocab-parallel logits.

    Install before building the Decoder (it copies target.gather_logits into the drafter)."""
    reduce = _symm_reduce(model, group) or partial(_all_reduce_, group=group)
    for layer in model.layers:
        layer.reduce = reduce
    nccl = dist.get_backend(group) == "nccl"
    model.gather_logits = partial(_all_gather_last, world=world, group=group, into_tensor=nccl)


# ------------------------------------------------------------------------------------------
# loading one rank's shard
# ------------------------------------------------------------------------------------------


from ddtree.model.checkpoint import NoInit as _NoInit  # noqa: E402  (shared with load_target)


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


def rank_bytes_per_token(cfg: TargetConfig, world: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Per-rank weight bytes read per decode step, and bytes each rank sends per decoded token
    (two all-reduces of one hidden row per layer + its slice of the fp logits all-gather)."""
    from ddtree.model.target import layer_bytes

    s = shard_config(cfg, world)
    weights = sum(layer_bytes(s, dtype_bytes)) + dtype_bytes * (cfg.vocab_size // world) * cfg.hidden_size
    allreduce = 2 * cfg.num_layers * cfg.hidden_size * dtype_bytes
    return {"weight_bytes": weights, "allreduce_bytes": allreduce,
            "gather_bytes": dtype_bytes * cfg.vocab_size // world, "collectives": 2 * cfg.num_layers + 1}


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
                        seed: int = 0):
    """This rank's shard of a target with random weights (benchmarks at the real shape: nothing
    is read from disk and the full model is never built). Hooks installed when world > 1."""
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
    if world > 1:
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


def _decoder_kw(opts: dict) -> dict:
    """Decoder arguments of a worker: the engine switches from its environment (inherited from the
    parent), `compile` and `use_graphs` (False = eager on CUDA) when the caller gives them."""
    from ddtree.options import Options

    kw = {k: opts[k] for k in ("use_graphs", "compile") if opts.get(k) is not None}
    return dict(kw, options=Options.from_env())


def bench_worker(rank: int, world: int, device, target_raw: dict, drafter_raw: dict | None, dtype, jobs: list[dict],
                 max_len: int, seed: int = 0, use_graphs: bool | None = None) -> list:
    """For run_tp: random-weight target shard (+ replicated random drafter), then one
    Decoder.generate per job (kwargs as for _gen_kwargs: method, budget, prompt_ids,
    max_new_tokens, ...). Returns the GenerationRecords (every rank computes them; run_tp hands
    back rank 0's). world=1 gives the single-GPU baseline through the same code."""
    from ddtree.decode.decoder import Decoder

    target = random_target_shard(target_raw, rank, world, device, dtype, max_len, seed)
    drafter = random_drafter(drafter_raw, target, device, dtype, max_len, seed + 1) if drafter_raw else None
    dec = Decoder(target, drafter, max_len, **_decoder_kw({"use_graphs": use_graphs}))
    return [dec.generate(**_gen_kwargs({}, job)) for job in jobs]


# ------------------------------------------------------------------------------------------
# process management
# ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _want_cuda(device_type: str | None) -> bool:
    if device_type in (None, "", "auto"):
        return torch.cuda.is_available()
    if device_type == "cuda" and not torch.cuda.is_available():
        raise DDTreeError("--tp asks for CUDA but CUDA is not available here: pass --devices cpu to use gloo on CPU")
    return device_type == "cuda"


def check_world(world: int, device_type: str | None = None) -> None:
    if world < 1:
        raise DDTreeError(f"--tp {world} must be at least 1")
    if _want_cuda(device_type) and world > torch.cuda.device_count():
        raise DDTreeError(f"--tp {world} needs {world} GPUs but only {torch.cuda.device_count()} are visible: lower --tp")


def init_worker(rank: int, world: int, init_method: str | None = None, device_type: str | None = None,
                quiet: bool = True) -> torch.device:
    """Per-process setup: NCCL multicast off, device, process group. Returns the rank's device.

    init_method None: env:// (a launcher such as torchrun set MASTER_ADDR / MASTER_PORT)."""
    for k, v in NCCL_ENV.items():
        os.environ[k] = v
    if quiet and rank > 0:  # ranks > 0 print nothing
        sys.stdout = open(os.devnull, "w")
        try:
            from loguru import logger

            logger.remove()
        except ImportError:
            pass
        import warnings

        warnings.filterwarnings("ignore")
    cuda = _want_cuda(device_type)
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if not dist.is_initialized():
        kw: dict[str, Any] = {"backend": "nccl" if cuda else "gloo", "rank": rank, "world_size": world,
                              "init_method": init_method or "env://"}
        if cuda:
            kw["device_id"] = device
        dist.init_process_group(**kw)
    return device


def close_worker() -> None:
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        # Every collective has completed (each rank synced on its last round) and the worker ends
        # with os._exit next. `generate --tp 2` was seen to hang at exit under NCCL on 2x H200
        # (cause not located yet); barrier and destroy are the two calls here that can block.
        return
    try:
        dist.barrier()
    except Exception:
        pass
    dist.destroy_process_group()


# forkserver: torch is imported once into the server process, later worker starts take ~0.1 s
# instead of a fresh interpreter importing torch. DDTREE_TP_START=spawn picks plain spawn.
START_METHOD = os.environ.get("DDTREE_TP_START") or ("forkserver" if sys.platform.startswith("linux") else "spawn")
_PRELOAD = ["ddtree.parallel.tp", "ddtree.decode.decoder", "ddtree.model.checkpoint"]


def _entry(rank, fn, args, q):
    """Worker process body: fn(rank, *args, q); report a DDTreeError; skip the slow interpreter
    teardown on success (the queue is flushed first)."""
    try:
        fn(rank, *args, q)
    except DDTreeError as e:
        _put(q, "error", str(e))
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    q.close()
    q.join_thread()
    os._exit(0)


def _spawn(world: int, fn: Callable, args: tuple, on_message: Callable[[tuple], None]):
    """Start `world` processes running fn(rank, *args, queue); pass each queued message to
    on_message while they run. Raises DDTreeError if a worker reported one."""
    import torch.multiprocessing as mp

    ctx = mp.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # no effect once the server runs
    q = ctx.Queue()
    errors: list[str] = []

    def drain(wait: float):
        while True:
            try:
                msg = pickle.loads(q.get(timeout=wait) if wait else q.get_nowait())
            except _queue.Empty:
                return
            if msg[0] == "error":
                errors.append(msg[1])
            else:
                on_message(msg)
            wait = 0

    pc = mp.start_processes(_entry, args=(fn, args, q), nprocs=world, join=False, start_method=START_METHOD)
    try:
        while True:
            drain(0)
            if pc.join(timeout=0.05):
                break
        drain(0.2)
    except Exception:
        drain(0.2)
        if errors:
            raise DDTreeError(errors[0]) from None
        raise
    finally:
        for p in pc.processes:
            if p.is_alive():
                p.terminate()
    if errors:
        raise DDTreeError(errors[0])


def _put(q, *msg):
    q.put(pickle.dumps(msg))  # plain pickle: no shared-memory tensors outliving their sender


def _run_tp_worker(rank, world, init_method, device_type, fn, args, all_ranks, q):
    device = init_worker(rank, world, init_method, device_type)
    res = fn(rank, world, device, *args)
    if rank == 0 or all_ranks:
        _put(q, "result", rank, res)
    close_worker()


def run_tp(world: int, fn: Callable, *args, device_type: str | None = None, all_ranks: bool = False):
    """Run fn(rank, world, device, *args) in `world` fresh processes with a process group set up
    (NCCL on cuda:rank, or gloo on CPU). Returns rank 0's result (all ranks' list if all_ranks).

    fn must be importable (module level) and its result picklable."""
    check_world(world, device_type)
    results: dict[int, Any] = {}

    def on_message(msg):
        if msg[0] == "result":
            results[msg[1]] = msg[2]

    _spawn(world, _run_tp_worker, (world, f"tcp://127.0.0.1:{free_port()}", device_type, fn, args, all_ranks), on_message)
    if all_ranks:
        return [results.get(r) for r in range(world)]
    return results.get(0)


# ------------------------------------------------------------------------------------------
# generate under TP
# ------------------------------------------------------------------------------------------


def _gen_kwargs(opts: dict, job: dict) -> dict:
    from ddtree.decode.sampling import SamplingParams

    o = {**opts, **job}
    return dict(
        prompt_ids=list(o["prompt_ids"]),
        method=o.get("method", "ddtree"),
        budget=o.get("budget", 32) if o.get("budget") == "auto" else int(o.get("budget", 32)),
        sampling=SamplingParams(float(o.get("temperature", 0.0) or 0.0), float(o.get("top_p", 1.0) or 1.0),
                                int(o.get("top_k", 0) or 0)),
        max_new_tokens=int(o.get("max_new_tokens", 128)),
        stop_ids=set(o.get("stop_ids") or ()),
        seed=o.get("seed", 0),
        top1_first=bool(o.get("top1_first", False)),
        prompt_id=str(o.get("prompt_id", "")),
    )


def _max_len(opts: dict, jobs: list[dict]) -> int:
    if opts.get("max_length"):
        return int(opts["max_length"])
    need = 0
    for job in jobs:
        o = {**opts, **job}
        tree = max(int(o.get("budget", 32)), 64) + 1
        need = max(need, len(o["prompt_ids"]) + int(o.get("max_new_tokens", 128)) + tree)
    return need


def tp_worker_generate(rank: int, world: int, opts: dict, result_queue=None) -> list:
    """One TP rank: set up, load the shard + replicated drafter, run every job of opts (or the one
    generate opts describes) with the same seed as the other ranks. Rank 0 sends ("tokens", job,
    ids) as they are decoded and ("record", job, GenerationRecord) to result_queue. Returns the
    records (rank 0) or [].

    opts: target, drafter, method, budget, max_new_tokens, temperature, top_p, top_k, seed, dtype,
    max_length, prompt_ids, stop_ids, tp; optional: jobs (list of per-generate overrides, e.g.
    {'method': 'ar', 'prompt_ids': [...], 'prompt_id': 'p1'}), init_method (default env://),
    device_type ('cuda' | 'cpu' | None = auto), top1_first, prompt_id, stream (send tokens),
    use_graphs (Decoder's; None = its default)."""
    from ddtree.model.checkpoint import load_drafter, parse_dtype, resolve_model_dir
    from ddtree.decode.decoder import Decoder

    device = init_worker(rank, world, opts.get("init_method"), opts.get("device_type"))
    jobs = opts.get("jobs") or [{}]
    dtype = parse_dtype(opts.get("dtype") or "bfloat16")
    max_len = _max_len(opts, jobs)
    target = load_target_shard(resolve_model_dir(str(opts["target"]), "target"), rank, world, device, dtype, max_len)
    drafter = None
    if opts.get("drafter"):
        drafter, _ = load_drafter(str(opts["drafter"]), target, dtype, max_len, device=device)
    dec = Decoder(target, drafter, max_len, **_decoder_kw(opts))  # after the hooks: it copies target.gather_logits
    records = []
    for i, job in enumerate(jobs):
        kw = _gen_kwargs(opts, job)
        on_tokens = None
        if rank == 0 and result_queue is not None and opts.get("stream", True):
            on_tokens = partial(_put_tokens, result_queue, i)
        rec = dec.generate(on_tokens=on_tokens, **kw)
        if rank == 0:
            records.append(rec)
            if result_queue is not None:
                _put(result_queue, "record", i, rec)
    close_worker()
    return records


def _put_tokens(q, job: int, toks: list[int]):
    _put(q, "tokens", job, list(toks))


def _prepare(opts: dict) -> tuple[dict, int]:
    """Validate in the parent (one clear error before any process starts) and resolve references."""
    from ddtree.model.checkpoint import parse_dtype, resolve_model_dir

    world = int(opts.get("tp") or 1)
    check_world(world, opts.get("device_type"))
    o = dict(opts)
    tdir = resolve_model_dir(str(o["target"]), "target")
    shard_config(TargetConfig.from_file(tdir / "config.json"), world)
    o["target"] = str(tdir)
    if o.get("drafter"):
        o["drafter"] = str(resolve_model_dir(str(o["drafter"]), "drafter"))
    parse_dtype(o.get("dtype") or "bfloat16")
    o["init_method"] = f"tcp://127.0.0.1:{free_port()}"
    return o, world


def run_generate_tp_jobs(opts: dict, jobs: list[dict], on_tokens: Callable[[int, list[int]], None] | None = None,
                         decode_text: Callable[[list[int]], str] | None = None) -> list:
    """Load the shards once and run several generates (per-job overrides of opts) under TP.
    on_tokens(job_index, ids) streams rank 0's tokens in this process. Returns the records."""
    o, world = _prepare(opts)
    o["jobs"] = [dict(j) for j in jobs]
    o["stream"] = on_tokens is not None
    records: dict[int, Any] = {}

    def on_message(msg):
        if msg[0] == "tokens" and on_tokens is not None:
            on_tokens(msg[1], msg[2])
        elif msg[0] == "record":
            records[msg[1]] = msg[2]

    _spawn(world, tp_worker_generate, (world, o), on_message)
    if len(records) != len(jobs):
        raise RuntimeError(f"tensor-parallel workers returned {len(records)} of {len(jobs)} generation records")
    out = [records[i] for i in range(len(jobs))]
    if decode_text is not None:
        for rec in out:
            rec.text = decode_text(rec.token_ids)
    return out


def run_generate_tp(opts: dict, on_tokens: Callable[[list[int]], None] | None = None,
                    decode_text: Callable[[list[int]], str] | None = None):
    """`ddtree generate --tp N`: spawn N ranks, generate once, return rank 0's GenerationRecord.

    Tokens are streamed to on_tokens(ids) in this process as rank 0 decodes them; decode_text
    (the tokenizer's decode) fills record.text. Same opts as tp_worker_generate."""
    cb = None if on_tokens is None else (lambda _i, toks: on_tokens(toks))
    return run_generate_tp_jobs(opts, [{}], on_tokens=cb, decode_text=decode_text)[0]

"""The collectives tensor parallelism installs into a model, and their single-process stand-ins.

A TargetModel has two hooks, identity by default: `DecoderLayer.reduce` (called on the mixer's and
on the MLP's output: under TP these are partial sums of the row-parallel projections) and
`TargetModel.gather_logits` (called on the lm_head's output: under TP this rank's vocab block).
`install_tp_hooks` sets them to an in-place SUM all-reduce of [T, hidden] and an all-gather of
[T, V/W] -> [T, V]; that is 2 x layers + 1 collectives per target forward, plus one gather for
the drafter's logits (it uses the target's lm_head and hook).

`install_rank_stand_ins` sets them for ONE rank without a process group (benchmarks of a rank's
share of the work on one GPU): the reduce is an identity (a distinct function, so the compiled
layers take the same two-halves path as under TP), the gather repeats the rank's block W times
(the full-vocab shape the decoder samples from, at the cost of one copy like the real gather's).
"""

from __future__ import annotations

import os
from functools import partial

import torch
import torch.distributed as dist

# NVLink SHARP / multicast stays off: it needs fabric-manager support that many multi-GPU hosts and
# containers lack.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def all_reduce_(x: torch.Tensor, group=None) -> torch.Tensor:
    dist.all_reduce(x, group=group)  # SUM, in place
    return x


def all_gather_last(x: torch.Tensor, world: int, group=None, into_tensor: bool = True) -> torch.Tensor:
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
    measured on a two-GPU machine; twin: NCCL (tests/parallel/test_tp.py compares their greedy tokens)."""

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
    from ddtree.options import Options

    mode = Options.from_env().tp_symm  # "1": use it when it sets up; "require": or fail (tests)
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
    reduce = _symm_reduce(model, group) or partial(all_reduce_, group=group)
    for layer in model.layers:
        layer.reduce = reduce
    nccl = dist.get_backend(group) == "nccl"
    model.gather_logits = partial(all_gather_last, world=world, group=group, into_tensor=nccl)


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """Stand-in for the all-reduce: this rank's partial sum, unsummed."""
    return x


def repeat_gather(x: torch.Tensor, world: int) -> torch.Tensor:
    """Stand-in for the logits all-gather: [..., V/W] -> [..., V], this rank's block W times."""
    return x.repeat(*([1] * (x.dim() - 1)), world)


def install_rank_stand_ins(model, world: int) -> None:
    """One rank's hooks without a process group (see the module docstring): what it computes and
    reads is what a rank of TP=world does; the collectives' cost is left out. Install before
    building the Decoder, like install_tp_hooks."""
    for layer in model.layers:
        layer.reduce = no_reduce
    model.gather_logits = partial(repeat_gather, world=world)

"""Building blocks shared by the target and the drafter: norms, the MLP, fused projection
weights, rotary embeddings, the residual add, and the torch.compile cache."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddtree.ops import eager


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, plus_one: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))
        self.eps, self.plus_one = eps, plus_one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = (x.shape[-1],)
        if self.plus_one:  # Qwen3.5: (x * (1 + w)) computed in fp32
            w = self.__dict__.get("_w_eff")
            if w is None:
                w = 1.0 + self.weight.float()
            return F.rms_norm(x.float(), d, w, self.eps).type_as(x)
        return self.weight * F.rms_norm(x.float(), d, None, self.eps).to(x.dtype)  # Qwen3: cast, then scale

    def prepare(self):
        """Precompute (1 + w) in fp32 once (not a parameter: not saved, not loaded)."""
        if self.plus_one:
            self.__dict__["_w_eff"] = 1.0 + self.weight.detach().float()


class GatedRMSNorm(nn.Module):
    """GDN output norm: w * norm(x) * silu(z), plain weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xn = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(dt)
        return (self.weight * xn * F.silu(z.float())).to(dt)


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = F.linear(x, fused(self, "_wgu", self.gate_proj, self.up_proj)).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def _identity(x):
    return x


def fuse_linears(*linears: nn.Linear) -> torch.Tensor:
    """One weight for several projections of the same input (one GEMM instead of several).

    The linears' weights become views into the fused tensor, so state_dict and loading still
    see the checkpoint's names and no memory is duplicated.
    """
    w = torch.cat([lin.weight.detach() for lin in linears])
    o = 0
    for lin in linears:
        n = lin.weight.shape[0]
        lin.weight = nn.Parameter(w[o : o + n], requires_grad=False)
        o += n
    return w


def fused(module: nn.Module, name: str, *linears: nn.Linear):
    """The fused weight `name` of `module`, built on first use (kept out of parameters)."""
    w = module.__dict__.get(name)
    if w is None or w.device != linears[0].weight.device:
        w = module.__dict__[name] = fuse_linears(*linears)
    return w


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, hd]; cos/sin: [T, rd] (NeoX halves) applied to the first rd dims."""
    rd = cos.shape[-1]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    xr, xp = x[..., :rd], x[..., rd:]
    return torch.cat([xr * cos + rotate_half(xr) * sin, xp], dim=-1)


def residual(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x + y, written so that inductor does not fold the add into y's GEMM (a cuBLAS addmm with
    beta = 1): that needs a copy of x into the output first, one more kernel per residual than
    the add fused into the next norm, and it rounds once where the eager model rounds twice. The
    unsqueezes keep the add from matching inductor's mm + add pattern; eager, they are free views."""
    return (x[None] + y[None])[0]


_COMPILED: dict = {}


def compiled(fn):
    """`fn` through torch.compile (inductor), made once per function.

    Why: a decode step is otherwise bound by kernel launches (~5000 small kernels per token);
    inductor fuses the elementwise chains (norms, gates, conv, rope, the T = 1 recurrence) into a
    few Triton kernels. For `_call_layer` one compiled function serves all layers: layers hold
    their buffers as tensors (no per-layer ints) and forward has no Python side effects, so
    dynamo's guards only tell the layer kinds and T = 1 from T > 1 apart (T > 1 and the context
    length are marked dynamic up front: `_mark_dynamic`). The eager functions are the reference
    twins (tests/test_compile.py, tests/test_gpu.py)."""
    c = _COMPILED.get(fn)
    if c is None:
        import torch._dynamo  # here, not at import: ddtree.ops.eager

        eager.apply()  # the functions compiled code calls eagerly, marked before the first trace
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, 64)  # headroom: other models in the process, drafter kv_len
        c = _COMPILED[fn] = torch.compile(fn, dynamic=None)
    return c

"""Triton plumbing shared by every kernel of the project: the optional import, where a kernel
may run (CUDA, or CPU tensors under Triton's interpreter for the tests), the jitted-function
cache, and what a device's properties decide about tiles (`Arch`).

On CPU tensors the kernels run under Triton's interpreter (TRITON_INTERPRET=1 before triton's
import, as tests/conftest.py sets it on machines without a GPU): that is how the tests compare
them with their torch twins without a GPU.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # triton is optional: the torch paths are complete
    triton = tl = None


_JIT: dict = {}  # (kernel, interpret) -> jitted; the CUDA ones are made at import (see the end)


def _on_device_of(t: torch.Tensor):
    """Triton launches on the current device's current stream: make it t's (layers split over
    GPUs run eagerly with another device current). Compiled code needs no guard: inductor sets it."""
    if t.is_cuda and not torch.compiler.is_compiling():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernel(fn, interpret: bool):
    """The jitted kernel for a CUDA launch, or the interpreted one for CPU tensors."""
    key = (fn.__name__, interpret)
    if key not in _JIT:
        if interpret:
            if not interpreter_on():
                raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
            from triton.runtime.interpreter import InterpretedFunction

            _fix_interpreter_index()
            _interpret_as_compiled()

            _JIT[key] = InterpretedFunction(fn)
        else:
            _JIT[key] = triton.jit(fn)
    return _JIT[key]


def _fix_interpreter_index() -> None:
    """The interpreter holds scalars as 1-element arrays and converts them to ints with int(array),
    which numpy >= 2.4 refuses: loops with device-computed bounds (`range(lo, hi)`) then fail under
    it. Convert through the single element instead (still an error for a block)."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_ddtree_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))  # size 1 only, as before

    patched._ddtree_fixed = True
    interpreter._patch_lang_tensor = patched


def _interpret_as_compiled() -> None:
    """The interpreter checks every int32 add, sub and mul of a kernel for overflow
    (sanitize_overflow, a debug option that compiled kernels run without): a third of the
    interpreted time of a decoding test. Interpret as the kernels compile: without it."""
    import dataclasses

    from triton.runtime import interpreter

    b = interpreter.interpreter_builder
    if b.options.sanitize_overflow:
        b.options = dataclasses.replace(b.options, sanitize_overflow=False)


# ----------------------------------------------------------------------------- the device
@dataclass(frozen=True)
class Arch:
    """What the kernels' tile choices read from a CUDA device (torch.cuda.get_device_properties):
    compute capability, the shared memory one block may use (the opt-in maximum: 227 KB on
    Hopper, 163 KB on A100, 99 KB on sm_86 / sm_89) and the SM count. Tests pass
    `Arch.from_props` of a stand-in properties object to see the choices of a GPU they lack."""

    major: int
    minor: int
    smem: int  # bytes of shared memory per block
    sms: int

    @classmethod
    def from_props(cls, props) -> "Arch":
        smem = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
        return cls(int(props.major), int(props.minor), int(smem), int(props.multi_processor_count))

    @property
    def cc(self) -> int:
        return 10 * self.major + self.minor


_ARCH: dict = {}


def arch(device) -> Arch | None:
    """The Arch of a CUDA device (read once), None elsewhere (CPU tensors: the interpreter; a
    "cuda:i" named on a machine without CUDA, as `ddtree plan` does for GPUs elsewhere)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    i = torch.cuda.current_device() if dev.index is None else dev.index
    if i not in _ARCH:
        _ARCH[i] = Arch.from_props(torch.cuda.get_device_properties(i))
    return _ARCH[i]


def dot_precision(requested: str, a: Arch | None) -> str:
    """tl.dot's input_precision for fp32 tiles on `a`. tf32 and tf32x3 (three TF32 MMAs, which
    Triton 3.6 decomposes for sm_80 and later) need TF32 tensor cores: sm_80+. Below that, and
    under the interpreter (a is None), "ieee"."""
    if requested in ("tf32", "tf32x3") and (a is None or a.major < 8):
        return "ieee"
    return requested


def tile(n: int) -> int:
    """A tile side for n rows or channels: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (n - 1).bit_length())

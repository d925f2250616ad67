"""Triton plumbing shared by every kernel of the project: the optional import, where a kernel
may run (CUDA, or CPU tensors under Triton's interpreter for the tests), and the jitted-function
cache.

On CPU tensors the kernels run under Triton's interpreter (TRITON_INTERPRET=1 before triton's
import, as tests/conftest.py sets it on machines without a GPU): that is how the tests compare
them with their torch twins without a GPU.
"""

from __future__ import annotations

import contextlib
import os

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

"""Functions that compiled code must call eagerly, marked without importing dynamo.

Compiled layers call some functions between their fused pieces: kernels whose grids come from host
integers, backends chosen on the host (torch.compiler.disable). Applying that decorator imports
torch._dynamo, which costs about as much as importing torch itself (0.8 s on a 2-core CPU; several
seconds on a slow disk), and a short prompt compiles nothing before its first token. So the marks
are kept here and applied when the first torch.compile is made (ddtree.model.layers.compiled):
each marked module-level name is rebound to its torch.compiler.disable wrapper. Callers reach a
marked function through its module's globals (a module attribute, or the name in the module that
marked it); a module that keeps a copy of one under its own name marks that name too.
"""

from __future__ import annotations

from typing import Callable

_MARKED: list[tuple[dict, str]] = []  # (a module's globals, the name bound there)
_applied = False


def _disable(fn: Callable) -> Callable:
    import torch

    return torch.compiler.disable(fn)


def eager(fn: Callable) -> Callable:
    """Decorator: fn runs eagerly inside compiled code (torch.compiler.disable, applied at the
    first compile). Module-level functions only."""
    _MARKED.append((fn.__globals__, fn.__name__))
    return _disable(fn) if _applied else fn


def eager_name(namespace: dict, name: str) -> None:
    """Mark namespace[name] (a module's globals(): an alias such as `tree_attention =
    attention.tree_attention`) like `eager`."""
    _MARKED.append((namespace, name))
    if _applied:
        namespace[name] = _disable(namespace[name])


def apply() -> None:
    """Rebind every marked name to its torch.compiler.disable wrapper (once, before the first
    torch.compile; later marks apply at once)."""
    global _applied
    if _applied:
        return
    for namespace, name in _MARKED:
        namespace[name] = _disable(namespace[name])
    _applied = True

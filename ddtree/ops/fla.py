"""flash-linear-attention's chunk kernel for prefill chains (optional; fla has no tree kernel),
and the prefill chain's choice between it and its torch twin (`chain_final`).

`fla_chain` runs `fla.ops.gated_delta_rule.chunk_gated_delta_rule` on a chain and returns what
`ddtree.ops.gdn.chain_chunked` (its twin) returns. Whether fla imports, and whether it agrees with
the twin for a dtype on a device, is checked once per process on a random problem
(`_checked`), so a version that does not run or disagrees is never used. This module imports
ddtree.ops.gdn; gdn never imports it.
"""

from __future__ import annotations

import functools

import torch

from ddtree.ops.gdn import chain_chunked, gdn_gates, l2norm


def chain_final(q, k, v, g, beta, S0, use_fla: bool = False, chunk: int = 64):
    """A chain (a prefill chunk of T tokens): outputs and the final state, through fla's chunk
    kernel when `use_fla` and it is usable here, else `gdn.chain_chunked`.
    -> (o [T, H, dv] fp32, final [H, dk, dv] fp32)."""
    if use_fla:
        r = fla_chain(q, k, v, g, beta, S0)
        if r is not None:
            return r
    return chain_chunked(q, k, v, g, beta, S0, chunk)


@functools.lru_cache(maxsize=None)
def _kernel():
    """fla's chunk kernel, or None when fla is not importable here."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:
        return None
    return chunk_gated_delta_rule


def _run(fn, q, k, v, g, beta, S0):
    with torch.cuda.device(q.device):  # Triton launches on the current device: make it q's
        o, final = fn(q.float()[None], k.float()[None], v.float()[None], g.float()[None], beta.float()[None],
                      scale=1.0, initial_state=S0[None].float(), output_final_state=True)
    return o[0].float(), final[0].float()


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _run_with_room(fn, q, k, v, g, beta, S0):
    """_run, once more after handing the allocator's cached blocks back to the driver where it ran
    out of memory: on an 80 GB card holding the 27B, torch's cache can hold nearly all the free
    memory after a long prefill, and Triton then fails to load fla's kernels (their code and
    local memory are the driver's, outside the cache: "Triton Error [CUDA]: out of memory")."""
    try:
        return _run(fn, q, k, v, g, beta, S0)
    except Exception as e:
        if not _out_of_memory(e) or not torch.cuda.is_available():
            raise
        torch.cuda.empty_cache()
        return _run(fn, q, k, v, g, beta, S0)


@functools.lru_cache(maxsize=None)
def _checked(device: torch.device, dtype: torch.dtype, H: int, dk: int, dv: int) -> bool:
    """Does fla run here and match the torch twin on a random 200-token chain (dtype's values)?"""
    from loguru import logger

    fn = _kernel()
    if fn is None:
        return False
    gen = torch.Generator(device=device).manual_seed(0)
    T = 200
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    q, k = l2norm(r(T, H, dk)) * dk**-0.5, l2norm(r(T, H, dk))
    v = r(T, H, dv).to(dtype).float()
    g, beta = gdn_gates(r(T, H), r(T, H), torch.zeros(H, device=device), torch.zeros(H, device=device))
    S0 = r(H, dk, dv) * 0.1
    try:
        o, final = _run_with_room(fn, q, k, v, g, beta, S0)
    except Exception as e:  # an fla / Triton version that does not run here
        logger.warning(f"flash-linear-attention failed ({type(e).__name__}: {str(e)[:200]}); using the torch GDN path")
        return False
    ref_o, ref_S = chain_chunked(q, k, v, g, beta, S0)
    err = max(float((o - ref_o).abs().max() / ref_o.abs().max().clamp_min(1e-30)),
              float((final - ref_S).abs().max() / ref_S.abs().max().clamp_min(1e-30)))
    # fp32 dots inside fla's kernels run as TF32: ~1e-3 off. Accept that where the model's own
    # values are coarser anyway (half of bf16/fp16 eps); a float32 model keeps float32 (its twin).
    tol = 1e-5 if dtype == torch.float32 else max(1e-3, torch.finfo(dtype).eps / 2)
    if not err < tol:
        logger.info(f"flash-linear-attention is {err:.2g} off the torch GDN path in {dtype} (TF32 dots; "
                    f"tolerance {tol:.1g}); using the torch path for this dtype")
    return err < tol


def available(device: torch.device, dtype: torch.dtype, H: int, dk: int, dv: int) -> bool:
    return device.type == "cuda" and _checked(device, dtype, H, dk, dv)


def fla_chain(q, k, v, g, beta, S0):
    """Chain outputs and final state through fla, or None where fla is not usable (then the
    caller takes the twin). Shapes as `ddtree.ops.gdn.tree_wy`; v's dtype is the model's.
    -> (o [T, H, dv] fp32, final [H, dk, dv] fp32) | None."""
    H, dk, dv = S0.shape
    if not available(q.device, v.dtype, H, dk, dv):
        return None
    try:
        return _run_with_room(_kernel(), q, k, v, g, beta, S0)
    except Exception as e:
        if not _out_of_memory(e):
            raise
        from loguru import logger

        logger.warning("flash-linear-attention ran out of GPU memory on this chunk; the torch GDN path takes it")
        return None

"""Every engine switch, declared once: its environment variable, default, type and meaning.

The command line reads them once (`Options.from_env()`) and hands the object to the Decoder,
which resolves it per device (`ddtree.ops.dispatch.Kernels`) and records it whole in the
statistics' metadata. Library users and tests pass `Options(...)` directly; nothing else in the
package reads the environment for these.

    field            environment              default   meaning
    compile          DDTREE_NO_COMPILE=1      on        layers through torch.compile (graphed rounds; a layer split)
    triton           DDTREE_NO_TRITON=1       on        the Triton kernels (GDN step and tree verify, commits, tree build, walk)
    triton_walk      DDTREE_TORCH_WALK=1      on        the walk in one Triton kernel (off: its torch twin)
    tree_kernel      DDTREE_TRITON_TREE       auto      tree verify's GDN recurrence in one kernel: auto (small tiles in one, larger trees by blocks), on (one up to 128 nodes; 64 on sm_86), off
    tree_precision   DDTREE_TREE_PRECISION    tf32x3    that kernel's tile products: tf32x3 (fp32-grade on tensor cores) or ieee
    tree_prologue    DDTREE_TREE_PROLOGUE     65        the GDN prologue in Triton for trees of up to N nodes: inside the one-tile tree kernel, or one kernel ahead of the blocked one (0: off)
    attention        DDTREE_ATTENTION         auto      tree / decode attention: auto (the split-KV kernel where it runs), kernel, sdpa (dense-mask twin)
    prefill_attention DDTREE_PREFILL_ATTENTION auto     prefill attention: auto (cuDNN for long chunks, FlashAttention-2 for short ones, each the other's fallback, else the split-KV kernel), cudnn, flash, triton, efficient
    verify_fused     DDTREE_VERIFY_FUSED      auto      a verify's long committed prefix through cuDNN's attention, the rest by the split-KV kernel: auto (Hopper), on (any CUDA GPU), off
    blas             DDTREE_BLAS              auto      the weight GEMMs' BLAS library on CUDA (torch's preferred_blas_library): auto (cuBLASLt on Hopper, torch's cuBLAS elsewhere), cublas, cublaslt
    fla              DDTREE_NO_FLA=1          on        flash-linear-attention's chunk kernel for prefill (when installed)
    prefill_fast_min DDTREE_PREFILL_FAST_MIN  2048      prompts of at least N tokens prefill through the compiled layers and fla; shorter ones through their eager twins (no compile or tuning before a short prompt's first token)
    host_rounds      DDTREE_HOST_ROUNDS=1     off       the host-tree round loop (the reference twin of the device pipeline)
    split_graphs     DDTREE_EAGER_SPLIT=1     on        a layer split's rounds as CUDA graph segments, one per stage visit (off: the eager split, its twin)
    tp_symm          DDTREE_TP_SYMM           0         --tp all-reduces through symmetric memory: 0, 1 (if it sets up), require (experimental)
    tp_start         DDTREE_TP_START          forkserver  how --tp starts its worker processes: forkserver or spawn
    triton_on_cpu    DDTREE_TRITON_ON_CPU=1   off       run the Triton kernels on CPU tensors under Triton's interpreter (tests)
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

from ddtree.errors import DDTreeError

# ddtree's default draft budget: 31 nodes and the root verify 32, a size the verify's kernels and
# GEMM tiles take at the cost of 31; a 32-node budget's 33 cost 0.4 ms more a round on an H100
# for 0.4-0.6% more tokens per round on the codepair pair (docs/PERFORMANCE.md, "The tree's fixed cost").
DEFAULT_BUDGET = 31


def _switch(env: str, help: str, parse=None, experimental: bool = False, **kw):
    return field(metadata={"env": env, "help": help, "parse": parse, "experimental": experimental}, **kw)


def _off_when_set(value: str) -> bool:  # DDTREE_NO_X=1 turns X off
    return value != "1"


def _on_when_set(value: str) -> bool:
    return value == "1"


def _choice(*allowed: str, alias: Mapping[str, str] | None = None):
    def parse(value: str) -> str:
        v = (alias or {}).get(value, value)
        if v not in allowed:
            raise ValueError(f"one of {', '.join(allowed)}")
        return v
    return parse


def _count(value: str) -> int:
    n = int(value)
    if n < 0:
        raise ValueError("a count >= 0")
    return n


@dataclass(frozen=True)
class Options:
    """The engine's switches (see the module docstring for the table)."""

    compile: bool = _switch("DDTREE_NO_COMPILE", "layers through torch.compile where rounds are graphed or split",
                            _off_when_set, default=True)
    triton: bool = _switch("DDTREE_NO_TRITON", "the Triton kernels (GDN step and tree verify, commits, tree build, walk)",
                           _off_when_set, default=True)
    triton_walk: bool = _switch("DDTREE_TORCH_WALK", "the walk in one Triton kernel (off: its torch twin)",
                                _off_when_set, default=True)
    tree_kernel: str = _switch("DDTREE_TRITON_TREE", "tree verify's GDN recurrence in one kernel: auto, on, off (by blocks past it unless off)",
                               _choice("auto", "on", "off", alias={"1": "on", "0": "off"}), default="auto")
    tree_precision: str = _switch("DDTREE_TREE_PRECISION", "the tree kernel's tile products: tf32x3 or ieee",
                                  _choice("tf32x3", "ieee"), default="tf32x3")
    tree_prologue: int = _switch("DDTREE_TREE_PROLOGUE", "the GDN prologue in Triton (inside the one-tile tree kernel, or ahead of the blocked one) up to this many nodes (0: off)",
                                 _count, default=65)
    attention: str = _switch("DDTREE_ATTENTION", "tree/decode attention: auto, kernel (split-KV), sdpa (dense-mask twin)",
                             _choice("auto", "kernel", "sdpa"), default="auto")
    prefill_attention: str = _switch("DDTREE_PREFILL_ATTENTION",
                                     "prefill attention: auto (cuDNN for long chunks, FlashAttention-2 for short ones, each the other's fallback, else the split-KV kernel), "
                                     "cudnn, flash, triton, efficient",
                                     _choice("auto", "cudnn", "flash", "triton", "efficient"), default="auto")
    verify_fused: str = _switch("DDTREE_VERIFY_FUSED",
                                "a verify's long committed prefix through cuDNN's attention: auto (Hopper), on, off",
                                _choice("auto", "on", "off", alias={"1": "on", "0": "off"}), default="auto")
    blas: str = _switch("DDTREE_BLAS", "the weight GEMMs' BLAS library on CUDA (torch's preferred_blas_library): "
                        "auto (cuBLASLt on Hopper, torch's cuBLAS elsewhere), cublas, cublaslt", _choice("auto", "cublas", "cublaslt"), default="auto")
    fla: bool = _switch("DDTREE_NO_FLA", "flash-linear-attention's chunk kernel for prefill (when installed)",
                        _off_when_set, default=True)
    prefill_fast_min: int = _switch("DDTREE_PREFILL_FAST_MIN",
                                    "prompts of at least this many tokens prefill through the compiled layers and fla's "
                                    "chunk kernel; shorter ones through their eager twins (no compile or autotuning "
                                    "before a short prompt's first token)", _count, default=2048)
    host_rounds: bool = _switch("DDTREE_HOST_ROUNDS", "the host-tree round loop (reference twin of the device pipeline)",
                                _on_when_set, default=False)
    split_graphs: bool = _switch("DDTREE_EAGER_SPLIT", "a layer split's rounds as CUDA graph segments (off: the eager split, their twin)",
                                 _off_when_set, default=True)
    tp_symm: str = _switch("DDTREE_TP_SYMM", "--tp all-reduces through symmetric memory: 0, 1, require",
                           _choice("0", "1", "require"), experimental=True, default="0")
    tp_start: str = _switch("DDTREE_TP_START", "how --tp starts its workers: forkserver or spawn",
                            _choice("forkserver", "spawn"),
                            default="forkserver" if sys.platform.startswith("linux") else "spawn")
    triton_on_cpu: bool = _switch("DDTREE_TRITON_ON_CPU", "Triton kernels on CPU tensors under the interpreter (tests)",
                                  _on_when_set, default=False)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Options":
        """The switches set in the environment, the defaults elsewhere; a bad value is one error line."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f.metadata["env"])
            if raw is None or raw == "":
                continue
            try:
                values[f.name] = f.metadata["parse"](raw.strip())
            except ValueError as e:
                raise DDTreeError(f"{f.metadata['env']}={raw!r} is not valid: use {e}") from None
        return cls(**values)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def changed(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """{DDTREE_X: value as set in the environment} for every switch off its default."""
        env = os.environ if env is None else env
        default = type(self)()
        return {f.metadata["env"]: env.get(f.metadata["env"], str(getattr(self, f.name)))
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(default, f.name)}

    def replace(self, **changes) -> "Options":
        return dataclasses.replace(self, **changes)


def markdown_table() -> str:
    """docs/USAGE.md's table of engine switches (tests/test_switches.py checks that file holds it)."""
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for _name, env, default, help, experimental in table():
        shown = {True: "on", False: "off"}.get(default, default) if isinstance(default, bool) else default
        how = ""
        if isinstance(default, bool):  # DDTREE_NO_X=1, DDTREE_TORCH_WALK=1, DDTREE_EAGER_SPLIT=1 turn a default on off
            how = "`=1` turns it off" if default else "`=1` turns it on"
        text = help + (f" ({how})" if how else "") + (" *experimental*" if experimental else "")
        rows.append(f"| `{env}` | {shown} | {text} |")
    return "\n".join(rows)


def table() -> list[tuple[str, str, Any, str, bool]]:
    """(field, environment variable, default, meaning, experimental) for every switch (docs, tests)."""
    return [(f.name, f.metadata["env"], f.default, f.metadata["help"], f.metadata["experimental"])
            for f in dataclasses.fields(Options)]

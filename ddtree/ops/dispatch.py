"""Which implementation each op takes on a device: the one place where fast paths are chosen.

`Kernels` is resolved once per device from the `Options` (and what this machine can run) and
travels with every forward (`Step.kernels`) and commit, so layers read plain frozen fields: no
module-level switches, and the compiled layers guard on the values they read.

Every fast path has its twin (ddtree.ops.gdn for the GDN math, the dense-mask SDPA for
attention, ddtree.ops.tree for the tree builder, ddtree.ops.walk.walk for the walk).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.ops import gdn_tree, triton_util
from ddtree.ops.triton_util import tile  # noqa: F401  (re-exported: Kernels.tree's tiles)
from ddtree.options import Options

# Tree-verify kernel sizes: tiles of up to this many nodes (a tree's nodes after its root, folded
# into the state first where that halves the tile: gdn_tree.tile_root; and no more than fit the
# device's shared memory: gdn_tree.max_nodes); with tree_kernel=auto also padded nodes x key width
# at most TREE_TILE. An H200 measured 16 nodes at dk 128 and 32 at dk 64 faster than tree_wy's cuBLAS
# path, 32 at dk 128 ~70 us per layer slower. Ampere keeps 2048, unmeasured there: the larger
# tiles already lost on the H200, and an sm_86 SM has the same register file (ptxas spills alike
# on both) with less shared memory and about a quarter of the TF32 throughput, so the crossover
# is not higher there.
TREE_MAX_NODES = {"auto": 32, "on": 128, "off": 0}
TREE_TILE = 2048
# Past those sizes (and up to this many nodes) the recurrence runs by blocks
# (gdn_tree.gdn_tree_blocked; tree_kernel auto or on) instead of tree_wy: the value-free matrices
# first (a program per 16-node block, or on Hopper past 33 nodes per head, one 64-node block
# inverted whole), then the blocks in order, the root folded into the state first where that
# saves a block (gdn_tree.block_nodes, fold_root). The H200 measured the recurrence alone at dk 128
# in 17.0 / 28.9 / 36.2 us at 17 / 33 / 64 nodes against tree_wy's 73 / 90 / 112
# (scripts/bench_verify.py --parts core, results/verify-core-2pass-h200.json); the one-pass kernel
# before it (16-node blocks solved in order) took 16.7 / 43.3 / 62.3 there and 74.3 at 65 nodes,
# whose ddtree-64 round (23.07 ms) beat the compiled tree_wy's (24.26; results/engine-long-h200.json).
# Without the fold, 65 nodes (5 blocks) had lost 2.4 ms a round (`git show 7b04cc0:results/engine-blocked65-h200.log`);
# past 65 nodes the blocks are unmeasured in the engine.
TREE_BLOCKED_MAX_NODES = 65
# The one-tile kernel takes the prologue inside for tiles of up to this many nodes: with
# tree_kernel=on, tiles of 65 to 128 nodes at the 27B's dk 128 would need 288 KB of shared memory
# on sm_90 with tf32x3, past any GPU's block (docs/AMPERE.md), so those trees keep the torch
# prologue ahead of the kernel.
TREE_PROLOGUE_ONE_TILE_MAX_NODES = 64


@dataclass(frozen=True)
class Kernels:
    """The fast paths one device takes (hashable: compiled code guards on it)."""

    triton: bool = False  # GDN step, commits, tree build
    walk: bool = False  # the walk kernel
    tree_max_nodes: int = 0  # tree-verify GDN kernel for tiles of 2..this nodes (after a folded root)
    tree_tile: int = TREE_TILE  # ... and padded nodes x key width at most this
    tree_precision: str = "ieee"
    tree_prologue: int = 0  # the GDN prologue in Triton for T <= this: inside the one-tile kernel, or one kernel ahead of the blocks
    tree_blocked: int = 0  # trees past that kernel's sizes, up to this many nodes: gdn_tree_blocked
    attention: str = "sdpa"  # "kernel" (split-KV, ddtree.ops.attention) or "sdpa" (dense mask)
    fla: bool = False  # fla's chunk kernel for prefill chains (CUDA, installed, self-checked)
    prefill_attention: str = "auto"  # ddtree.ops.attention.prefill_attention's backend (auto: math on CPU)
    fused_prefix: bool = False  # a verify's committed prefix through cuDNN's attention (tree_attention's floor)

    def tree(self, T: int, dk: int) -> bool:
        """The one-kernel tree verify for a T-node tree of key width dk? Its tile holds the nodes
        after a folded root (gdn_tree.tile_nodes: 17 nodes take the 16-node tile)."""
        if not 1 < T <= self.tree_max_nodes + 1:  # (first: T is symbolic in compiled layers, and
            return False  # the tile's arithmetic would guard on it where no kernel runs)
        n = gdn_tree.tile_nodes(T)
        return n <= self.tree_max_nodes and tile(n) * tile(dk) <= self.tree_tile

    def prologue(self, T: int, dk: int) -> bool:
        """The GDN prologue in Triton for this tree (inside the one-tile kernel, or gdn_tree.gdn_prologue ahead of the blocked one)?"""
        if T > self.tree_prologue:
            return False
        return self.blocked(T, dk) or (self.tree(T, dk) and gdn_tree.tile_nodes(T) <= TREE_PROLOGUE_ONE_TILE_MAX_NODES)

    def blocked(self, T: int, dk: int) -> bool:
        """The 16-node-block tree kernel (for trees the one-tile kernel does not take)?"""
        return 1 < T <= self.tree_blocked and not self.tree(T, dk)


REFERENCE = Kernels()  # every op on its torch twin


def resolve(options: Options, device: torch.device | str, props=None) -> Kernels:
    """The Kernels a device gets under `options`: Triton on CUDA when it imports (and on CPU only
    under the interpreter with triton_on_cpu). props: stand-in device properties (tests of
    another GPU's choices); default the device's own."""
    dev = torch.device(device)
    runs = triton_util.triton is not None and (dev.type == "cuda" or (options.triton_on_cpu and triton_util.interpreter_on()))
    tri = options.triton and runs
    a = triton_util.Arch.from_props(props) if props is not None else triton_util.arch(dev)
    attention = _attention(options, tri)
    return Kernels(
        triton=tri,
        walk=tri and options.triton_walk,
        tree_max_nodes=min(TREE_MAX_NODES[options.tree_kernel], gdn_tree.max_nodes(a)) if tri else 0,
        tree_tile=TREE_TILE if options.tree_kernel == "auto" else 1 << 30,
        tree_precision=triton_util.dot_precision(options.tree_precision, a),
        tree_prologue=options.tree_prologue if tri else 0,
        tree_blocked=TREE_BLOCKED_MAX_NODES if tri and options.tree_kernel != "off" else 0,
        attention=attention,
        fla=options.fla and dev.type == "cuda",
        prefill_attention=options.prefill_attention if dev.type == "cuda" else "auto",
        fused_prefix=attention == "kernel" and _fused_prefix(options, dev, a),
    )


def _fused_prefix(options: Options, dev: torch.device, a) -> bool:
    """cuDNN's attention for a verify's long committed prefix: auto on Hopper and later (measured
    there: 082b8a3:results/verify-paths-h200.json), on for any CUDA GPU (cuDNN refusing a shape falls back
    to the split-KV kernel alone), off."""
    if options.verify_fused == "off" or dev.type != "cuda":
        return False
    return options.verify_fused == "on" or (a is not None and a.major >= 9)


def _attention(options: Options, tri: bool) -> str:
    if options.attention == "sdpa" or not tri:
        return "sdpa"
    return "kernel" if _attention_kernel_available() else "sdpa"


def _attention_kernel_available() -> bool:
    try:
        from ddtree.ops import attention  # noqa: F401
    except ImportError:
        return False
    return hasattr(attention, "tree_attention")


def blas_library(options: Options, archs: list) -> str | None:
    """The BLAS library for the weight GEMMs of a target on CUDA devices of these Archs (None: leave
    torch's choice, cuBLAS; so on a CPU target, archs empty). auto takes cuBLASLt on Hopper: at 1K
    it verified every tree 0.2-0.5 ms faster than cuBLAS on an H100 and an H200, the AR step alike
    (`results/blas-h100.json`, `results/blas-h200.json`); cuBLAS's tiles for 17 / 33 / 65 rows are
    where the two differ most. Elsewhere (Ampere: unmeasured) torch's choice stays."""
    if not archs:
        return None
    if options.blas != "auto":
        return options.blas
    return "cublaslt" if all(a is not None and a.major == 9 for a in archs) else None


def apply_blas(options: Options, devices) -> bool:
    """blas_library for a target on `devices`: torch's BLAS library for every GEMM of the process.
    -> whether it was set."""
    archs = [triton_util.arch(d) for d in devices if torch.device(d).type == "cuda"]
    lib = blas_library(options, archs)
    if lib is None:
        return False
    torch.backends.cuda.preferred_blas_library(lib)
    return True

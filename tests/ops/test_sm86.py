"""Every Triton kernel of the project compiles for sm_86 (RTX A6000: 99 KB of shared memory a
block) within that shared memory, without a GPU; and the tile choices that depend on the GPU come
from its properties (ddtree.ops.triton_util.Arch), with an H200's unchanged.

Which launches: each launcher runs on meta tensors of the real shapes (Qwen3.6-27B and its DFlash
drafter; the codepair fixture's pair) with its `_kernel` replaced by a recorder and the device's
properties by a stand-in (an A6000's, an H200's). What it would launch there (constexprs,
num_warps, num_stages, the argument types and Triton's own specialisation of the arguments)
becomes a compile job, so nothing here restates a launcher's tile rules. Trees: every node count
at both ends of each tile class (tile side, squarings), auto's sizes, 1..128; every switch that
changes a constexpr (tree_kernel, tree_precision, tree_prologue; budgets 4..64 at top-k = budget
and auto's 32).

How: the jobs go to tests/ops/triton_compile.py in a subprocess without TRITON_INTERPRET (which
tests/conftest.py sets here before triton's import, and under which triton.jit does not
compile), which compiles them for GPUTarget("cuda", 86, 32) and ("cuda", 90, 32) with Triton's
bundled ptxas. Compiled kernels stay in Triton's cache (~/.triton/cache, or TRITON_CACHE_DIR):
a run after the first reads them back.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton not installed: nothing to compile")

from ddtree.decode.budget import AUTO_BUDGETS, AUTO_TOPK  # noqa: E402
from ddtree.decode.buffers import Slot  # noqa: E402
from ddtree.model import presets  # noqa: E402
from ddtree.model.config import DrafterConfig, TargetConfig  # noqa: E402
from ddtree.ops import commit, dispatch, gated_norm, gdn_step, gdn_tree, tree_kernel, triton_util, walk  # noqa: E402
from ddtree.options import Options  # noqa: E402

from conftest import FIXTURE_DIR, FIXTURE_REASON, have_fixture  # noqa: E402

try:
    from ddtree.ops import attention
except ImportError as e:  # not landed on this branch yet
    attention, ATTENTION_MISSING = None, f"ddtree.ops.attention does not import ({e})"
else:
    ATTENTION_MISSING = None if hasattr(attention, "tree_attention") else "ddtree.ops.attention has no tree_attention"
try:  # the GDN layer and its group (the model imports ddtree.ops.attention)
    from ddtree.model.target import GatedDeltaNet, GDNGroup, Step
except ImportError as e:
    TARGET_MISSING = f"ddtree.model.target does not import ({e})"
else:
    TARGET_MISSING = None

WORKER = Path(__file__).with_name("triton_compile.py")
META = torch.device("meta")
SM86_SMEM = 101376  # max dynamic shared memory per block on sm_86 (99 KB)

# Stand-in torch.cuda.get_device_properties results (the fields Arch reads).
A6000 = SimpleNamespace(name="NVIDIA RTX A6000", major=8, minor=6, shared_memory_per_block=49152,
                        shared_memory_per_block_optin=SM86_SMEM, multi_processor_count=84)
H200 = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, shared_memory_per_block=49152,
                       shared_memory_per_block_optin=232448, multi_processor_count=132)

# Tree sizes: both ends of every (tile side, squarings) class of the tree kernel (between them only
# the constexpr T moves, a mask bound), and auto's (budget + 1); 1 is the decode step.
TREES = sorted({1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128} | {b + 1 for b in AUTO_BUDGETS})
BUDGETS = range(4, 65)
PATHS = (1, 16)  # walk / commit path lengths: ar (the bonus alone) and a block of 16


def _pair(name: str):
    """(TargetConfig, DrafterConfig) of a model, or a skip reason."""
    if name == "qwen3.6-27b":
        t, d = presets.PRESETS[name]
        return TargetConfig.from_dict(t()), DrafterConfig.from_dict(d(), 64)
    if not have_fixture():
        return FIXTURE_REASON
    tc = TargetConfig.from_file(FIXTURE_DIR / "target" / "config.json")
    return tc, DrafterConfig.from_file(FIXTURE_DIR / "drafter" / "config.json", tc.num_layers)


MODELS = ("qwen3.6-27b", "codepair")


# ----------------------------------------------------------------------------- recording launches
@dataclass
class Launch:
    fn: object  # the kernel's Python function
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a jitted kernel: kern[grid](*args, **kwargs) is written down, not run."""

    def __init__(self, fn, log: list):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append(Launch(self.fn, args, kwargs))


KERNEL_MODULES = [gdn_step, gdn_tree, gated_norm, commit, tree_kernel, walk] + ([attention] if attention is not None else [])


def _recording(monkeypatch, props, log: list):
    """Launchers record instead of running, and see `props` as their device's properties."""
    a = triton_util.Arch.from_props(props)
    for m in KERNEL_MODULES:
        monkeypatch.setattr(m, "_kernel", lambda fn, interpret: _Recorder(fn, log))
    monkeypatch.setattr(triton_util, "arch", lambda device: a)
    if attention is not None and ATTENTION_MISSING is None:
        # its CUDA branch of candidate_tiles and _sm_count, with the stand-in's numbers
        monkeypatch.setattr(attention, "candidate_tiles", lambda d, rows, dtype, device, read_len=0: attention.pick_tiles(
            d, rows, torch.empty((), dtype=dtype).element_size(), a.smem, a.major >= 9, read_len))
        monkeypatch.setattr(attention, "_sm_count", lambda device: a.sms)


def _gdn_launches(tc: TargetConfig, props, dtype=torch.bfloat16):
    """A GDN layer's forward (decode step, tree verify) and the group's commit, as the model calls
    them, under every tree-kernel switch setting that changes a launch."""
    with torch.device(META):
        layer = GatedDeltaNet(tc).to(dtype)
    # the group holds the scratch and states the layer's kernels read (every GDN layer on one GPU)
    group = GDNGroup([layer] * tc.layer_types.count("linear_attention"), META, dtype, max(TREES))
    settings = [Options(tree_kernel=m, tree_precision=p, tree_prologue=n)
                for m, p, n in itertools.product(("auto", "on"), ("tf32x3", "ieee"), (0, 16, gdn_tree.MAX_NODES))]
    for T in TREES:
        x = torch.empty(T, tc.hidden_size, dtype=dtype, device=META)
        z = torch.zeros(T, dtype=torch.long, device=META)
        for opt in settings:
            kn = dispatch.resolve(opt, "cuda", props)
            s = Step(positions=z, path_mask=torch.empty(T, T, dtype=torch.bool, device=META),
                     window=torch.empty(T, layer.width, dtype=torch.long, device=META), attn_mask=None,
                     cos=None, sin=None, start=z[0], kv_len=T, kernels=kn)
            layer(x, s)
        group.step = (T, torch.empty(T, layer.width, dtype=torch.long, device=META), None)
        for P in PATHS:
            group.commit(torch.empty(P, dtype=torch.long, device=META), z[0], dispatch.resolve(Options(), "cuda", props))


def _kv_commit_launches(tc: TargetConfig, dtype=torch.bfloat16):
    L = tc.layer_types.count("full_attention")
    kc = torch.empty(L, 4096, tc.num_kv_heads, tc.head_dim, dtype=dtype, device=META)
    for P in PATHS:
        commit.kv_commit_(kc, torch.empty_like(kc), torch.empty(P, dtype=torch.long, device=META),
                          torch.empty((), dtype=torch.long, device=META))


def _tree_build_launches(dc: DrafterConfig):
    """The device tree builder at every budget, top-k = budget (--budget B) or auto's; auto's
    budgets also with the prefix summary."""
    D = dc.block_size - 1
    for B in BUDGETS:
        for K, summary in {(B, False), (AUTO_TOPK, B in AUTO_BUDGETS)}:
            slot = Slot(B + 1, META)
            depth = torch.empty(1, dtype=torch.long, device=META)
            summ = (torch.empty(B, device=META), torch.empty(B, dtype=torch.long, device=META)) if summary else None
            tree_kernel.build_tree_kernel(torch.empty((), dtype=torch.long, device=META), torch.empty(D, K, device=META),
                                          torch.empty(D, K, dtype=torch.long, device=META), B,
                                          out=(slot.tokens, slot.depths, slot.parents, slot.ranks, slot.mask, depth),
                                          summary=summ)


def _walk_launches():
    for T in TREES:
        slot = Slot(T, META)
        for P in PATHS:
            outs = (torch.empty(P, dtype=torch.long, device=META), torch.empty((), dtype=torch.long, device=META),
                    torch.empty((), dtype=torch.long, device=META))
            for header in (None, torch.empty(2 + 2 * P, device=META)):
                walk.walk_kernel(slot.tokens, slot.parents, slot.depths, slot.mask, slot.choice, P, outs,
                                 ranks=None if header is None else slot.ranks, pack=header)


def _attention_launches(tc: TargetConfig, dc: DrafterConfig, dtype=torch.bfloat16):
    """tree_attention as the verify (tree mask), a prefill chunk (causal) and the drafter's block
    (its layers' causal / window settings) call it, the prefix split (both merges) and not."""
    def call(H, KVH, D, T, mask, window=None, causal=True):
        q = torch.empty(T, H, D, dtype=dtype, device=META)
        kc = torch.empty(8192, KVH, D, dtype=dtype, device=META)
        start = torch.empty((), dtype=torch.long, device=META)
        for splits, merge in ((0, "auto"), (4, "last"), (4, "kernel")):  # unsplit; split, merged in-kernel / apart
            attention.tree_attention(q, kc, torch.empty_like(kc), start, mask, 8192, window=window, causal=causal,
                                     splits=splits, merge=merge)

    for T in TREES:  # the verify: rows = T x query heads per KV head pick the row tile
        call(tc.num_heads, tc.num_kv_heads, tc.head_dim, T, torch.empty(T, T, dtype=torch.bool, device=META))
    call(tc.num_heads, tc.num_kv_heads, tc.head_dim, 512, "causal")  # prefill chunk, triton backend
    for causal, window in set(zip(dc.causal, dc.sliding_window)):
        call(dc.num_heads, dc.num_kv_heads, dc.head_dim, dc.block_size, "causal" if causal else "full", window, causal)


def record(monkeypatch, name: str, props, kernels: set) -> list[Launch]:
    """Every launch of model `name` on a device with `props`, for the kernel families in `kernels`."""
    pair = _pair(name)
    if isinstance(pair, str):
        pytest.skip(pair)
    tc, dc = pair
    log: list = []
    with monkeypatch.context() as mp:
        _recording(mp, props, log)
        with torch.no_grad():
            if "gdn" in kernels:
                _gdn_launches(tc, props)
            if "kv" in kernels:
                _kv_commit_launches(tc)
            if "tree" in kernels:
                _tree_build_launches(dc)
            if "walk" in kernels:
                _walk_launches()
            if "attention" in kernels:
                _attention_launches(tc, dc)
    return log


# ----------------------------------------------------------------------------- compile jobs
def job(launch: Launch, cc: int) -> dict:
    """The compile job of a recorded launch: the signature, constexprs and specialisation
    attributes that Triton's launcher derives from these arguments (runtime.jit._pack_args)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    kw = dict(launch.kwargs)
    num_warps, num_stages = kw.pop("num_warps", 4), kw.pop("num_stages", None)
    params = list(inspect.signature(launch.fn).parameters.values())
    bound = dict(zip([p.name for p in params], launch.args)) | kw
    sig, consts, attrs = {}, [], []
    for i, p in enumerate(params):
        v = bound[p.name]
        if "constexpr" in str(p.annotation):
            ty, key = "constexpr", v
        else:
            ty, key = native_specialize_impl(BaseBackend, v, False, True, True)
        sig[p.name] = ty
        if ty == "constexpr":
            consts.append([[i], key])
        elif isinstance(key, str) and key:
            attrs.append([[i], BaseBackend.parse_attr(key)])
    return {"module": launch.fn.__module__, "fn": launch.fn.__name__, "signature": sig, "constexprs": consts,
            "attrs": attrs, "num_warps": num_warps, "num_stages": num_stages, "cc": cc}


def label(j: dict) -> str:
    names = list(j["signature"])
    c = {names[k[0]]: v for k, v in j["constexprs"] if j["signature"][names[k[0]]] == "constexpr"
         and not names[k[0]].startswith("s_")}
    return f"{j['fn']} sm_{j['cc']} w{j['num_warps']}" + (f" s{j['num_stages']}" if j["num_stages"] else "") + \
        " " + " ".join(f"{k}={v}" for k, v in c.items())


def _ptxas_reason() -> str | None:
    """Why the bundled ptxas (and the cuobjdump beside it, for registers) cannot run here, or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(86).path
    except Exception as e:
        return f"Triton's NVIDIA backend or its bundled ptxas is not usable here ({type(e).__name__}: {e})"
    for tool in (path, os.path.join(os.path.dirname(path or ""), "cuobjdump")):
        if not (tool and os.access(tool, os.X_OK)):
            return f"{tool} is missing: Triton's NVIDIA tools are not bundled here"
    return None


_RESULTS: dict = {}  # job key -> result, for this test process


def compile_jobs(jobs: list[dict]) -> list[dict]:
    """Compile each distinct job once (this process's memo, then Triton's own cache)."""
    reason = _ptxas_reason()
    if reason:
        pytest.skip(reason)
    keys = [json.dumps(j, sort_keys=True) for j in jobs]
    todo = list(dict.fromkeys(k for k in keys if k not in _RESULTS))
    if todo:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
        r = subprocess.run([sys.executable, str(WORKER)], input="[" + ",".join(todo) + "]", capture_output=True,
                           text=True, env=env, timeout=4 * 3600)
        assert r.returncode == 0, f"the compile worker failed:\n{r.stderr[-4000:]}"
        for k, res in zip(todo, json.loads(r.stdout)):
            _RESULTS[k] = res
    return [_RESULTS[k] for k in keys]


def distinct(launches: list[Launch], cc: int) -> list[dict]:
    return list({json.dumps(j, sort_keys=True): j for j in (job(x, cc) for x in launches)}.values())


# ----------------------------------------------------------------------------- which to compile
# Constexprs that bound a mask or a dynamic loop or offset a pointer, and shape no tensor (nor
# unroll a static_range): launches that differ only in these have the same tensors, so the same
# shared memory. One member of each such class is compiled: the largest values (DDTREE_SM86_ALL=1:
# every distinct launch). The class keeps num_warps, num_stages, every other constexpr and the
# arguments' alignment specialisation, which does move shared memory (the attention kernel:
# 28 vs 32 KB for the same tiles).
SCALARS = {"_tree_kernel": ("B", "K", "KBV", "D"), "_walk_kernel": ("T", "P", "PK"), "_gdn_tree_kernel": ("T",),
           "_gdn_tree_mats_kernel": ("T",), "_gdn_tree_solve_kernel": ("T",),
           "_gdn_prologue_kernel": ("T",), "_kv_commit_kernel": ("P",)}
EXHAUSTIVE = os.environ.get("DDTREE_SM86_ALL") == "1"
KERNELS = {"_gdn_step_kernel": "gdn", "_gdn_tree_kernel": "gdn",
           "_gdn_tree_mats_kernel": "gdn", "_gdn_tree_solve_kernel": "gdn",  # (_gdn_tree_mats_head_kernel: Hopper only, gdn_tree.block_nodes)
           "_gdn_prologue_kernel": "gdn", "_gated_norm_kernel": "gdn", "_gdn_commit_kernel": "gdn", "_conv_commit_kernel": "gdn", "_kv_commit_kernel": "kv", "_tree_kernel": "tree",
           "_walk_kernel": "walk", "_attn_fwd_kernel": "attention", "_attn_merge_kernel": "attention"}  # kernel -> the launches that make it
MISSING = {"gdn": TARGET_MISSING, "attention": ATTENTION_MISSING}  # a family that cannot be recorded, and why
FAMILIES = {f for f in KERNELS.values() if not MISSING.get(f)}


def constexprs(j: dict) -> dict:
    names = list(j["signature"])
    return {names[k[0]]: v for k, v in j["constexprs"]}


def representatives(jobs: list[dict]) -> list[dict]:
    if EXHAUSTIVE:
        return jobs
    classes: dict = {}
    for j in jobs:
        sc = SCALARS.get(j["fn"], ())
        c = constexprs(j)
        key = json.dumps([j["fn"], j["num_warps"], j["num_stages"], j["attrs"],
                          sorted((k, v) for k, v in c.items() if k not in sc)])
        classes.setdefault(key, []).append((tuple(c[s] for s in sc), j))
    return [max(members, key=lambda m: m[0])[1] for members in classes.values()]


# Compiling is opt-in: ~300 kernels take ptxas ~35 CPU-minutes on a cold Triton cache (a warm one:
# under a minute), more than the whole suite's budget on a 2-core CI machine.
COMPILE = os.environ.get("DDTREE_SM86") == "1"
compiles = pytest.mark.skipif(not COMPILE, reason="compiles every Triton kernel for sm_86 (~35 CPU-minutes cold): "
                                                  "run DDTREE_SM86=1 python -m pytest -q tests/ops/test_sm86.py")


@pytest.fixture(scope="module")
def recorded():
    """{model: [job]} of every representative launch the launchers make on an A6000 (or the
    model's skip reason): recorded on meta tensors, nothing compiled."""
    per_model = {}
    with pytest.MonkeyPatch.context() as mp:
        for name in MODELS:
            pair = _pair(name)
            if isinstance(pair, str):
                per_model[name] = pair  # the skip reason
                continue
            per_model[name] = representatives(distinct(record(mp, name, A6000, FAMILIES), 86))
    return per_model


@pytest.fixture(scope="module")
def sm86(recorded):
    """{model: [(job, sm_86 result)]} for every representative launch, and the sm_90 comparison:
    {(kernel, precision): (job, sm_86 result, sm_90 result)} for the largest sm_86 launch of each
    kernel (and dot precision)."""
    per_model = recorded
    jobs = [j for v in per_model.values() if not isinstance(v, str) for j in v]
    results = dict(zip(map(json.dumps, jobs), compile_jobs(jobs)))
    out = {n: v if isinstance(v, str) else [(j, results[json.dumps(j)]) for j in v] for n, v in per_model.items()}
    largest = {}  # (kernel, its dot precision if it has one) -> the launch with the most shared memory
    for v in out.values():
        for j, r in ([] if isinstance(v, str) else v):
            key = (j["fn"], constexprs(j).get("PREC", ""))
            if r["ok"] and r["shared"] >= largest.get(key, (None, {"shared": -1}))[1]["shared"]:
                largest[key] = (j, r)
    cmp = dict(zip(largest, compile_jobs([dict(j, cc=90) for j, _ in largest.values()])))
    return out, {key: (j, r, cmp[key]) for key, (j, r) in largest.items()}


def _table(rows) -> str:
    return "\n".join(f"  {label(j):<110} shared {r['shared']:>6}  regs {r['regs']}  stack {r['stack']}  "
                     f"barriers {r.get('barriers')}  sass {r.get('sass')}" for j, r in rows)


@compiles
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kernel", list(KERNELS))
def test_kernel_compiles_for_sm86_within_its_shared_memory(sm86, model, kernel):
    """Every launch of `kernel` the launchers make for `model` on an A6000 compiles for sm_86 and
    fits its 99 KB of shared memory a block and its 64K registers."""
    if MISSING.get(KERNELS[kernel]):
        pytest.skip(MISSING[KERNELS[kernel]])
    out, _ = sm86
    if isinstance(out[model], str):
        pytest.skip(out[model])
    rows = [(j, r) for j, r in out[model] if j["fn"] == kernel]
    assert rows, f"no launch of {kernel} recorded for {model}"
    failed = [(label(j), r["error"]) for j, r in rows if not r["ok"]]
    assert not failed, f"{len(failed)} of {len(rows)} do not compile for sm_86: {failed[:3]}"
    print(f"\n{kernel} for {model}, sm_86:\n" + _table(rows))
    over = [(label(j), r["shared"]) for j, r in rows if r["shared"] > SM86_SMEM]
    assert not over, f"over sm_86's {SM86_SMEM} bytes of shared memory: {over}"
    regs = [(label(j), r["regs"]) for j, r in rows if r["regs"] * 32 * j["num_warps"] > 65536]
    assert not regs, f"more registers than an sm_86 block has: {regs}"


def test_every_recorded_kernel_is_checked(recorded):
    """A kernel a launcher starts launching is one the test above checks (KERNELS), and every
    kernel of KERNELS is launched for some model (recording only: this runs without DDTREE_SM86)."""
    seen = {j["fn"] for v in recorded.values() if not isinstance(v, str) for j in v}
    assert seen <= set(KERNELS), f"add to KERNELS: {sorted(seen - set(KERNELS))}"
    if all(not isinstance(v, str) for v in recorded.values()) and not any(MISSING.values()):
        assert seen == set(KERNELS), f"never launched: {sorted(set(KERNELS) - seen)}"


@compiles
def test_largest_launches_compile_for_sm90_too(sm86):
    """For comparison: each kernel's largest sm_86 launch (per dot precision), compiled for sm_90."""
    _, cmp = sm86
    assert cmp, "nothing compiled"
    lines = []
    for _, (j, r86, r90) in sorted(cmp.items()):
        assert r90["ok"], f"{label(j)} does not compile for sm_90: {r90['error']}"
        assert r90["shared"] <= H200.shared_memory_per_block_optin
        lines.append(f"  {label(j):<110} sm_86 {r86['shared']:>6}  sm_90 {r90['shared']:>6}")
    print("\nlargest shared memory per kernel, bytes:\n" + "\n".join(lines))


# ----------------------------------------------------------------------------- the choices
def _arch(props) -> triton_util.Arch:
    return triton_util.Arch.from_props(props)


TURING = SimpleNamespace(major=7, minor=5, shared_memory_per_block=49152, shared_memory_per_block_optin=65536,
                         multi_processor_count=40)
A100 = SimpleNamespace(major=8, minor=0, shared_memory_per_block=49152, shared_memory_per_block_optin=166912,
                       multi_processor_count=108)


def test_arch_reads_the_properties():
    a = _arch(A6000)
    assert (a.major, a.minor, a.cc, a.smem, a.sms) == (8, 6, 86, 101376, 84)
    old = SimpleNamespace(major=8, minor=6, shared_memory_per_block=49152, multi_processor_count=84)  # no opt-in field
    assert _arch(old).smem == 49152
    assert triton_util.arch("cpu") is None and triton_util.arch(META) is None


def test_tree_kernel_limit_follows_shared_memory():
    """The tree kernel's largest tree: 128 nodes where a block has the shared memory (H200, A100),
    64 on sm_86 / sm_89 (99 KB) and on a 48 KB device, 32 on a 16 KB one; the interpreter is not
    limited."""
    assert [gdn_tree.max_nodes(_arch(p)) for p in (H200, A100, A6000)] == [128, 128, 64]
    small = SimpleNamespace(major=8, minor=6, shared_memory_per_block=49152, multi_processor_count=1)
    assert gdn_tree.max_nodes(_arch(small)) == 64  # 8 * 64^2 = 32 KB of 48
    tiny = SimpleNamespace(major=8, minor=6, shared_memory_per_block=16384, multi_processor_count=1)
    assert gdn_tree.max_nodes(_arch(tiny)) == 32
    assert gdn_tree.max_nodes(None) == gdn_tree.MAX_NODES


def _old_resolve(options: Options) -> dispatch.Kernels:
    """dispatch.resolve for a CUDA device as it was before tiles followed the device (the H200's)."""
    return dispatch.Kernels(
        triton=options.triton, walk=options.triton and options.triton_walk,
        tree_max_nodes=dispatch.TREE_MAX_NODES[options.tree_kernel] if options.triton else 0,
        tree_tile=dispatch.TREE_TILE if options.tree_kernel == "auto" else 1 << 30,
        tree_precision=options.tree_precision, tree_prologue=options.tree_prologue if options.triton else 0,
        tree_blocked=dispatch.TREE_BLOCKED_MAX_NODES if options.triton and options.tree_kernel != "off" else 0,
        attention=dispatch._attention(options, options.triton), fla=options.fla)


SWITCHES = [Options(tree_kernel=m, tree_precision=p, tree_prologue=n, triton=t)
            for m, p, n, t in itertools.product(("auto", "on", "off"), ("tf32x3", "ieee"), (0, 16, 128), (True, False))]


@pytest.mark.parametrize("opt", SWITCHES, ids=lambda o: f"{o.tree_kernel}-{o.tree_precision}-{o.tree_prologue}-{o.triton}")
def test_h200_choices_unchanged(opt):
    """The H200 keeps those choices and adds the fused prefix (DDTREE_VERIFY_FUSED=auto: Hopper)
    wherever the split-KV kernel serves; the A6000 (below) does not take it."""
    old = _old_resolve(opt)
    assert dispatch.resolve(opt, "cuda", H200) == dataclasses.replace(old, fused_prefix=old.attention == "kernel")
    assert not dispatch.resolve(dataclasses.replace(opt, verify_fused="off"), "cuda", H200).fused_prefix


@pytest.mark.parametrize("opt", SWITCHES, ids=lambda o: f"{o.tree_kernel}-{o.tree_precision}-{o.tree_prologue}-{o.triton}")
def test_a6000_choices(opt):
    """An A6000 gets the H200's choices but the tree kernel's size: tiles of up to 64 nodes with
    tree_kernel=on (65 with the root folded; auto's 32-node, 2048-element limit is under it),
    tf32x3 as asked."""
    old, new = _old_resolve(opt), dispatch.resolve(opt, "cuda", A6000)
    assert new == dataclasses.replace(old, tree_max_nodes=min(old.tree_max_nodes, 64))
    if opt.triton:
        k = dispatch.resolve(opt, "cuda", A6000)
        assert k.tree(64, 64) == k.tree(65, 64) == (opt.tree_kernel == "on") and not k.tree(66, 64)


@pytest.mark.parametrize("props", [H200, A6000], ids=["h200", "a6000"])
def test_each_tree_size_takes_one_tree_kernel(props):
    """At the 27B's dk 128, a tree of 2..130 nodes takes at most one of the two tree kernels:
    auto the one-tile kernel up to 17 nodes (16 in the tile after the root, folded) and blocks up
    to TREE_BLOCKED_MAX_NODES; on the one-tile kernel as far as shared memory allows (tiles of 128
    / 64 nodes: 129 / 65 nodes) and blocks past that up to the same bound; off and no Triton
    neither (tree_wy)."""
    one = {"auto": 16, "on": gdn_tree.max_nodes(_arch(props))}  # the largest tile
    for mode in ("auto", "on", "off"):
        for triton_on in (True, False):
            k = dispatch.resolve(Options(tree_kernel=mode, triton=triton_on), "cuda", props)
            for T in range(2, 131):
                fits = T <= one.get(mode, 0) or T == one.get(mode, 0) + 1  # the root folded: 17, 65, 129
                want = ("none" if mode == "off" or not triton_on
                        else "tree" if fits else "blocked" if T <= dispatch.TREE_BLOCKED_MAX_NODES else "none")
                got = "tree" if k.tree(T, 128) else "blocked" if k.blocked(T, 128) else "none"
                assert got == want, (mode, triton_on, T)
                assert not (k.tree(T, 128) and k.blocked(T, 128))


@pytest.mark.parametrize("props", [H200, A6000], ids=["h200", "a6000"])
def test_prologue_sizes(props):
    """Where the GDN prologue runs in Triton at the 27B's dk 128 under the default prologue limit
    (65): inside the one-tile kernel for tiles of up to 64 nodes (65 with the root folded; never
    the 65..128-node tiles tree_kernel=on makes: 288 KB of shared memory on sm_90), ahead of the
    blocks for 18..65 nodes, nowhere past the limit; and under a limit of 0 nowhere."""
    for mode in ("auto", "on"):
        k = dispatch.resolve(Options(tree_kernel=mode), "cuda", props)
        assert k.tree_prologue == 65
        for T in range(2, 131):
            want = T <= 65 and (k.blocked(T, 128) or (k.tree(T, 128) and gdn_tree.tile_nodes(T) <= 64))
            assert k.prologue(T, 128) == want, (mode, T)
        assert all(k.prologue(T, 128) for T in range(2, 66))  # every tree of up to 65 nodes
        if mode == "on" and props is H200:  # 66 nodes in a 128-node tile there, with the torch prologue
            assert k.tree(66, 128) and not k.prologue(66, 128) and k.prologue(65, 128)
        off = dispatch.resolve(Options(tree_kernel=mode, tree_prologue=0), "cuda", props)
        assert not any(off.prologue(T, 128) for T in range(2, 130))


@pytest.mark.parametrize("props", [H200, A6000], ids=["h200", "a6000"])
def test_blocked_kernel_tiles(monkeypatch, props):
    """gdn_tree_blocked's launches: 16-node blocks up to 33 nodes (everywhere past 33 below
    Hopper), the first pass a program per block and head; past that on Hopper one block of 64
    nodes, the first pass a program per head (64-node tiles: warp-group MMAs); 32 value channels
    in the second pass; the root folded into the state first where that saves a block (16m + 1
    nodes, or 65 in a block of 64); 4 warps."""
    hopper = props is H200
    for T, dk, dv in ((17, 128, 128), (32, 128, 128), (33, 128, 128), (34, 128, 128), (48, 128, 64), (64, 128, 128),
                      (65, 128, 128), (128, 64, 32), (20, 64, 16)):
        block = 64 if hopper and T > 33 else 16
        root = int((T - 1) % block == 0)
        bv = min(32, max(16, dv))
        first, solve = _tree_launches(monkeypatch, props, T, dk, dv, "tf32x3", gdn_tree.gdn_tree_blocked)
        want = "_gdn_tree_mats_head_kernel" if block == 64 else "_gdn_tree_mats_kernel"
        assert first.fn.__name__ == want and solve.fn.__name__ == "_gdn_tree_solve_kernel", (T, first.fn.__name__)
        nsq = (min(T - root, block) - 1).bit_length() - 1
        assert (first.kwargs["SB"], first.kwargs["NSQ"], first.kwargs["ROOT"]) == (block, nsq, root), (T, dk, dv)
        if block == 64:
            assert first.kwargs["BN"] == max(64, 1 << (T - root - 1).bit_length())
        c = solve.kwargs
        assert (c["SB"], c["BK"], c["BV"], c["ROOT"], c["num_warps"]) == (block, dk, bv, root, 4), (T, dk, dv)


def _tree_launches(monkeypatch, props, T: int, dk: int, dv: int, precision: str, launcher=None) -> list[Launch]:
    """The launch of a tree kernel's launcher (default gdn_tree.gdn_tree) for a T-node tree, called
    directly: dispatch would send some sizes elsewhere."""
    log: list = []
    _recording(monkeypatch, props, log)
    H = 4
    f32 = dict(dtype=torch.float32, device=META)
    q = torch.empty(T, H, dk, **f32)
    out = (torch.empty(H, T, dk, **f32), torch.empty(H, T, dv, **f32), torch.empty(H, T, **f32))
    (launcher or gdn_tree.gdn_tree)(q, torch.empty_like(q), torch.empty(T, H, dv, **f32), torch.empty(T, H, **f32),
                                    torch.empty(T, H, **f32), torch.empty(H, dk, dv, **f32),
                                    torch.empty(T, T, dtype=torch.bool, device=META), out, precision)
    return log


@pytest.mark.parametrize("props", [H200, A6000], ids=["h200", "a6000"])
def test_tree_kernel_tiles(monkeypatch, props):
    """gdn_tree's tiles for every tree size: the H200's rule, the same on an A6000 (only the
    largest tree it takes differs, in dispatch). The tile holds the nodes after the root where
    folding the root halves it (17, 33, 65, 129 nodes), else every node."""
    for T in range(2, 130):
        root = T - 1 in (16, 32, 64, 128)
        n = T - root
        for dk in (64, 128):
            (launch,) = _tree_launches(monkeypatch, props, T, dk, dk, "tf32x3")
            c = launch.kwargs
            BT = max(16, 1 << (n - 1).bit_length())
            got = (c["BT"], c["BK"], c["BV"], c["NSQ"], c["num_warps"], c["PREC"], c["ROOT"])
            assert got == (BT, dk, 32, max(0, (n - 1).bit_length() - 1), 8 if BT > 32 else 4, "tf32x3", int(root)), (T, dk)


@pytest.mark.parametrize("props", [H200, A6000], ids=["h200", "a6000"])
def test_prologue_tree_kernel_tiles(monkeypatch, props):
    """With the prologue inside, the one-tile kernel's 16-node tiles (trees of 2..17 nodes at the
    27B's shapes) take 64 value channels on 8 warps (every program recomputes q and k); larger
    tiles keep gdn_tree's (tree_kernel=on)."""
    tc, _ = _pair("qwen3.6-27b")
    with torch.device(META):
        layer = GatedDeltaNet(tc).to(torch.bfloat16)
    for T in (2, 9, 16, 17, 18, 32, 33):
        log: list = []
        _recording(monkeypatch, props, log)
        bf16 = dict(dtype=torch.bfloat16, device=META)
        proj = torch.empty(T, layer.in_proj_qkv.out_features + layer.hv * layer.dv + 2 * layer.hv, **bf16)
        out = [torch.empty(layer.hv, T, d, device=META) for d in (layer.dk, layer.dv)] + [torch.empty(layer.hv, T, device=META)]
        gdn_tree.gdn_tree_prologue(layer, proj, torch.empty(layer.width - 1 + T, layer.conv_dim, **bf16),
                                   torch.empty(T, layer.width, dtype=torch.long, device=META),
                                   torch.empty(layer.hv, layer.dk, layer.dv, device=META),
                                   torch.empty(T, T, dtype=torch.bool, device=META), out, "tf32x3")
        monkeypatch.undo()
        (launch,) = log
        c = launch.kwargs
        small = T <= 17  # a 16-node tile (17: after the folded root)
        assert (c["BT"], c["BV"], c["num_warps"], c["PROLOGUE"]) == ((16, 64, 8, True) if small else (32, 32, 4, True)), T


def test_tf32x3_falls_back_to_ieee_without_tf32_tensor_cores(monkeypatch):
    """Triton 3.6 decomposes tf32x3 into TF32 MMAs for sm_80 and later (so on sm_86); below that
    the launcher asks for ieee. The interpreter always gets ieee."""
    assert triton_util.dot_precision("tf32x3", _arch(A6000)) == "tf32x3"
    assert triton_util.dot_precision("tf32x3", _arch(A100)) == "tf32x3"
    assert triton_util.dot_precision("tf32x3", _arch(TURING)) == "ieee"
    assert triton_util.dot_precision("ieee", _arch(A6000)) == "ieee"
    assert triton_util.dot_precision("tf32x3", None) == "ieee"
    assert dispatch.resolve(Options(), "cuda", TURING).tree_precision == "ieee"
    assert dispatch.resolve(Options(), "cuda", A6000).tree_precision == "tf32x3"
    for props, want in ((TURING, "ieee"), (A6000, "tf32x3")):
        (launch,) = _tree_launches(monkeypatch, props, 16, 128, 128, "tf32x3")
        assert launch.kwargs["PREC"] == want


@compiles
def test_tf32x3_is_three_tf32_mmas_on_sm86(sm86):
    """The tree kernel's tf32x3 products compile, on sm_86, to TF32 mma.sync with the operands
    split by cvt.rna.tf32 (Triton's 3xTF32 decomposition, not an fp32 fallback); ieee to no MMA."""
    if TARGET_MISSING:
        pytest.skip(TARGET_MISSING)
    out, _ = sm86
    rows = [(constexprs(j)["PREC"], r) for v in out.values() if not isinstance(v, str) for j, r in v
            if j["fn"] == "_gdn_tree_kernel"]
    assert {p for p, _ in rows} == {"tf32x3", "ieee"}
    for prec, r in rows:
        if prec == "tf32x3":
            assert r["tf32_mma"] > 0 and r["tf32_cvt"] > 0, r
        else:
            assert r["tf32_mma"] == 0, r


@compiles
def test_oversized_tree_tile_fails_the_check(monkeypatch):
    """The shared-memory check can fail: the 128-node tree at dk 128 (the 27B's) that
    gdn_tree.max_nodes keeps off sm_86 needs more than its 99 KB. One squaring (A @ A, the product
    of two [128, 128] tiles) of the six such a tree takes: the others add no tile, only minutes of
    compile time."""
    assert gdn_tree.max_nodes(_arch(A6000)) < 128 <= gdn_tree.max_nodes(_arch(H200))
    (launch,) = _tree_launches(monkeypatch, A6000, 128, 128, 128, "tf32x3")
    j = job(launch, 86)
    assert constexprs(j)["BT"] == 128 and constexprs(j)["NSQ"] == 6
    names = list(j["signature"])
    j["constexprs"] = [[k, 1 if names[k[0]] == "NSQ" else v] for k, v in j["constexprs"]]
    (r,) = compile_jobs([j])
    assert r["ok"], r["error"]
    assert r["shared"] > SM86_SMEM, r

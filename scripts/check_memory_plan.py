#!/usr/bin/env python3
"""GPU check of the memory plan: build the random-weight Qwen3.6-27B + DFlash drafter
(ddtree.model.synthetic.build_random_on_devices, exact shapes), then compare with
ddtree.model.placement's plan, per GPU:

* exact components (target weights, the fp32 constants prepare() derives, the target's state,
  drafter weights, drafter state, --budget auto's DeferredContext) as torch.cuda.memory_allocated
  deltas: they must come within 5% (they should be 1.000); the DeferredContext is made first, as
  `ddtree` makes it before the weights (made after them, the allocator may hand its few-MB request
  a free block up to 1 MB larger, unsplit: 1.108 at 32K), and also reported as the bytes its
  tensors requested (`requested_bytes`);
* unless --no-activations, the estimated phases as torch.cuda.max_memory_allocated deltas over
  what is allocated before each: a real prefill of --prompt-tokens (Decoder.prefill's path:
  TargetModel.prefill in the chunks TargetModel.prefill_chunk picks from the free memory now,
  each chunk's taps to DFlashDrafter.add_context; the chunks' and the drafter context's peaks
  apart), a verify of --verify-nodes at kv_len = --max-length (Decoder._verify: the dense-mask
  kernel or SDPA, as the engine's options say), a verify of --verify-nodes at the engine's context
  bound for the prompt (Decoder._verify on a chain) and a draft there (Decoder.draft_topk).
  Eager code, no CUDA graphs (the plan's graphs=False). An estimate below its measurement is
  flagged (exit 1), as is an exact row off by more than 5%.

--attention math holds the verify's and draft's attention to torch's math SDPA (the dense-mask
twin, DDTREE_ATTENTION=sdpa, on its math backend: the A6000 fallback); auto takes the engine's
path (the split-KV kernel where Triton runs). The prefill takes its flash kernels either way.
At 32K and 128K on an H200 a run takes well under three minutes (most of it the build, the
prefill and the first compiles of the Triton kernels).

    python scripts/check_memory_plan.py --prompt-tokens 32768 --out results/memory-plan-32k-h200.json
    python scripts/check_memory_plan.py --prompt-tokens 131072 --out results/memory-plan-128k-h200.json
    python scripts/check_memory_plan.py --devices cuda:0,cuda:1 --prompt-tokens 32768
    python scripts/check_memory_plan.py --tiny --devices cpu --prompt-tokens 700   # CPU: the code path only

--tiny builds the tests' tiny random pair instead of the 27B shapes; on the CPU there are no
allocator statistics, so the measured columns read 0 and nothing is flagged: a dry run that
the script still matches the code.
Feeds the memory-plan row of docs/PERFORMANCE.md's targets.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.app.plan import attention_path  # noqa: E402
from ddtree.decode.decoder import Decoder  # noqa: E402
from ddtree.decode.graphs import VerifyKey  # noqa: E402
from ddtree.decode.round import DeferredContext  # noqa: E402
from ddtree.decode.sampling import SamplingParams  # noqa: E402
from ddtree.model import memory as mem  # noqa: E402
from ddtree.model.config import DrafterConfig, TargetConfig  # noqa: E402
from ddtree.model.drafter import DFlashDrafter  # noqa: E402
from ddtree.model.placement import EXACT_ROWS, Workload, gpu_of, place  # noqa: E402
from ddtree.model.presets import qwen36_27b_config, qwen36_27b_dflash_config  # noqa: E402
from ddtree.model.synthetic import build_random_on_devices, tiny_drafter_config, tiny_hybrid_config  # noqa: E402
from ddtree.model.target import TargetModel  # noqa: E402
from ddtree.ops import fla  # noqa: E402
from ddtree.ops.tree import Tree  # noqa: E402
from ddtree.options import Options  # noqa: E402

GiB = 1 << 30
EXACT = ("target weights", "derived fp32", "target state", "drafter weights", "drafter state", "deferred context")
PHASES = ("prefill chunk", "drafter context", "verify", "draft")  # what is measured, and the plan's phase of each:
PLAN_PHASE = {"prefill chunk": "prefill", "drafter context": "context", "verify": "verify", "draft": "draft"}


def _cuda(g: str) -> bool:
    return g.startswith("cuda")


def snapshot(gpus) -> dict[str, int]:
    """Bytes allocated per device now (0 on the CPU: no allocator statistics there)."""
    for g in gpus:
        if _cuda(g):
            torch.cuda.synchronize(g)
    return {g: torch.cuda.memory_allocated(g) if _cuda(g) else 0 for g in gpus}


def requested(gpus) -> dict[str, int]:
    """Bytes the live tensors asked for per device now: memory_allocated counts whole allocator
    blocks, and a cached free block less than 1 MB larger than a request is handed out unsplit."""
    return {g: torch.cuda.memory_stats(g).get("requested_bytes.all.current", 0) if _cuda(g) else 0 for g in gpus}


def planned_components(cfg, dcfg, split, wl) -> dict[str, dict[str, int]]:
    """The exact components per GPU from ddtree.model.memory (the split's stages)."""
    dt, out = wl.dtype, {}
    last = len(split.stages) - 1
    for j, s in enumerate(split.stages):
        g = gpu_of(s.device)
        c = out.setdefault(g, dict.fromkeys(EXACT, 0))
        kinds = cfg.layer_types[s.start:s.end]
        c["target weights"] += sum(mem.layer_weight_bytes(cfg, k, dt) for k in kinds)
        c["derived fp32"] += sum(mem.layer_prepared_bytes(cfg, k, dt) for k in kinds)
        n_attn = kinds.count("full_attention")
        c["target state"] += mem.kv_cache_bytes(cfg, n_attn, wl.max_len, dt) + sum(
            mem.gdn_group_bytes(cfg, len(kinds) - n_attn, dt, wl.tree_capacity).values())
        if j == 0:
            c["target weights"] += mem.embedding_bytes(cfg, dt)
        if j == last:
            c["target weights"] += mem.head_bytes(cfg, dt)
            c["derived fp32"] += mem.head_prepared_bytes(cfg)
        if j == split.drafter_stage:
            c["drafter weights"] += mem.drafter_weight_bytes(dcfg, dt)
            c["drafter state"] += sum(mem.drafter_state_bytes(dcfg, wl.max_len, dt).values())
            c["deferred context"] += mem.deferred_context_bytes(cfg, dcfg, dt) if wl.deferred else 0
    for g in out:
        if any(gpu_of(s.device) == g and s.end > s.start for s in split.stages):
            out[g]["target state"] += mem.target_rope_bytes(cfg, wl.max_len)
        assert sum(out[g].values()) == sum(split.gpus[g][r] for r in EXACT_ROWS), "plan rows disagree"
    return out


def measure_build(raw_t, raw_d, devices, dtype, max_len):
    """--budget auto's DeferredContext first (as `ddtree` makes it before the weights, on the
    drafter's device: the last), then the build, snapshotting memory at the component boundaries
    of build_random_on_devices."""
    gpus = list(dict.fromkeys(gpu_of(d) for d in devices))
    marks: dict[str, dict[str, int]] = {"start": snapshot(gpus)}
    asked = requested(gpus)
    cfg = TargetConfig.from_dict(raw_t)
    dcfg = DrafterConfig.from_dict(raw_d, cfg.num_layers)
    deferred = DeferredContext.for_models(cfg, dcfg, devices[-1], dtype)
    marks["deferred context"] = snapshot(gpus)
    asked = {g: n - asked[g] for g, n in requested(gpus).items()}
    t_alloc, t_prep, d_alloc = TargetModel.allocate_state, TargetModel.prepare, DFlashDrafter.allocate_state

    def target_alloc(self, *a, **k):
        marks["target weights"] = snapshot(gpus)
        t_alloc(self, *a, **k)
        marks["target state+derived"] = snapshot(gpus)

    def target_prepare(self):
        marks.setdefault("target state", snapshot(gpus))
        t_prep(self)

    def drafter_alloc(self, *a, **k):
        marks["drafter weights"] = snapshot(gpus)
        d_alloc(self, *a, **k)
        marks["drafter state"] = snapshot(gpus)

    TargetModel.allocate_state, TargetModel.prepare, DFlashDrafter.allocate_state = target_alloc, target_prepare, drafter_alloc
    try:
        target, drafter = build_random_on_devices(raw_t, raw_d, devices, dtype, max_len)
    finally:
        TargetModel.allocate_state, TargetModel.prepare, DFlashDrafter.allocate_state = t_alloc, t_prep, d_alloc
    assert deferred.rows.device == drafter.device, "the drafter is not on the last device: make the context there"
    seq = [("deferred context", "start", "deferred context"), ("target weights", "deferred context", "target weights"),
           ("target state", "target weights", "target state"),
           ("derived fp32", "target state", "target state+derived"),
           ("drafter weights", "target state+derived", "drafter weights"), ("drafter state", "drafter weights", "drafter state")]
    measured = {g: {name: marks[b][g] - marks[a][g] for name, a, b in seq} for g in gpus}
    for g in gpus:  # the deferred context as its tensors asked for it, beside the blocks it got
        measured[g]["deferred context (requested)"] = asked[g]
    return target, drafter, deferred, measured


class Peaks:
    """Per GPU, the largest max_memory_allocated above a base over several calls of a piece."""

    def __init__(self, gpus):
        self.gpus, self.peak = gpus, dict.fromkeys(gpus, 0)

    def around(self, fn, base: dict[str, int]):
        def wrapped(*a, **k):
            for g in filter(_cuda, self.gpus):
                torch.cuda.synchronize(g)
                torch.cuda.reset_peak_memory_stats(g)
            out = fn(*a, **k)
            for g in filter(_cuda, self.gpus):
                torch.cuda.synchronize(g)
                self.peak[g] = max(self.peak[g], torch.cuda.max_memory_allocated(g) - base[g])
            return out
        return wrapped


@torch.no_grad()
def measure_phases(dec: Decoder, gpus, prompt_tokens: int, verify_nodes: int, chunk: int,
                   math_sdpa: bool) -> dict[str, dict[str, int]]:
    """Peaks of the phases the plan estimates, each over what is allocated when it starts; the
    pieces as the decoder runs them (eager: no graphs, no compiled layers)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    target, drafter = dec.target, dec.drafter
    dev = target.device
    P = prompt_tokens
    prompt = torch.randint(2, min(100000, target.cfg.vocab_size), (P,), device=dev,
                           generator=torch.Generator(device=dev).manual_seed(0))
    target.reset()
    drafter.reset()
    base = snapshot(gpus)  # the state: every chunk's and context call's peak is over it
    chunks, context = Peaks(gpus), Peaks(gpus)
    forward_chunk = target._prefill_chunk
    target._prefill_chunk = chunks.around(forward_chunk, base)
    t0 = time.perf_counter()
    try:
        target.prefill(prompt, chunk=chunk, want_taps=True, on_taps=context.around(drafter.add_context, base))
    finally:
        del target._prefill_chunk  # the bound method again
    print(f"prefill of {P} tokens in chunks of {chunk}, taps to the drafter: {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    sdpa = sdpa_kernel(SDPBackend.MATH) if math_sdpa else contextlib.nullcontext()
    T = verify_nodes
    dec.start_d.fill_(P)
    slot = dec.slot(T)
    slot.load(Tree.chain(prompt[:T].cpu()))
    key = VerifyKey(T, dec.kv_len(P + T), True, True)  # the graph key the engine verifies under (greedy, taps)

    def verify():  # a T-node chain at the committed length P (a verify commits nothing)
        return dec._verify(slot, key)

    def draft():  # the drafter's block after the prompt, its top-32 (a --budget 32 tree's columns)
        return dec.draft_topk(prompt[0], dec.kv_len(P + 1), 32, SamplingParams())

    out = {}
    with sdpa:
        for name, fn in (("verify", verify), ("draft", draft)):
            fn()  # first use: Triton compiles, cuBLAS handles, workspaces
            p = Peaks(gpus)
            p.around(fn, snapshot(gpus))()
            out[name] = p.peak
    return {g: {"prefill chunk": chunks.peak[g], "drafter context": context.peak[g], "verify": out["verify"][g],
                "draft": out["draft"][g]} for g in gpus}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-tokens", type=int, default=32768, help="tokens of the measured prefill")
    ap.add_argument("--max-length", type=int, default=None, help="state length (default: prompt + 1024)")
    ap.add_argument("--devices", default="cuda:0")
    ap.add_argument("--verify-nodes", type=int, default=33, help="nodes of the measured verify (--budget 32: 33)")
    ap.add_argument("--attention", choices=("auto", "math"), default="auto",
                    help="the verify's and draft's masked SDPA: math holds it to torch's math path (the A6000's)")
    ap.add_argument("--no-activations", action="store_true", help="weights and state only (seconds)")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny random pair (float32): a quick run of the code path")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    devices = [d.strip() for d in a.devices.split(",")]
    on_cuda = all(d.startswith("cuda") for d in devices)
    if not on_cuda and not a.tiny:
        sys.exit("error: this check measures GPU memory: pass cuda devices, or --tiny --devices cpu for a dry run")
    if on_cuda and not torch.cuda.is_available():
        sys.exit("error: no CUDA device: pass --tiny --devices cpu for a dry run on the CPU")
    max_len = a.max_length or a.prompt_tokens + 1024
    if a.prompt_tokens + a.verify_nodes > max_len:
        sys.exit(f"error: --prompt-tokens {a.prompt_tokens} + a {a.verify_nodes}-node verify exceed --max-length {max_len}")
    if a.tiny:
        raw_t = tiny_hybrid_config(layers=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
                                   + ("full_attention",))
        raw_d, dtype = tiny_drafter_config(raw_t, block_size=8), torch.float32
    else:
        raw_t, raw_d, dtype = qwen36_27b_config(), qwen36_27b_dflash_config(), torch.bfloat16
    cfg = TargetConfig.from_dict(raw_t)
    dcfg = DrafterConfig.from_dict(raw_d, cfg.num_layers)
    # the engine's switches (the environment's), the verify's and draft's attention as --attention says
    options = Options.from_env()
    if a.attention == "math":
        options = options.replace(attention="sdpa")
    path = "math" if a.attention == "math" else attention_path(devices, cfg, dcfg, dtype) if on_cuda else "math"

    gpu_list = list(dict.fromkeys(gpu_of(d) for d in devices))
    free_before = {g: torch.cuda.mem_get_info(g)[0] for g in gpu_list} if on_cuda else None
    t0 = time.perf_counter()
    target, drafter, deferred, measured = measure_build(raw_t, raw_d, devices, dtype, max_len)
    gpus = list(measured)
    # the rounds' pieces as the engine wires them (the stage hooks, the drafter's stage and kernels),
    # eagerly; and whether fla's chunk kernel really runs here (its self-check, made now so that it is
    # not measured). target.kernels is keyed by stage index.
    dec = Decoder(target, drafter, max_len=max_len, options=options, use_graphs=False, compile=False)
    uses_fla = all(target.kernels[st.index].fla
                   and fla.available(st.device, dtype, cfg.gdn_num_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim)
                   for st in target.stages if st.end > st.start)
    free = None
    if on_cuda:
        torch.cuda.synchronize()
        free = torch.cuda.mem_get_info(target.device)[0]
    chunk = target.prefill_chunk(free)  # what TargetModel.prefill would pick now
    # no capacities: the read-balanced split build_random_on_devices makes (checked below); eager
    # forwards here, so no CUDA-graph pools; the chunk the engine picked
    wl = Workload(max_len=max_len, dtype=dtype, attention=path, verify_nodes=a.verify_nodes, graphs=False,
                  prefill_chunk=chunk, fla=uses_fla, deferred=True)
    split = place(cfg, dcfg, devices, wl)
    planned = planned_components(cfg, dcfg, split, wl)
    # the chunk the plan predicts from the free memory before the build (what plan_for_devices sees)
    predicted = place(cfg, dcfg, devices, Workload(**{**wl.__dict__, "prefill_chunk": None}), free_before)
    print(f"built in {time.perf_counter() - t0:.1f} s; layers {[(s.start, s.end) for s in split.stages]}, "
          f"drafter on {split.drafter_device}; verify/draft attention {path}; prefill GDN chain "
          f"{'fla' if uses_fla else 'torch (chain_chunked)'}; chunk {chunk} from {(free or 0) / GiB:.2f} GiB free "
          f"(the plan's, from the free memory before the build: {predicted.prefill_chunk})", file=sys.stderr)
    assert target.layer_devices == [torch.device(d) for d in split.layer_devices], "the builder split differently"
    assert [(s.start, s.end) for s in target.stages] == [(s.start, s.end) for s in split.stages], "the stages differ"

    rows = []  # (component, gpu, planned, measured, exact)
    for g in gpus:
        rows += [(c, g, planned[g][c], measured[g][c], True) for c in EXACT]
        rows.append(("deferred (requested)", g, planned[g]["deferred context"], measured[g]["deferred context (requested)"],
                     True))
    if not a.no_activations:
        got = measure_phases(dec, gpus, a.prompt_tokens, a.verify_nodes, chunk, path == "math")
        for g in gpus:
            rows += [(f"~ {k}", g, split.phases[g][PLAN_PHASE[k]], got[g][k], False) for k in PHASES]
    del deferred

    doc = {"prompt_tokens": a.prompt_tokens, "max_length": max_len, "devices": devices, "attention": path,
           "fla": uses_fla, "prefill_chunk": chunk, "free_before_prefill": free,
           "plan_prefill_chunk": predicted.prefill_chunk, "verify_nodes": a.verify_nodes,
           "dtype": str(dtype).replace("torch.", ""), "tiny": a.tiny, "torch": torch.__version__,
           "options": options.to_dict(), "gpus": {g: torch.cuda.get_device_name(g) if _cuda(g) else g for g in gpus},
           "layers": [[s.start, s.end] for s in split.stages], "drafter_device": split.drafter_device,
           "rows": [dict(component=c, device=g, planned=p, measured=m, ratio=(m / p if p else None), exact=e)
                    for c, g, p, m, e in rows]}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {a.out}", file=sys.stderr)

    def flag(c, g, p, m, e) -> str:
        if not _cuda(g):
            return ""  # nothing measured on the CPU
        if e:
            return "" if (p == m == 0) or (p and 0.95 <= m / p <= 1.05) else "  OFF"
        return "  UNDER" if m > p else ""

    what = "the tiny random pair, float32" if a.tiny else "Qwen3.6-27B + DFlash, bf16"
    print(f"\nmemory plan vs measured: {what}, --max-length {max_len}, a {a.prompt_tokens}-token "
          f"prefill in chunks of {chunk}, verify of {a.verify_nodes}, attention {path} (~ rows: estimates vs measured "
          "peaks; ratio = measured / planned)" + ("; CPU: nothing measured (a dry run)" if not on_cuda else ""))
    print(f"{'component':<22}{'device':<8}{'planned GiB':>12}{'measured GiB':>14}{'ratio':>8}")
    for r in rows:
        c, g, p, m, e = r
        ratio = f"{m / p:.3f}" if p else "-"
        print(f"{c:<22}{g:<8}{p / GiB:>12.3f}{m / GiB:>14.3f}{ratio:>8}{flag(*r)}")
    sys.exit(1 if any(flag(*r) for r in rows) else 0)


if __name__ == "__main__":
    main()

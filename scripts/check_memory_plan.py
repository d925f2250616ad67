#!/usr/bin/env python3
"""GPU check of the memory plan: build the random-weight Qwen3.6-27B + DFlash drafter
(ddtree.model.synthetic.build_random_on_devices, exact shapes) and compare what each component
really takes (torch.cuda.memory_allocated deltas, per device) with ddtree.model.placement's plan.

Exact components (target weights, the fp32 constants prepare() derives, the target's state,
drafter weights, drafter state) must come within 5% (they should be 1.000). Then, unless
--no-activations, the transient estimates against measured peaks (max_memory_allocated over the
state held before): a prefill of the whole --max-length (chunks of 256, the prompt's taps kept),
the drafter's context over it, a 33-node verify and a draft at that length. --attention math
turns off cuDNN / flash / memory-efficient SDPA so that torch's math path (what an RTX A6000
runs) is measured; auto keeps torch's choice. A short table is printed last.

    python scripts/check_memory_plan.py --max-length 32768 --devices cuda:0 --out results/memory-plan.json
    python scripts/check_memory_plan.py --devices cuda:0,cuda:1 --attention math
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.app.plan import attention_path  # noqa: E402
from ddtree.model import memory as mem  # noqa: E402
from ddtree.model.config import DrafterConfig, TargetConfig  # noqa: E402
from ddtree.model.drafter import DFlashDrafter  # noqa: E402
from ddtree.model.placement import EXACT_ROWS, Workload, gpu_of, place  # noqa: E402
from ddtree.model.presets import qwen36_27b_config, qwen36_27b_dflash_config  # noqa: E402
from ddtree.model.synthetic import build_random_on_devices  # noqa: E402
from ddtree.model.target import TargetModel  # noqa: E402

GiB = 1 << 30
EXACT = ("target weights", "derived fp32", "target state", "drafter weights", "drafter state")


def snapshot(gpus) -> dict[str, int]:
    for g in gpus:
        torch.cuda.synchronize(g)
    return {g: torch.cuda.memory_allocated(g) for g in gpus}


def planned_components(cfg, dcfg, split, wl) -> dict[str, dict[str, int]]:
    """The exact components per GPU from ddtree.model.memory (the split's stages)."""
    dt, out = wl.dtype, {}
    last = len(split.stages) - 1
    for j, s in enumerate(split.stages):
        g = gpu_of(s.device)
        c = out.setdefault(g, dict.fromkeys(EXACT, 0))
        kinds = cfg.layer_types[s.start:s.end]
        c["target weights"] += sum(mem.layer_weight_bytes(cfg, k, dt) for k in kinds)
        c["derived fp32"] += sum(mem.layer_prepared_bytes(cfg, k) for k in kinds)
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
    for g in out:
        if any(gpu_of(s.device) == g and s.end > s.start for s in split.stages):
            out[g]["target state"] += mem.target_rope_bytes(cfg, wl.max_len)
        assert sum(out[g].values()) == sum(split.gpus[g][r] for r in EXACT_ROWS), "plan rows disagree"
    return out


def measure_build(raw_t, raw_d, devices, dtype, max_len):
    """Build, snapshotting memory at the component boundaries of build_random_on_devices."""
    gpus = list(dict.fromkeys(gpu_of(d) for d in devices))
    marks: dict[str, dict[str, int]] = {"start": snapshot(gpus)}
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
    seq = [("target weights", "start", "target weights"), ("target state", "target weights", "target state"),
           ("derived fp32", "target state", "target state+derived"),
           ("drafter weights", "target state+derived", "drafter weights"), ("drafter state", "drafter weights", "drafter state")]
    measured = {g: {name: marks[b][g] - marks[a][g] for name, a, b in seq} for g in gpus}
    return target, drafter, measured


def peak_of(gpus, base: dict[str, int], fn):
    """fn()'s result and, per GPU, its peak allocated bytes above `base`."""
    for g in gpus:
        torch.cuda.synchronize(g)
        torch.cuda.reset_peak_memory_stats(g)
    out = fn()
    for g in gpus:
        torch.cuda.synchronize(g)
    return out, {g: torch.cuda.max_memory_allocated(g) - base[g] for g in gpus}


@torch.no_grad()
def measure_transients(target, drafter, gpus, max_len: int, verify_nodes: int) -> dict[str, dict[str, int]]:
    """Peaks of the phases the plan estimates, over the state held before the prefill."""
    dev = target.device
    target.tap_layers = list(drafter.cfg.target_layer_ids)
    drafter.attach(target.embed_tokens, target.lm_head)
    P = max_len - verify_nodes - drafter.cfg.block_size
    prompt = torch.randint(2, min(1000, target.cfg.vocab_size), (P,), device=dev)
    target.reset()
    drafter.reset()
    base = snapshot(gpus)
    t0 = time.perf_counter()
    (_, taps), prefill = peak_of(gpus, base, lambda: target.prefill(prompt, chunk=256, want_taps=True))
    print(f"prefill of {P} tokens: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    _, context = peak_of(gpus, base, lambda: drafter.add_context(taps))
    del taps
    T = verify_nodes
    tril = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    start = torch.tensor(P, device=dev)
    _, verify = peak_of(gpus, snapshot(gpus), lambda: target.forward(
        prompt[:T], P + torch.arange(T, device=dev), tril, torch.arange(T, device=dev) - 1, start, P + T))
    _, draft = peak_of(gpus, snapshot(gpus), lambda: drafter.draft_logits(prompt[0], P))
    return {g: {"prefill (+ taps)": prefill[g], "drafter context": context[g], "verify": verify[g], "draft": draft[g]}
            for g in gpus}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-length", type=int, default=32768)
    ap.add_argument("--devices", default="cuda:0")
    ap.add_argument("--attention", choices=("auto", "math"), default="auto",
                    help="math: turn off cuDNN, flash and memory-efficient SDPA (the A6000's path)")
    ap.add_argument("--no-activations", action="store_true", help="weights and state only (seconds)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device: this check measures GPU memory")
    devices = [d.strip() for d in a.devices.split(",")]
    if a.attention == "math":
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    raw_t, raw_d = qwen36_27b_config(), qwen36_27b_dflash_config()
    cfg = TargetConfig.from_dict(raw_t)
    dcfg = DrafterConfig.from_dict(raw_d, cfg.num_layers)
    dtype = torch.bfloat16
    path = attention_path(devices, cfg, dcfg, dtype)
    verify_nodes = 33
    # no capacities: the read-balanced split build_random_on_devices makes (checked after the build);
    # eager forwards here, so no CUDA-graph pools
    wl = Workload(max_len=a.max_length, dtype=dtype, attention=path, verify_nodes=verify_nodes, graphs=False)
    split = place(cfg, dcfg, devices, wl)
    planned = planned_components(cfg, dcfg, split, wl)

    t0 = time.perf_counter()
    target, drafter, measured = measure_build(raw_t, raw_d, devices, dtype, a.max_length)
    print(f"built in {time.perf_counter() - t0:.1f} s; layers {[(s.start, s.end) for s in split.stages]}, "
          f"drafter on {split.drafter_device}; SDPA path {path}", file=sys.stderr)
    assert target.layer_devices == [torch.device(d) for d in split.layer_devices], "the builder split differently"

    rows = []  # (component, gpu, planned, measured, exact)
    for g in planned:
        rows += [(c, g, planned[g][c], measured[g][c], True) for c in EXACT]
    if not a.no_activations:
        got = measure_transients(target, drafter, list(planned), a.max_length, verify_nodes)
        for g in planned:
            ph = split.phases[g]
            want = {"prefill (+ taps)": max(ph["prefill"], ph["concat"]), "drafter context": ph["context"],
                    "verify": ph["verify"], "draft": ph["draft"]}
            rows += [(f"~ {k}", g, v, got[g][k], False) for k, v in want.items()]

    doc = {"max_length": a.max_length, "devices": devices, "attention": path, "dtype": "bfloat16",
           "torch": torch.__version__, "gpus": {g: torch.cuda.get_device_name(g) for g in planned},
           "layers": [[s.start, s.end] for s in split.stages], "drafter_device": split.drafter_device,
           "rows": [dict(component=c, device=g, planned=p, measured=m, ratio=(m / p if p else None), exact=e)
                    for c, g, p, m, e in rows]}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc, indent=2))
        print(f"wrote {a.out}", file=sys.stderr)
    bad = [r for r in rows if r[4] and (r[2] or r[3]) and not (0.95 <= (r[3] / r[2] if r[2] else 0) <= 1.05)]
    print(f"\nmemory plan vs measured: Qwen3.6-27B + DFlash, bf16, --max-length {a.max_length}, SDPA {path} "
          "(~ rows: estimates, measured as peaks)")
    print(f"{'component':<22}{'device':<8}{'planned GiB':>12}{'measured GiB':>14}{'ratio':>8}")
    for c, g, p, m, e in rows:
        ratio = f"{m / p:.3f}" if p else "-"
        flag = "  OFF" if (c, g, p, m, e) in bad else ""
        print(f"{c:<22}{g:<8}{p / GiB:>12.3f}{m / GiB:>14.3f}{ratio:>8}{flag}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

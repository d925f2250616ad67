"""The memory plan: will the target, the drafter and a context of max_len fit these GPUs?

`plan_memory` places the layers (ddtree.model.placement) and tallies every GPU's bytes from the
configs alone; `format_plan` prints the table; `check_fits` raises a one-line DDTreeError naming
what would fit (the largest --max-length, or how many such GPUs). `ddtree plan` runs them
anywhere, CPU included (`run_plan`); `plan_for_devices` is the check `ddtree generate` / `bench`
make on the real GPUs before any weight is read.

torch is imported only to ask real GPUs for their memory: everything else works from config.json.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from ddtree.errors import DDTreeError
from ddtree.model import memory as mem
from ddtree.model.config import DrafterConfig, TargetConfig, read_json
from ddtree.model.placement import (EXACT_ROWS, ESTIMATE_ROWS, WEIGHT_ROWS, GiB, Split, Workload, gpu_of, graphs_on,
                                     place)
from ddtree.options import DEFAULT_BUDGET

#: the CUDA context per GPU, reserved when capacities are a card's total memory (not its free memory)
CUDA_CONTEXT = GiB // 2
#: --max-length values the plan searches are multiples of this
LENGTH_STEP = 1024
#: most identical GPUs the "would fit on N x ..." suggestion tries
MAX_GPUS = 8

# ============================================================================================
# the plan
# ============================================================================================


@dataclass
class MemoryPlan:
    name: str
    target_cfg: TargetConfig
    drafter_cfg: DrafterConfig | None
    split: Split
    capacities: dict[str, int]  # per GPU, bytes
    capacity_kind: str  # 'total' (a card's memory, the CUDA context reserved) or 'free'
    largest: int | None  # the largest max_len (a multiple of LENGTH_STEP) that fits; None: none does
    attention_basis: str = ""  # why the verify's attention is the one planned (the header says it)

    @property
    def max_len(self) -> int:
        return self.split.workload.max_len

    @property
    def fits(self) -> bool:
        return self.split.fits

    def free_after(self, gpu: str) -> int:
        return self.capacities[gpu] - self.split.gpus[gpu]["total"]


def largest_max_len(t: TargetConfig, d: DrafterConfig | None, devices, wl: Workload, caps: dict[str, int],
                    limit: int | None = None) -> int | None:
    """The largest max_len, a multiple of LENGTH_STEP up to `limit` (default: the model's
    max_position_embeddings), that fits; None if not even LENGTH_STEP does. Bisection: every
    figure of the plan grows with max_len."""
    top = (limit or t.max_position_embeddings) // LENGTH_STEP
    if top < 1 or not place(t, d, devices, replace(wl, max_len=LENGTH_STEP), caps).fits:
        return None
    lo, hi = 1, top
    if place(t, d, devices, replace(wl, max_len=hi * LENGTH_STEP), caps).fits:
        return hi * LENGTH_STEP
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if place(t, d, devices, replace(wl, max_len=mid * LENGTH_STEP), caps).fits:
            lo = mid
        else:
            hi = mid
    return lo * LENGTH_STEP


def plan_memory(target_cfg: TargetConfig, drafter_cfg: DrafterConfig | None, devices: Sequence[Any],
                capacities: dict[str, int] | Sequence[int], max_len: int, dtype: Any = "bfloat16", *,
                attention: str = "math", verify_nodes: int = 33, capacity_kind: str = "total",
                name: str = "target", search: bool = True, attention_basis: str = "", **workload) -> MemoryPlan:
    """Place and tally the target (+ drafter) over `devices` (one stage per entry; entries may
    repeat) at max_len. capacities: bytes per GPU, as a dict keyed 'cuda:N' or a list in the
    order the GPUs first appear in `devices` (one value: every GPU). capacity_kind 'total' reserves
    the CUDA context on each GPU; 'free' (torch.cuda.mem_get_info after the context exists) does
    not. attention: the SDPA path of the verify's and draft's masked attention. Other Workload
    fields (fla, deferred, tree_capacity, prefill_chunk, graphs, ...) pass through `workload`.
    attention_basis: why that attention path (printed in the header)."""
    devices = list(devices)
    gpus = list(dict.fromkeys(gpu_of(x) for x in devices))
    caps = _capacity_map(capacities, gpus)
    wl = Workload(max_len=max_len, dtype=dtype, attention=attention, verify_nodes=verify_nodes,
                  context=CUDA_CONTEXT if capacity_kind == "total" else 0, **workload)
    split = place(target_cfg, drafter_cfg, devices, wl, caps)
    largest = largest_max_len(target_cfg, drafter_cfg, devices, wl, caps) if search else None
    return MemoryPlan(name, target_cfg, drafter_cfg, split, caps, capacity_kind, largest, attention_basis)


def _capacity_map(capacities, gpus: list[str]) -> dict[str, int]:
    if isinstance(capacities, dict):
        missing = [g for g in gpus if g not in capacities]
        if missing:
            raise DDTreeError(f"no memory size for {missing[0]}: give one per GPU in --gpu-memory")
        return {g: int(capacities[g]) for g in gpus}
    caps = [int(c) for c in capacities]
    if len(caps) == 1:
        caps = caps * len(gpus)
    if len(caps) != len(gpus):
        raise DDTreeError(
            f"--gpu-memory gives {len(caps)} sizes for {len(gpus)} GPUs ({', '.join(gpus)}): "
            "give one size per GPU (e.g. 2x48GiB) or one for all"
        )
    return dict(zip(gpus, caps))


def _gpus_needed(plan: MemoryPlan) -> int | None:
    """How many GPUs like the largest one given would hold this max_len (None: not even MAX_GPUS)."""
    cap = max(plan.capacities.values())
    wl = plan.split.workload
    for n in range(len(plan.capacities) + 1, MAX_GPUS + 1):
        devs = [f"cuda:{i}" for i in range(n)]
        if place(plan.target_cfg, plan.drafter_cfg, devs, wl, {g: cap for g in devs}).fits:
            return n
    return None


def check_fits(plan: MemoryPlan) -> None:
    """Raise a one-line DDTreeError naming what would fit, unless the plan fits."""
    if plan.fits:
        return
    split = plan.split
    over = split.over()
    gpu = max(over, key=over.get) if over else max(split.gpus, key=lambda g: split.gpus[g]["total"])
    have = f"{_gib(plan.capacities[gpu])} free" if plan.capacity_kind == "free" else f"a {_gib(plan.capacities[gpu])} GPU"
    need = f"{plan.name} at --max-length {plan.max_len} needs {_gib(split.gpus[gpu]['total'])} on {gpu} ({have})"
    if plan.largest is not None:
        raise DDTreeError(
            f"{need}: the largest --max-length that fits these devices is {plan.largest}; pass --max-length "
            f"{plan.largest} or less, or add a device (--devices) / use GPUs with more memory{_eager_hint(plan)}"
        )
    n = _gpus_needed(plan)
    cap = _gib(max(plan.capacities.values()))
    weights = sum(r[k] for r in split.gpus.values() for k in WEIGHT_ROWS)
    what = (f"the weights alone ({_gib(weights)}) exceed {len(plan.capacities)} x {cap}" if weights > sum(plan.capacities.values())
            else f"no --max-length fits {len(plan.capacities)} x {cap}, not even {LENGTH_STEP}")
    where = (f"{n} x {cap} would hold it at this --max-length (--devices {','.join(f'cuda:{i}' for i in range(n))})" if n
             else f"not even {MAX_GPUS} x {cap} would hold it: use GPUs with more memory")
    raise DDTreeError(f"{need}: {what}; {where}")


# ============================================================================================
# the table
# ============================================================================================


def _eager_hint(plan: MemoryPlan) -> str:
    """Where a graphed split's graph pools are what does not fit: the eager split's switch."""
    split = plan.split
    wl = split.workload
    if len(split.devices) < 2 or not graphs_on(wl, split.devices):
        return ""
    eager = place(plan.target_cfg, plan.drafter_cfg, split.devices, replace(wl, graphs=False), plan.capacities)
    return ", or run the eager split (no CUDA-graph pools) with DDTREE_EAGER_SPLIT=1" if eager.fits else ""


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


ROW_LABELS = {
    "GDN weights": "  GDN mixers",
    "attention weights": "  attention mixers",
    "MLP weights": "  MLPs",
    "norms": "  norms (+ fp32 copies)",
    "embedding": "embedding",
    "final norm + lm_head": "final norm + lm_head",
    "drafter weights": "drafter weights",
    "K/V cache": "K/V cache",
    "GDN states": "GDN states (conv + fp32 recurrent)",
    "GDN tree scratch": "GDN tree-verify scratch",
    "GDN snapshots": "GDN snapshots (chat's turn boundaries)",
    "rope tables": "rope tables",
    "drafter K/V + rope": "drafter K/V cache + rope",
    "deferred context": "deferred drafter context (auto)",
    "activations": "~ activations (peak phase)",
    "graph pools": "~ CUDA-graph pools",
    "workspace": "~ workspace + reserve",
}


PHASES = {"prefill": "prefill chunk", "context": "drafter context", "verify": "verify", "draft": "draft"}
ATTENTION_NOTES = {
    "kernel": "the split-KV attention kernel (no mask tensor; wherever Triton runs)",
    "math": "torch's math SDPA (fp32 K/V for every query head: A6000, A100, any GPU without cuDNN attention)",
    "fused": "a fused SDPA kernel (cuDNN attention: H100, H200)",
}


def _ranges(split: Split, gpu: str) -> str:
    parts = [f"{s.start}-{s.end - 1}" if s.end - s.start > 1 else str(s.start)
             for s in split.stages if gpu_of(s.device) == gpu and s.end > s.start]
    return ", ".join(parts) or "-"


def format_plan(plan: MemoryPlan) -> str:
    """The per-GPU table and the verdict: rows exact unless marked ~ (estimates)."""
    split, t, d = plan.split, plan.target_cfg, plan.drafter_cfg
    wl = split.workload
    gpus = list(split.gpus)
    n_attn = t.layer_types.count(mem.ATTN)
    kinds = f"{t.num_layers - n_attn} GDN + {n_attn} attention" if t.is_hybrid else f"{t.num_layers} attention"
    head = [f"memory plan: {plan.name} ({t.num_layers} layers: {kinds})"
            + (f" + {d.num_layers}-layer DFlash drafter" if d else "")
            + f", {str(wl.dtype).replace('torch.', '')}, --max-length {wl.max_len}",
            f"verify / draft attention: {ATTENTION_NOTES[wl.attention]}"
            + (f" [{plan.attention_basis}]" if plan.attention_basis else "") + f"; verify of {min(wl.verify_nodes, wl.tree_capacity)} "
            "nodes; " + (("CUDA graphs" + (" in segments (one per stage visit)" if len(split.devices) > 1 else ""))
                         if graphs_on(wl, split.devices) else "no CUDA graphs (the eager split)"),
            f"prefill: chunks of {split.prefill_chunk} tokens"
            + ("" if wl.prefill_chunk is not None else f" (the engine's pick from {gpu_of(split.devices[0])}'s free memory)")
            + ", flash attention, GDN chain through " + ("fla's chunk kernel" if wl.fla else "the torch chunked recurrence")
            + (", the drafter's context added per chunk" if d else ""),
            "rows are exact but for ~ (estimates)"]
    table: list[list[str]] = [[""] + gpus, ["layers"] + [_ranges(split, g) for g in gpus]]
    if d is not None:
        table.append(["drafter"] + ["yes" if gpu_of(str(split.drafter_device)) == g else "-" for g in gpus])
    for r in EXACT_ROWS + ESTIMATE_ROWS:
        vals = [split.gpus[g][r] for g in gpus]
        if any(vals) or r in ESTIMATE_ROWS:
            table.append([ROW_LABELS[r]] + [_gib(v) if v else "-" for v in vals])
        if r == "activations":
            table.append(["    peak in"] + [PHASES[split.peak_phase(g)] for g in gpus])
    table.append(["total"] + [_gib(split.gpus[g]["total"]) for g in gpus])
    table.append([f"capacity ({plan.capacity_kind})"] + [_gib(plan.capacities[g]) for g in gpus])
    table.append(["free after"] + [_gib(plan.free_after(g)) for g in gpus])
    reads = {g: sum(r for s, r in zip(split.stages, split.reads) if gpu_of(s.device) == g) for g in gpus}
    table.append([f"read per step (at {wl.max_len})"] + [_gib(reads[g]) for g in gpus])
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = head + [""] + ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                           for row in table]
    lines.append("")
    lines.append(_verdict(plan))
    return "\n".join(lines)


def _verdict(plan: MemoryPlan) -> str:
    largest = plan.largest
    if plan.fits:
        g = min(plan.capacities, key=plan.free_after)
        s = f"fits: {_gib(plan.free_after(g))} to spare on {g} (the fullest)"
        if largest is not None:
            top = plan.target_cfg.max_position_embeddings
            s += (f"; the largest --max-length that fits is {largest} ({largest / plan.max_len:.2f}x the requested "
                  f"{plan.max_len})" + (", the model's maximum" if largest >= top - top % LENGTH_STEP else ""))
        return s
    if largest is not None:
        return f"does not fit: the largest --max-length that fits is {largest}"
    return "does not fit at any --max-length"


# ============================================================================================
# inputs: memory sizes, devices, model references
# ============================================================================================

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*(?:(\d+)\s*[xX*]\s*)?(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")


def parse_gpu_memory(spec: str) -> list[int]:
    """'2x48GiB', '48GiB,48GiB', '80GB', '47.5GiB' -> bytes per GPU (GB = 10^9, GiB = 2^30)."""
    out: list[int] = []
    for item in str(spec).split(","):
        if not item.strip():
            continue
        m = _SIZE.match(item)
        unit = m.group(3).lower() if m else ""
        if not m or unit not in _UNITS:
            raise DDTreeError(
                f"--gpu-memory entry {item.strip()!r} is not a size: write e.g. 48GiB, 80GB or 2x48GiB "
                "(units B, KB, MB, GB, TB or KiB, MiB, GiB, TiB)"
            )
        n = int(m.group(1) or 1)
        size = int(float(m.group(2)) * _UNITS[unit])
        if n < 1 or size < 1:
            raise DDTreeError(f"--gpu-memory entry {item.strip()!r} is empty: give a positive size, e.g. 48GiB")
        out += [size] * n
    if not out:
        raise DDTreeError("--gpu-memory is empty: give the memory per GPU, e.g. 2x48GiB")
    return out


_DEVICE = re.compile(r"^cuda(?::(\d+))?$")


def parse_plan_devices(spec: str | None, n_sizes: int | None) -> list[str]:
    """--devices for a plan: cuda:N entries (repeats allowed: stages on one GPU). auto: one per
    --gpu-memory entry, else cuda:0 (what `ddtree generate` uses by default)."""
    if spec is None or str(spec).strip().lower() in ("", "auto"):
        return [f"cuda:{i}" for i in range(n_sizes or 1)]
    out = []
    for item in str(spec).split(","):
        d = item.strip().lower()
        m = _DEVICE.match(d)
        if not m:
            raise DDTreeError(
                f"--devices entry {item.strip()!r} is not a GPU: ddtree plan sizes GPU memory; pass cuda:N entries, "
                "e.g. --devices cuda:0,cuda:1"
            )
        out.append(f"cuda:{m.group(1) or 0}")
    return out


def _looks_like_repo(ref: str) -> bool:
    return ref.count("/") == 1 and not ref.startswith((".", "/", "~")) and "\\" not in ref


def read_model_config(ref: str, what: str) -> tuple[dict, str]:
    """config.json of a local directory (or the file itself), or of a hub repo: the local Hugging
    Face cache first, then a download of config.json alone (not with HF_HUB_OFFLINE=1)."""
    p = Path(ref).expanduser()
    if p.is_file():
        return read_json(p), str(p)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise DDTreeError(f"{what} path {ref} has no config.json: pass a checkpoint directory or a Hugging Face repo id")
        return read_json(p / "config.json"), str(p / "config.json")
    if not _looks_like_repo(ref):
        raise DDTreeError(f"{what} path {ref} not found: pass an existing checkpoint directory or a repo id like Qwen/Qwen3.6-27B")
    try:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(ref, "config.json", local_files_only=True)
        except Exception:
            if os.environ.get("HF_HUB_OFFLINE") == "1":
                raise
            path = hf_hub_download(ref, "config.json")
    except Exception as e:  # offline, no such repo, gated: one line and the fix
        raise DDTreeError(
            f"{what} {ref!r}: config.json is not in the local Hugging Face cache and could not be downloaded "
            f"({type(e).__name__}): run `hf download {ref} config.json` on a connected machine, or pass a local directory"
        ) from None
    return read_json(Path(path)), f"{ref}/config.json"


def read_configs(target: str | None, drafter: str | None) -> tuple[TargetConfig, DrafterConfig | None]:
    if not target:
        raise DDTreeError("no target model: pass --target REF (a local directory or a repo id like Qwen/Qwen3.6-27B)")
    raw, where = read_model_config(str(target), "target")
    t = TargetConfig.from_dict(raw, where)
    d = None
    if drafter:
        raw, where = read_model_config(str(drafter), "drafter")
        d = DrafterConfig.from_dict(raw, t.num_layers, where)
        if d.hidden_size != t.hidden_size or max(d.target_layer_ids) >= t.num_layers:
            raise DDTreeError(f"drafter {drafter} was not trained for this target (hidden size or tapped layers differ): "
                              "pass the drafter of this target")
    return t, d


# ============================================================================================
# real GPUs
# ============================================================================================


def engine_attention(triton: bool | None = None) -> str:
    """The verify's and draft's attention the engine takes on a CUDA GPU under this environment's
    options (ddtree.ops.dispatch's rule): its split-KV kernel where Triton runs, else SDPA's
    dense-mask twin ('math' here: the plan's conservative SDPA path). triton: whether Triton runs
    on those GPUs; None: whether it imports on this machine."""
    from ddtree.options import Options

    if triton is None:
        try:
            import triton as _triton  # noqa: F401
        except ImportError:
            triton = False
        else:
            triton = True
    options = Options.from_env()
    return "kernel" if triton and options.triton and options.attention != "sdpa" else "math"


def _attention_switch() -> str:
    """The engine switch that holds the verify to SDPA, if one is set ('' if none)."""
    from ddtree.options import Options

    options = Options.from_env()
    return "DDTREE_NO_TRITON=1" if not options.triton else "DDTREE_ATTENTION=sdpa" if options.attention == "sdpa" else ""


def attention_path(devices, target_cfg: TargetConfig, drafter_cfg: DrafterConfig | None, dtype: Any) -> str:
    """The SDPA path the masked attentions of these models take on these CUDA devices (a verify's,
    Attention.forward with the dense [T, kv_len] mask, and a draft's, DraftAttention.forward):
    'math' if torch picks its math fallback for either the target's or the drafter's head shapes
    on any of them, else 'fused'. Asked of torch (its backend choice) with tiny tensors on each GPU.
    'kernel' wherever the engine takes its split-KV attention kernel instead (Triton, not turned off)."""
    import torch

    if engine_attention() == "kernel":
        return "kernel"

    from ddtree.model.checkpoint import parse_dtype

    dt = parse_dtype(str(dtype).replace("torch.", ""))
    shapes = [(target_cfg.num_heads, target_cfg.num_kv_heads, target_cfg.head_dim)]
    if drafter_cfg is not None:
        shapes.append((drafter_cfg.num_heads, drafter_cfg.num_kv_heads, drafter_cfg.head_dim))
    for dev in dict.fromkeys(torch.device(x) for x in devices):
        for h, kvh, hd in shapes:
            q = torch.zeros(1, h, 2, hd, device=dev, dtype=dt)
            k = torch.zeros(1, kvh, 8, hd, device=dev, dtype=dt)
            m = torch.ones(2, 8, device=dev, dtype=torch.bool)
            if torch._fused_sdp_choice(q, k, k, m, 0.0, False, enable_gqa=h != kvh) == 0:  # SDPBackend.MATH
                return "math"
    return "fused"


def gpu_capacities(devices: Sequence[str], kind: str) -> dict[str, int]:
    """Bytes per physical GPU of `devices`: 'total' (the card) or 'free' (mem_get_info now)."""
    import torch

    if not torch.cuda.is_available():
        raise DDTreeError("no GPU is visible here: pass --gpu-memory (e.g. 2x48GiB) to plan for GPUs elsewhere")
    out = {}
    for g in dict.fromkeys(gpu_of(str(x)) for x in devices):
        i = int(g.split(":")[1])
        if i >= torch.cuda.device_count():
            raise DDTreeError(f"--devices asks for {g} but only {torch.cuda.device_count()} GPU(s) are visible")
        out[g] = torch.cuda.mem_get_info(i)[0] if kind == "free" else torch.cuda.get_device_properties(i).total_memory
    return out


def fla_in_use(devices, options=None) -> bool:
    """Whether the prefill's GDN chain may take fla's chunk kernel on these devices: the options
    allow it (Kernels.fla through ddtree.ops.dispatch.resolve) and fla is installed (found, not
    imported: importing fla costs seconds of start-up; its import and per-dtype self-check run at
    the first long prefill, and a failing one only lowers the real peak)."""
    import importlib.util

    from ddtree.ops.dispatch import resolve
    from ddtree.options import Options

    options = options or Options.from_env()
    return all(resolve(options, str(x)).fla for x in devices) and importlib.util.find_spec("fla") is not None


def plan_for_devices(target_cfg: TargetConfig, drafter_cfg: DrafterConfig | None, devices: Sequence[Any],
                     max_len: int, dtype: Any, room: int | None = None, name: str = "target",
                     auto: bool = False, snapshots: int = 0) -> Split | None:
    """The check before loading: plan against the free memory of the real CUDA devices and raise
    the one-line error if it does not fit; -> the split to load with (None on CPU: no check).
    room: nodes of the largest tree a round verifies (default: the most a forward may hold);
    auto: --budget auto runs (its deferred drafter context); snapshots: ddtree chat's GDN state snapshots."""
    if any(str(x).startswith("cpu") for x in devices):
        return None
    caps = gpu_capacities([str(x) for x in devices], "free")
    path = attention_path(devices, target_cfg, drafter_cfg, dtype)
    plan = plan_memory(target_cfg, drafter_cfg, list(devices), caps, max_len, dtype, attention=path,
                       verify_nodes=room or Workload.tree_capacity, capacity_kind="free", name=name, search=False,
                       fla=fla_in_use(devices), deferred=auto and drafter_cfg is not None, snapshots=snapshots)
    if not plan.fits:
        plan.largest = largest_max_len(target_cfg, drafter_cfg, list(devices), plan.split.workload, plan.capacities)
        check_fits(plan)
    return plan.split


# ============================================================================================
# ddtree plan
# ============================================================================================

PLAN_DEFAULTS: dict[str, Any] = {"target": None, "drafter": None, "devices": None, "dtype": "bfloat16",
                                 "max_length": None, "budget": DEFAULT_BUDGET}


def _verify_nodes(budget: Any, drafter: DrafterConfig | None) -> int:
    """Nodes of the largest verify: budget + 1 (ddtree), the block (a chain), 1 without a drafter."""
    if drafter is None:
        return 1
    if str(budget).strip().lower() == "auto":
        from ddtree.decode.budget import AUTO_BUDGETS

        return max(AUTO_BUDGETS) + 1
    return int(budget) + 1


def _parse_budget(value: Any) -> int | str:
    s = str(value).strip().lower()
    if s == "auto":
        return s
    if not s.isdigit() or int(s) < 1:
        raise DDTreeError(f"--budget {value!r} is not a positive integer: pass the draft nodes per round (e.g. 31) or auto")
    return int(s)


def run_plan(opts: dict, gpu_memory: str | None = None, attention: str = "auto", setup=None) -> MemoryPlan:
    """`ddtree plan` after option merging: print the table; raise check_fits' error if it does not fit.
    setup() (logging) runs once the arguments are valid: bad input fails before any slow import."""
    sizes = parse_gpu_memory(gpu_memory) if gpu_memory is not None else None
    devices = parse_plan_devices(opts.get("devices"), len(sizes) if sizes else None)
    dtype = str(opts.get("dtype") or "bfloat16")
    try:
        mem.dtype_bytes(dtype)
    except ValueError:
        raise DDTreeError(f"unknown --dtype {dtype!r}: use bfloat16, float16 or float32") from None
    max_length = opts.get("max_length")
    if max_length is not None and (isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1):
        raise DDTreeError(f"--max-length {max_length!r} must be a positive integer")
    if attention not in ("auto",) + mem.ATTENTION_PATHS:
        raise DDTreeError(f"unknown --attention {attention!r}: use auto, kernel, math or fused")
    budget = _parse_budget(opts.get("budget", DEFAULT_BUDGET))
    if setup is not None:
        setup()
    t, d = read_configs(opts.get("target"), opts.get("drafter"))
    max_len = max_length or t.max_position_embeddings
    if sizes is None:
        caps, kind = gpu_capacities(devices, "total"), "total"
        path = attention_path(devices, t, d, dtype) if attention == "auto" else attention
        basis = "what these GPUs run" if attention == "auto" else "as --attention asks"
    else:
        # GPUs planned from their sizes run what any CUDA GPU runs: Triton ships with CUDA builds
        # of torch, whatever this machine has (a CPU build, no Triton)
        caps, kind = _capacity_map(sizes, list(dict.fromkeys(devices))), "total"
        path = engine_attention(triton=True) if attention == "auto" else attention
        switch = _attention_switch()
        basis = ("as --attention asks" if attention != "auto" else f"as {switch} asks" if switch else
                 "assumed for the GPUs of --gpu-memory: Triton ships with CUDA builds of torch; --attention math plans for SDPA's fallback")
    plan = plan_memory(t, d, devices, caps, max_len, dtype, attention=path, verify_nodes=_verify_nodes(budget, d),
                       capacity_kind=kind, name=str(opts.get("target")), deferred=budget == "auto" and d is not None,
                       snapshots=mem.CHAT_SNAPSHOTS if opts.get("chat") else 0, attention_basis=basis)
    print(format_plan(plan), flush=True)
    check_fits(plan)
    return plan

"""Where the target's layers and the drafter go: contiguous layers per stage, the embedding on the
first stage, the final norm and lm_head on the last, the drafter on the stage where it costs least.

A stage is one entry of --devices; entries may repeat ("cuda:0,cuda:0": two stages on one GPU),
and stages on the same GPU share its capacity. The split balances the bytes a decode step reads
per stage (weights + K/V at max_len + states, ddtree.model.memory) while every GPU holds its
stages' weights and state, the transient peak of a generation's phases (a prefill chunk, the
drafter's context of a chunk, a verify, a draft) and the reserves (`gpu_rows`). Configs only:
nothing here allocates or imports torch.

    split = place(cfg, drafter_cfg, ["cuda:0", "cuda:1"], Workload(max_len=131072), capacities)
    split.layer_devices   # one entry of devices per layer
    split.layer_stages    # one stage index per layer (what tells two stages on one GPU apart)
    split.drafter_device  # an entry of devices, or None without a drafter
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ddtree.model import memory as mem
from ddtree.model.config import DrafterConfig, TargetConfig

GiB = 1 << 30


@dataclass(frozen=True)
class Workload:
    """What the state and the transients are sized for (defaults: the decoder's today)."""

    max_len: int
    dtype: Any = "bfloat16"
    attention: str = "math"  # the verify's / draft's masked SDPA: 'math' or 'fused' (memory.ATTENTION_PATHS)
    tree_capacity: int = 256  # nodes one tree forward may hold (TargetModel.allocate_state's default)
    prefill_chunk: int | None = None  # tokens per prefill forward; None: the engine's rule (see prefill_chunk)
    fla: bool = True  # the prefill's GDN chain through fla's chunk kernel (Kernels.fla); False: gdn.chain_chunked
    deferred: bool = False  # --budget auto: its DeferredContext on the drafter's device
    verify_nodes: int = 33  # nodes of the largest tree verified (budget + root; --budget 32 by default)
    snapshots: int = 0  # ddtree chat: GDN state snapshots at turn boundaries (memory.CHAT_SNAPSHOTS)
    graphs: bool | None = None  # CUDA graphs: None = the Decoder's rule (on CUDA; a split unless DDTREE_EAGER_SPLIT=1)
    graph_buckets: int = 2  # context buckets whose captured graphs are alive at once (see gpu_rows)
    workspace: int = GiB  # per GPU: cuBLAS / cuDNN workspaces, Triton and inductor kernel images
    slack: float = 0.02  # per GPU, of everything else: allocator rounding and fragmentation
    context: int = 0  # per GPU: the CUDA context, when capacities are total (not free) memory


def gpu_of(device: str) -> str:
    """The physical GPU of a stage's device string ('cuda' is cuda:0)."""
    d = str(device).strip()
    return "cuda:0" if d == "cuda" else d


def graphs_on(wl: Workload, devices: Sequence[Any]) -> bool:
    """Whether rounds run as CUDA graphs: as the Decoder decides, on CUDA devices; a split in
    segments (each GPU holding its segments' pools) unless DDTREE_EAGER_SPLIT=1."""
    if wl.graphs is not None:
        return wl.graphs
    from ddtree.options import Options

    cuda = all(gpu_of(x).startswith("cuda") for x in devices)
    return cuda and (len(devices) == 1 or Options.from_env().split_graphs)


# ============================================================================================
# per-stage accounting
# ============================================================================================


@dataclass
class _Layers:
    """Per-layer figures as prefix sums (a stage's sum is two lookups), once per (config, workload)."""

    kinds: list[str]
    weights: dict[str, list[int]]  # part -> prefix sums of bytes per layer
    read: list[int]  # prefix sums of the bytes one decode step reads per layer
    attn: list[int]  # prefix counts of attention layers

    def sum(self, pre: list[int], start: int, end: int) -> int:
        return pre[end] - pre[start]


def _layers(cfg: TargetConfig, wl: Workload) -> _Layers:
    dt = mem.dtype_bytes(wl.dtype)
    parts: dict[str, list[int]] = {"GDN": [], "attention": [], "MLP": [], "norms": []}
    for k in cfg.layer_types:
        n = mem.layer_weight_numel(cfg, k)
        parts["GDN"].append(n["mixer"] * dt if k == mem.GDN else 0)
        parts["attention"].append(n["mixer"] * dt if k == mem.ATTN else 0)
        parts["MLP"].append(n["mlp"] * dt)
        parts["norms"].append(n["norms"] * dt + mem.layer_prepared_bytes(cfg, k, wl.dtype))
    read = [mem.layer_read_bytes(cfg, k, wl.max_len, wl.dtype) for k in cfg.layer_types]
    attn = [int(k == mem.ATTN) for k in cfg.layer_types]
    return _Layers(list(cfg.layer_types), {p: _prefix(v) for p, v in parts.items()}, _prefix(read), _prefix(attn))


def _prefix(xs: list[int]) -> list[int]:
    out = [0]
    for x in xs:
        out.append(out[-1] + x)
    return out


#: row names of a device's table, in order; EXACT rows first, then the estimates
EXACT_ROWS = ("GDN weights", "attention weights", "MLP weights", "norms", "embedding", "final norm + lm_head",
              "drafter weights", "K/V cache", "GDN states", "GDN tree scratch", "GDN snapshots", "rope tables", "drafter K/V + rope",
              "deferred context")
ESTIMATE_ROWS = ("activations", "graph pools", "workspace")
WEIGHT_ROWS = EXACT_ROWS[:7]


def stage_rows(cfg: TargetConfig, d: DrafterConfig | None, lay: _Layers, start: int, end: int, first: bool,
               last: bool, drafter: bool, wl: Workload) -> dict[str, int]:
    """The exact bytes one stage holds: its layers' weights by part, its extras, its state (the
    rope tables are per GPU: gpu_rows)."""
    dt = wl.dtype
    rows = {r: 0 for r in EXACT_ROWS}
    for part in ("GDN", "attention", "MLP", "norms"):
        rows[f"{part} weights" if part != "norms" else "norms"] = lay.sum(lay.weights[part], start, end)
    n_attn = lay.sum(lay.attn, start, end)
    n_gdn = end - start - n_attn
    if first:
        rows["embedding"] = mem.embedding_bytes(cfg, dt)
    if last:
        rows["final norm + lm_head"] = mem.head_bytes(cfg, dt) + mem.head_prepared_bytes(cfg)
    if drafter and d is not None:
        rows["drafter weights"] = mem.drafter_weight_bytes(d, dt)
        rows["drafter K/V + rope"] = sum(mem.drafter_state_bytes(d, wl.max_len, dt).values())
        if wl.deferred:
            rows["deferred context"] = mem.deferred_context_bytes(cfg, d, dt)
    rows["K/V cache"] = mem.kv_cache_bytes(cfg, n_attn, wl.max_len, dt)
    g = mem.gdn_group_bytes(cfg, n_gdn, dt, wl.tree_capacity)
    rows["GDN states"] = g["conv"] + g["recurrent"]
    rows["GDN tree scratch"] = g["scratch"]
    rows["GDN snapshots"] = mem.gdn_snapshot_bytes(cfg, n_gdn, dt, wl.snapshots)
    return rows


def stage_read(cfg: TargetConfig, d: DrafterConfig | None, lay: _Layers, start: int, end: int, last: bool,
               drafter: bool, wl: Workload) -> int:
    """Bytes one decode step (a verify, and a drafter round) reads on the stage."""
    r = lay.sum(lay.read, start, end)
    if last:
        r += mem.head_read_bytes(cfg, wl.dtype)
    if drafter and d is not None:
        r += mem.drafter_read_bytes(d, wl.max_len, wl.dtype)
    return r


def prefill_chunk(cfg: TargetConfig, wl: Workload, first_gpu_free: int | None) -> int:
    """Tokens per prefill forward: wl.prefill_chunk, else what TargetModel.prefill_chunk picks
    from the free memory of the first layer's GPU once weights and state are in (the first
    generation's: later ones find less free and take smaller chunks); the largest when it is not
    known (no capacities)."""
    if wl.prefill_chunk is not None:
        return wl.prefill_chunk
    return mem.prefill_chunk_tokens(cfg, first_gpu_free)


def _phases(cfg: TargetConfig, d: DrafterConfig | None, lay: _Layers, start: int, end: int, first: bool, last: bool,
            drafter: bool, drafter_beside_taps: bool, remote_taps: int, chunk: int, wl: Workload,
            rope_rows: bool = True) -> dict[str, tuple[int, int]]:
    """Transient bytes of one stage (layers [start, end)) per phase of a generation, as (held,
    working): held tensors add up over the stages of one GPU, working ones do not (one stage
    computes at a time).

    prefill (TargetModel.prefill -> _prefill_chunk, a chunk of `chunk` tokens, keys up to max_len):
      working: the residual stream x [T, H] and the largest of its layers' DecoderLayer.prefill
      (memory.prefill_layer_bytes); on the last stage also the chunk's tap cat (the taps of the
      remote_taps layers on other GPUs copied over, and the cat [T, taps H]). held: the outputs
      of its tapped layers (kept for the cat), the chunk's rope rows (once per GPU: rope_rows),
      the tokens (first stage); on the last stage the previous chunk's taps (Decoder.prefill
      hands them to the drafter; `tap` lives on into the next chunk) and the last row's logits.
    context (DFlashDrafter.add_context of a chunk's taps, on_taps): working on the drafter's stage
      (memory.drafter_context_bytes, + the taps' copy when the drafter is on another GPU than the
      lm_head); held: what TargetModel.prefill keeps while on_taps runs: the chunk's tokens (first
      stage), its taps and the last row's logits (last stage).
    verify / draft: a tree's forward (its masks, layers, masked SDPA; logits and taps on the last
      stage) and a drafter round (its logits on the lm_head's stage)."""
    S, dt, H = wl.max_len, wl.dtype, cfg.hidden_size
    b = mem.dtype_bytes(dt)
    kinds = set(lay.kinds[start:end])
    has_attn = mem.ATTN in kinds

    def forward(T: int) -> int:
        attn = mem.sdpa_workspace_bytes(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, T, S, dt, wl.attention)
        masks = mem.step_mask_bytes(T, S) if wl.attention != "kernel" else 0  # the kernel takes no [T, S] mask
        return masks + mem.activation_bytes(cfg, T) + (attn if has_attn else 0)

    T = chunk
    taps = mem.taps_bytes(cfg, d, T, dt) if d is not None else 0
    here = sum(1 for i in (d.target_layer_ids if d is not None else []) if start <= i < end)
    layer = max((mem.prefill_layer_bytes(cfg, k, T, S, dt, wl.fla) for k in kinds), default=0)
    work = T * H * b + layer if end > start else 0
    held = here * T * H * b + (2 * T * cfg.rotary_dim * b if rope_rows else 0) + (T * mem.LONG if first else 0)
    if last:
        work = max(work, remote_taps * T * H * b + taps)  # the cat: copies of other GPUs' taps, then it
        held += taps + mem.logits_bytes(cfg, 1, dt)
    ph = {"prefill": (held, work)}
    Tv = min(wl.verify_nodes, wl.tree_capacity)
    vtaps = mem.taps_bytes(cfg, d, Tv, dt) if d is not None else 0
    ph["verify"] = ((mem.logits_bytes(cfg, Tv, dt) + vtaps) if last else 0, forward(Tv) if end > start else 0)
    if d is not None:
        ctx = mem.drafter_context_bytes(cfg, d, T, dt) + (0 if drafter_beside_taps else taps)
        ctx_held = (T * mem.LONG if first else 0) + (taps + mem.logits_bytes(cfg, 1, dt) if last else 0)
        ph["context"] = (ctx_held, ctx if drafter else 0)
        ph["draft"] = (mem.logits_bytes(cfg, d.block_size - 1, dt) if last else 0,
                       mem.drafter_round_bytes(cfg, d, S, dt, wl.attention) if drafter else 0)
    return ph


@dataclass
class Stage:
    device: str
    start: int  # layers [start, end)
    end: int


@dataclass
class Split:
    """A placement: stages (layer ranges), the drafter's stage, and per GPU its bytes."""

    devices: list[Any]  # as given (strings or torch devices)
    stages: list[Stage]
    drafter_stage: int | None
    workload: Workload
    capacities: dict[str, int] | None
    gpus: dict[str, dict[str, int]] = field(default_factory=dict)  # gpu -> row -> bytes (+ 'total')
    reads: list[int] = field(default_factory=list)  # per stage
    phases: dict[str, dict[str, int]] = field(default_factory=dict)  # gpu -> phase -> transient bytes
    prefill_chunk: int = 0  # the tokens per prefill forward the phases assume
    fits: bool = True

    def peak_phase(self, gpu: str) -> str:
        """The phase of a generation that sets the GPU's activations row."""
        return max(self.phases[gpu], key=self.phases[gpu].get)

    @property
    def layer_devices(self) -> list[Any]:
        return [self.devices[j] for j, s in enumerate(self.stages) for _ in range(s.start, s.end)]

    @property
    def layer_stages(self) -> list[int]:
        return [j for j, s in enumerate(self.stages) for _ in range(s.start, s.end)]

    @property
    def drafter_device(self):
        return None if self.drafter_stage is None else self.devices[self.drafter_stage]

    def over(self) -> dict[str, int]:
        """GPUs whose total exceeds their capacity -> bytes over."""
        if not self.capacities:
            return {}
        return {g: r["total"] - self.capacities[g] for g, r in self.gpus.items() if r["total"] > self.capacities[g]}


def gpu_rows(cfg: TargetConfig, d: DrafterConfig | None, lay: _Layers, bounds: list[int], devices: Sequence[Any],
             drafter_stage: int | None, wl: Workload, phases_out: dict | None = None,
             capacities: dict[str, int] | None = None, info: dict | None = None) -> dict[str, dict[str, int]]:
    """Per GPU: the exact rows summed over its stages, then the estimates and the total.

    bounds: stage j holds layers [bounds[j], bounds[j + 1]); fewer than len(devices) + 1 entries
    is a partial split (the first stages, while placing). activations: the largest phase of
    `_phases` (held bytes summed over the GPU's stages + the largest working term), for a prefill
    chunk of `prefill_chunk` tokens (from the first GPU's capacity less its exact rows and the CUDA
    context). graph pools (CUDA graphs: one GPU): every captured graph keeps a private pool as large
    as its forward's peak; a verify and a draft graph per context bucket, for `graph_buckets`
    buckets (graphs of earlier buckets stay captured: long generations hold more). workspace: the
    fixed allowance + the slack fraction of the rest + the CUDA context. phases_out (a dict) gets
    each GPU's transient bytes per phase; info (a dict) the prefill chunk."""
    D = len(devices)
    graphs = graphs_on(wl, devices)
    out: dict[str, dict[str, int]] = {}
    n = len(bounds) - 1
    for j in range(n):
        g = gpu_of(devices[j])
        s, e = bounds[j], bounds[j + 1]
        acc = out.setdefault(g, {r: 0 for r in EXACT_ROWS})
        for r, v in stage_rows(cfg, d, lay, s, e, j == 0, j == D - 1, j == drafter_stage, wl).items():
            acc[r] += v
        if e > s:  # one cos / sin pair per device that holds layers (TargetModel._rope)
            acc["rope tables"] = mem.target_rope_bytes(cfg, wl.max_len)
    g0 = gpu_of(devices[0])
    free0 = None if capacities is None else capacities[g0] - wl.context - sum(out[g0].values())
    chunk = prefill_chunk(cfg, wl, free0)
    if info is not None:
        info["prefill_chunk"] = chunk
    out_gpu = gpu_of(devices[D - 1])
    beside = drafter_stage is not None and gpu_of(devices[drafter_stage]) == out_gpu
    remote = 0  # tapped layers on other GPUs than the lm_head's (their taps are copied for the cat)
    if d is not None and n == D:
        remote = sum(1 for i in d.target_layer_ids for j in range(D)
                     if bounds[j] <= i < bounds[j + 1] and gpu_of(devices[j]) != out_gpu)
    phases: dict[str, dict[str, list[int]]] = {}
    roped: set = set()  # GPUs whose Chunk (its rope rows) is counted: one per device (TargetModel._prefill_chunk)
    for j in range(n):
        g = gpu_of(devices[j])
        rope = bounds[j + 1] > bounds[j] and g not in roped
        if rope:
            roped.add(g)
        for name, (held, work) in _phases(cfg, d, lay, bounds[j], bounds[j + 1], j == 0, j == D - 1,
                                          j == drafter_stage, beside, remote, chunk, wl, rope).items():
            p = phases.setdefault(g, {}).setdefault(name, [0, 0])
            p[0] += held
            p[1] = max(p[1], work)
    for g, acc in out.items():
        ph = phases[g]
        acc["activations"] = max(h + w for h, w in ph.values())
        if phases_out is not None:
            phases_out[g] = {k: h + w for k, (h, w) in ph.items()}
        acc["graph pools"] = (wl.graph_buckets * sum(sum(ph.get(k, (0, 0))) for k in ("verify", "draft"))
                              if graphs else 0)
        acc["workspace"] = wl.workspace + wl.context + int(wl.slack * sum(acc.values()))
        acc["total"] = sum(acc[r] for r in EXACT_ROWS + ESTIMATE_ROWS)
    return out


# ============================================================================================
# the split
# ============================================================================================


def _greedy(cfg, d, lay, devices, drafter_stage, wl, caps, limit) -> list[int] | None:
    """Stage by stage, the most layers that keep the stage's reads <= limit and its GPU within
    capacity, leaving at least one layer to each later stage. -> stage bounds, or None.

    Reads and bytes only grow with the layers a stage takes, so the largest end is found by
    bisection; and for distinct GPUs taking the most is never worse for the stages after (they
    are left fewer layers), which makes this an exact test of `limit`."""
    L, D = len(lay.kinds), len(devices)

    def ok(bounds: list[int]) -> bool:
        j = len(bounds) - 2
        lo, e = bounds[-2], bounds[-1]
        if stage_read(cfg, d, lay, lo, e, j == D - 1, j == drafter_stage, wl) > limit:
            return False
        if caps is None:
            return True
        g = gpu_of(devices[j])
        return gpu_rows(cfg, d, lay, bounds, devices, drafter_stage, wl, capacities=caps)[g]["total"] <= caps[g]

    bounds = [0]
    for j in range(D - 1):
        lo, hi = bounds[-1] + 1, L - (D - 1 - j)  # the end of stage j lies in [lo, hi]
        if not ok(bounds + [lo]):
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(bounds + [mid]):
                lo = mid
            else:
                hi = mid - 1
        bounds.append(lo)
    return bounds + [L] if ok(bounds + [L]) else None


def _best_bounds(cfg, d, lay, devices, drafter_stage, wl, caps) -> list[int] | None:
    """The bounds with the smallest largest-stage read that fit (bisection on the read limit,
    to 0.01%)."""
    if len(devices) > len(lay.kinds):
        return None
    hi = stage_read(cfg, d, lay, 0, len(lay.kinds), True, True, wl)
    best = _greedy(cfg, d, lay, devices, drafter_stage, wl, caps, hi)
    if best is None:
        return None
    lo = 0
    while hi - lo > max(1, hi // 10_000):
        mid = (lo + hi) // 2
        b = _greedy(cfg, d, lay, devices, drafter_stage, wl, caps, mid)
        if b is None:
            lo = mid
        else:
            hi, best = mid, b
    return best


def place(cfg: TargetConfig, d: DrafterConfig | None, devices: Sequence[Any], wl: Workload,
          capacities: dict[str, int] | None = None) -> Split:
    """The split of cfg's layers over `devices` (one stage per entry) and the drafter's stage.

    Balances the largest stage read per decode step; with `capacities` (bytes per GPU, keys as
    gpu_of gives them) every GPU must fit. The drafter goes to the stage that gives the smallest
    largest read among those that fit; the last stage (beside the lm_head it borrows, where the
    taps already are) unless another is better by more than 1%. If nothing fits, the split is the
    unconstrained one with fits=False (the table then says by how much each GPU is over). For
    distinct GPUs the split found is the best that fits (see _greedy); with stages sharing a GPU
    it is a greedy one, and fits is checked on the whole split."""
    devices = list(devices)
    if not devices:
        raise ValueError("no devices")
    lay = _layers(cfg, wl)
    D = len(devices)
    options = [None] if d is None else [D - 1] + list(range(D - 1))
    caps = None if capacities is None else {gpu_of(x): capacities[gpu_of(x)] for x in devices}

    def solve(cap):
        found = []
        for ds in options:
            b = _best_bounds(cfg, d, lay, devices, ds, wl, cap)
            if b is not None:
                worst = max(stage_read(cfg, d, lay, b[j], b[j + 1], j == D - 1, j == ds, wl) for j in range(D))
                found.append((worst, ds, b))
        if not found:
            return None
        best = min(found, key=lambda f: f[0])
        pref = found[0] if found[0][1] == options[0] else None  # the last stage, if it fits
        return pref if pref is not None and pref[0] <= best[0] * 1.01 else best

    sol = solve(caps)
    fits = sol is not None
    if sol is None:
        sol = solve(None)
    if sol is None:  # more stages than layers
        bounds = [min(j, len(lay.kinds)) for j in range(D + 1)]
        bounds[-1] = len(lay.kinds)
        sol = (0, options[0], bounds)
    _, ds, b = sol
    split = Split(devices=devices, stages=[Stage(str(devices[j]), b[j], b[j + 1]) for j in range(D)],
                  drafter_stage=ds, workload=wl, capacities=caps)
    info: dict = {}
    split.gpus = gpu_rows(cfg, d, lay, b, devices, ds, wl, split.phases, caps, info)
    split.prefill_chunk = info["prefill_chunk"]
    split.reads = [stage_read(cfg, d, lay, b[j], b[j + 1], j == D - 1, j == ds, wl) for j in range(D)]
    split.fits = fits and not split.over()
    return split


def split_layers(cfg: TargetConfig, devices: Sequence[Any], max_len: int = 4096, dtype: Any = "bfloat16",
                 drafter_cfg: DrafterConfig | None = None, capacities: dict[str, int] | None = None) -> list[Any]:
    """One entry of `devices` per layer: contiguous layers per device, reads balanced (see place)."""
    stages = split_stages(cfg, devices, max_len, dtype, drafter_cfg, capacities)
    return [devices[j] for j in stages]


def split_stages(cfg: TargetConfig, devices: Sequence[Any], max_len: int = 4096, dtype: Any = "bfloat16",
                 drafter_cfg: DrafterConfig | None = None, capacities: dict[str, int] | None = None) -> list[int]:
    """One stage index (an entry of `devices`, which may repeat) per layer: contiguous, reads balanced."""
    if len(devices) == 1:
        return [0] * cfg.num_layers
    return place(cfg, drafter_cfg, devices, Workload(max_len=max_len, dtype=dtype), capacities).layer_stages


"""ddtree.model.memory against the tensors a built model really holds (CPU, tiny models).

Weights, the constants prepare() derives and the state buffers (the drafter's cache rows and
--budget auto's DeferredContext included) must agree byte for byte with the planned figures, per
device of a split (layers on cpu and on meta: the meta device keeps shapes and sizes without
storage). The transient estimates are checked against the live bytes of the code paths they
model, on Qwen3.6-27B's shapes scaled down: a prefill chunk through each layer kind and the
drafter's context of a chunk (per token), a whole chunked prefill with taps to the drafter, a
verify and a draft through torch's math SDPA, and the math-SDPA workspace alone (the same C++
code on CPU and CUDA). The prefill's attention runs SDPA's flash kernel (CPU's, as the GPUs'
take theirs); its GDN chain the torch path (fla's is modelled from its source and checked on a
GPU by scripts/check_memory_plan.py).
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ddtree.decode.round import DeferredContext
from ddtree.model import memory as mem
from ddtree.model.config import DrafterConfig, TargetConfig
from ddtree.model.drafter import DFlashDrafter
from ddtree.model.placement import EXACT_ROWS, Workload, gpu_rows, _layers, place
from ddtree.decode.random_pair import build_random_pair
from ddtree.model.synthetic import randomize_, tiny_dense_config, tiny_drafter_config, tiny_hybrid_config
from ddtree.model.target import Chunk, TargetModel

from helpers import tensors_in, tiny_cpu_each_test  # noqa: F401  (autouse: one thread, no_grad)

HYBRID_LAYERS = ("linear_attention", "linear_attention", "full_attention", "linear_attention",
                 "full_attention", "linear_attention", "linear_attention", "full_attention")


def _storage_bytes(tensors) -> dict:
    """Bytes per device of the distinct storages behind `tensors` (views count once)."""
    seen, out = set(), {}
    for t in tensors:
        s = t.untyped_storage()
        if s._cdata in seen:
            continue
        seen.add(s._cdata)
        out[t.device.type] = out.get(t.device.type, 0) + s.nbytes()
    return out


def _held(target: TargetModel, drafter: DFlashDrafter | None, deferred: DeferredContext | None = None):
    """(parameters, derived constants, state buffers) of a built pair, as tensor lists."""
    params = list(target.parameters()) + (list(drafter.parameters()) if drafter is not None else [])
    derived = [t for mod in (target, drafter) if mod is not None for m in mod.modules()
               for k, v in m.__dict__.items() if k in ("_w_eff", "_c", "_wgu", "_wqkv", "_win") for t in tensors_in(v)]
    state = list(tensors_in([target.kv_stacks, target._rope]))
    for g in target.gdn_groups.values():
        state += [g.state, g.conv, g.kbuf, g.ubuf, g.cbuf, g.ebuf]
    if drafter is not None:
        state += [x for layer in drafter.layers for x in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
        state += [drafter.cos, drafter.sin, drafter.ctx_len]
    if deferred is not None:
        state += [deferred.rows, deferred.count, deferred.index]
    return params, derived, state


def _deferred(target: TargetModel, drafter: DFlashDrafter) -> DeferredContext:
    """--budget auto's deferred context, made as ddtree.decode.round.Pipeline makes it."""
    return DeferredContext(target.cfg.hidden_size * len(drafter.cfg.target_layer_ids), drafter.device, target.dtype)


def _build(raw: dict, draft_raw: dict | None, dtype, max_len: int, layer_devices=None, drafter_device="cpu",
           tree_capacity: int = 256):
    cfg = TargetConfig.from_dict(raw)
    target = randomize_(TargetModel(cfg), 0).to(dtype)
    for layer, dev in zip(target.layers, layer_devices or ["cpu"] * cfg.num_layers):
        layer.to(dev)
    last = (layer_devices or ["cpu"])[-1]
    target.norm.to(last)
    target.lm_head.to(last)
    target.allocate_state(max_len, tree_capacity=tree_capacity)
    drafter = None
    if draft_raw is not None:
        drafter = randomize_(DFlashDrafter(DrafterConfig.from_dict(draft_raw, cfg.num_layers)), 1).to(dtype)
        drafter.to(drafter_device)
        drafter.allocate_state(max_len)
    return target, drafter


CASES = [("hybrid", torch.float32, 300), ("hybrid", torch.bfloat16, 257), ("dense", torch.bfloat16, 300),
         ("hybrid", torch.float16, 4096)]  # 4096: the tiny configs' max_position_embeddings


@pytest.mark.parametrize("kind,dtype,max_len", CASES)
def test_planned_bytes_equal_allocated_bytes(kind, dtype, max_len):
    """One device: weights, derived constants and state buffers, exactly (and nothing else is
    allocated by allocate_state: the state is what the plan says for this max_len, no more),
    the drafter's cache rows and --budget auto's deferred context included."""
    raw = tiny_hybrid_config(layers=HYBRID_LAYERS) if kind == "hybrid" else tiny_dense_config()
    draft_raw = tiny_drafter_config(raw, layers=2, sliding=3)
    target, drafter = _build(raw, draft_raw, dtype, max_len)
    cfg, dcfg = target.cfg, drafter.cfg
    rows = mem.drafter_cache_rows(dcfg, max_len)
    assert rows == drafter.cache_rows(max_len)
    assert all(layer.self_attn.k_cache.shape[0] == rows for layer in drafter.layers) and drafter.cos.shape[0] == rows
    params, derived, state = _held(target, drafter, _deferred(target, drafter))
    w = _storage_bytes(params)["cpu"]
    assert w == mem.target_weight_bytes(cfg, dtype) + mem.drafter_weight_bytes(dcfg, dtype)
    # fused projection weights are views of the parameters' storages: only the fp32 constants are new
    param_storages = {p.untyped_storage()._cdata for p in params}
    new = [t for t in derived if t.untyped_storage()._cdata not in param_storages]
    assert _storage_bytes(new).get("cpu", 0) == (sum(mem.layer_prepared_bytes(cfg, k, dtype) for k in cfg.layer_types)
                                                  + mem.head_prepared_bytes(cfg))
    n_attn = cfg.layer_types.count("full_attention")
    g = mem.gdn_group_bytes(cfg, cfg.num_layers - n_attn, dtype, 256)
    planned_state = (mem.kv_cache_bytes(cfg, n_attn, max_len, dtype) + sum(g.values())
                     + mem.target_rope_bytes(cfg, max_len) + sum(mem.drafter_state_bytes(dcfg, max_len, dtype).values())
                     + mem.deferred_context_bytes(cfg, dcfg, dtype))
    assert _storage_bytes(state)["cpu"] == planned_state


def test_split_rows_equal_allocated_bytes_per_device():
    """A two-stage split (cpu, meta), the drafter on the stage the placement picks: every exact
    row of every device's plan equals what that device holds, including a non-default tree
    capacity and --budget auto's deferred context (on the drafter's device)."""
    raw = tiny_hybrid_config(layers=HYBRID_LAYERS)
    draft_raw = tiny_drafter_config(raw, layers=2)
    cfg = TargetConfig.from_dict(raw)
    dcfg = DrafterConfig.from_dict(draft_raw, cfg.num_layers)
    for deferred in (False, True):
        wl = Workload(max_len=640, dtype=torch.bfloat16, tree_capacity=64, deferred=deferred)
        split = place(cfg, dcfg, ["cpu", "meta"], wl)
        assert split.stages[0].end - split.stages[0].start not in (0, cfg.num_layers)
        target, drafter = _build(raw, draft_raw, torch.bfloat16, 640, split.layer_devices, split.drafter_device, 64)
        params, derived, state = _held(target, drafter, _deferred(target, drafter) if deferred else None)
        held = _storage_bytes(params + derived + state)
        planned = {dev: sum(rows[r] for r in EXACT_ROWS) for dev, rows in split.gpus.items()}
        assert held == planned
        assert split.gpus[str(split.drafter_device)]["deferred context"] == (
            mem.deferred_context_bytes(cfg, dcfg, torch.bfloat16) if deferred else 0)


def test_deferred_context_of_an_auto_run_is_the_planned_one():
    """The DeferredContext a --budget auto generation really makes (ddtree.decode.round.Pipeline),
    and the constants the plan mirrors without importing torch."""
    from ddtree.decode import budget
    from ddtree.model import drafter as drafter_mod

    assert mem.DEFERRED_ROWS == drafter_mod.DEFERRED_ROWS == budget.PLAIN_PROBE_MAX
    dec, _ = build_random_pair("hybrid", seed=7, dtype=torch.bfloat16)
    assert dec.deferred is None
    dec.generate(list(range(2, 15)), "ddtree", budget="auto", max_new_tokens=6)
    got = _storage_bytes([dec.deferred.rows, dec.deferred.count, dec.deferred.index])
    assert got == {"cpu": mem.deferred_context_bytes(dec.target.cfg, dec.drafter.cfg, torch.bfloat16)}


def test_exact_rows_of_a_stage_add_up_to_the_model():
    """Summed over any split, the exact rows are the whole model: nothing counted twice or lost."""
    cfg = TargetConfig.from_dict(tiny_hybrid_config(layers=HYBRID_LAYERS))
    dcfg = DrafterConfig.from_dict(tiny_drafter_config(tiny_hybrid_config(layers=HYBRID_LAYERS)), cfg.num_layers)
    wl = Workload(max_len=1000)
    lay = _layers(cfg, wl)
    whole = gpu_rows(cfg, dcfg, lay, [0, cfg.num_layers], ["cuda:0"], 0, wl)["cuda:0"]
    for b in range(1, cfg.num_layers):
        for ds in (0, 1):
            parts = gpu_rows(cfg, dcfg, lay, [0, b, cfg.num_layers], ["cuda:0", "cuda:1"], ds, wl)
            for r in EXACT_ROWS:
                n = sum(p[r] for p in parts.values())
                assert n == (2 * whole[r] if r == "rope tables" else whole[r]), (r, b, ds)


def test_read_bytes_per_layer():
    cfg = TargetConfig.from_dict(tiny_hybrid_config())
    dt = 2
    kv_row = 2 * cfg.num_kv_heads * cfg.head_dim * dt
    assert mem.layer_read_bytes(cfg, "full_attention", 100, "bfloat16") == mem.layer_weight_bytes(cfg, "full_attention", "bfloat16") + 100 * kv_row
    gdn = mem.layer_read_bytes(cfg, "linear_attention", 100, "bfloat16") - mem.layer_weight_bytes(cfg, "linear_attention", "bfloat16")
    assert gdn == 2 * cfg.gdn_num_v_heads * cfg.gdn_k_dim * cfg.gdn_v_dim * 4 + 2 * (cfg.conv_kernel - 1) * cfg.gdn_conv_dim * dt
    assert mem.layer_read_bytes(cfg, "linear_attention", 10, "bfloat16") == mem.layer_read_bytes(cfg, "linear_attention", 10_000, "bfloat16")


# ------------------------------------------------------------------------------------------ transients


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created inside the mode and alive at once.

    Each aten op's new outputs are counted until their last tensor dies (views of tensors made
    before the mode are not new). Composite-explicit ops hide
    their insides from a dispatch mode; _safe_softmax (math SDPA's) is run as its C++ body is
    written (softmax, the -inf test, the all-masked rows, where) so that its temporaries count."""

    def __init__(self):
        super().__init__()
        self.size, self.refs, self.now, self.peak = {}, {}, 0, 0

    def _drop(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.size.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        if func is torch.ops.aten._safe_softmax.default:  # ops called here bypass the mode: tracked by hand
            x, dim = args[0], args[1]
            out = self._track(torch.softmax(x, dim), inputs)
            masked = self._track(x.eq(float("-inf")), inputs)  # named locals there: alive to the end
            rows = self._track(masked.all(dim, keepdim=True), inputs)
            return self._track(torch.where(rows, torch.zeros((), dtype=out.dtype), out), inputs)
        return self._track(func(*args, **kwargs), inputs)

    def _track(self, out, inputs):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                key = s._cdata
                if key not in self.size and key in inputs:  # a view of a tensor made before the mode
                    continue
                if key not in self.size:
                    self.size[key], self.refs[key] = s.nbytes(), 0
                    self.now += s.nbytes()
                    self.peak = max(self.peak, self.now)
                self.refs[key] += 1
                weakref.finalize(t, self._drop, key)
        return out


@pytest.mark.parametrize("h,kvh,hd,T,S", [(24, 4, 256, 16, 2048), (24, 4, 256, 256, 1024), (32, 8, 128, 16, 4096),
                                          (8, 2, 64, 33, 3000)])
def test_math_sdpa_workspace_estimate_matches_torch(h, kvh, hd, T, S):
    """The masked GQA attention of the target / drafter through torch's math path, bf16: the
    estimate bounds the live bytes, within 2% (both branches of its peak: QK^T and softmax)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(T, h, hd, dtype=torch.bfloat16).transpose(0, 1)[None]  # the layouts Attention.forward passes
    k = torch.randn(S, kvh, hd, dtype=torch.bfloat16).transpose(0, 1)[None]
    v = torch.randn(S, kvh, hd, dtype=torch.bfloat16).transpose(0, 1)[None]
    mask = torch.rand(T, S) > 0.3
    live = LiveBytes()
    with sdpa_kernel(SDPBackend.MATH), live:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)
    planned = mem.sdpa_workspace_bytes(h, kvh, hd, T, S, torch.bfloat16, "math")
    assert live.peak <= planned <= 1.02 * live.peak, (live.peak, planned)
    assert out.shape == (1, h, T, hd)


# ------------------------------------------------------------------------------------------ prefill, verify, draft

QWEN36_LAYERS = ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",)


def scaled_qwen36(scale: int) -> tuple[dict, dict]:
    """Qwen3.6-27B + DFlash with every width divided by `scale` and the head counts kept (8 target
    layers in its 3:1 pattern, 5 drafter layers, 4 sliding of them): the same code paths and
    tensor shapes, small enough for the CPU."""
    raw = tiny_hybrid_config(vocab=4099, hidden=5120 // scale, layers=QWEN36_LAYERS, heads=24, kv_heads=4,
                             head_dim=256 // scale, partial=0.25, gdn_k_heads=16, gdn_v_heads=48,
                             gdn_k_dim=128 // scale, gdn_v_dim=128 // scale, inter=17408 // scale)
    draft = tiny_drafter_config(raw, layers=5, block_size=16, sliding=64, taps=[1, 2, 4, 6, 7])
    draft.update(intermediate_size=17408 // scale, num_attention_heads=32, num_key_value_heads=8, head_dim=128 // scale,
                 layer_types=["sliding_attention"] * 4 + ["full_attention"])
    return raw, draft


@pytest.fixture
def flash_prefill(monkeypatch):
    """The prefill's attention through SDPA's flash kernel on the CPU (prefill_attention takes its
    dense-mask twin there), with the lower-right causal bias made outside any dispatch mode (a
    tensor subclass cannot be created inside one)."""
    import functools

    import torch.nn.attention.bias as bias
    from torch.utils._python_dispatch import _disable_current_modes

    from ddtree.ops import attention

    lower_right = bias.causal_lower_right

    def made_outside(*a):
        with _disable_current_modes():
            return lower_right(*a)

    monkeypatch.setattr(bias, "causal_lower_right", made_outside)
    monkeypatch.setattr(attention, "prefill_attention", functools.partial(attention.prefill_attention, backend="flash"))


def _pair(scale: int, max_len: int, dtype=torch.bfloat16):
    raw, draw = scaled_qwen36(scale)
    target, drafter = _build(raw, draw, dtype, max_len)
    target.tap_layers = list(drafter.cfg.target_layer_ids)
    drafter.attach(target.embed_tokens, target.lm_head)
    return target, drafter


_TARGETS: dict = {}


def _target(scale: int, dtype) -> TargetModel:
    """A scaled Qwen3.6 target (state for 2048 positions), built once per (scale, dtype)."""
    if (scale, dtype) not in _TARGETS:
        _TARGETS[(scale, dtype)] = _build(scaled_qwen36(scale)[0], None, dtype, 2048)[0]
    return _TARGETS[(scale, dtype)]


def _peak(fn) -> int:
    live = LiveBytes()
    with torch.no_grad(), live:
        out = fn()
    del out
    return live.peak


@pytest.mark.parametrize("scale,T,dtype", [(16, 256, torch.bfloat16), (16, 1000, torch.bfloat16), (8, 64, torch.bfloat16),
                                           (16, 33, torch.bfloat16), (8, 256, torch.float32)])
def test_prefill_layer_estimates_bound_live_bytes(flash_prefill, scale, T, dtype):
    """DecoderLayer.prefill over a chunk of T tokens, per layer kind: the estimate bounds the live
    bytes beyond the layer's input, within 6% (the GDN layer's peak is its output norm on the
    torch chain path, the attention layer's its MLP)."""
    target = _target(scale, dtype)
    cfg = target.cfg
    x = torch.randn(T, cfg.hidden_size, dtype=dtype)
    cos, sin = target._rope[torch.device("cpu")]
    chunk = Chunk(0, cos[:T].to(dtype), sin[:T].to(dtype), target.kernels[0])  # (kernels per stage)
    for i in (0, 3):
        layer = target.layers[i]
        live = _peak(lambda: layer.prefill(x, chunk))
        planned = mem.prefill_layer_bytes(cfg, layer.kind, T, T, dtype, fla=False)
        assert live <= planned <= 1.06 * live, (layer.kind, live, planned)


@pytest.mark.parametrize("scale,rows", [(16, 256), (8, 512), (8, 40)])
def test_drafter_context_estimate_matches_live_bytes(scale, rows):
    """DFlashDrafter.add_context of one chunk's tap rows (the taps the caller's)."""
    raw, draw = scaled_qwen36(scale)
    cfg = TargetConfig.from_dict(raw)
    drafter = randomize_(DFlashDrafter(DrafterConfig.from_dict(draw, cfg.num_layers)), 1).to(torch.bfloat16)
    drafter.allocate_state(rows + 8)
    taps = torch.randn(rows, len(drafter.cfg.target_layer_ids) * cfg.hidden_size, dtype=torch.bfloat16)
    live = _peak(lambda: drafter.add_context(taps))
    assert live == mem.drafter_context_bytes(cfg, drafter.cfg, rows, torch.bfloat16)


def test_prefill_phases_bound_a_chunked_prefill_with_taps_to_the_drafter(flash_prefill):
    """Decoder.prefill's path: TargetModel.prefill in chunks (the last one short), each chunk's
    taps to DFlashDrafter.add_context. The peak over the whole prefill is the larger of the
    plan's prefill and drafter-context phases, within 10%."""
    chunk, n = 128, 300
    target, drafter = _pair(16, n + 64)
    tokens = torch.randint(2, 4000, (n,), generator=torch.Generator().manual_seed(0))
    live = _peak(lambda: target.prefill(tokens, chunk=chunk, on_taps=drafter.add_context))
    wl = Workload(max_len=n + 64, dtype=torch.bfloat16, prefill_chunk=chunk, fla=False)
    split = place(target.cfg, drafter.cfg, ["cpu"], wl)
    assert split.prefill_chunk == chunk
    ph = split.phases["cpu"]
    planned = max(ph["prefill"], ph["context"])
    assert live <= planned <= 1.10 * live, (live, ph)


def test_verify_and_draft_phases_bound_the_math_sdpa_path():
    """A 33-node verify (Decoder._verify: TargetModel.forward with the dense [T, kv_len] mask) and
    a draft at a 4K context, with SDPA held to its math path (RTX A6000 / A100): the plan's
    verify and draft phases (attention "math") bound the live bytes, within 8%."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    n, T = 4096, 33
    target, drafter = _pair(16, n + T)
    tril = torch.ones(T, T, dtype=torch.bool).tril()
    start = torch.tensor(n)
    with sdpa_kernel(SDPBackend.MATH):
        verify = _peak(lambda: target.forward(torch.arange(2, 2 + T), n + torch.arange(T), tril, torch.arange(T) - 1,
                                              start, n + T))
        draft = _peak(lambda: drafter.draft_logits(torch.tensor(3), n + T))
    ph = place(target.cfg, drafter.cfg, ["cpu"],
               Workload(max_len=n + T, dtype=torch.bfloat16, verify_nodes=T, attention="math")).phases["cpu"]
    assert verify <= ph["verify"] <= 1.08 * verify, (verify, ph["verify"])
    assert draft <= ph["draft"] <= 1.08 * draft, (draft, ph["draft"])


def test_prefill_chunk_is_the_targets_rule():
    """mem.prefill_chunk_tokens is TargetModel.prefill_chunk on a GPU (its device faked: the rule
    reads no memory when free_bytes is given)."""

    class OnGpu(TargetModel):
        device = property(lambda self: torch.device("cuda", 0))

    for raw in (tiny_hybrid_config(), tiny_dense_config(), scaled_qwen36(1)[0]):
        cfg = TargetConfig.from_dict(raw)
        with torch.device("meta"):
            model = OnGpu(cfg)
        for free in (0, 1 << 20, 3 << 30, 13 << 30, 40 << 30, 1 << 40):
            assert mem.prefill_chunk_tokens(cfg, free) == model.prefill_chunk(free), (raw.get("model_type"), free)


def test_check_memory_plan_script_runs_on_cpu():
    """scripts/check_memory_plan.py (the GPU check of these figures) still matches the code: its
    --tiny dry run on two CPU stages builds, plans, prefills, verifies and drafts."""
    import subprocess
    import sys

    from conftest import REPO, cli_env

    r = subprocess.run([sys.executable, str(REPO / "scripts" / "check_memory_plan.py"), "--tiny", "--devices", "cpu,cpu",
                        "--prompt-tokens", "600"], capture_output=True, text=True, timeout=300, env=cli_env())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "memory plan vs measured" in r.stdout and "~ verify" in r.stdout and "layers [(0," in r.stderr

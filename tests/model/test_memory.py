"""ddtree.model.memory against the tensors a built model really holds (CPU, tiny models).

Weights, the constants prepare() derives and the state buffers must agree byte for byte with
the planned figures, per device of a split (layers on cpu and on meta: the meta device keeps
shapes and sizes without storage). The math-SDPA workspace estimate is checked against the live
bytes torch's math path allocates (the same C++ code on CPU and CUDA).
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ddtree.model import memory as mem
from ddtree.model.config import DrafterConfig, TargetConfig
from ddtree.model.drafter import DFlashDrafter
from ddtree.model.placement import EXACT_ROWS, Workload, gpu_rows, _layers, place
from ddtree.model.synthetic import randomize_, tiny_dense_config, tiny_drafter_config, tiny_hybrid_config
from ddtree.model.target import TargetModel

from helpers import tiny_cpu_each_test  # noqa: F401  (autouse: one thread, no_grad)

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


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _held(target: TargetModel, drafter: DFlashDrafter | None):
    """(parameters, derived constants, state buffers) of a built pair, as tensor lists."""
    params = list(target.parameters()) + (list(drafter.parameters()) if drafter is not None else [])
    derived = [t for mod in (target, drafter) if mod is not None for m in mod.modules()
               for k, v in m.__dict__.items() if k in ("_w_eff", "_c", "_wgu", "_wqkv", "_win") for t in _tensors(v)]
    state = list(_tensors([target.kv_stacks, target._rope]))
    for g in target.gdn_groups.values():
        state += [g.state, g.conv, g.kbuf, g.ubuf, g.cbuf, g.ebuf, g.final_states]
    if drafter is not None:
        state += [x for layer in drafter.layers for x in (layer.self_attn.k_cache, layer.self_attn.v_cache)]
        state += [drafter.cos, drafter.sin, drafter.ctx_len]
    return params, derived, state


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
    allocated by allocate_state: the state is what the plan says for this max_len, no more)."""
    raw = tiny_hybrid_config(layers=HYBRID_LAYERS) if kind == "hybrid" else tiny_dense_config()
    draft_raw = tiny_drafter_config(raw, layers=2, sliding=3)
    target, drafter = _build(raw, draft_raw, dtype, max_len)
    cfg, dcfg = target.cfg, drafter.cfg
    params, derived, state = _held(target, drafter)
    w = _storage_bytes(params)["cpu"]
    assert w == mem.target_weight_bytes(cfg, dtype) + mem.drafter_weight_bytes(dcfg, dtype)
    # fused projection weights are views of the parameters' storages: only the fp32 constants are new
    param_storages = {p.untyped_storage()._cdata for p in params}
    new = [t for t in derived if t.untyped_storage()._cdata not in param_storages]
    assert _storage_bytes(new).get("cpu", 0) == (sum(mem.layer_prepared_bytes(cfg, k) for k in cfg.layer_types)
                                                  + mem.head_prepared_bytes(cfg))
    n_attn = cfg.layer_types.count("full_attention")
    g = mem.gdn_group_bytes(cfg, cfg.num_layers - n_attn, dtype, 256)
    planned_state = (mem.kv_cache_bytes(cfg, n_attn, max_len, dtype) + sum(g.values())
                     + mem.target_rope_bytes(cfg, max_len) + sum(mem.drafter_state_bytes(dcfg, max_len, dtype).values()))
    assert _storage_bytes(state)["cpu"] == planned_state


def test_split_rows_equal_allocated_bytes_per_device():
    """A two-stage split (cpu, meta), the drafter on the stage the placement picks: every exact
    row of every device's plan equals what that device holds, including a non-default tree
    capacity."""
    raw = tiny_hybrid_config(layers=HYBRID_LAYERS)
    draft_raw = tiny_drafter_config(raw, layers=2)
    cfg = TargetConfig.from_dict(raw)
    dcfg = DrafterConfig.from_dict(draft_raw, cfg.num_layers)
    wl = Workload(max_len=640, dtype=torch.bfloat16, tree_capacity=64)
    split = place(cfg, dcfg, ["cpu", "meta"], wl)
    assert split.stages[0].end - split.stages[0].start not in (0, cfg.num_layers)
    target, drafter = _build(raw, draft_raw, torch.bfloat16, 640, split.layer_devices, split.drafter_device, 64)
    params, derived, state = _held(target, drafter)
    held = _storage_bytes(params + derived + state)
    planned = {dev: sum(rows[r] for r in EXACT_ROWS) for dev, rows in split.gpus.items()}
    assert held == planned


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

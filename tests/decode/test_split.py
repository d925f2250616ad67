"""A split target (ddtree.model.stages) on one CPU: two and three stages on `cpu` give the one-stage
run's greedy tokens and committed states for every method, and every piece of a round enters its
stages in the designed order, touching only the current stage's tensors between two boundaries.

The stage audit (StageAudit) is what stands in for two devices here: it tracks which stage owns
every tensor (by storage), copies what a boundary hands over (as a real cross-device hand-over
would), and flags any op inside a piece that reads or writes another stage's tensor, writes a
handed-over one, or runs before the piece's first boundary. Under graphs on two GPUs each of those
would be a kernel in the wrong device's graph segment.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree.decode import auto as auto_budget
from ddtree.decode.budget import AUTO_BUDGETS
from ddtree.decode.decoder import Decoder
from ddtree.decode.graphs import HostCommitKey, HostDraftKey, PrefixKey, StepKey, VerifyKey
from ddtree.model.stages import StageHook
from ddtree.model.synthetic import build_random_on_devices, tiny_drafter_config, tiny_hybrid_config
from helpers import AUTO_CYCLE, forced_chooser, tensors_in

RAW_T = tiny_hybrid_config(layers=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
                           + ("full_attention",))
RAW_D = tiny_drafter_config(RAW_T, block_size=8)
PROMPT = torch.randint(2, 97, (21,), generator=torch.Generator().manual_seed(1)).tolist()
NEW = 24
PLAIN_CYCLE = [8, 0, 0, 0, 32, 0, 15, 4]  # --budget auto with plain steps: "defer", "flush", "path" contexts
# (method, budget, host-tree loop)
RUNS = [("ar", 1, False), ("dflash", 1, False), ("ddtree", 8, False), ("ddtree", "auto", False),
        ("ar", 1, True), ("ddtree", 8, True), ("ddtree", "auto", True)]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):  # tests/conftest.py: tiny models run on one thread
    yield


def _pair(devices: list[str]):
    return build_random_on_devices(RAW_T, RAW_D, devices, torch.float32, 512, seed=3)


def _generate(dec: Decoder, method, budget, host: bool):
    dec.options = dec.options.replace(host_rounds=host)  # the host-tree loop: HostDraftKey, HostCommitKey pieces
    dec.chooser_class = forced_chooser(AUTO_CYCLE) if host else forced_chooser(PLAIN_CYCLE, probe_every=3)
    return dec.generate(PROMPT, method, budget=budget, max_new_tokens=NEW)


def _assert_runs_equal(dec, one_stage):
    """Every run of RUNS on dec: the one-stage run's tokens and committed states, bitwise."""
    for method, budget, host in RUNS:
        rec = _generate(dec, method, budget, host)
        tokens, state = one_stage[method, budget, host]
        assert rec.token_ids == tokens, (method, budget, host)
        got = committed_state(dec)
        for k, v in state.items():
            assert torch.equal(got[k], v), (method, budget, host, k)


def committed_state(dec: Decoder) -> dict[str, torch.Tensor]:
    """Everything a generation leaves committed, per layer (comparable across stackings)."""
    t, d = dec.target, dec.drafter
    n, m = int(dec.start_d), int(d.ctx_len)
    out = {"start": dec.start_d, "ctx_len": d.ctx_len}
    for i, layer in enumerate(t.layers):
        if layer.kind == "linear_attention":
            out[f"{i}.conv"], out[f"{i}.rec"] = layer.linear_attn.conv_state, layer.linear_attn.rec_state
        else:
            out[f"{i}.k"], out[f"{i}.v"] = layer.self_attn.k_cache[:n], layer.self_attn.v_cache[:n]
    for i, layer in enumerate(d.layers):
        out[f"drafter {i}.k"], out[f"drafter {i}.v"] = layer.self_attn.k_cache[:m], layer.self_attn.v_cache[:m]
    return {k: v.clone() for k, v in out.items()}


@pytest.fixture(scope="module")
def one_stage():
    """The one-stage run of every RUNS entry: (tokens, committed state)."""
    torch.set_num_threads(1)
    dec = Decoder(*_pair(["cpu"]))
    assert len(dec.target.stages) == 1
    out = {}
    for method, budget, host in RUNS:
        rec = _generate(dec, method, budget, host)
        out[method, budget, host] = (rec.token_ids, committed_state(dec))
    return out


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu", "cpu", "cpu"]], ids=["2 stages", "3 stages"])
def test_split_equals_one_stage(devices, one_stage):
    """Greedy tokens of ar, dflash, ddtree (fixed, auto with forced switches and plain steps) and
    the host-tree loop, and every committed state after each generation, equal the one-stage run's."""
    target, drafter = _pair(devices)
    assert [s.index for s in target.stages] == list(range(len(devices)))
    of = {i: s.index for s in target.stages for i in range(s.start, s.end)}  # own state groups per stage
    kinds = RAW_T["text_config"]["layer_types"]
    assert set(target.gdn_groups) == {of[i] for i, k in enumerate(kinds) if k != "full_attention"}
    assert set(target.kv_stacks) == {of[i] for i, k in enumerate(kinds) if k == "full_attention"}
    dec = Decoder(target, drafter)
    assert not dec.use_graphs and dec.split
    _assert_runs_equal(dec, one_stage)


# ----------------------------------------------------------------------------------------------
# the stage audit
# ----------------------------------------------------------------------------------------------

def _ptr(t: torch.Tensor) -> int | None:
    s = t.untyped_storage()
    return s.data_ptr() if s.nbytes() else None


def _held(obj):
    """Tensors an object holds in its attributes (modules: parameters, buffers, prepared weights, caches)."""
    items = []
    if isinstance(obj, torch.nn.Module):
        for m in obj.modules():
            items += list(m._parameters.values()) + list(m._buffers.values()) + list(vars(m).values())
    else:
        items = list(vars(obj).values())
    for v in items:
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, torch.Tensor):
                yield x


class StageAudit(TorchDispatchMode):
    """Which stage owns each tensor (by storage): registered state and weights, then whatever an op
    inside a piece creates belongs to the stage it runs on. Checks every op inside a piece (views
    aside: they launch nothing)."""

    def __init__(self, dec: Decoder):
        super().__init__()
        self.dec = dec
        self.owner: dict[int, frozenset] = {}
        self.readonly: set[int] = set()  # tensors handed over: read, never written
        self.kept: list[torch.Tensor] = []  # those copies, alive for good (their addresses are never reused)
        self.stage = None
        self.piece = None  # the key of the piece running, or None outside pieces
        self.pieces: list[tuple[object, list[int]]] = []
        self.errors: list[str] = []
        self.quiet = 0

    # ---------------------------------------------------------------- ownership
    def own(self, t: torch.Tensor, stages):
        p = _ptr(t)
        if p is not None:
            self.owner[p] = frozenset(stages)

    def register(self):
        """Every persistent tensor's stage: the model's once, the decoder's before each piece (its
        slots and statics appear lazily)."""
        dec, t, d = self.dec, self.dec.target, self.dec.drafter
        home = t.home
        if not self.owner:
            self._register_model()
        if dec.deferred is not None:
            for x in _held(dec.deferred):
                self.own(x, [d.stage])
        self.own(dec.start_d, [home])
        for v in dec.statics._bufs.values():
            for x in (v if isinstance(v, tuple) else (v,)):
                self.own(x, [home])
        for slot in list(dec._slots.values()) + list(dec._chain_stages.values()):
            for x in _held(slot):
                self.own(x, [home])

    def _register_model(self):
        t, d = self.dec.target, self.dec.drafter
        home = t.home
        for st in t.stages:
            for layer in t.layers[st.start:st.end]:
                for x in _held(layer):
                    self.own(x, [st.index])
            for obj in (t.gdn_groups.get(st.index),):
                if obj is not None:
                    for x in (obj.state, obj.conv, obj.kbuf, obj.ubuf, obj.cbuf, obj.ebuf):
                        self.own(x, [st.index])
            for x in t.kv_stacks.get(st.index, ()):
                self.own(x, [st.index])
        from ddtree.ops import gdn

        for x in [x for tables in t._rope.values() for x in tables] + list(gdn._QK_SCALE.values()):
            self.own(x, [s.index for s in t.stages if s.device == x.device])  # a device's constants serve its stages
        for x in _held(t.embed_tokens):
            self.own(x, [0])
        for x in list(_held(t.norm)) + list(_held(t.lm_head)):
            self.own(x, [home])
        for x in _held(d):
            self.own(x, [d.stage])

    # ---------------------------------------------------------------- pieces and boundaries
    def begin(self, key):
        self.register()
        self.piece, self.stage = key, None
        self.pieces.append((key, []))

    def end(self):
        self.piece = self.stage = None

    def entered(self, j: int):
        if self.piece is not None:
            seq = self.pieces[-1][1]
            if not seq or seq[-1] != j:
                seq.append(j)
            self.stage = j

    def hand(self, t, j: int):
        """A boundary's hand-over: the tensor itself if stage j owns it, else a copy owned by j."""
        if self.piece is None or t is None:
            return t
        owners = self.owner.get(_ptr(t))
        if owners is None:
            self.errors.append(f"{self.piece}: handed an unknown tensor {tuple(t.shape)} to stage {j}")
            return t
        if j in owners:
            return t
        self.quiet += 1
        try:
            c = t.clone()
        finally:
            self.quiet -= 1
        self.own(c, [j])
        self.readonly.add(_ptr(c))
        self.kept.append(c)
        return c

    # ---------------------------------------------------------------- every op
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.quiet:
            return out
        ins = {}  # storage -> a tensor on it
        for x in tensors_in((args, kwargs)):
            p = _ptr(x)
            if p is not None:
                ins.setdefault(p, x)
        if self.piece is not None:
            if self.stage is None:
                self.errors.append(f"{self.piece}: {func} before the piece's first boundary")
            elif not func.is_view:
                for p, x in ins.items():
                    owners = self.owner.get(p)
                    if owners is None or self.stage not in owners:
                        self.errors.append(f"{self.piece}: {func} on stage {self.stage} touches a tensor "
                                           f"{tuple(x.shape)} of {set(owners) if owners else 'unknown'}")
                for x in tensors_in(self._written(func, args, kwargs)):
                    if _ptr(x) in self.readonly:
                        self.errors.append(f"{self.piece}: {func} writes a handed-over tensor {tuple(x.shape)}")
        for x in tensors_in(out):
            p = _ptr(x)
            if p is not None and p not in ins:
                if self.piece is not None and self.stage is not None:
                    self.owner[p] = frozenset([self.stage])
                else:
                    self.owner.pop(p, None)  # made outside pieces: unknown until registered
        return out

    _writes: dict = {}

    @classmethod
    def _written(cls, func, args, kwargs) -> list:
        """The arguments an op writes (in-place and out= ones)."""
        idx = cls._writes.get(func)
        if idx is None:
            idx = cls._writes[func] = [i for i, a in enumerate(func._schema.arguments)
                                       if a.alias_info is not None and a.alias_info.is_write]
        return [args[i] for i in idx if i < len(args)] + [v for k, v in kwargs.items() if k == "out"]


class AuditHook(StageHook):
    """The target's stage hook under the audit; hand_over=False hands nothing over (the control)."""

    def __init__(self, audit: StageAudit, stages, hand_over: bool = True):
        super().__init__(stages)
        self.audit, self.hand_over = audit, hand_over

    def enter(self, j, tensors):
        self.audit.entered(j)
        return [self.audit.hand(t, j) if self.hand_over else t for t in tensors]


def audited(dec: Decoder, hand_over: bool = True) -> StageAudit:
    audit = StageAudit(dec)
    dec.target.hook = AuditHook(audit, dec.target.stages, hand_over)
    run = dec.graphs.run

    def piece(key, fn, keep=()):
        audit.begin(key)
        try:
            return run(key, fn, keep)
        finally:
            audit.end()

    dec.graphs.run = piece
    return audit


def _collapse(seq):
    return [x for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x]


def expected_stages(key, N: int, D: int) -> list[int]:
    """The designed stage order of each piece (ddtree.decode.decoder's table): N stages, home the
    last, the drafter on stage D."""
    home, commit = N - 1, list(range(N))
    if isinstance(key, VerifyKey):
        return list(range(N))
    if isinstance(key, PrefixKey):
        return [home]
    if isinstance(key, HostCommitKey):
        return commit
    if isinstance(key, HostDraftKey):  # walk; (ar: commit) or drafter context, block embedding, draft
        return _collapse([home] + commit + [home]) if not key.verify.taps else _collapse([home, D, 0, D, home])
    assert isinstance(key, StepKey), key
    return _collapse([home] + commit + ([D] if key.context != "none" else []) + [home])


@pytest.mark.parametrize("devices,drafter_stage", [(["cpu", "cpu"], 1), (["cpu", "cpu", "cpu"], 0)],
                         ids=["2 stages", "3 stages, drafter on 0"])
def test_pieces_enter_their_stages_and_touch_only_their_tensors(devices, drafter_stage, one_stage, monkeypatch):
    """Every piece of every method (pipeline and host-tree loop) under the stage audit: no op before
    its first boundary, none on another stage's tensors, no write to a handed-over tensor; the
    stages in the designed order; and with hand-overs as copies the tokens still equal one stage's."""
    target, drafter = _pair(devices)
    drafter.stage = drafter_stage  # every stage is on `cpu`: the drafter may sit on any
    dec = Decoder(target, drafter)
    assert drafter.stage == drafter_stage
    N = len(devices)
    # the forced chooser ignores timings: skip calibrate's timing loops (its verifies are audited elsewhere)
    monkeypatch.setattr(auto_budget, "verify_costs", lambda dec, start, greedy: ({b: 1.0 for b in (0,) + AUTO_BUDGETS}, 0.0))
    audit = audited(dec)
    with audit:
        for method, budget, host in RUNS:
            rec = _generate(dec, method, budget, host)
            assert rec.token_ids == one_stage[method, budget, host][0], (method, budget, host)
    assert not audit.errors, "\n".join(audit.errors[:20])
    kinds = set()
    for key, seq in audit.pieces:
        assert seq == expected_stages(key, N, drafter_stage), (key, seq)
        kinds.add((type(key).__name__, getattr(key, "context", None)))
    assert {k for k, _ in kinds} == {"VerifyKey", "StepKey", "PrefixKey", "HostDraftKey", "HostCommitKey"}
    assert {c for _, c in kinds} >= {"none", "path", "defer", "flush"}
    if N == 2:  # the segments per piece of a two-stage split (docs/SPLIT.md)
        seqs = {type(k).__name__: s for k, s in audit.pieces}
        assert seqs == {"VerifyKey": [0, 1], "StepKey": [1, 0, 1], "PrefixKey": [1], "HostDraftKey": [1, 0, 1],
                        "HostCommitKey": [0, 1]}


def test_audit_catches_a_missing_hand_over():
    """The control: a hook that enters stages but hands nothing over leaves stage 0 reading the
    home stage's tree slot in the verify: the audit must say so."""
    dec = Decoder(*_pair(["cpu", "cpu"]))
    audit = audited(dec, hand_over=False)
    with audit:
        dec.generate(PROMPT, "dflash", max_new_tokens=4)
    assert any("VerifyKey" in e and "stage 0" in e for e in audit.errors), audit.errors[:5]


def test_placement_with_repeated_devices():
    """cpu,cpu: two stages (contiguous, both non-empty), each with its own state groups; the
    drafter's stage comes from the placement; `ddtree` accepts repeated --devices."""
    from ddtree.app.setup import parse_device_list
    from ddtree.model.config import TargetConfig
    from ddtree.model.placement import Workload, place, split_layers, split_stages
    from ddtree.model.stages import stages_of

    cfg = TargetConfig.from_dict(RAW_T)
    stages = split_stages(cfg, ["cpu", "cpu"])
    assert stages[0] == 0 and stages[-1] == 1 and stages == sorted(stages) and set(stages) == {0, 1}
    assert split_layers(cfg, ["cpu", "cpu"]) == ["cpu"] * cfg.num_layers  # devices alone cannot tell them apart
    split = place(cfg, None, ["cuda:0", "cuda:0", "cuda:0"], Workload(max_len=512))
    assert sorted(set(split.layer_stages)) == [0, 1, 2]
    target, drafter = _pair(["cpu", "cpu"])
    built = place(cfg, drafter.cfg, ["cpu", "cpu"], Workload(max_len=512, dtype=torch.float32))  # as the builder placed it
    cut = built.layer_stages.index(1)
    assert [(s.start, s.end) for s in target.stages] == [(0, cut), (cut, cfg.num_layers)]
    assert target.layer_devices == [torch.device("cpu")] * cfg.num_layers
    assert set(target.gdn_groups) == set(target.kv_stacks) == {0, 1} and set(target.kernels) == {0, 1}
    assert drafter.stage == built.drafter_stage == 1
    # without stage entries, runs of equal devices are one stage (what a layer_devices list says)
    assert len(stages_of([torch.device("cpu")] * 4)) == 1
    assert [(s.start, s.end) for s in stages_of([torch.device("cpu")] * 4, [0, 0, 1, 1])] == [(0, 2), (2, 4)]
    with pytest.raises(ValueError):
        stages_of([torch.device("cpu")] * 4, [0, 1, 0, 1])
    assert [str(d) for d in parse_device_list("cpu,cpu")] == ["cpu", "cpu"]


# ----------------------------------------------------------------------------------------------
# graph segments, emulated on the CPU
# ----------------------------------------------------------------------------------------------

class FakeGraph:
    """A CUDA graph's CPU stand-in: its capture records the aten ops that run (views aside: they
    launch nothing), its replay runs them again on the same tensors and writes each fresh result
    into the tensor the capture made, as a CUDA graph replays its kernels on the same addresses.
    No Python of the piece runs at replay, so what a graph would get wrong (state only Python
    updates, a buffer that is not static, a hand-over copied too early) goes wrong here too."""

    SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
             torch.ops.aten.is_nonzero.default}

    def __init__(self):
        self.ops: list = []
        self.mode = None

    def replay(self):
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            for o, n in zip(pytree.tree_leaves(out), pytree.tree_leaves(new)):
                if isinstance(o, torch.Tensor) and o is not n:
                    o.copy_(n)

    def capture_end(self):
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.mode = None


class _Record(TorchDispatchMode):
    def __init__(self, graph: FakeGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FakeGraph.SYNCS:
            raise RuntimeError(f"{func}: a host read of a device value inside a graph capture")
        out = func(*args, **kwargs)
        if not func.is_view:
            self.graph.ops.append((func, args, kwargs, out))
        return out


class FakeGraphCapture:
    """torch.cuda.graph(g, pool=, stream=) on the CPU."""

    def __init__(self, cuda_graph: FakeGraph, pool=None, stream=None, **kw):
        self.cuda_graph, self.stream_ctx = cuda_graph, contextlib.nullcontext()

    def __enter__(self):
        self.cuda_graph.mode = _Record(self.cuda_graph)
        self.cuda_graph.mode.__enter__()

    def __exit__(self, *exc):
        self.cuda_graph.capture_end()


class FakeStream:
    def __init__(self, device=None, **kw):
        self.device = torch.device(device or "cpu")

    def wait_event(self, event):
        pass

    def wait_stream(self, stream):
        pass


class FakeEvent:
    def __init__(self, **kw):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


@pytest.fixture
def cpu_graphs(monkeypatch):
    """torch.cuda's graph, stream and event API emulated on the CPU; every tensor a boundary hands
    over is copied into a buffer before the consuming segment, as between two devices."""
    from ddtree.decode import graphs

    for name, obj in (("CUDAGraph", FakeGraph), ("graph", FakeGraphCapture), ("Stream", FakeStream),
                      ("Event", FakeEvent), ("stream", lambda s=None: contextlib.nullcontext()),
                      ("current_stream", lambda device=None: FakeStream(device)),
                      ("graph_pool_handle", lambda: object())):
        monkeypatch.setattr(torch.cuda, name, obj)
    monkeypatch.setattr(graphs._Hook, "crosses", lambda self, t, j, boundary: boundary)
    return graphs


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]], ids=["1 stage", "2 stages"])
def test_graphed_rounds_replay_like_eager(devices, cpu_graphs, one_stage):
    """Every method's rounds through the graph runner (capture once per key, then replays): the
    eager one-stage run's tokens and committed states, for one graph per piece (one stage) and for
    segments with their hand-over copies (two stages: 2 segments per verify, 3 per step, ...)."""
    dec = Decoder(*_pair(devices), use_graphs=True, compile=False)
    _assert_runs_equal(dec, one_stage)
    graphs = dec.graphs._graphs
    if len(devices) == 1:
        assert graphs and all(isinstance(g, FakeGraph) and g.ops for g in graphs.values())
        return
    kinds = {}
    for key, g in graphs.items():
        assert isinstance(g, cpu_graphs.Segments) and all(s.graph.ops for s in g.segments), key  # none empty
        kinds.setdefault(type(key).__name__, set()).add(len(g))
        assert all(s.pulls for s in g.segments[1:]), key  # every boundary copies what it hands over
    assert kinds == {"VerifyKey": {2}, "StepKey": {3}, "PrefixKey": {1}, "HostDraftKey": {3}, "HostCommitKey": {2}}


def test_graphed_split_without_its_copies_goes_wrong(cpu_graphs, one_stage, monkeypatch):
    """The control: segments replayed without the copies before them read the warm-up's values."""
    from ddtree.decode.graphs import GraphRunner

    capture = GraphRunner._capture_segments

    def without_copies(self, key, fn, keep):
        capture(self, key, fn, keep)
        for seg in self._graphs[key].segments:
            seg.pulls.clear()

    monkeypatch.setattr(GraphRunner, "_capture_segments", without_copies)
    dec = Decoder(*_pair(["cpu", "cpu"]), use_graphs=True, compile=False)
    assert _generate(dec, "ar", 1, False).token_ids != one_stage["ar", 1, False][0]

"""The graphed layer split on CUDA (skipped without it): a split target's pieces captured as one graph
segment per stage visit (ddtree.decode.graphs) give the greedy tokens of the one-stage graphed run
and of the eager split (their twin), for every method, in float32 on a tiny random pair with the
same weights. `cuda:0,cuda:0` (two stages on one GPU: own streams, events between segments, no
copies) runs on any GPU; `cuda:0,cuda:1` (peer copies before the consuming segment) needs two.

    python -m pytest -q tests/decode/test_split_gpu.py
"""

import pytest
import torch

from ddtree.decode.decoder import Decoder
from ddtree.decode.graphs import Segments
from ddtree.decode.sampling import SamplingParams
from ddtree.model.synthetic import build_random_on_devices, tiny_drafter_config, tiny_hybrid_config
from ddtree.options import Options

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

RAW_T = tiny_hybrid_config(layers=("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3
                           + ("full_attention",))
RAW_D = tiny_drafter_config(RAW_T, block_size=8)
PLAIN_CYCLE = [8, 0, 0, 0, 32, 0, 15, 4]  # --budget auto with plain steps (probe every 3rd)
# (method, budget, host-tree loop)
RUNS = [("ar", 1, False), ("dflash", 1, False), ("ddtree", 8, False), ("ddtree", 64, False),
        ("ddtree", "auto", False), ("ar", 1, True), ("ddtree", 8, True), ("ddtree", "auto", True)]
# graph segments per piece of a two-stage split with the drafter on the last stage (docs/SPLIT.md)
SEGMENTS = {"VerifyKey": 2, "StepKey": 3, "PrefixKey": 1, "HostDraftKey": 3, "HostCommitKey": 2}


def _tokens(dec: Decoder, prompt, method, budget, host: bool, sampling=SamplingParams()):
    from helpers import AUTO_CYCLE, forced_chooser  # tests/ is on sys.path

    dec.options = dec.options.replace(host_rounds=host)
    dec.chooser_class = forced_chooser(AUTO_CYCLE) if host else forced_chooser(PLAIN_CYCLE, probe_every=3)
    return dec.generate(prompt, method, budget=budget, sampling=sampling, max_new_tokens=40, seed=2).token_ids


def _check_split(devices):
    one = Decoder(*build_random_on_devices(RAW_T, RAW_D, ["cuda:0"], torch.float32, 512, seed=3))
    target, drafter = build_random_on_devices(RAW_T, RAW_D, devices, torch.float32, 512, seed=3)
    assert len(target.stages) == 2 and drafter.stage == 1, "the tiny pair's split: two stages, the drafter on the last"
    seg = Decoder(target, drafter)  # the default on CUDA: graph segments (options.split_graphs)
    eager = Decoder(target, drafter, use_graphs=False)
    assert seg.use_graphs and seg.compile, "a split on CUDA runs graphed segments over compiled layers"
    assert not eager.use_graphs and eager.compile, "its twin: eager rounds over compiled layers"
    prompt = torch.randint(2, 97, (250,), generator=torch.Generator().manual_seed(1)).tolist()  # crosses a bucket
    for method, budget, host in RUNS:
        ref = _tokens(one, prompt, method, budget, host)
        assert _tokens(seg, prompt, method, budget, host) == ref, (method, budget, host, "graphed split")
        assert _tokens(eager, prompt, method, budget, host) == ref, (method, budget, host, "eager split")
    sp = SamplingParams(temperature=0.8, top_p=0.9)  # sampled: the same draws, graphed or eager
    assert _tokens(seg, prompt, "ddtree", 8, False, sp) == _tokens(eager, prompt, "ddtree", 8, False, sp)
    assert seg.compile and one.compile, "compiling the layers did not fall back"
    # the segments were captured: one graph per stage visit, in the designed count per piece
    graphs = seg.graphs._graphs
    assert graphs and all(isinstance(g, Segments) for g in graphs.values())
    kinds = {}
    for key, g in graphs.items():
        kinds.setdefault(type(key).__name__, set()).add(seg.graphs.segments(key))
        assert [s.stage for s in g.segments] == {2: [0, 1], 3: [1, 0, 1], 1: [1]}[len(g)], key
    assert kinds == {k: {n} for k, n in SEGMENTS.items()}, kinds
    assert all(one.graphs.segments(k) == 1 and isinstance(g, torch.cuda.CUDAGraph) for k, g in one.graphs._graphs.items())
    return seg


def test_two_stages_on_one_gpu_graphed_equal_one_stage_and_eager_split():
    """cuda:0,cuda:0: the graphed split (two streams, events between the segments) = one stage = eager split."""
    seg = _check_split(["cuda:0", "cuda:0"])
    assert not any(s.pulls for g in seg.graphs._graphs.values() for s in g.segments), "one device: nothing is copied"
    assert len({s.stream for g in seg.graphs._graphs.values() for s in g.segments}) == 2, "a stream per stage"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (a split over two devices)")
def test_two_gpus_graphed_equal_one_gpu_and_eager_split():
    """cuda:0,cuda:1: the same, with the hand-overs copied between the devices before each segment."""
    seg = _check_split(["cuda:0", "cuda:1"])
    verify = [g for k, g in seg.graphs._graphs.items() if type(k).__name__ == "VerifyKey"]
    assert all(g.segments[0].pulls and g.segments[1].pulls for g in verify), "the verify's inputs cross to stage 0, x back"


def test_one_stage_is_one_graph_per_piece():
    """The one-stage twin keeps a single CUDA graph per piece, replayed on the current stream."""
    dec = Decoder(*build_random_on_devices(RAW_T, RAW_D, ["cuda:0"], torch.float32, 512, seed=3),
                  options=Options())
    dec.generate(list(range(2, 30)), "ddtree", budget=8, max_new_tokens=16)
    assert dec.graphs._graphs and not dec.split
    assert all(isinstance(g, torch.cuda.CUDAGraph) for g in dec.graphs._graphs.values())


@pytest.mark.parametrize("eager", [False, True])
def test_split_on_cuda_is_graphed_by_default(tmp_path, monkeypatch, eager):
    """`ddtree generate --devices cuda:0,cuda:0` runs the graphed split (graph segments over compiled
    layers) unless DDTREE_EAGER_SPLIT=1, which keeps the eager twin (the CPU side:
    tests/app/test_cli.py::test_split_default_on_cpu_is_the_eager_twin)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "app"))
    from app_helpers import write_tiny_pair
    from test_cli import split_paths

    meta = split_paths(write_tiny_pair(tmp_path / "pair"), tmp_path, "cuda:0,cuda:0", monkeypatch, eager)
    assert meta["devices"] == ["cuda:0", "cuda:0"]
    assert meta["options"]["split_graphs"] is (not eager)
    assert meta["cuda_graphs"] is (not eager) and meta["compiled_layers"] is True

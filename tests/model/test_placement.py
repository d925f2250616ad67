"""ddtree.model.placement: the split balances the bytes read per step and respects capacities.

Brute force over every contiguous split (and every drafter stage) of the exact Qwen3.6-27B +
DFlash configs is the reference: `place` must find the smallest largest-stage read among the
splits that fit, fit whenever one does, and say so when none does. Configs only (no tensors).
"""

from __future__ import annotations

import itertools

import pytest

from ddtree.model import memory as mem
from ddtree.model.config import DrafterConfig, TargetConfig
from ddtree.model.placement import GiB, Workload, _layers, gpu_rows, place, split_layers, stage_read
from ddtree.model.presets import qwen36_27b_config, qwen36_27b_dflash_config

T = TargetConfig.from_dict(qwen36_27b_config())
D = DrafterConfig.from_dict(qwen36_27b_dflash_config(), T.num_layers)


def brute(devices, wl, caps, drafter=D):
    """(largest stage read, bounds, drafter stage) of the best split that fits, or None."""
    lay = _layers(T, wl)
    L, n = T.num_layers, len(devices)
    best = None
    for cuts in itertools.combinations(range(1, L), n - 1):
        b = [0, *cuts, L]
        for ds in ([None] if drafter is None else range(n)):
            rows = gpu_rows(T, drafter, lay, b, devices, ds, wl, capacities=caps)
            if caps and any(r["total"] > caps[g] for g, r in rows.items()):
                continue
            worst = max(stage_read(T, drafter, lay, b[j], b[j + 1], j == n - 1, j == ds, wl) for j in range(n))
            if best is None or worst < best[0]:
                best = (worst, b, ds)
    return best


@pytest.mark.parametrize("max_len", [4096, 131072])
def test_two_gpus_unconstrained_is_the_best_balance(max_len):
    wl = Workload(max_len=max_len)
    split = place(T, D, ["cuda:0", "cuda:1"], wl)
    ref = brute(["cuda:0", "cuda:1"], wl, None)
    assert split.fits
    assert max(split.reads) <= ref[0] * 1.01  # the 1% it may give up to keep the drafter by the lm_head
    assert split.drafter_stage == 1
    assert [s.start for s in split.stages] == [0, split.stages[0].end] and split.stages[1].end == T.num_layers
    # balanced: the two stages' reads differ by less than one layer's
    assert abs(split.reads[0] - split.reads[1]) < max(mem.layer_read_bytes(T, k, max_len, "bfloat16") for k in T.layer_types)


@pytest.mark.parametrize("caps_gib,max_len,attention", [((48, 48), 131072, "fused"), ((48, 48), 131072, "math"),
                                                        ((48, 48), 262144, "fused"), ((48, 48), 65536, "math"),
                                                        ((40, 52), 32768, "math"), ((52, 40), 32768, "math"),
                                                        ((46, 46), 131072, "fused"), ((30, 30), 4096, "fused")])
def test_two_gpus_with_capacities_match_brute_force(caps_gib, max_len, attention):
    """Fits exactly when some split fits; then every GPU is within capacity and the largest read
    is the best of the splits that fit (within the 1% kept for the drafter's stage)."""
    devices = ["cuda:0", "cuda:1"]
    caps = {g: c * GiB for g, c in zip(devices, caps_gib)}
    wl = Workload(max_len=max_len, attention=attention, context=GiB // 2)
    split = place(T, D, devices, wl, caps)
    ref = brute(devices, wl, caps)
    assert split.fits == (ref is not None)
    if ref is None:
        assert split.over()  # the table can say by how much
        return
    for g, rows in split.gpus.items():
        assert rows["total"] <= caps[g]
    assert max(split.reads) <= ref[0] * 1.01


def test_three_gpus_match_brute_force():
    devices = ["cuda:0", "cuda:1", "cuda:2"]
    for caps_gib in ((24, 24, 24), (20, 30, 24)):
        caps = {g: c * GiB for g, c in zip(devices, caps_gib)}
        wl = Workload(max_len=16384, attention="fused", context=GiB // 2)
        split = place(T, D, devices, wl, caps)
        ref = brute(devices, wl, caps)
        assert split.fits == (ref is not None)
        if ref is not None:
            assert max(split.reads) <= ref[0] * 1.01
            assert all(r["total"] <= caps[g] for g, r in split.gpus.items())


def test_drafter_moves_where_it_fits():
    """A last GPU too small for the drafter beside its share: the drafter goes to the first (the
    eager split: no graph pools)."""
    devices = ["cuda:0", "cuda:1"]
    wl = Workload(max_len=8192, attention="fused", graphs=False)
    caps = {"cuda:0": 70 * GiB, "cuda:1": 6 * GiB}  # the lm_head, a few layers and the reserves; no drafter
    split = place(T, D, devices, wl, caps)
    assert split.fits and split.drafter_stage == 0
    assert split.gpus["cuda:1"]["drafter weights"] == 0
    assert split.gpus["cuda:0"]["drafter weights"] == mem.drafter_weight_bytes(D, "bfloat16")
    assert split.gpus["cuda:1"]["final norm + lm_head"] > 0 and split.gpus["cuda:0"]["embedding"] > 0


def test_nothing_fits_is_reported():
    split = place(T, D, ["cuda:0", "cuda:1"], Workload(max_len=4096), {"cuda:0": 20 * GiB, "cuda:1": 20 * GiB})
    assert not split.fits
    assert set(split.over()) == {"cuda:0", "cuda:1"}
    assert len(split.layer_devices) == T.num_layers


def test_stages_on_one_gpu_share_it():
    """cuda:0,cuda:0: one GPU holds both stages (their weights and state add up, one rope table,
    one forward's activations at a time); the reads still balance between the stages. Both graphed
    (the split's segments, as a split on CUDA runs by default)."""
    wl = Workload(max_len=32768, graphs=True)
    one = place(T, D, ["cuda:0"], wl).gpus["cuda:0"]
    two = place(T, D, ["cuda:0", "cuda:0"], wl)
    assert list(two.gpus) == ["cuda:0"]
    rows = two.gpus["cuda:0"]
    for r in ("GDN weights", "MLP weights", "K/V cache", "GDN states", "GDN tree scratch", "rope tables",
              "drafter weights", "activations", "graph pools"):
        assert rows[r] == one[r], r
    assert abs(two.reads[0] - two.reads[1]) < 2 * GiB
    assert not place(T, D, ["cuda:0", "cuda:0"], wl, {"cuda:0": 60 * GiB}).fits  # the one GPU's capacity holds both


def test_split_layers_is_contiguous_and_keeps_the_device_objects():
    devs = [object(), object()]
    out = split_layers(T, devs, max_len=4096)
    assert len(out) == T.num_layers and out[0] is devs[0] and out[-1] is devs[1]
    first_of_second = out.index(devs[1])
    assert all(d is devs[1] for d in out[first_of_second:])
    assert split_layers(T, devs[:1]) == [devs[0]] * T.num_layers

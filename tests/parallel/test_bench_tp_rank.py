"""scripts/bench_tp_rank.py's measurement and projection, run on CPU with a tiny hybrid pair (the
GPU run differs only in the device, bf16, CUDA graphs and compiled layers)."""

from __future__ import annotations

import pytest

from ddtree.model.config import TargetConfig
from ddtree.model.synthetic import tiny_drafter_config, tiny_hybrid_config
from scripts.bench_tp_rank import ALLREDUCE_US, measure, parse_costs, project, report


def test_parse_costs():
    assert parse_costs("nvlink,oneshot-pcie,nccl-pcie") == {"nvlink": 6.0, "oneshot-pcie": 5.0, "nccl-pcie": 20.0}
    assert parse_costs("12, pcie4=9.5") == {"12us": 12.0, "pcie4": 9.5}
    with pytest.raises(SystemExit):
        parse_costs("infiniband")
    assert set(ALLREDUCE_US) == {"nvlink", "oneshot-pcie", "nccl-pcie"}


def test_measure_and_project_on_cpu(one_thread, capsys):
    raw_t = tiny_hybrid_config(vocab=96, heads=4, kv_heads=2, gdn_k_heads=2, gdn_v_heads=4, inter=96)
    raw_d = tiny_drafter_config(raw_t)
    cfg = TargetConfig.from_dict(raw_t)
    res = measure(raw_t, raw_d, 2, [24, 40], tokens=10, budget=4, full=True, device="cpu")
    for key in ("ctx24", "ctx40"):
        s, f = res["shard"][key], res["full"][key]
        assert "error" not in s and "error" not in f, (s, f)
        assert s["ar_ms_per_token"] > 0 and s["dflash_round_ms"] > 0 and s["ddtree_round_ms"] > 0
        assert s["ddtree_rounds"] >= 1 and f["ar_ms_per_token"] > 0
    costs = parse_costs("nvlink,nccl-pcie")
    proj = project(res, cfg, 2, costs, copy_GBps=None)
    n = 2 * cfg.num_layers + 1
    assert proj["collectives_per_step"] == n and proj["collectives_per_round"] == n + 1
    for key, row in proj["contexts"].items():
        s, f = res["shard"][key], res["full"][key]
        for name, us in costs.items():
            p = row["projected"][name]
            assert p["ar_ms_per_token"] == pytest.approx(s["ar_ms_per_token"] + n * us * 1e-3)
            assert p["ar_speedup_vs_1gpu"] == pytest.approx(f["ar_ms_per_token"] / p["ar_ms_per_token"])
            assert p["ddtree_round_ms"] == pytest.approx(s["ddtree_round_ms"] + (n + 1) * us * 1e-3)
        assert row["shard_over_full"] == pytest.approx(s["ar_ms_per_token"] / f["ar_ms_per_token"])
        assert row["shard_bytes_per_token"] < row["full_bytes_per_token"]
    doc = {"kind": "tp_rank", "world": 2, "budget": 4, "gpu": "cpu", "date": "-", "preset": "tiny", "copy_GBps": 1.0,
           **res, "projection": proj}
    report(doc)
    text = capsys.readouterr().out
    assert "PROJECTED TP=2" in text and "nccl-pcie 20us" in text and "published" in text

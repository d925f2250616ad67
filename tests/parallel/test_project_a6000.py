"""scripts/project_a6000.py on small synthetic result files: every projected figure recomputed here
from the stated model (H200 time x copy bandwidth / A6000 bandwidth, scaled by bytes, plus the
collectives), and once on the committed H200 results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree.model.config import TargetConfig
from ddtree.model.presets import qwen36_27b_config
from ddtree.parallel.sharding import rank_bytes_per_token
from scripts.project_a6000 import PUBLISHED, main

REPO = Path(__file__).resolve().parents[2]
CFG = TargetConfig.from_dict(qwen36_27b_config())
ENGINE = {"gpu": "NVIDIA H200", "copy_GBps": 4000.0,
          "main": {"preset": "qwen3.6-27b", "weight_bytes_per_token": 1,
                   "ctx1024": {"ar_ms_per_token": 16.0,
                               "rounds": {"dflash:15": {"round_ms": 20.0}, "ddtree:32": {"round_ms": 24.0}}}},
          "codepair": {"ar": {"accept": 1.0}, "dflash": {"accept": 1.5}, "ddtree:32": {"accept": 2.0}}}
SPLIT = {"gpu": "NVIDIA H200", "n_gpus": 2, "copy_GBps": 4000.0,
         "results": {"1 GPU": {"ar_ms_per_token": 16.0}, "layer split": {"ar_ms_per_token": 100.0, "ddtree32_round_ms": 30.0},
                     "TP=2": {"ar_ms_per_token": 11.0}}}
TP_RANK = {"kind": "tp_rank", "preset": "qwen3.6-27b", "world": 2, "budget": 32, "copy_GBps": 3000.0,
           "shard": {"ctx1024": {"ar_ms_per_token": 9.0, "dflash_round_ms": 12.0, "ddtree_round_ms": 14.0},
                     "ctx32768": {"ar_ms_per_token": 10.0, "dflash_round_ms": 13.0, "ddtree_round_ms": 16.0}}}


def _files(tmp_path, **docs):
    paths = []
    for name, doc in docs.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(doc))
        paths.append(str(p))
    return paths


def _row(doc, setup, ctx):
    return next(r for r in doc["rows"] if r["setup"].startswith(setup) and r["ctx"] == ctx)


def _coll_ms(us, T, drafter_rows=0, link=20.0):
    """2 x 64 all-reduces of T x 5120 bf16 + a [T, 248320 / 2] gather (+ the drafter's rows), us + bytes / link."""
    per = lambda nbytes: us + nbytes / (link * 1e9) * 1e6  # noqa: E731
    total = 128 * per(T * 5120 * 2) + per(T * 124160 * 2) + (per(drafter_rows * 124160 * 2) if drafter_rows else 0)
    return total / 1e3


def step_bytes(world, ctx):
    return rank_bytes_per_token(CFG, world, context=ctx)["step_bytes"]


def test_projection_from_engine_and_split(tmp_path, capsys):
    out = tmp_path / "proj.json"
    doc = main(_files(tmp_path, engine=ENGINE, split=SPLIT) + ["--out", str(out)])
    assert json.loads(out.read_text())["rows"] == doc["rows"]
    scale = 4000.0 / 768.0  # same context: the bytes cancel, e = B / (t x copy)
    split = _row(doc, "layer split", 1024)
    assert split["ar_ms"] == 100.0 and "host-bound" in split["ar_source"]  # the H200 split (100) > 16 x 5.2
    assert split["ddtree_ms"] == pytest.approx(24.0 * scale)  # GPU-bound (125 ms) > the split's 30 ms
    assert split["dflash_ms"] == pytest.approx(20.0 * scale)
    far = _row(doc, "layer split", 32768)  # extrapolated by bytes at the 1K efficiency
    assert far["ar_ms"] == pytest.approx(16.0 * scale * step_bytes(1, 32768) / step_bytes(1, 1024))
    assert "bytes-scaled" in far["ar_source"]
    tp = _row(doc, "TP=2, nccl", 1024)  # no shard measured: the rank's bytes at the one-GPU efficiency
    shard_ar = 16.0 * scale * step_bytes(2, 1024) / step_bytes(1, 1024)
    assert tp["ar_ms"] == pytest.approx(shard_ar + _coll_ms(20.0, 1))
    assert tp["ddtree_collectives_ms"] == pytest.approx(_coll_ms(20.0, 33, 15))
    assert _row(doc, "TP=2, oneshot", 1024)["dflash_collectives_ms"] == pytest.approx(_coll_ms(5.0, 16, 15))
    chain, tree = PUBLISHED["chain_accept"], PUBLISHED["chain_accept"] * (1 + PUBLISHED["tree_gain"])
    assert tp["dflash_tok_s_published"] == pytest.approx(chain * 1e3 / tp["dflash_ms"])
    assert tp["ddtree_tok_s_published"] == pytest.approx(tree * 1e3 / tp["ddtree_ms"])
    assert tp["ddtree_tok_s_codepair"] == pytest.approx(2.0 * 1e3 / tp["ddtree_ms"])
    v = doc["verdict"]
    assert v["above"] == (tp["ddtree_tok_s_published"] > 73.5)
    assert v["accept_needed"] == pytest.approx(73.5 * tp["ddtree_ms"] / 1e3)
    c = doc["cross_check"]
    assert c["implied_us_per_collective"] == pytest.approx((11.0 - 16.0 * step_bytes(2, 1024) / step_bytes(1, 1024))
                                                           / 129 * 1e3)
    text = capsys.readouterr().out
    assert "PROJECTION, not a measurement" in text and "assumptions:" in text and "PUBLISHED" in text
    assert "ONE-GPU efficiency" in text  # says that the shard was not measured


def test_projection_uses_the_measured_shard(tmp_path):
    doc = main(_files(tmp_path, engine=ENGINE, tp=TP_RANK))
    scale = 3000.0 / 768.0
    for ctx, key in ((1024, "ctx1024"), (32768, "ctx32768")):
        tp = _row(doc, "TP=2, nccl", ctx)
        s = TP_RANK["shard"][key]
        assert tp["ar_ms"] == pytest.approx(s["ar_ms_per_token"] * scale + _coll_ms(20.0, 1))
        assert tp["ddtree_ms"] == pytest.approx(s["ddtree_round_ms"] * scale + _coll_ms(20.0, 33, 15))
        assert "bytes-scaled" not in tp["ar_source"] and "one-GPU efficiency" not in tp["ar_source"]
    assert doc["cross_check"] is None  # no two-GPU result given


def test_rejects_unknown_and_other_preset(tmp_path):
    with pytest.raises(SystemExit):
        main(_files(tmp_path, other={"hello": 1}))
    with pytest.raises(SystemExit):
        main(_files(tmp_path, engine={**ENGINE, "main": {**ENGINE["main"], "preset": "qwen3-8b"}}))


def test_projection_on_the_committed_h200_results():
    doc = main([str(REPO / "results/engine-long-h200.json"), str(REPO / "results/multigpu-h200x2.json")])
    assert len(doc["rows"]) == 6  # layer split, TP=2 NCCL, TP=2 one-shot at 1K and 32K
    for r in doc["rows"]:
        assert all(r[f"{u}_ms"] > 0 for u in ("ar", "dflash", "ddtree")), r
        assert r["ar_tok_s"] < 1e3 / 33.0  # no faster than a card's bandwidth allows for half the bytes
    assert isinstance(doc["verdict"]["above"], bool)

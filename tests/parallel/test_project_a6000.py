"""scripts/project_a6000.py on synthetic bench_engine results whose two parts are known: the split,
the two-card fit, the checks and every projected figure recomputed here from the stated model."""

from __future__ import annotations

import json

import pytest

from ddtree.model.presets import PRESETS
from scripts.project_a6000 import (A6000_GBPS, Bytes, collective_ms, default_fixed_scale, fit_two_cards, main,
                                   split)

BY = Bytes(*(f() for f in PRESETS["qwen3.6-27b"]))
# known parts on the source card (ms): GEMMs and fixed part per unit
GEMM = {"ar": 17.0, "dflash": 19.5, "ddtree:32": 20.0}
FIXED = {"ar": 1.5, "dflash": 2.5, "ddtree:32": 4.0}


def _doc(gpu: str, copy: float, contexts=(1024, 32768), profile: bool = True, src_copy: float = 3000.0) -> dict:
    """A bench_engine result whose times follow the model exactly: GEMMs scaled by copy bandwidth
    from the source card's, other bytes over copy bandwidth, the fixed part as it is."""
    ctxs = {}
    for i, L in enumerate(contexts):
        def ms(u):
            return GEMM[u] * src_copy / copy + BY.other(u, L) / (copy * 1e9) * 1e3 + FIXED[u]

        def prof(u):
            return {"us_by_category": {"gemm": GEMM[u] * src_copy / copy * 1e3, "gdn": 500.0}} if profile and i == 0 else None

        r = {"ar_ms": ms("ar"), "rounds": {"dflash:15": {"round_ms": ms("dflash")}, "ddtree:32": {"round_ms": ms("ddtree:32")}}}
        if prof("ar"):
            r["ar_profile_per_step"] = prof("ar")
            r["rounds"]["dflash:15"]["profile_per_round"] = prof("dflash")
            r["rounds"]["ddtree:32"]["profile_per_round"] = prof("ddtree:32")
        ctxs[str(L)] = r
    return {"gpu": gpu, "copy_GBps": copy, "commit": "abc1234", "main": {"preset": "qwen3.6-27b", "contexts": ctxs}}


def _write(tmp_path, **docs):
    paths = []
    for name, doc in docs.items():
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps(doc))
        paths.append(str(p))
    return paths


def test_two_card_fit_recovers_known_bandwidth_and_fixed_parts():
    for bw_ms, fixed, bw1, bw2 in ((17.0, 1.5, 3000.0, 4200.0), (21.0, 6.0, 4200.0, 3000.0), (3.0, 0.2, 900.0, 3350.0)):
        t1, t2 = bw_ms + fixed, bw_ms * bw1 / bw2 + fixed
        f = fit_two_cards(t1, bw1, t2, bw2)
        assert f["bandwidth_ms_1"] == pytest.approx(bw_ms) and f["fixed_ms"] == pytest.approx(fixed)
        assert f["bandwidth_ms_2"] == pytest.approx(bw_ms * bw1 / bw2)


def test_split_is_gemms_plus_other_bytes_and_the_rest_fixed():
    p = split({"ms": 20.0, "gemm_ms": 17.0}, int(3e9), 3000.0)
    assert p["other_ms"] == pytest.approx(1.0) and p["bandwidth_ms"] == pytest.approx(18.0) and p["fixed_ms"] == pytest.approx(2.0)


def test_projection_recovers_the_parts_checks_the_model_and_projects_by_the_stated_formula(tmp_path, capsys):
    out = tmp_path / "proj.json"
    paths = _write(tmp_path, h100=_doc("NVIDIA H100 80GB HBM3", 3000.0),
                   h200=_doc("NVIDIA H200", 4200.0, contexts=(1024, 8192), profile=False))
    doc = main(paths + ["--out", str(out)])
    assert json.loads(out.read_text())["rows"] == doc["rows"]
    for u in GEMM:  # the profile's split is the known one
        assert doc["split"][u]["fixed_ms"] == pytest.approx(FIXED[u])
        assert doc["split"][u]["gemm_ms"] == pytest.approx(GEMM[u])
    assert doc["checks"] and all(abs(c["error"]) < 1e-9 for c in doc["checks"])  # data made by the model: no error
    assert {c["from"] for c in doc["checks"]} == {"same run", "source"}
    assert {f["unit"] for f in doc["fits"]} == set(GEMM)
    for f in doc["fits"]:  # the two-card fit agrees with the profile on consistent data
        assert f["fit_fixed_ms"] == pytest.approx(f["profile_fixed_ms"], abs=1e-6)
    lo, hi = default_fixed_scale("H100")
    assert doc["fixed_scale"] == [pytest.approx(lo), pytest.approx(hi)] and 1.0 < lo < hi < 2.0
    bw_a = A6000_GBPS * 0.9
    for r in doc["rows"]:
        L, s = r["ctx"], r["fixed_scale"]
        tp = r["setup"].startswith("TP=2")
        us = 20.0 if "20 us" in r["setup"] else 5.0
        for u in GEMM:
            want = (GEMM[u] * 3000.0 / bw_a * (BY.weight_share(2) if tp else 1.0)
                    + BY.other(u, L, 2 if tp else 1) / (bw_a * 1e9) * 1e3 + FIXED[u] * s)
            if tp:
                T = {"ar": 1, "dflash": 16, "ddtree:32": 33}[u]
                want += collective_ms(BY.cfg, u, T, 15, us, 20.0)
            assert r["ms"][u] == pytest.approx(want)
        assert r["break_even_gain"]["ddtree:32"] == pytest.approx(r["ms"]["ddtree:32"] / r["ms"]["dflash"] - 1)
    text = capsys.readouterr().out
    assert "PROJECTION, not a measurement" in text and "break-even tree gain" in text


def test_the_fixed_part_does_not_scale_with_bandwidth(tmp_path):
    """Doubling the A6000's bandwidth halves the bandwidth part only: the premium of a tree round
    that is all fixed latency stays, in ms."""
    paths = _write(tmp_path, h100=_doc("NVIDIA H100 80GB HBM3", 3000.0))
    a = main(paths + ["--contexts", "1024", "--fixed-scale", "1,1"])
    b = main(paths + ["--contexts", "1024", "--fixed-scale", "1,1", "--a6000-GBps", str(2 * A6000_GBPS)])
    ra = next(r for r in a["rows"] if r["setup"] == "layer split")
    rb = next(r for r in b["rows"] if r["setup"] == "layer split")
    prem_a = ra["ms"]["ddtree:32"] - ra["ms"]["dflash"]
    prem_b = rb["ms"]["ddtree:32"] - rb["ms"]["dflash"]
    fixed_prem = FIXED["ddtree:32"] - FIXED["dflash"]
    assert prem_a - fixed_prem == pytest.approx(2 * (prem_b - fixed_prem))  # the GEMM premium halves, the fixed one stays


def test_rejects_results_without_a_profile_or_of_another_kind(tmp_path):
    with pytest.raises(SystemExit, match="no input has a profile"):
        main(_write(tmp_path, h200=_doc("NVIDIA H200", 4200.0, profile=False)))
    with pytest.raises(SystemExit, match="not a scripts/bench_engine.py result"):
        main(_write(tmp_path, other={"kind": "tp_rank"}))

"""Plots: three non-empty PNGs from a synthetic result document."""

from __future__ import annotations

import random
import sys

import pytest

from ddtree.errors import DDTreeError
from ddtree.stats import GenerationRecord, RoundRecord, make_run_document, run_metadata, write_json

NAMES = ["speedup_vs_budget.png", "acceptance_hist.png", "stage_times.png"]


def _records(method, budget, mean_acc, seed, n_prompts=2, n_tokens=48):
    rng = random.Random(seed)
    recs = []
    for p in range(n_prompts):
        rounds, made = [], 1
        while made < n_tokens:
            if method == "ar":
                r = RoundRecord(0, 0, 0, [], 1, {"verify": 20.0 + rng.random(), "commit": 0.5})
            else:
                size = 15 if method == "dflash" else budget
                depth = 15 if method == "dflash" else min(15, 2 + int(budget ** 0.5))
                acc = 0
                while acc < depth and rng.random() < (mean_acc - 1) / mean_acc:
                    acc += 1
                ranks = [0 if rng.random() < 0.7 else rng.randint(1, 3) for _ in range(acc)]
                r = RoundRecord(size, depth, acc, ranks, acc + 1,
                                {"draft": 3.0, "tree": 0.01 * size, "verify": 21 + 0.05 * size, "commit": 0.6})
            rounds.append(r)
            made += r.committed
        decode_s = sum(sum(r.times_ms.values()) for r in rounds) / 1000
        recs.append(GenerationRecord(f"p{p}", 50, made, list(range(made)), "x", 0.05, decode_s, 0.06,
                                     method, budget, rounds))
    return recs


def _doc(with_ar=True, budgets=(4, 16, 64)):
    runs = []
    if with_ar:
        runs.append({"method": "ar", "budget": None, "records": _records("ar", None, 1, 0)})
    runs.append({"method": "dflash", "budget": None, "records": _records("dflash", None, 1.65, 1), "block_size": 16})
    for i, b in enumerate(budgets):
        runs.append({"method": "ddtree", "budget": b, "records": _records("ddtree", b, 1.7 + 0.15 * i, 2 + i),
                     "block_size": 16})
    return make_run_document(run_metadata(target="codepair/target", dtype="float32"), runs)


def _check_pngs(paths, tmp_path):
    assert [p.name for p in paths] == NAMES
    for p in paths:
        assert p.parent == tmp_path
        data = p.read_bytes()
        assert len(data) > 5000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_three_pngs(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'ddtree[plot]')")
    from ddtree.app.plot import plot_results

    _check_pngs(plot_results(_doc(), tmp_path), tmp_path)


def test_plot_from_path_and_edge_cases(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'ddtree[plot]')")
    from ddtree.app.plot import plot_results

    path = write_json(_doc(with_ar=False), tmp_path / "r.json")  # no ar: plots tok/s instead
    _check_pngs(plot_results(path, tmp_path), tmp_path)

    ar_only = make_run_document(run_metadata(), [{"method": "ar", "budget": None, "records": _records("ar", None, 1, 0)}])
    out = tmp_path / "ar"
    paths = plot_results(ar_only, out)
    assert all(p.stat().st_size > 0 for p in paths)


def test_plot_rejects_bad_documents(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'ddtree[plot]')")
    from ddtree.app.plot import plot_results

    doc = _doc()
    del doc["runs"][0]["aggregate"]
    with pytest.raises(DDTreeError, match=r"not a ddtree bench document .*runs\[0\]: missing required key 'aggregate'"):
        plot_results(doc, tmp_path)
    with pytest.raises(DDTreeError, match="not found"):
        plot_results(tmp_path / "missing.json", tmp_path)


def test_plot_without_matplotlib(tmp_path, monkeypatch):
    from ddtree.app.plot import plot_results

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(DDTreeError, match=r"matplotlib is not installed: pip install 'ddtree\[plot\]'"):
        plot_results(_doc(), tmp_path)

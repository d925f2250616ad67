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


def _figures(doc, tmp_path):
    """The speedup and the histogram figures (drawn and saved, as plot_results does)."""
    from ddtree.app import plot

    mpl, Figure, Canvas = plot._import_matplotlib()
    with mpl.rc_context(plot._STYLE):
        return (plot._plot_speedup(doc, Figure, Canvas, tmp_path / "s.png"),
                plot._plot_acceptance(doc, Figure, Canvas, tmp_path / "a.png", mpl))


def _texts_inside(fig) -> list[str]:
    """Texts drawn outside the figure (clipped in the PNG)."""
    from matplotlib.text import Text

    fig.canvas.draw()  # lay out at the figure's own dpi (savefig drew at another)
    r = fig.canvas.get_renderer()
    box = fig.bbox
    out = []
    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip():
            e = t.get_window_extent(r)
            if e.x0 < box.x0 - 1 or e.x1 > box.x1 + 1 or e.y0 < box.y0 - 1 or e.y1 > box.y1 + 1:
                out.append(t.get_text())
    return out


def _legend_lists_only_drawn(fig) -> None:
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is None:
            continue
        drawn = {a.get_label() for a in ax.lines + ax.patches if a.get_visible()}
        drawn |= {c.get_label() for c in ax.containers}
        for t in leg.get_texts():
            assert t.get_text() in drawn, t.get_text()


def _generate_auto_doc():
    """What `generate --budget auto --stats-json` writes: one ddtree run, budget null, no ar."""
    recs = _records("ddtree", 32, 2.2, 9)
    for r in recs:
        r.budget = None
        r.rounds[1:3] = [RoundRecord(0, 0, 0, [], 1, {"verify": 20.0}) for _ in range(2)]  # plain steps
    return make_run_document(run_metadata(target="t"), [
        {"method": "ddtree", "budget": None, "budget_setting": "auto", "records": recs, "block_size": 16}])


def test_speedup_figure_two_panels_axis_from_one(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'ddtree[plot]')")
    speed, hist = _figures(_doc(), tmp_path)
    top, bottom = speed.axes  # no twin axis: speedup and acceptance in their own panels
    assert top.get_position().y0 >= bottom.get_position().y1
    lo, hi = top.get_ylim()
    assert lo <= 1.0 <= hi  # the autoregressive line is on the axis
    assert bottom.get_ylim()[0] == 0
    assert [t.get_text() for t in bottom.get_xticklabels()] == ["4", "16", "64"]
    _legend_lists_only_drawn(speed)
    assert _texts_inside(speed) == [] and _texts_inside(hist) == []
    # no run with plain steps: the histograms' legend does not list them
    assert "plain step (no draft)" not in {t.get_text() for leg in hist.legends for t in leg.get_texts()}


def test_generate_auto_document_plots(tmp_path):
    """What generate --budget auto --stats-json writes, also as written before budget_setting and
    the headline keys existed: read as an auto run, one bar per run (not "no ddtree runs"), the
    single-run histogram's title fits, plain steps drawn and listed."""
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'ddtree[plot]')")
    import copy

    from ddtree.stats import validate_document

    doc = _generate_auto_doc()
    validate_document(doc)
    old = copy.deepcopy(doc)
    for run in old["runs"]:
        del run["budget_setting"], run["interrupted"]
        for d in [run["aggregate"], *run["prompts"]]:
            del d["tokens_per_target_forward"], d["num_plain_steps"]
    validate_document(old)
    new_speed, _ = _figures(doc, tmp_path)
    speed, hist = _figures(old, tmp_path)
    for fig in (new_speed, speed):
        assert not any("no ddtree runs" in t.get_text() for ax in fig.axes for t in ax.texts)
        assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["ddtree auto"]
        _legend_lists_only_drawn(fig)
    heights = [[round(p.get_height(), 6) for p in ax.patches] for ax in (new_speed.axes[1], speed.axes[1])]
    assert heights[0] == heights[1]  # the same figures from the older keys
    assert _texts_inside(hist) == [] and _texts_inside(speed) == []
    assert "plain step (no draft)" in {t.get_text() for leg in hist.legends for t in leg.get_texts()}


def test_plot_cli_gzip_default_folder_and_bad_out(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install 'ddtree[plot]')")
    from typer.testing import CliRunner

    from ddtree.app.cli import app

    path = write_json(_doc(budgets=(8,)), tmp_path / "bench.json.gz")
    r = CliRunner().invoke(app, ["plot", str(path)])
    assert r.exit_code == 0, r.stderr
    assert [line for line in r.stdout.splitlines()] == [str(tmp_path / "bench-plots" / n) for n in NAMES]
    assert f"created folder {tmp_path / 'bench-plots'} for --out" in r.stderr  # a folder nobody named: said so
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = CliRunner().invoke(app, ["plot", str(path), "--out", str(afile)])
    assert r.exit_code == 2 and r.stderr.startswith("error: --out ") and len(r.stderr.splitlines()) == 1
    assert "is a file" in r.stderr

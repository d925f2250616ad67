"""``ddtree plot``: figures from a ``ddtree.stats/1`` result document (matplotlib optional).

:func:`plot_results` writes three PNGs:

* ``speedup_vs_budget.png``: decode-throughput speedup over ``ar`` against the DDTree budget, the
  DFlash chain as a horizontal line, and mean acceptance length on a second axis;
* ``acceptance_hist.png``: the distribution of per-round acceptance lengths, one panel per
  speculative run;
* ``stage_times.png``: stacked bars of the draft / tree / verify / commit time, per round and per
  generated token, for every run.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

from ddtree.errors import DDTreeError
from ddtree.stats import STAGES, read_json, validate_document

_STYLE = {
    "font.size": 11,
    "axes.titlesize": 13,
    "axes.titleweight": "bold",
    "axes.labelsize": 12,
    "xtick.labelsize": 10.5,
    "ytick.labelsize": 10.5,
    "legend.fontsize": 10,
    "legend.frameon": False,
    "figure.titlesize": 14,
    "figure.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linestyle": "-",
    "axes.axisbelow": True,
    "savefig.dpi": 150,
}

_C_DDTREE = "#1f5fa8"
_C_DFLASH = "#e07b00"
_C_AR = "#6b6b6b"
_C_ACC = "#2a9d5c"
_STAGE_COLORS = {"draft": "#e07b00", "tree": "#8e5cc2", "verify": "#1f5fa8", "commit": "#2a9d5c"}
_EXTRA_COLORS = ["#c0392b", "#7f8c8d", "#b8860b", "#17becf"]


def _import_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise DDTreeError("matplotlib is not installed: pip install 'ddtree[plot]'") from None
    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    return matplotlib, Figure, FigureCanvasAgg


# --------------------------------------------------------------------------------------------
# helpers over the document
# --------------------------------------------------------------------------------------------


def _label(run: dict) -> str:
    if run["method"] == "ddtree" and run.get("budget_setting") == "auto":
        return "ddtree auto"
    if run["method"] == "ddtree" and run.get("budget") is not None:
        return f"ddtree {run['budget']}"
    if run.get("budget") is not None and run["method"] != "ar":
        return f"{run['method']} {run['budget']}"
    return run["method"]


def _order(run: dict) -> tuple:
    rank = {"ar": 0, "dflash": 1, "ddtree": 2}.get(run["method"], 3)
    return (rank, run["method"], run.get("budget") or 0)


def _ar_rate(runs: list[dict]) -> float | None:
    for r in runs:
        if r["method"] == "ar" and r["aggregate"]["decode_tok_s"] > 0:
            return float(r["aggregate"]["decode_tok_s"])
    return None


def _speedup(run: dict, ar_rate: float | None) -> float | None:
    if ar_rate:
        return run["aggregate"]["decode_tok_s"] / ar_rate
    s = run.get("speedup_vs_ar")
    return float(s) if s is not None else None


def _subtitle(doc: dict) -> str:
    meta = doc.get("metadata", {})
    bits = []
    target = meta.get("target")
    if target:
        t = str(target).rstrip("/\\")
        if t.startswith((".", "/", "~")) or os.path.isabs(t) or Path(t).exists():
            t = "/".join(Path(t).parts[-2:])  # a local folder: its last two components
        bits.append(t)
    for key in ("dtype",):
        if meta.get(key):
            bits.append(str(meta[key]))
    gpus = meta.get("gpus")
    if gpus:
        names = sorted(set(gpus))
        bits.append(", ".join(f"{gpus.count(n)}x {n}" if gpus.count(n) > 1 else n for n in names))
    runs = doc.get("runs", [])
    if runs:
        bits.append(f"{runs[0]['aggregate']['num_prompts']} prompts")
    return "  ·  ".join(bits)


def _new_figure(Figure, FigureCanvasAgg, size):
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


# --------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------


def _plot_speedup(doc: dict, Figure, Canvas, path: Path) -> None:
    runs = sorted(doc["runs"], key=_order)
    ar_rate = _ar_rate(runs)
    trees = [r for r in runs if r["method"] == "ddtree" and r.get("budget") is not None]
    trees.sort(key=lambda r: r["budget"])
    chain = next((r for r in runs if r["method"] == "dflash"), None)

    have_speedup = ar_rate is not None or all(
        r.get("speedup_vs_ar") is not None for r in trees + ([chain] if chain else [])
    )

    def value(r):
        return _speedup(r, ar_rate) if have_speedup else r["aggregate"]["decode_tok_s"]

    fig = _new_figure(Figure, Canvas, (9, 5.4))
    ax = fig.add_subplot()
    ax2 = ax.twinx()
    ax2.spines["right"].set_visible(True)
    ax2.grid(False)
    handles = []

    if trees:
        xs = [r["budget"] for r in trees]
        ys = [value(r) for r in trees]
        (h,) = ax.plot(xs, ys, "-o", color=_C_DDTREE, lw=2.4, ms=7, zorder=3,
                       label="DDTree speedup" if have_speedup else "DDTree decode tok/s")
        handles.append(h)
        fmt = "{:.2f}×" if have_speedup else "{:.1f}"
        for x, y in zip(xs, ys):
            ax.annotate(fmt.format(y), (x, y), textcoords="offset points", xytext=(0, 9),
                        ha="center", fontsize=9.5, color=_C_DDTREE, fontweight="bold")
        acc = [r["aggregate"]["mean_acceptance_length"] for r in trees]
        (h2,) = ax2.plot(xs, acc, "--s", color=_C_ACC, lw=1.8, ms=6, alpha=0.9,
                         label="DDTree acceptance length")
        handles.append(h2)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.minorticks_off()
        pad = 2 ** 0.35
        ax.set_xlim(min(xs) / pad, max(xs) * pad)
    else:
        ax.set_xticks([])
        ax.text(0.5, 0.5, "no ddtree runs in this file", transform=ax.transAxes, ha="center",
                va="center", color=_C_AR, fontsize=12)

    auto = next((r for r in runs if r["method"] == "ddtree" and r.get("budget_setting") == "auto"), None)
    if auto is not None and value(auto) is not None:
        v = value(auto)
        txt = f"DDTree --budget auto ({v:.2f}×" if have_speedup else f"DDTree --budget auto ({v:.1f} tok/s"
        h = ax.axhline(v, color=_C_DDTREE, ls="-.", lw=1.6, alpha=0.8,
                       label=txt + f", acceptance length {auto['aggregate']['mean_acceptance_length']:.2f})", zorder=2)
        handles.append(h)
    if chain is not None and value(chain) is not None:
        v = value(chain)
        txt = f"DFlash chain ({v:.2f}×)" if have_speedup else f"DFlash chain ({v:.1f} tok/s)"
        a = chain["aggregate"]["mean_acceptance_length"]
        txt = txt[:-1] + f", acceptance length {a:.2f})"
        h = ax.axhline(v, color=_C_DFLASH, ls="--", lw=2, label=txt, zorder=2)
        handles.append(h)
    if have_speedup:
        h = ax.axhline(1.0, color=_C_AR, ls=":", lw=1.5, label="autoregressive (1×)", zorder=1)
        handles.append(h)

    ax.set_xlabel("tree budget (draft nodes verified per round)")
    ax.set_ylabel("decode speedup over autoregressive" if have_speedup else "decode tokens / s")
    ax2.set_ylabel("mean acceptance length (tokens / round)", color=_C_ACC)
    ax2.tick_params(axis="y", colors=_C_ACC)

    # leave headroom for the value labels and the legend
    lo, hi = ax.get_ylim()
    lo = min(lo, 0.9) if have_speedup else 0.0
    ax.set_ylim(max(0.0, lo), hi + (hi - lo) * 0.12)
    alo, ahi = ax2.get_ylim()
    ax2.set_ylim(min(1.0, alo), ahi + (ahi - alo) * 0.12)

    if not trees and chain is None:
        ax2.set_visible(False)
    ax.set_title("DDTree: " + ("speedup" if have_speedup else "decode throughput") + " vs. tree budget",
                 loc="left")
    sub = _subtitle(doc)
    if sub:
        fig.suptitle(sub, fontsize=10, fontweight="normal", color="#444444", x=0.99, ha="right")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    fig.savefig(path)


def _plot_acceptance(doc: dict, Figure, Canvas, path: Path, mpl) -> None:
    runs = [r for r in sorted(doc["runs"], key=_order) if r["aggregate"]["num_drafts"] > 0]
    if not runs:
        fig = _new_figure(Figure, Canvas, (7, 3.5))
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.5, 0.5, "no speculative (dflash / ddtree) runs in this file",
                ha="center", va="center", fontsize=12, color=_C_AR)
        fig.savefig(path)
        return

    n = len(runs)
    ncols = min(4, n)
    nrows = math.ceil(n / ncols)
    fig = _new_figure(Figure, Canvas, (3.3 * ncols + 0.6, 2.7 * nrows + 1.0))
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
    max_len = max(
        max((int(k) for k in r["aggregate"]["acceptance_length_histogram"]), default=1) for r in runs
    )
    trees = [r for r in runs if r["method"] == "ddtree"]
    cmap = mpl.colormaps["viridis"]

    for i, run in enumerate(runs):
        ax = axes[i // ncols][i % ncols]
        agg = run["aggregate"]
        hist = {int(k): v for k, v in agg["acceptance_length_histogram"].items()}
        total = sum(hist.values()) or 1
        xs = list(range(1, max_len + 1))
        ys = [100.0 * hist.get(x, 0) / total for x in xs]
        if run["method"] == "ddtree":
            j = trees.index(run)
            color = cmap(0.15 + 0.7 * (j / max(1, len(trees) - 1)))
        elif run["method"] == "dflash":
            color = _C_DFLASH
        else:
            color = _C_AR
        ax.bar(xs, ys, width=0.8, color=color, alpha=0.9)
        mean = agg["mean_acceptance_length"]
        ax.axvline(mean, color="#222222", ls="--", lw=1.3)
        ax.set_title(_label(run), fontsize=12, loc="left")
        ax.text(0.97, 0.93, f"mean {mean:.2f}\n{agg['num_drafts']} rounds", transform=ax.transAxes,
                ha="right", va="top", fontsize=9.5,
                bbox=dict(boxstyle="round,pad=0.3", fc="white", ec="#cccccc", alpha=0.9))
        ax.grid(axis="x", visible=False)
    for j in range(n, nrows * ncols):
        axes[j // ncols][j % ncols].axis("off")
    step = 1 if max_len <= 10 else 2 if max_len <= 20 else 4
    axes[0][0].set_xticks(list(range(1, max_len + 1, step)))
    axes[0][0].set_xlim(0.4, max_len + 0.6)
    fig.suptitle("Acceptance length per round (tokens committed, bonus token included)")
    fig.supxlabel("acceptance length")
    fig.supylabel("% of rounds")
    fig.savefig(path)


def _plot_stages(doc: dict, Figure, Canvas, path: Path) -> None:
    runs = sorted(doc["runs"], key=_order)
    stages = list(STAGES)
    for r in runs:
        for s in r["aggregate"]["stage_times_ms"]:
            if s not in stages:
                stages.append(s)
    colors = dict(_STAGE_COLORS)
    for k, s in enumerate(s for s in stages if s not in colors):
        colors[s] = _EXTRA_COLORS[k % len(_EXTRA_COLORS)]

    labels = [_label(r) for r in runs]
    per_round = {s: [r["aggregate"]["stage_times_ms"].get(s, {}).get("mean", 0.0) for r in runs] for s in stages}

    def tokens(r):
        a = r["aggregate"]
        return a["committed_tokens"] or a["new_tokens"] or 0

    per_token = {
        s: [
            (r["aggregate"]["stage_times_ms"].get(s, {}).get("total", 0.0) / tokens(r)) if tokens(r) else 0.0
            for r in runs
        ]
        for s in stages
    }
    # `host` overlaps the device stages (it is the host's own time): not a slice of the stack
    stages = [s for s in stages if any(per_round[s]) and s != "host"] or list(STAGES)

    width = max(8.0, 0.75 * len(runs) * 2 + 3)
    fig = _new_figure(Figure, Canvas, (min(width, 18), 5.2))
    axes = fig.subplots(1, 2)
    xs = list(range(len(runs)))
    for ax, data, title, unit in (
        (axes[0], per_round, "Time per round", "ms / round"),
        (axes[1], per_token, "Time per generated token", "ms / token"),
    ):
        bottom = [0.0] * len(runs)
        for s in stages:
            ax.bar(xs, data[s], bottom=bottom, color=colors[s], width=0.7, label=s,
                   edgecolor="white", linewidth=0.6)
            bottom = [b + v for b, v in zip(bottom, data[s])]
        top = max(bottom) if bottom else 0.0
        for x, b in zip(xs, bottom):
            ax.text(x, b + top * 0.015, f"{b:.1f}" if b >= 10 else f"{b:.2f}", ha="center",
                    va="bottom", fontsize=9)
        ax.set_ylim(0, top * 1.1 if top > 0 else 1)
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, rotation=35, ha="right")
        ax.set_title(title, loc="left")
        ax.set_ylabel(unit)
        ax.grid(axis="x", visible=False)
    handles, hl = axes[0].get_legend_handles_labels()
    fig.legend(handles[::-1], hl[::-1], loc="outside right center", title="stage")
    sub = _subtitle(doc)
    fig.suptitle("Where the decode time goes")
    if sub:
        fig.supxlabel(sub, fontsize=10, color="#444444")
    fig.savefig(path)


def plot_results(doc_or_path: dict | str | os.PathLike, out_dir: str | os.PathLike) -> list[Path]:
    """Write the three figures for a result document (or the path of one) into ``out_dir``."""
    mpl, Figure, Canvas = _import_matplotlib()
    doc: Any = doc_or_path if isinstance(doc_or_path, dict) else read_json(doc_or_path)
    try:
        validate_document(doc)
    except ValueError as e:
        where = "" if isinstance(doc_or_path, dict) else f" '{doc_or_path}'"
        raise DDTreeError(f"results file{where} is not a ddtree bench document ({e}): re-run ddtree bench") from None
    if not doc["runs"]:
        raise DDTreeError("results document has no runs: run ddtree bench with at least one method")

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DDTreeError(f"cannot create plot folder '{out}' ({e.strerror or e}): pick a writable folder") from None

    paths = [out / "speedup_vs_budget.png", out / "acceptance_hist.png", out / "stage_times.png"]
    with mpl.rc_context(_STYLE):
        _plot_speedup(doc, Figure, Canvas, paths[0])
        _plot_acceptance(doc, Figure, Canvas, paths[1], mpl)
        _plot_stages(doc, Figure, Canvas, paths[2])
    return paths

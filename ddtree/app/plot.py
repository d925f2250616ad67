"""``ddtree plot``: figures from a ``ddtree.stats/1`` result document (matplotlib optional).

:func:`plot_results` writes three PNGs:

* ``speedup_vs_budget.png``: two panels over the DDTree budget: decode-throughput speedup over
  ``ar`` (the DFlash chain and ``--budget auto`` as horizontal lines) above; tokens per target
  forward (all rounds, the headline) and the mean acceptance length over the drafted rounds
  below. Without fixed-budget runs (a ``generate --stats-json`` file) one bar per run instead;
* ``acceptance_hist.png``: the distribution of tokens committed per round, one panel per
  speculative run, plain steps (``--budget auto``'s rounds without a draft) stacked apart;
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
from ddtree.stats import STAGES, is_auto, plain_steps, read_json, tokens_per_forward, validate_document

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
    if is_auto(run):
        return "ddtree auto"
    if run["method"] == "ddtree" and run.get("budget") is not None:
        return f"ddtree {run['budget']}"
    if run.get("budget") is not None and run["method"] != "ar":
        return f"{run['method']} {run['budget']}"
    return run["method"]


def _order(run: dict) -> tuple:
    rank = {"ar": 0, "dflash": 1, "ddtree": 2}.get(run["method"], 3)
    return (rank, run["method"], is_auto(run), run.get("budget") or 0)


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


def _value_axis(ax, values: list[float], have_speedup: bool, bars: bool) -> None:
    """Speedup: the axis includes 1x (autoregressive); bars and throughput start at 0."""
    lo = min(values + ([1.0] if have_speedup else [0.0]))
    hi = max(values + ([1.0] if have_speedup else [0.0]))
    pad = max(hi - lo, 0.1 * hi, 0.05) * 0.15
    ax.set_ylim(0.0 if bars or not have_speedup else max(0.0, lo - pad), hi + 2.2 * pad)


def _plot_speedup(doc: dict, Figure, Canvas, path: Path):
    """Two panels over one x axis: speedup (or decode tok/s without an ar run) above, tokens per
    target forward and the drafted-round acceptance length below; nothing drawn over anything."""
    runs = sorted(doc["runs"], key=_order)
    ar_rate = _ar_rate(runs)
    trees = sorted((r for r in runs if r["method"] == "ddtree" and not is_auto(r)), key=lambda r: r["budget"])
    others = [r for r in runs if r["method"] == "dflash" or is_auto(r)]
    have_speedup = ar_rate is not None or (bool(trees + others) and all(
        r.get("speedup_vs_ar") is not None for r in trees + others))

    def value(r):
        return _speedup(r, ar_rate) if have_speedup else r["aggregate"]["decode_tok_s"]

    fig = _new_figure(Figure, Canvas, (9, 7.6))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    ylabel = "decode speedup over autoregressive" if have_speedup else "decode tokens / s"
    fmt = "{:.2f}×" if have_speedup else "{:.0f}"
    if trees:
        _speedup_lines(top, bottom, trees, others, value, fmt, have_speedup)
        bottom.set_xlabel("tree budget (draft nodes verified per round)")
        title = ("speedup" if have_speedup else "decode throughput") + " and acceptance vs. tree budget"
    else:
        _speedup_bars(top, bottom, [r for r in runs if r["method"] != "ar" or not have_speedup], value, fmt, have_speedup)
        title = ("speedup" if have_speedup else "decode throughput") + " and acceptance per run"
    top.set_ylabel(ylabel)
    bottom.set_ylabel("tokens / target forward")
    top.set_title("DDTree: " + title, loc="left")
    sub = _subtitle(doc)
    if sub:
        fig.suptitle(sub, fontsize=10, fontweight="normal", color="#444444", x=0.99, ha="right")
    fig.savefig(path)
    return fig


def _speedup_lines(top, bottom, trees, others, value, fmt, have_speedup) -> None:
    xs = [r["budget"] for r in trees]
    ys = [value(r) for r in trees]
    top.plot(xs, ys, "-o", color=_C_DDTREE, lw=2.4, ms=7, zorder=3,
             label="DDTree, fixed budget" + ("" if have_speedup else " (decode tok/s)"))
    for x, y in zip(xs, ys):
        top.annotate(fmt.format(y), (x, y), textcoords="offset points", xytext=(0, 9), ha="center", fontsize=9.5,
                     color=_C_DDTREE, fontweight="bold")
    flat = list(ys)
    for r in others:
        v = value(r)
        if v is None:
            continue
        auto = is_auto(r)
        color, ls = (_C_DDTREE, "-.") if auto else (_C_DFLASH, "--")
        top.axhline(v, color=color, ls=ls, lw=1.8, alpha=0.85, zorder=2,
                    label=f"{'DDTree --budget auto' if auto else 'DFlash chain'} ({fmt.format(v)})")
        flat.append(v)
    if have_speedup:
        top.axhline(1.0, color=_C_AR, ls=":", lw=1.5, zorder=1, label="autoregressive (1×)")
    _value_axis(top, flat, have_speedup, bars=False)
    top.legend(loc="upper left", ncol=2, fontsize=9)

    tpf = [tokens_per_forward(r["aggregate"]) for r in trees]
    acc = [r["aggregate"]["mean_acceptance_length"] for r in trees]
    bottom.plot(xs, tpf, "-o", color=_C_ACC, lw=2.2, ms=6, zorder=3, label="DDTree tokens per target forward (all rounds)")
    bottom.plot(xs, acc, "--s", color=_C_ACC, lw=1.3, ms=5, alpha=0.6, zorder=2,
                label="DDTree mean acceptance length (drafted rounds)")
    for x, y in zip(xs, tpf):  # below the point, boxed: horizontal lines may pass there
        bottom.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, -16), ha="center", fontsize=9,
                        color=_C_ACC, fontweight="bold", zorder=5,
                        bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.85))
    level = list(tpf) + list(acc)
    for r in others:
        t = tokens_per_forward(r["aggregate"])
        auto = is_auto(r)
        bottom.axhline(t, color=_C_DDTREE if auto else _C_DFLASH, ls="-." if auto else "--", lw=1.5, alpha=0.85,
                       label=f"{'DDTree auto' if auto else 'DFlash chain'} tokens per target forward ({t:.2f})")
        level.append(t)
    bottom.set_ylim(0, max(level + [1.0]) * 1.35)
    bottom.legend(loc="upper left", ncol=2, fontsize=8.5)
    bottom.set_xscale("log", base=2)
    bottom.set_xticks(xs)
    bottom.set_xticklabels([str(x) for x in xs])
    bottom.minorticks_off()
    pad = 2 ** 0.4
    bottom.set_xlim(min(xs) / pad, max(xs) * pad)


def _speedup_bars(top, bottom, runs, value, fmt, have_speedup) -> None:
    """No fixed-budget ddtree run (a generate document, or only dflash / auto): one bar per run."""
    if not runs:
        top.text(0.5, 0.5, "no speculative runs in this file", transform=top.transAxes, ha="center", va="center",
                 color=_C_AR, fontsize=12)
        top.set_xticks([])
        bottom.set_visible(False)
        return
    xs = list(range(len(runs)))
    colors = [_C_DFLASH if r["method"] == "dflash" else _C_AR if r["method"] == "ar" else _C_DDTREE for r in runs]
    vals = [value(r) or 0.0 for r in runs]
    top.bar(xs, vals, width=0.55, color=colors, zorder=3)
    for x, v in zip(xs, vals):
        top.annotate(fmt.format(v), (x, v), textcoords="offset points", xytext=(0, 4), ha="center", fontsize=10,
                     fontweight="bold")
    if have_speedup:
        top.axhline(1.0, color=_C_AR, ls=":", lw=1.5, zorder=4, label="autoregressive (1×)")
        top.legend(loc="upper left", fontsize=9)
    _value_axis(top, vals, have_speedup, bars=True)
    w = 0.3
    tpf = [tokens_per_forward(r["aggregate"]) or 0.0 for r in runs]
    acc = [r["aggregate"]["mean_acceptance_length"] for r in runs]
    bottom.bar([x - w / 2 for x in xs], tpf, width=w, color=_C_ACC, zorder=3, label="tokens per target forward (all rounds)")
    bottom.bar([x + w / 2 for x in xs], acc, width=w, color=_C_ACC, alpha=0.45, zorder=3,
               label="mean acceptance length (drafted rounds)")
    for x, t, a in zip(xs, tpf, acc):
        bottom.annotate(f"{t:.2f}", (x - w / 2, t), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=9)
        bottom.annotate(f"{a:.2f}", (x + w / 2, a), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=9)
    bottom.set_ylim(0, max(tpf + acc + [1.0]) * 1.4)
    bottom.legend(loc="upper left", ncol=2, fontsize=9)
    bottom.set_xticks(xs)
    bottom.set_xticklabels([_label(r) for r in runs])
    bottom.set_xlim(-0.6, len(runs) - 0.4)
    for ax in (top, bottom):
        ax.grid(axis="x", visible=False)


def _plot_acceptance(doc: dict, Figure, Canvas, path: Path, mpl):
    runs = [r for r in sorted(doc["runs"], key=_order) if r["method"] != "ar" and r["aggregate"]["rounds"] > 0]
    if not runs:
        fig = _new_figure(Figure, Canvas, (7, 3.5))
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.5, 0.5, "no speculative (dflash / ddtree) runs in this file",
                ha="center", va="center", fontsize=12, color=_C_AR)
        fig.savefig(path)
        return fig

    n = len(runs)
    ncols = min(4, n)
    nrows = math.ceil(n / ncols)
    fig = _new_figure(Figure, Canvas, (max(7.0, 3.4 * ncols + 0.8), 2.9 * nrows + 1.5))
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False)
    max_len = max(
        max((int(k) for k in r["aggregate"]["acceptance_length_histogram"]), default=1) for r in runs
    )
    trees = [r for r in runs if r["method"] == "ddtree"]
    cmap = mpl.colormaps["viridis"]
    any_plain = False

    for i, run in enumerate(runs):
        ax = axes[i // ncols][i % ncols]
        agg = run["aggregate"]
        hist = {int(k): v for k, v in agg["acceptance_length_histogram"].items()}
        plain = plain_steps(agg) or 0
        total = (sum(hist.values()) + plain) or 1
        xs = list(range(1, max_len + 1))
        ys = [100.0 * hist.get(x, 0) / total for x in xs]
        if run["method"] == "ddtree":
            j = trees.index(run)
            color = cmap(0.15 + 0.7 * (j / max(1, len(trees) - 1)))
        else:
            color = _C_DFLASH
        ax.bar(xs, ys, width=0.8, color=color, alpha=0.9)
        if plain:  # a plain step commits one token: stacked on length 1, apart in grey
            any_plain = True
            ax.bar([1], [100.0 * plain / total], bottom=[ys[0]], width=0.8, color="#bbbbbb", hatch="//",
                   edgecolor="white", label="plain step (no draft)")
        tpf = tokens_per_forward(agg)
        ax.axvline(tpf, color="#222222", ls="-", lw=1.3)
        ax.axvline(agg["mean_acceptance_length"], color="#222222", ls="--", lw=1.0, alpha=0.7)
        ax.set_title(_label(run), fontsize=12, loc="left", pad=27)
        facts = (f"{tpf:.2f} tokens / forward, {agg['rounds']} rounds" + (f" ({plain} plain)" if plain else "")
                 + f"\naccept len {agg['mean_acceptance_length']:.2f} over {agg['num_drafts']} drafted rounds")
        ax.text(0.0, 1.02, facts, transform=ax.transAxes, ha="left", va="bottom", fontsize=8.5, color="#444444",
                linespacing=1.3)
        ax.grid(axis="x", visible=False)
        ax.tick_params(labelbottom=True)
    for j in range(n, nrows * ncols):
        axes[j // ncols][j % ncols].axis("off")
    step = 1 if max_len <= 10 else 2 if max_len <= 20 else 4
    axes[0][0].set_xticks(list(range(1, max_len + 1, step)))
    axes[0][0].set_xlim(0.4, max_len + 0.6)
    top = max(max(p.get_y() + p.get_height() for p in ax.patches) for row in axes for ax in row if ax.patches)
    axes[0][0].set_ylim(0, min(100.0, top * 1.1))
    fig.suptitle("Tokens committed per round (bonus token included)")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="#222222", ls="-", lw=1.3, label="tokens per target forward (all rounds)"),
               Line2D([], [], color="#222222", ls="--", lw=1.0, label="mean acceptance length (drafted rounds)")]
    if any_plain:
        from matplotlib.patches import Patch

        handles.append(Patch(facecolor="#bbbbbb", hatch="//", edgecolor="white", label="plain step (no draft)"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles) if ncols > 2 else 1, fontsize=9)
    fig.supylabel("% of rounds")
    fig.savefig(path)
    return fig


def _plot_stages(doc: dict, Figure, Canvas, path: Path):
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
    return fig


def checked_document(doc_or_path: dict | str | os.PathLike, source: str | None = None) -> dict:
    """A result document (or the path of one, .json or .json.gz), validated, with runs."""
    doc: Any = doc_or_path if isinstance(doc_or_path, dict) else read_json(doc_or_path)
    source = source or (None if isinstance(doc_or_path, dict) else str(doc_or_path))
    try:
        validate_document(doc)
    except ValueError as e:
        where = f" '{source}'" if source else ""
        raise DDTreeError(f"results file{where} is not a ddtree bench document ({e}): re-run ddtree bench") from None
    if not doc["runs"]:
        raise DDTreeError("results document has no runs: run ddtree bench with at least one method")
    return doc


def plot_results(doc_or_path: dict | str | os.PathLike, out_dir: str | os.PathLike, source: str | None = None) -> list[Path]:
    """Write the three figures for a result document (or the path of one, .json or .json.gz)
    into ``out_dir``; ``source`` names the file a passed document came from (messages)."""
    mpl, Figure, Canvas = _import_matplotlib()
    doc = checked_document(doc_or_path, source)
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

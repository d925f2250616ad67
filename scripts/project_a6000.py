#!/usr/bin/env python3
"""PROJECT Qwen3.6-27B decode on 2x RTX A6000 (48 GB each, PCIe) from measurements on another
card, each unit of work split into the part that scales with memory bandwidth and the part that
does not. Nothing here is measured on an A6000: the output is a labelled projection. It runs on a
CPU from `scripts/bench_engine.py --profile` results and feeds docs/PERFORMANCE.md's projection
section:

    python scripts/project_a6000.py results/engine-1k-32k-h100.json results/engine-128k-h100.json \
        results/engine-1k-32k-h200.json results/engine-128k-h200.json --out results/projection-2xa6000-h100.json

The split (the first input with a profile, at its profiled context L0), per unit (AR step, dflash
round, ddtree round per budget):
  * bandwidth part = the weight GEMMs' kernel time under the CUDA graph (the profile's `gemm`)
    + the unit's other bytes (K/V at the context, the GDN states read and written, the drafter's
    K/V) over the run's copy bandwidth;
  * fixed part = the unit's wall time - the bandwidth part: launches, the GDN and attention
    kernels' latency, norms, the tree build, the walk, gaps.
On an A6000 the bandwidth part scales by copy bandwidth (source / A6000, --a6000-GBps x
--copy-fraction) and by the bytes a card holds (a TP=2 rank: half the weights, K/V heads and
GDN heads), and the fixed part by a stated range (--fixed-scale LO,HI: by default the source's
clock / the A6000's clock, and SMs x clock; Hopper's figures against the A6000's). TP=2 adds per
forward 2 x layers all-reduces and a logits gather, each a published latency plus its bytes over
the link. The break-even tree gain of ddtree-B is its round / the dflash round - 1: the extra
acceptance a tree needs to pass the chain.

The model is checked before it is trusted: from the split at L0, every other context of the same
file is predicted (fixed part and GEMMs unchanged, the other bytes at that context) and every other
input at L0 (another card: the bandwidth part scaled by copy bandwidth); and where two inputs come
from cards of different copy bandwidth, t = bytes / (bandwidth x e) + c is solved across them per
unit and set beside the profile's split. Each prediction's error is printed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.model.config import DrafterConfig, TargetConfig  # noqa: E402
from ddtree.model.presets import PRESETS  # noqa: E402
from ddtree.parallel.sharding import rank_bytes_per_token  # noqa: E402

# Published figures (../shared/notes/anchors.md), not measurements of ours.
PUBLISHED = {
    "allreduce_us": {"nccl-pcie": 20.0, "oneshot-pcie": 5.0},  # ~8-10 KB all-reduce inside CUDA graphs, PCIe
    "chain_accept": 5.5,  # real Qwen3.6-27B DFlash drafter: about 5-6 tokens per round
    "tree_gain": 0.04,  # branching adds 3.5-4% acceptance on the real pair (vLLM DDTree fork, 2x A6000)
}
A6000_GBPS = 768.0  # datasheet
# SM count and boost clock (GHz), datasheets: the fixed part's range is by clock alone and by SMs x clock
CARDS = {"H100": (132, 1.98), "H200": (132, 1.98), "A6000": (84, 1.80)}


def load(path: Path) -> dict:
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return json.loads(raw)


def card_of(doc: dict) -> str:
    name = doc.get("gpu", "")
    return next((c for c in CARDS if c in name), name or "?")


def default_fixed_scale(card: str) -> tuple[float, float]:
    """(clock ratio, SMs x clock ratio) of `card` over the A6000: the fixed part's stated range."""
    sms, ghz = CARDS.get(card, CARDS["H100"])
    a_sms, a_ghz = CARDS["A6000"]
    return ghz / a_ghz, sms * ghz / (a_sms * a_ghz)


class Bytes:
    """What a unit reads besides the weight GEMMs, per card holding 1/world of the target."""

    def __init__(self, raw_t: dict, raw_d: dict):
        self.cfg = TargetConfig.from_dict(raw_t)
        self.dcfg = DrafterConfig.from_dict(raw_d, self.cfg.num_layers)

    def drafter_kv(self, ctx: int) -> int:
        d = self.dcfg
        rows = sum(min(ctx, w) if w else ctx for w in d.sliding_window)
        return rows * d.num_kv_heads * d.head_dim * 2 * 2

    def other(self, unit: str, ctx: int, world: int = 1) -> int:
        """K/V at ctx + the GDN states read and written (+ the drafter's K/V in a round)."""
        b = rank_bytes_per_token(self.cfg, world, context=ctx)
        return b["kv_bytes"] + b["state_bytes"] + (self.drafter_kv(ctx) if unit != "ar" else 0)

    def weight_share(self, world: int) -> float:
        """A rank's share of the target's weight bytes."""
        return rank_bytes_per_token(self.cfg, world)["weight_bytes"] / rank_bytes_per_token(self.cfg, 1)["weight_bytes"]


def units(ctx_doc: dict) -> dict[str, dict]:
    """{unit: {"ms": wall ms, "gemm_ms": profile's GEMM ms or None}} of one context of a bench_engine result."""
    out = {"ar": {"ms": ctx_doc["ar_ms"], "gemm_ms": _gemm_ms(ctx_doc.get("ar_profile_per_step"))}}
    for k, r in ctx_doc.get("rounds", {}).items():
        name = "dflash" if k.startswith("dflash") else k
        out[name] = {"ms": r["round_ms"], "gemm_ms": _gemm_ms(r.get("profile_per_round"))}
    return out


def _gemm_ms(profile: dict | None) -> float | None:
    return profile["us_by_category"].get("gemm", 0.0) / 1e3 if profile else None


def split(u: dict, other_bytes: int, copy_GBps: float) -> dict:
    """One unit's two parts (ms): bandwidth = GEMMs + other bytes / copy bandwidth; fixed = the rest."""
    bw = u["gemm_ms"] + other_bytes / (copy_GBps * 1e9) * 1e3
    return {"ms": u["ms"], "gemm_ms": u["gemm_ms"], "other_ms": bw - u["gemm_ms"], "bandwidth_ms": bw,
            "fixed_ms": u["ms"] - bw}


def fit_two_cards(t1: float, bw1: float, t2: float, bw2: float) -> dict:
    """t = X / bandwidth + c through two cards' times: X (ms x GB/s, the bytes over the efficiency)
    and c (ms). -> {"bandwidth_ms_1", "bandwidth_ms_2", "fixed_ms"}."""
    x = (t1 - t2) / (1.0 / bw1 - 1.0 / bw2)
    c = t1 - x / bw1
    return {"bandwidth_ms_1": x / bw1, "bandwidth_ms_2": x / bw2, "fixed_ms": c}


def collective_ms(cfg: TargetConfig, unit: str, T: int, drafter_rows: int, us: float, link_GBps: float,
                  world: int = 2) -> float:
    """One unit's collectives under TP: per forward 2 x layers all-reduces of [T, hidden] bf16 and a
    gather of this rank's [T, V/W] logits; a round adds the drafter's [rows, V/W] gather. Each costs
    the published latency plus its bytes over the link."""
    ar_bytes = T * cfg.hidden_size * 2
    gather = T * cfg.vocab_size // world * 2
    ms = 2 * cfg.num_layers * (us + ar_bytes / link_GBps * 1e-3) * 1e-3 + (us + gather / link_GBps * 1e-3) * 1e-3
    if unit != "ar":
        ms += (us + drafter_rows * cfg.vocab_size // world * 2 / link_GBps * 1e-3) * 1e-3
    return ms


def verify_nodes(unit: str, block: int) -> int:
    return 1 if unit == "ar" else block if unit == "dflash" else int(unit.split(":")[1]) + 1


def project(parts: dict, by: Bytes, ctx: int, copy_src: float, bw_a: float, scale: float, setup: str,
            us: float | None, link_GBps: float) -> dict:
    """A6000 ms of every unit under `setup` ("layer split" or "TP=2"), the fixed part times `scale`."""
    world = 2 if setup == "TP=2" else 1
    out = {}
    for name, p in parts.items():
        gemm = p["gemm_ms"] * copy_src / bw_a * (by.weight_share(world) if world > 1 else 1.0)
        other = by.other(name, ctx, world) / (bw_a * 1e9) * 1e3
        ms = gemm + other + p["fixed_ms"] * scale
        if us is not None:
            ms += collective_ms(by.cfg, name, verify_nodes(name, by.dcfg.block_size), by.dcfg.block_size - 1, us,
                                link_GBps)
        out[name] = ms
    return out


def break_even(ms: dict) -> dict:
    """The acceptance gain each ddtree budget needs to pass the dflash chain: its round / dflash's - 1."""
    return {k: v / ms["dflash"] - 1 for k, v in ms.items() if k.startswith("ddtree:") and "dflash" in ms}


def profiled(doc: dict) -> int | None:
    """The first context of a bench_engine result that carries --profile figures, or None."""
    got = [int(k) for k, r in doc["main"]["contexts"].items() if r.get("ar_profile_per_step")]
    return min(got) if got else None


def splits_of(doc: dict, by: Bytes) -> tuple[int, dict] | None:
    """(its profiled context, each unit's split there) of a bench_engine result, or None."""
    l0 = profiled(doc)
    if l0 is None:
        return None
    return l0, {n: split(u, by.other(n, l0), doc["copy_GBps"])
                for n, u in units(doc["main"]["contexts"][str(l0)]).items() if u["gemm_ms"] is not None}


def predict(p: dict, name: str, ctx: int, copy_src: float, copy: float, by: Bytes) -> float:
    """A unit's ms at ctx on a card copying at `copy` GB/s from its split on one copying at copy_src:
    the GEMMs scaled by copy bandwidth, the other bytes at ctx, the fixed part as it is."""
    return p["gemm_ms"] * copy_src / copy + by.other(name, ctx) / (copy * 1e9) * 1e3 + p["fixed_ms"]


def checks(src: tuple[Path, dict], src_parts: dict, docs: list[tuple[Path, dict]], by: Bytes) -> list[dict]:
    """Predictions against measurements: each profiled file's split against its own other contexts
    ("same run"), and the source's split (src_parts) against every other file at every context
    ("source")."""
    rows = []

    def row(kind, path, doc, L, name, u, pred):
        rows.append({"from": kind, "file": path.name, "card": card_of(doc), "commit": doc.get("commit"), "ctx": L,
                     "unit": name, "measured_ms": u["ms"], "predicted_ms": pred, "error": pred / u["ms"] - 1})

    for path, doc in docs:
        own = splits_of(doc, by)
        if own is not None:
            l0, parts = own
            for key, r in doc["main"]["contexts"].items():
                if int(key) != l0:
                    for name, u in units(r).items():
                        if name in parts:
                            row("same run", path, doc, int(key), name, u,
                                predict(parts[name], name, int(key), doc["copy_GBps"], doc["copy_GBps"], by))
        if doc is not src[1]:
            for key, r in doc["main"]["contexts"].items():
                for name, u in units(r).items():
                    if name in src_parts:
                        row("source", path, doc, int(key), name, u,
                            predict(src_parts[name], name, int(key), src[1]["copy_GBps"], doc["copy_GBps"], by))
    return rows


def fits(docs: list[tuple[Path, dict]], src: tuple[Path, dict], l0: int, parts: dict) -> list[dict]:
    """t = bytes / (bandwidth x e) + c per unit across the source and each input of another copy
    bandwidth (5% apart or more) at l0, beside the profile's split (parts: the source's units at l0)."""
    doc0 = src[1]
    rows = []
    for path, doc in docs:
        r = doc["main"]["contexts"].get(str(l0))  # (JSON keys: the contexts as strings)
        if r is None or abs(doc["copy_GBps"] / doc0["copy_GBps"] - 1) < 0.05:
            continue
        for name, u in units(r).items():
            if name not in parts:
                continue
            f = fit_two_cards(parts[name]["ms"], doc0["copy_GBps"], u["ms"], doc["copy_GBps"])
            rows.append({"with": path.name, "card": card_of(doc), "commit": doc.get("commit"), "unit": name,
                         "fit_bandwidth_ms": f["bandwidth_ms_1"], "fit_fixed_ms": f["fixed_ms"],
                         "profile_bandwidth_ms": parts[name]["bandwidth_ms"], "profile_fixed_ms": parts[name]["fixed_ms"]})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", type=Path, help="scripts/bench_engine.py results; the first with --profile "
                                                          "figures gives the split, the others check it")
    ap.add_argument("--contexts", default="1024,32768", help="contexts projected")
    ap.add_argument("--a6000-GBps", type=float, default=A6000_GBPS, help="datasheet bandwidth of one card")
    ap.add_argument("--copy-fraction", type=float, default=0.9,
                    help="A6000 copy bandwidth / datasheet (Hopper cards copy at 0.87-0.91 of theirs)")
    ap.add_argument("--fixed-scale", default=None,
                    help="LO,HI: the fixed part's A6000 / source ratio (default: clock ratio, SMs x clock ratio)")
    ap.add_argument("--link-GBps", type=float, default=20.0, help="assumed PCIe peer-to-peer bandwidth per direction")
    ap.add_argument("--accept-chain", type=float, default=PUBLISHED["chain_accept"])
    ap.add_argument("--tree-gain", type=float, default=PUBLISHED["tree_gain"])
    ap.add_argument("--preset", default="qwen3.6-27b", choices=sorted(PRESETS))
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    docs = [(p, load(p)) for p in a.inputs]
    for p, d in docs:
        if not isinstance(d.get("main", {}).get("contexts"), dict):
            raise SystemExit(f"error: {p} is not a scripts/bench_engine.py result: pass bench_engine's JSON")
        if d["main"].get("preset", a.preset) != a.preset:
            raise SystemExit(f"error: {p} measured {d['main']['preset']}, not {a.preset}: pass --preset {d['main']['preset']}")
    src = next(((p, d) for p, d in docs if profiled(d) is not None), None)
    if src is None:
        raise SystemExit("error: no input has a profile: run scripts/bench_engine.py --profile and pass its JSON first")
    path0, doc0 = src
    mk_t, mk_d = PRESETS[a.preset]
    by = Bytes(mk_t(), mk_d())
    copy_src = doc0["copy_GBps"]
    l0, parts = splits_of(doc0, by)
    card = card_of(doc0)
    lo, hi = (tuple(float(x) for x in a.fixed_scale.split(",")) if a.fixed_scale else default_fixed_scale(card))
    bw_a = a.a6000_GBps * a.copy_fraction
    names = sorted(parts, key=lambda n: (n != "ar", n != "dflash", int(n.split(":")[1]) if ":" in n else 0))

    print(f"== split of each unit on the {card} ({path0.name}, commit {doc0.get('commit')}, {l0 // 1024}K context, "
          f"copy {copy_src:.0f} GB/s): ms")
    print(f"  {'unit':10s} {'wall':>7s} {'GEMMs':>7s} {'other B':>7s} {'= bandw.':>8s} {'fixed':>6s}")
    for n in names:
        p = parts[n]
        print(f"  {n:10s} {p['ms']:7.2f} {p['gemm_ms']:7.2f} {p['other_ms']:7.2f} {p['bandwidth_ms']:8.2f} {p['fixed_ms']:6.2f}")
    chk = checks(src, parts, docs, by)
    if chk:
        print("== the model checked: predicted / measured - 1 (same run: a file's own split at its profiled context; "
              "source: the split above)")
        for c in chk:
            print(f"  {c['from']:8s} {c['file']:24s} {c['card']:5s} {c['commit'] or '?':8s} {c['ctx'] // 1024:4d}K "
                  f"{c['unit']:10s} {c['measured_ms']:7.2f} ms  predicted {c['predicted_ms']:7.2f}  {100 * c['error']:+5.1f}%")
        for kind in ("same run", "source"):
            errs = [abs(c["error"]) for c in chk if c["from"] == kind]
            if errs:
                print(f"  {kind}: largest error {100 * max(errs):.1f}%, median {100 * sorted(errs)[len(errs) // 2]:.1f}%")
    fit = fits(docs, src, l0, parts)
    if fit:
        print(f"== t = bytes / (bandwidth x e) + c across two cards at {l0 // 1024}K, beside the profile's split (ms on the {card})")
        for f in fit:
            print(f"  with {f['with']} ({f['card']}, {f['commit']}): {f['unit']:10s} bandwidth {f['fit_bandwidth_ms']:6.2f} "
                  f"(profile {f['profile_bandwidth_ms']:6.2f})  fixed {f['fit_fixed_ms']:5.2f} (profile {f['profile_fixed_ms']:5.2f})")

    contexts = [int(x) for x in a.contexts.split(",")]
    setups = [("layer split", None)] + [("TP=2", us) for us in PUBLISHED["allreduce_us"].values()]
    rows = []
    accept = {"dflash": a.accept_chain, "ddtree": a.accept_chain * (1 + a.tree_gain)}
    print(f"\n== PROJECTION, not a measurement: {a.preset} bf16 on 2x RTX A6000 ({a.a6000_GBps:.0f} GB/s x {a.copy_fraction:g} "
          f"copy), batch 1, from the {card} split; fixed part x {lo:.2f} (clock) to x {hi:.2f} (SMs x clock)")
    print(f"  {'setup':22s} {'ctx':>4s} {'fixed x':>7s} | " + " ".join(f"{n:>10s}" for n in names)
          + " | break-even tree gain: " + " ".join(n.split(":")[1] for n in names if n.startswith("ddtree:")))
    for ctx in contexts:
        for setup, us in setups:
            label = setup + ("" if us is None else f", {us:g} us all-reduce")
            for scale in (lo, hi):
                ms = project(parts, by, ctx, copy_src, bw_a, scale, setup, us, a.link_GBps)
                be = break_even(ms)
                rows.append({"setup": label, "ctx": ctx, "fixed_scale": scale, "ms": ms, "break_even_gain": be,
                             "tok_s": {n: (1 if n == "ar" else accept["dflash" if n == "dflash" else "ddtree"]) * 1e3 / v
                                       for n, v in ms.items()}})
                print(f"  {label:22s} {ctx // 1024:3d}K {scale:7.2f} | " + " ".join(f"{ms[n]:10.2f}" for n in names)
                      + " | " + " ".join(f"{100 * be[n]:+.1f}%" for n in names if n in be))
    assumptions = [
        f"the split is of the {card} at commit {doc0.get('commit')} ({path0.name}); GEMM kernel time from torch.profiler "
        "under the CUDA graph; other bytes from the configs (K/V, GDN states read and written, the drafter's K/V)",
        f"A6000 copy bandwidth {bw_a:.0f} GB/s ({a.a6000_GBps:.0f} datasheet x {a.copy_fraction:g}); the GEMMs reach the "
        "same fraction of copy bandwidth as on the source card",
        f"the fixed part x {lo:.2f} to x {hi:.2f}: the source's boost clock / the A6000's, and SMs x clock (datasheets: "
        f"{card} {CARDS.get(card, ('?', '?'))[0]} SMs at {CARDS.get(card, ('?', '?'))[1]} GHz, A6000 84 at 1.80)",
        "a TP=2 rank: half the weight, K/V and GDN bytes, the whole fixed part (it launches every kernel), plus "
        f"{2 * by.cfg.num_layers} all-reduces and a logits gather per forward at a PUBLISHED latency (NCCL ~20 us, one-shot "
        f"~5 us over PCIe) + bytes / {a.link_GBps:g} GB/s",
        "layer split: every byte through one card at a time, the whole fixed part; the activation hop left out",
        f"tok/s: PUBLISHED acceptance, chain {accept['dflash']:.2f} tokens per round, tree +{a.tree_gain:.0%}",
    ]
    print("assumptions:\n" + "\n".join(f"  {i + 1}. {s}" for i, s in enumerate(assumptions)))
    doc = {"kind": "projection_2xA6000", "preset": a.preset, "source": {"file": path0.name, "card": card,
           "commit": doc0.get("commit"), "context": l0, "copy_GBps": copy_src}, "split": parts, "checks": chk,
           "fits": fit, "a6000_GBps": a.a6000_GBps, "copy_fraction": a.copy_fraction, "fixed_scale": [lo, hi],
           "link_GBps": a.link_GBps, "accept": accept, "published": PUBLISHED, "rows": rows, "assumptions": assumptions}
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=2))
    return doc


if __name__ == "__main__":
    main()

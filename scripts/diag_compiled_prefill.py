#!/usr/bin/env python3
"""Where the compiled prefill layers leave the eager ones: the case of
tests/test_gpu.py::test_cuda_compiled_prefill_matches_eager (tests/model/test_compile.py's
check_compiled_prefill_matches_eager: the tiny hybrid pair, float32, a 41-token prompt in chunks
of 16, 16 and 9), under several settings, one fresh compile each:

    as found       the process's own flags (what the test sees)
    tf32 off       every float32 matmul / cuDNN switch to IEEE float32 (old and new torch APIs)
    tf32 on        the same switches to TF32: the size of a TF32 difference, for comparison
    fla off        the GDN chain through the torch twin (chain_chunked), not fla's chunk kernel
    no padding     inductor's shape_padding off (padded matmuls take other cuBLAS kernels)
    eager twice    eager against eager: the run-to-run floor
    sensitivity    eager against eager with every layer's input nudged by 1e-7 of its largest
                   value (about one float32 rounding): how far this model carries a rounding
                   difference, the floor of any end-to-end comparison of two float32 paths

Per setting: the test's figures (max |compiled - eager| / max |eager| of the logits, taps, states
and K/V rows, against its 5e-5), then per layer the difference carried in from the layers before
("carried") and the layer's own (compiled against eager on the same input and state: "own"),
and for the layer with the largest own difference its pieces alone (the fused projections, the
norms, the MLP) compiled against eager on that input. A float32 path should stay near 1e-6;
a TF32 one (10-bit mantissa) shows ~1e-4, and a TF32 step downstream turns any input difference
into one of that size.

    python scripts/diag_compiled_prefill.py                 # CUDA if present, else CPU
    python scripts/diag_compiled_prefill.py --only "as found" "tf32 off" --json diag.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.model import layers as layers_mod  # noqa: E402
from ddtree.decode.random_pair import build_random_pair  # noqa: E402
from ddtree.options import Options  # noqa: E402

TOL = 5e-5  # the test's
NAMES = ("logits", "taps", "recurrent states", "conv states", "K cache", "V cache")
SETTINGS = ("as found", "tf32 off", "tf32 on", "fla off", "no padding", "eager twice", "sensitivity")
NUDGE = 1e-7  # relative to a layer input's largest value


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (the test's measure)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def flags() -> dict:
    """Every float32-precision switch torch has here (old and new APIs)."""
    out = {"torch": torch.__version__, "float32_matmul_precision": torch.get_float32_matmul_precision(),
           "cuda.matmul.allow_tf32": torch.backends.cuda.matmul.allow_tf32,
           "cudnn.allow_tf32": torch.backends.cudnn.allow_tf32}
    for name in ("backends.fp32_precision", "backends.cuda.matmul.fp32_precision", "backends.cudnn.fp32_precision",
                 "backends.cudnn.conv.fp32_precision"):
        obj = torch
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
            out[name] = obj
        except AttributeError:
            pass
    try:
        import torch._inductor.config as ic

        out["inductor.shape_padding"] = ic.shape_padding
        out["inductor.max_autotune"] = ic.max_autotune
        out["inductor.emulate_precision_casts"] = ic.emulate_precision_casts
    except Exception:
        pass
    return out


def set_tf32(on: bool):
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    torch.set_float32_matmul_precision("high" if on else "highest")
    for parent in (torch.backends.cuda.matmul, torch.backends.cudnn):
        if hasattr(parent, "fp32_precision"):
            with contextlib.suppress(Exception):
                parent.fp32_precision = "tf32" if on else "ieee"


@contextlib.contextmanager
def setting(name: str, tgt):
    saved = flags()
    import torch._inductor.config as ic

    pad = ic.shape_padding
    kernels = dict(tgt.kernels)
    try:
        if name == "tf32 off":
            set_tf32(False)
        elif name == "tf32 on":
            set_tf32(True)
        elif name == "fla off":
            tgt.use(Options(fla=False))
        elif name == "no padding":
            ic.shape_padding = False
        yield
    finally:
        set_tf32(saved["cuda.matmul.allow_tf32"])
        torch.set_float32_matmul_precision(saved["float32_matmul_precision"])
        torch.backends.cudnn.allow_tf32 = saved["cudnn.allow_tf32"]
        ic.shape_padding = pad
        tgt.kernels = kernels


def fresh_compile():
    torch._dynamo.reset()
    layers_mod._COMPILED.clear()


def live(layer, c, T: int) -> list[torch.Tensor]:
    """The state a layer's prefill writes: a GDN layer's conv and recurrent states, an attention
    layer's K/V rows of the chunk."""
    m = layer.mixer
    if layer.kind == "linear_attention":
        return [m.conv_state, m.rec_state]
    return [m.k_cache[c.start:c.start + T], m.v_cache[c.start:c.start + T]]


@torch.no_grad()
def run(tgt, prompt, compiled: bool, own: bool, nudge: bool = False):
    """Prefill in chunks of 16 as the test does; -> (the test's tensors, per layer [(chunk start,
    out, own difference | None, input)]). nudge: each layer's input gets seeded noise of NUDGE x
    its largest value first."""
    gen = torch.Generator(device=prompt.device).manual_seed(0)
    import ddtree.model.target as tm

    per_layer: dict[int, list] = {}
    orig = tm.TargetModel._prefill_layer

    def hooked(self, i, x, c):
        layer = self.layers[i]
        if nudge:
            x = x + NUDGE * x.abs().max() * torch.randn(x.shape, generator=gen, device=x.device, dtype=x.dtype)
        before = [t.clone() for t in live(layer, c, x.shape[0])] if own else None
        out = orig(self, i, x, c)
        own_diff = None
        if own and compiled:  # the same input and state through the eager twin
            after = [t.clone() for t in live(layer, c, x.shape[0])]
            for t, v in zip(live(layer, c, x.shape[0]), before):
                t.copy_(v)
            ref = tm._prefill_layer(layer, x, c)
            own_diff = max([rel(out, ref)] + [rel(a, t) for a, t in zip(after, live(layer, c, x.shape[0]))])
            for t, v in zip(live(layer, c, x.shape[0]), after):
                t.copy_(v)  # carry on with the compiled run's state, as the test does
        per_layer.setdefault(i, []).append((c.start, out.clone(), own_diff, x.clone()))
        return out

    tm.TargetModel._prefill_layer = hooked
    try:
        tgt.reset()
        tgt.compile_layers = compiled
        logits, taps = tgt.prefill(prompt, chunk=16)
    finally:
        tm.TargetModel._prefill_layer = orig
        tgt.compile_layers = False
    g = next(iter(tgt.gdn_groups.values()))
    kv = next(iter(tgt.kv_stacks.values()))
    n = prompt.shape[0]
    return (logits, taps, g.state.clone(), g.conv.clone(), kv[0][:, :n].clone(), kv[1][:, :n].clone()), per_layer


@torch.no_grad()
def pieces(layer, x) -> dict[str, float]:
    """The layer's pieces alone on its input x [T, hidden]: compiled against eager."""
    out = {}
    W = [(n, t) for n, t in vars(layer.mixer).items() if n.startswith("_w") and torch.is_tensor(t)]
    W += [(f"mlp.{n}", t) for n, t in vars(layer.mlp).items() if n.startswith("_w") and torch.is_tensor(t)]
    lin = torch.compile(lambda a, w: F.linear(a, w), dynamic=True)
    h = layer.input_layernorm(x)
    for n, w in W:
        a = h if w.shape[1] == x.shape[1] else torch.randn(x.shape[0], w.shape[1], device=x.device, dtype=x.dtype)
        out[f"linear {n} {tuple(w.shape)}"] = rel(lin(a, w), F.linear(a, w))
    for n, fn in (("input_layernorm", layer.input_layernorm), ("post_attention_layernorm", layer.post_attention_layernorm),
                  ("mlp", layer.mlp)):
        out[n] = rel(torch.compile(fn, dynamic=True)(x), fn(x))
    if torch.cuda.is_available() and x.is_cuda:  # cuBLAS against a float64 product: is the eager matmul float32?
        for n, w in W[:1]:
            exact = F.linear(h.double(), w.double())
            out[f"eager linear {n} vs float64"] = rel(F.linear(h, w), exact)
            out[f"compiled linear {n} vs float64"] = rel(lin(h, w), exact)
    return out


def diagnose(name: str, device: str) -> dict:
    dec, raw = build_random_pair("hybrid", 5, device=device)
    tgt = dec.target
    prompt = torch.randint(2, raw["text_config"]["vocab_size"], (41,), generator=torch.Generator().manual_seed(3))
    prompt = prompt.to(device)
    with setting(name, tgt):
        fresh_compile()
        ref, ref_layers = run(tgt, prompt, False, False)
        eager = name in ("eager twice", "sensitivity")
        got, got_layers = run(tgt, prompt, not eager, not eager, nudge=name == "sensitivity")
        fla_info = {}
        if device.startswith("cuda"):
            from ddtree.ops import fla

            g = next(iter(tgt.gdn_groups.values()))
            fla_info = {"fla importable": fla._kernel() is not None,
                        "fla in float32 (self-check)": fla.available(torch.device(device), torch.float32, g.h, g.dk, g.dv),
                        "kernels.fla": tgt.kernels[0].fla}
        test = {n: rel(b, a) for n, a, b in zip(NAMES, ref, got)}
        rows = []
        for i in sorted(ref_layers):
            carried = max(rel(b[1], a[1]) for a, b in zip(ref_layers[i], got_layers[i]))
            own = [b[2] for b in got_layers[i] if b[2] is not None]
            rows.append({"layer": i, "kind": tgt.layers[i].kind, "carried": carried, "own": max(own) if own else None,
                         "own per chunk": own})
        worst = max(rows, key=lambda r: r["own"] or 0.0)
        parts = {}
        if worst["own"] is not None:
            x = got_layers[worst["layer"]][0][3]
            parts = pieces(tgt.layers[worst["layer"]], x)
        return {"setting": name, "flags": flags(), "kernels": dataclasses.asdict(tgt.kernels[0]), **fla_info,
                "test": test, "passes": all(v <= TOL for v in test.values()), "layers": rows,
                "worst layer": worst["layer"], "its pieces": parts}


def show(r: dict) -> None:
    print(f"\n=== {r['setting']}: {'passes' if r['passes'] else 'FAILS'} the test's {TOL:g}")
    print("  flags: " + ", ".join(f"{k} {v}" for k, v in r["flags"].items()))
    for k in ("fla importable", "fla in float32 (self-check)", "kernels.fla"):
        if k in r:
            print(f"  {k}: {r[k]}")
    print(f"  prefill attention {r['kernels'].get('prefill_attention')}, attention {r['kernels'].get('attention')}")
    print("  test: " + ", ".join(f"{k} {v:.2e}" for k, v in r["test"].items()))
    print(f"  {'layer':>5} {'kind':<18}{'carried':>10}{'own':>10}  own per chunk")
    for row in r["layers"]:
        own = "-" if row["own"] is None else f"{row['own']:.2e}"
        chunks = " ".join(f"{v:.1e}" for v in row["own per chunk"])
        print(f"  {row['layer']:>5} {row['kind']:<18}{row['carried']:>10.2e}{own:>10}  {chunks}")
    if r["its pieces"]:
        print(f"  layer {r['worst layer']}'s pieces, compiled vs eager on its input:")
        for k, v in r["its pieces"].items():
            print(f"    {k:<52}{v:.2e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", nargs="*", choices=SETTINGS, default=list(SETTINGS))
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    if a.device.startswith("cuda"):
        print(f"{torch.cuda.get_device_name(0)}", file=sys.stderr)
    out = []
    for name in a.only:
        r = diagnose(name, a.device)
        show(r)
        out.append(r)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2, default=str))


if __name__ == "__main__":
    main()

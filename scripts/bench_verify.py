#!/usr/bin/env python3
"""What a verify of T nodes costs besides attention, on the Qwen3.6-27B shapes:

1. gemms: every weight GEMM of the model at T rows (per shape, times its count in the model),
   against the weight-read roofline at the measured copy bandwidth, through each BLAS backend of
   --gemm-backends;
2. gdn: one GDN layer's recurrence on each path, from the layer's input projection to the mixer's
   output: `prologue` (ddtree.ops.gdn_tree.gdn_tree_prologue: conv, norms, gates and recurrence in
   one kernel), `kernel` (the torch prologue qkvgb, then gdn_tree), `wy` (qkvgb, then gdn.tree_wy's
   cuBLAS path), and the one-kernel paths at each (BV, warps) of --tiles, each with its error
   against tree_wy's output;
3. core: the recurrence alone from ready q / k / v / g / beta: tree_wy, gdn_tree and
   gdn_tree_blocked (`blocked`: its rule's block, root and tiles; `blocked chunk<C>`: its first
   pass's key products in chunks of C channels; `blocked loop` / `unrolled`: where the first pass
   is per head, its squarings in a loop or unrolled; `blocked<B>`: blocks of B nodes
   of --blocks, `root`: with the root folded into the state first, at its tiles and at each of
   --tiles); and `blocked prologue` (the engine's path past one tile: gdn_tree.gdn_prologue from
   the projection, then gdn_tree_blocked; less the projection's time). Each is timed after the
   layer's projection, as the engine runs it (the projection's GEMM sweeps the L2, code included;
   its time taken off), and back to back (`warm_ms`)

Times are medians of CUDA-graph replays (launch gaps gone, as in the engine's captured verify);
the torch pieces run eager here, where the engine compiles them, so the `kernel` and `wy` rows
are upper bounds. Feeds docs/PERFORMANCE.md's "Where the time goes" (part tile) and the GDN kernel rules'
measurements (part core).
Example:
    python scripts/bench_verify.py --nodes 16,17,32,33,64 --out results/verify-parts-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree.model.presets import qwen36_27b_config  # noqa: E402
from ddtree.model.synthetic import build_random_target, tiny_hybrid_config  # noqa: E402
from ddtree.ops import gdn, gdn_tree, triton_util  # noqa: E402
from ddtree.ops.dispatch import resolve  # noqa: E402
from ddtree.ops.tree import ancestor_mask_from_parents  # noqa: E402
from ddtree.options import Options  # noqa: E402
from bench_engine import copy_bandwidth, event_time, git_commit, profile_kernels  # noqa: E402  (scripts/ is sys.path[0])

DEV = torch.device("cuda")


def graph_of(fn, calls: int = 8) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` fn() calls in a row (fn warmed up on a side stream first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def graph_ms(fn, calls: int = 8, replays: int = 15) -> float:
    """Median ms of one fn() call, from replays of a CUDA graph of `calls` calls in a row."""
    return event_time(graph_of(fn, calls).replay, reps=replays, warmup=1) / calls


def graph_kernels(fn, calls: int = 8) -> dict[str, float]:
    """us per fn() call of each Triton kernel fn launches (torch.profiler over replays of a CUDA
    graph of `calls` calls in a row)."""
    top = profile_kernels(graph_of(fn, calls).replay, reps=3, top=12)["top"]
    return {k["name"].strip("_"): k["us"] / calls for k in top if k["name"].startswith("_")}


def gemm_shapes(tc: dict) -> list[tuple[str, int, int, int]]:
    """(name, out features, in features, count in the model): the fused weights the engine uses."""
    h, n_layers = tc["hidden_size"], tc["num_hidden_layers"]
    n_full = sum(t == "full_attention" for t in tc["layer_types"])
    n_gdn = n_layers - n_full
    hd, nh, kv = tc["head_dim"], tc["num_attention_heads"], tc["num_key_value_heads"]
    q = nh * hd * (2 if tc.get("attn_output_gate") else 1)
    kd, vd = tc["linear_num_key_heads"] * tc["linear_key_head_dim"], tc["linear_num_value_heads"] * tc["linear_value_head_dim"]
    return [
        ("gdn.in_proj", 2 * kd + 2 * vd + 2 * tc["linear_num_value_heads"], h, n_gdn),
        ("gdn.out_proj", h, vd, n_gdn),
        ("attn.qkv", q + 2 * kv * hd, h, n_full),
        ("attn.o_proj", h, nh * hd, n_full),
        ("mlp.gate_up", 2 * tc["intermediate_size"], h, n_layers),
        ("mlp.down", h, tc["intermediate_size"], n_layers),
        ("lm_head", tc["vocab_size"], h, 1),
    ]


def bench_gemms(tc: dict, nodes: list[int], bw: float, backends: tuple[str, ...] = ("cublas",)) -> list[dict]:
    """Each weight GEMM at T rows through each BLAS backend torch offers (`cublas`, `cublaslt`:
    torch.backends.cuda.preferred_blas_library; each picks its own kernel per shape, and a
    verify's 17 / 33 / 65 rows are where cuBLAS's choice costs most)."""
    rows = []
    default = torch.backends.cuda.preferred_blas_library()
    for name, n, k, count in gemm_shapes(tc):
        copies = max(1, min(4, (1 << 30) // (n * k * 2)))  # distinct weights so that L2 cannot serve them
        ws = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
        for backend in backends:
            torch.backends.cuda.preferred_blas_library(backend)
            for T in nodes:
                x = torch.randn(T, k, device=DEV, dtype=torch.bfloat16)
                it = iter(range(1 << 62))
                ms = graph_ms(lambda: F.linear(x, ws[next(it) % copies]), calls=copies * 2)
                roof = n * k * 2 / (bw * 1e9) * 1e3
                rows.append(dict(name=name, backend=backend, T=T, count=count, ms=ms, model_ms=ms * count,
                                 roofline_frac=roof / ms))
        torch.backends.cuda.preferred_blas_library(default)
        del ws
    return rows


def gdn_layer(tc: dict, seed: int = 0):
    cfg = tiny_hybrid_config(
        vocab=256, hidden=tc["hidden_size"], layers=("linear_attention",), heads=tc["num_attention_heads"],
        kv_heads=tc["num_key_value_heads"], head_dim=tc["head_dim"], partial=0.25,
        gdn_k_heads=tc["linear_num_key_heads"], gdn_v_heads=tc["linear_num_value_heads"],
        gdn_k_dim=tc["linear_key_head_dim"], gdn_v_dim=tc["linear_value_head_dim"], inter=64)
    model = build_random_target(cfg, device=DEV, dtype=torch.bfloat16, seed=seed, max_len=1024)
    model.prepare()
    group = next(iter(model.gdn_groups.values()))
    g = torch.Generator(device=DEV).manual_seed(seed)
    group.state.copy_(torch.randn(group.state.shape, device=DEV, generator=g) * 0.05)
    group.conv.copy_(torch.randn(group.conv.shape, device=DEV, generator=g).to(group.conv.dtype))
    return model


def random_parents(T: int, seed: int) -> list[int]:
    """A ddtree-like tree: a spine with branches off random earlier nodes."""
    g = torch.Generator().manual_seed(seed)
    return [-1] + [i - 1 if torch.rand((), generator=g) < 0.6 else int(torch.randint(0, i, (), generator=g))
                   for i in range(1, T)]


def tree_case(model, layer, tc: dict, T: int):
    """One verify of a random T-node tree through the GDN layer: (mask, step, x, (q, k, v, g, beta)
    from the torch prologue, the commit scratch, S0, tree_wy's output: the reference)."""
    parents = torch.tensor(random_parents(T, T), device=DEV)
    mask = ancestor_mask_from_parents(parents.tolist()).to(DEV)
    step = model.make_step(torch.arange(T, device=DEV) + 100, mask, parents, torch.tensor(100, device=DEV), 100 + T)
    x = torch.randn(T, tc["hidden_size"], device=DEV, dtype=torch.bfloat16)
    q, k, v, g, beta, _, _ = layer.qkvgb(x, step)
    kb, ub, cb = layer.wy_bufs
    ref, _ = gdn.tree_wy(q, k, v, g, beta, layer.rec_state, mask)
    return mask, step, x, (q, k, v, g, beta), (kb[:, :T], ub[:, :T], cb[:, :T]), layer.rec_state, ref


def blocked_prologue_path(layer, x, step, S0, mask, scratch, prec):
    """The engine's path past one tile, from the projection: the prologue kernel, then the blocks
    (fold_root's rule). -> a function of no arguments running it."""
    def run():
        pj, ex = layer.project(x)
        return gdn_tree.gdn_tree_blocked(*gdn_tree.gdn_prologue(layer, pj, ex, step.window), S0, mask, scratch, prec)
    return run


def bench_tile(tc: dict, nodes: list[int], tiles: list[tuple[int, int]], rows: list, save) -> None:
    """The engine's GDN paths of a verify from the layer's projection, less the projection's time:
    `blocked prologue` (gdn_prologue, then gdn_tree_blocked: three launches) against the one-tile
    kernel with the prologue inside (gdn_tree_prologue: one launch), at its default tiles and at
    each (BV, warps) of `tiles`. A row per size."""
    model = gdn_layer(tc)
    layer = model.layers[0].linear_attn
    prec = resolve(Options.from_env(), DEV).tree_precision
    for T in nodes:
        mask, step, x, _, scratch, S0, ref = tree_case(model, layer, tc, T)
        proj_ms = graph_ms(lambda: layer.project(x))
        blocked = blocked_prologue_path(layer, x, step, S0, mask, scratch, prec)

        def one(t=None):
            pj, ex = layer.project(x)
            return gdn_tree.gdn_tree_prologue(layer, pj, ex, step.window, S0, mask, scratch, prec, tiles=t)

        row = dict(T=T, default_tiles=gdn_tree.launch_tiles(gdn_tree.tile_nodes(T), layer.dv, prologue=True), paths={})
        for name, fn in [("blocked prologue", blocked), ("one", one)] + [
                (f"one BV{t[0]} w{t[1]}", lambda t=t: one(t)) for t in tiles]:
            try:
                o = fn()
                row["paths"][name] = dict(ms=graph_ms(fn) - proj_ms, err=((o.float() - ref).norm() / ref.norm()).item())
            except Exception as e:  # a tile past the shared memory: noted, not fatal
                row["paths"][name] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
        rows.append(row)
        save()
        print(f"T={T:3d} from the projection: " + "  ".join(
            f"{n} {v['ms'] * 1e3:.1f} us ({v['err']:.0e})" if "ms" in v else f"{n} {v['error'][:40]}"
            for n, v in row["paths"].items()), flush=True)


def bench_gdn(tc: dict, nodes: list[int], tiles: list[tuple[int, int]], rows: list, save, core_only: bool = False,
              blocks: tuple[int, ...] = (), chunks: tuple[int, ...] = (), kernels: bool = False) -> None:
    """A row per tree size, appended to `rows`; save() after each (a stopped run keeps what it measured).
    core_only: only the recurrence alone (tree_wy, the kernel, the blocked kernel per block and tile);
    kernels: each core path's Triton kernels under torch.profiler too, after the projection and back
    to back (us per call)."""
    model = gdn_layer(tc)
    layer = model.layers[0].linear_attn
    base = resolve(Options.from_env(), DEV)
    for T in nodes:
        mask, step, x, (q, k, v, g, beta), scratch, S0, ref = tree_case(model, layer, tc, T)
        prec = base.tree_precision

        def err(o):
            return ((o.float() - ref).norm() / ref.norm()).item()

        def wy():
            qq, kk, vv, gg, bb, _, _ = layer.qkvgb(x, step)
            return gdn.tree_wy(qq, kk, vv, gg, bb, S0, mask, out=scratch)[0]

        def kernel(t=None):
            qq, kk, vv, gg, bb, _, _ = layer.qkvgb(x, step)
            return gdn_tree.gdn_tree(qq, kk, vv, gg, bb, S0, mask, scratch, prec, tiles=t)

        def prologue(t=None):
            pj, ex = layer.project(x)
            return gdn_tree.gdn_tree_prologue(layer, pj, ex, step.window, S0, mask, scratch, prec, tiles=t)

        blocked_prologue = blocked_prologue_path(layer, x, step, S0, mask, scratch, prec)

        with_proj = {blocked_prologue}
        proj_ms = graph_ms(lambda: layer.project(x))
        n = gdn_tree.tile_nodes(T)
        tiles_of = {p: gdn_tree.launch_tiles(n, layer.dv, prologue=p == "prologue") for p in ("kernel", "prologue")}
        row = dict(T=T, in_proj_ms=proj_ms, paths={}, default_tiles=tiles_of)
        for name, fn in () if core_only else (("wy", wy), ("kernel", kernel), ("prologue", prologue)):
            row["paths"][name] = dict(ms=graph_ms(fn) - proj_ms, err=err(fn()))
        sweep = {}
        for t in () if core_only else tiles:
            for name, fn in (("kernel", kernel), ("prologue", prologue)):
                key = f"{name} BV{t[0]} w{t[1]}"
                try:
                    o = fn(t)
                    sweep[key] = dict(ms=graph_ms(lambda: fn(t)) - proj_ms, err=err(o))
                except Exception as e:  # a tile past the shared memory: noted, not fatal
                    sweep[key] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
                print(f"    {key}: " + (f"{sweep[key]['ms'] * 1e3:.1f} us, err {sweep[key]['err']:.1e}"
                                        if "ms" in sweep[key] else sweep[key]["error"]), flush=True)
        row["sweep"] = sweep
        # the recurrence alone, from ready q / k / v / g / beta: tree_wy, the kernel, the blocked kernel
        core = {}
        head = gdn_tree.block_nodes(T, triton_util.arch(DEV)) >= gdn_tree.HEAD_BLOCK
        for name, fn in (("wy", lambda: gdn.tree_wy(q, k, v, g, beta, S0, mask, out=scratch)[0]),
                         ("kernel", lambda: gdn_tree.gdn_tree(q, k, v, g, beta, S0, mask, scratch, prec)),
                         ("blocked", lambda: gdn_tree.gdn_tree_blocked(q, k, v, g, beta, S0, mask, scratch, prec)),
                         *((f"blocked {'loop' if lp else 'unrolled'}", lambda lp=lp: gdn_tree.gdn_tree_blocked(
                             q, k, v, g, beta, S0, mask, scratch, prec, loop=lp)) for lp in ((False, True) if head else ())),
                         ("blocked prologue", blocked_prologue),
                         *((f"blocked chunk{c}", lambda c=c: gdn_tree.gdn_tree_blocked(
                             q, k, v, g, beta, S0, mask, scratch, prec, chunk=c)) for c in chunks),
                         *((f"blocked{b} root" if r else f"blocked{b}", lambda b=b, r=r: gdn_tree.gdn_tree_blocked(
                             q, k, v, g, beta, S0, mask, scratch, prec, block=b, root=r))
                           for b in blocks for r in (False, True)),
                         *((f"blocked{b}{' root' if r else ''} BV{t[0]} w{t[1]}", lambda b=b, t=t, r=r: gdn_tree.gdn_tree_blocked(
                             q, k, v, g, beta, S0, mask, scratch, prec, tiles=t, block=b, root=r))
                           for b in blocks for t in tiles for r in (False, True))):
            try:  # ms: after the layer's projection, as in the engine (its GEMM sweeps the L2); warm: back to back
                cold = fn if fn in with_proj else lambda fn=fn: (layer.project(x), fn())
                core[name] = dict(ms=graph_ms(cold) - proj_ms, err=err(fn()),
                                  **({} if fn in with_proj else dict(warm_ms=graph_ms(fn))))
                if kernels:
                    core[name]["kernels"] = graph_kernels(cold)
                    if fn not in with_proj:
                        core[name]["warm_kernels"] = graph_kernels(fn)
            except Exception as e:  # a tile past the shared memory: noted, not fatal
                core[name] = dict(error=f"{type(e).__name__}: {str(e)[:120]}")
        row["core"] = core
        print(f"T={T:3d}  recurrence alone (us after the projection / back to back): " + "  ".join(
            f"{n} {v['ms'] * 1e3:.1f}" + (f" / {v['warm_ms'] * 1e3:.1f}" if "warm_ms" in v else "") + f" ({v['err']:.1e})"
            if "ms" in v else f"{n} {v['error']}" for n, v in core.items()), flush=True)
        for n, v in core.items() if kernels else ():
            print(f"    {n}: " + "  ".join(f"{k} {us:.1f}" + (f" / {v['warm_kernels'][k]:.1f}" if k in v.get("warm_kernels", {}) else "")
                                       for k, us in v.get("kernels", {}).items()), flush=True)
        rows.append(row)
        save()
        if core_only:
            continue
        best = min((v["ms"], k) for k, v in sweep.items() if "ms" in v) if sweep else (float("nan"), "-")
        p = row["paths"]
        print(f"T={T:3d}  in_proj {proj_ms * 1e3:6.1f} us | wy {p['wy']['ms'] * 1e3:6.1f} us  kernel "
              f"{p['kernel']['ms'] * 1e3:6.1f} us  prologue {p['prologue']['ms'] * 1e3:6.1f} us "
              f"(err {p['prologue']['err']:.1e}) | best tile: {best[1]} {best[0] * 1e3:.1f} us", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1,16,17,32,33,64")
    ap.add_argument("--parts", default="gemms,gdn",
                    help="comma-separated: gemms, gdn (whole-layer paths and the tile sweep), core (the recurrence alone), "
                         "tile (the engine's paths from the projection: blocked against the one-tile kernel)")
    ap.add_argument("--tiles", nargs="*", default=["16,4", "32,4", "32,8", "64,8", "16,8"],
                    help="BV,WARPS pairs of the one-kernel paths to sweep")
    ap.add_argument("--blocks", type=int, nargs="*", default=[16, 64],
                    help="gdn_tree_blocked's block sizes to time besides its rule's (core), with and without the root "
                         "folded, at its tiles and at each of --tiles")
    ap.add_argument("--tile-sweep", nargs="*", default=["32,4", "32,8", "64,8"],
                    help="BV,WARPS pairs of the one-tile kernel (part tile)")
    ap.add_argument("--mats-chunks", type=int, nargs="*", default=[16, 32, 64],
                    help="gdn_tree_blocked's first pass with its key products in chunks of these many channels (core)")
    ap.add_argument("--kernels", action="store_true",
                    help="core: each path's Triton kernels under torch.profiler, after the projection and back to back")
    ap.add_argument("--gemm-backends", default="cublas",
                    help="comma-separated BLAS backends of the gemms part: cublas, cublaslt")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: bench_verify.py needs a CUDA GPU (run it on a machine with one)", file=sys.stderr)
        sys.exit(2)
    torch.backends.cuda.matmul.allow_tf32 = False
    tc = qwen36_27b_config()["text_config"]
    nodes = [int(t) for t in a.nodes.split(",")]
    out = dict(gpu=torch.cuda.get_device_name(0), date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
               commit=git_commit())
    out["copy_GBps"] = bw = copy_bandwidth() / 1e9
    print(f"copy bandwidth {bw:.0f} GB/s", flush=True)

    def save():  # after every part and every tree size: a run stopped by its time limit keeps its rows
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(out, indent=1))

    parts = a.parts.split(",")
    if "gemms" in parts:
        backends = tuple(a.gemm_backends.split(","))
        rows = out["gemms"] = bench_gemms(tc, nodes, bw, backends)
        save()
        for backend in backends:
            for T in nodes:
                mine = [r for r in rows if r["T"] == T and r["backend"] == backend]
                tot = sum(r["model_ms"] for r in mine)
                print(f"{backend:8s} T={T:3d}  GEMMs of the model {tot:7.3f} ms  " + "  ".join(
                    f"{r['name']} {r['ms'] * 1e3:.1f}us({r['roofline_frac']:.0%})" for r in mine), flush=True)
    if "tile" in parts:
        bench_tile(tc, nodes, [tuple(int(v) for v in s.split(",")) for s in a.tile_sweep], out.setdefault("tile", []), save)
    for part in ("gdn", "core"):
        if part in parts:
            bench_gdn(tc, [t for t in nodes if t > 1], [tuple(int(v) for v in s.split(",")) for s in a.tiles],
                      out.setdefault(part, []), save, core_only=part == "core", blocks=tuple(a.blocks),
                      chunks=tuple(a.mats_chunks), kernels=a.kernels)


if __name__ == "__main__":
    main()

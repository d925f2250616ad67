#!/usr/bin/env python3
"""Start-up as a user meets it: each case runs in a FRESH process, first cold (empty compile caches:
inductor's, Triton's and ddtree's own, all under one temporary folder) and then warm (the same
folder again, as a later process on the same machine finds it).

Cases:
  * generate: `ddtree generate --target T --drafter D -n N "def quicksort(xs):"` on the codepair pair
    (--codepair DIR, --drafter NAME): process wall time, and the summary line's time to first token
    and the start-up line (weights, compile, graph capture, prefill) that generate prints
  * selftest: `ddtree selftest`: process wall time
  * phases: one fresh process that times the steps of the setup phase one after another (import
    torch, CUDA's context, import transformers, the tokenizer, ddtree's model and decode modules,
    the configs), then `python -X importtime` of the generate case with its 25 costliest imports
  * profile: the generate case under cProfile (its .prof in --logs; the row keeps the 30 costliest
    calls by cumulative time up to the first token's print, and by their own time)
  * preset: random weights of --preset's exact shapes on the GPU, then Decoder.generate per method
    (--methods): from the weights in memory to the first token, and to the last (--tokens), which
    holds the compiles and the captures of the first generation of a process

With --probe each process also prints torch's own compile-time counters at exit (dynamo's per
function, and the time per phase). Prints a table last; JSON with --out; each process's stderr in
--logs. Feeds docs/USAGE.md's start-up table, the README's selftest time and the start-up rows of
docs/PERFORMANCE.md's targets (results/startup-h200.json, results/startup-cpu.json).

    python scripts/bench_startup.py --codepair .fixture/codepair --cases generate,selftest,preset \
        --out results/startup-h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PROBE = r"""
import atexit, sys
def _dump():
    try:
        from torch._dynamo.utils import calculate_time_spent, compile_times
        print("probe: compile phases (s):", {k: round(v, 2) for k, v in calculate_time_spent().items()}, file=sys.stderr)
        print("probe: dynamo per function:\n" + compile_times(repr="str", aggregate=True), file=sys.stderr)
    except Exception as e:
        print(f"probe: no counters ({e})", file=sys.stderr)
atexit.register(_dump)
"""

PHASES_INNER = r"""
import sys, time, json
sys.path.insert(0, {root!r})
from pathlib import Path
marks = [("start", time.perf_counter())]
def mark(name):
    marks.append((name, time.perf_counter()))
import torch; mark("import torch")
if torch.cuda.is_available():
    torch.zeros(1, device="cuda"); torch.cuda.synchronize(); mark("CUDA context")
import transformers; mark("import transformers")
from transformers import AutoTokenizer; mark("from transformers import AutoTokenizer")
from ddtree.app import setup as S; mark("import ddtree.app.setup")
tok = S.load_tokenizer(Path({target!r})); mark("load_tokenizer")
import ddtree.decode.decoder; mark("import ddtree.decode.decoder")
spec = S.inspect_models({target!r}, {drafter!r}, None, None, need_drafter=True); mark("inspect_models again")
out = {{b[0]: round(b[1] - a[1], 3) for a, b in zip(marks, marks[1:])}}
print("PHASES " + json.dumps(out), flush=True)
"""

PRESET_INNER = r"""
import sys, time, json
sys.path.insert(0, {root!r})
import torch
from ddtree.model.presets import PRESETS
from ddtree.model.synthetic import build_random_on_devices
from ddtree.decode.decoder import Decoder
from ddtree.options import Options
t0 = time.perf_counter()
mk_t, mk_d = PRESETS[{preset!r}]
target, drafter = build_random_on_devices(mk_t(), mk_d(), [torch.device("cuda:0")], torch.bfloat16, {ctx} + 1024)
torch.cuda.synchronize()
build_s = time.perf_counter() - t0
dec = Decoder(target, drafter, options=Options.from_env())
ids = torch.randint(10, 1000, ({ctx},), generator=torch.Generator().manual_seed(0)).tolist()
out = {{"build_s": build_s}}
for spec in {methods!r}:
    method, _, b = spec.partition(":")
    stamps = []
    t1 = time.perf_counter()
    rec = dec.generate(ids, method=method, budget=int(b) if b else 32, max_new_tokens={tokens},
                       on_tokens=lambda toks: stamps.append(time.perf_counter()))
    torch.cuda.synchronize()
    out[spec] = {{"first_token_s": stamps[0] - t1, "last_token_s": time.perf_counter() - t1, "tokens": rec.new_tokens}}
print("PRESET " + json.dumps(out), flush=True)
"""


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def run(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[float, str, str, int]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:  # (its output comes back as bytes even with text=True)
        rc, out, err = 124, _text(e.stdout), _text(e.stderr)
    wall = time.perf_counter() - t0
    log.write_text(f"$ {' '.join(cmd)}\n--- rc {rc}, wall {wall:.2f} s\n--- stdout\n{out}\n--- stderr\n{err}")
    return wall, out, err, rc


def parse_generate(err: str) -> dict:
    out = {}
    m = re.search(r"time to first token (\d+) ms", err)
    if m:
        out["ttft_s"] = int(m.group(1)) / 1e3
    m = re.search(r"start-up: (.*)", err)
    if m:
        out["startup_line"] = m.group(1).strip()
        for k, v in re.findall(r"([a-z ]+?) ([\d.]+) s", m.group(1)):
            out["startup_" + k.strip().replace(" ", "_")] = float(v)
    return out


def top_imports(err: str, n: int = 25) -> list:
    """The n costliest imports (cumulative us) of a `python -X importtime` stderr."""
    rows = []
    for m in re.finditer(r"^import time:\s+(\d+) \|\s+(\d+) \| (.*)$", err, re.M):
        rows.append((int(m.group(2)), m.group(3).rstrip()))
    rows.sort(reverse=True)
    return [f"{us / 1e6:.3f} s {name}" for us, name in rows[:n]]


def top_calls(prof: Path, n: int = 30) -> dict:
    """The costliest calls of a cProfile dump: by cumulative and by own time (s)."""
    import pstats

    if not prof.is_file():
        return {}
    st = pstats.Stats(str(prof))
    rows = [(f"{Path(f).name}:{line}({fn})", round(cc, 3), round(tt, 3), nc)
            for (f, line, fn), (_, nc, tt, cc, _) in st.stats.items()]
    return {"by_cumulative": sorted(rows, key=lambda r: -r[1])[:n], "by_own": sorted(rows, key=lambda r: -r[2])[:n]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--codepair", type=Path, default=ROOT / ".fixture" / "codepair")
    ap.add_argument("--drafter", default="drafter-distilled")
    ap.add_argument("--cases", default="generate,selftest")
    ap.add_argument("--states", default="cold,warm")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--preset", default="qwen3.6-27b")
    ap.add_argument("--methods", default="ar,dflash,ddtree:32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens of each preset generation")
    ap.add_argument("--probe", action="store_true", help="print torch's compile counters at each process's exit")
    ap.add_argument("--cache-root", type=Path, default=None, help="keep the caches here (default: a fresh temp folder)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--logs", type=Path, default=Path(os.environ.get("OUT", "/tmp")) / "startup-logs")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    a.logs.mkdir(parents=True, exist_ok=True)
    cases, states = a.cases.split(","), a.states.split(",")
    root = a.cache_root or Path(tempfile.mkdtemp(prefix="ddtree-startup-"))
    env = dict(os.environ, PYTHONUNBUFFERED="1", XDG_CACHE_HOME=str(root / "xdg"),
               TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"), TRITON_CACHE_DIR=str(root / "triton"),
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    py = [sys.executable] + (["-c", PROBE + "\nimport runpy, sys; sys.argv = sys.argv[1:]; runpy.run_module('ddtree', run_name='__main__')", "ddtree"]
                             if a.probe else ["-m", "ddtree"])
    fx = a.codepair
    rows = []
    for state in states:
        for case in cases:
            log = a.logs / f"{case}-{state}.log"
            if case == "generate":
                cmd = py + ["generate", "--target", str(fx / "target"), "--drafter", str(fx / a.drafter),
                            "-n", str(a.new_tokens), "-v", "def quicksort(xs):"]
            elif case == "selftest":
                cmd = py + ["selftest", "-v"]
            elif case == "phases":
                cmd = [sys.executable, "-c", PHASES_INNER.format(root=str(ROOT), target=str(fx / "target"),
                                                                 drafter=str(fx / a.drafter))]
            elif case == "profile":
                prof = a.logs / f"generate-{state}.prof"
                cmd = [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "ddtree", "generate", "--target",
                       str(fx / "target"), "--drafter", str(fx / a.drafter), "-n", str(a.new_tokens), "-v", "def quicksort(xs):"]
            elif case == "importtime":
                cmd = [sys.executable, "-X", "importtime", "-m", "ddtree", "generate", "--target", str(fx / "target"),
                       "--drafter", str(fx / a.drafter), "-n", "8", "def quicksort(xs):"]
            elif case == "preset":
                code = PRESET_INNER.format(root=str(ROOT), preset=a.preset, ctx=a.context,
                                           methods=a.methods.split(","), tokens=a.tokens)
                cmd = [sys.executable, "-c", (PROBE if a.probe else "") + code]
            else:
                sys.exit(f"unknown case {case!r}")
            wall, out, err, rc = run(cmd, env, log, a.timeout)
            row = {"case": case, "state": state, "wall_s": round(wall, 2), "rc": rc}
            if case == "generate":
                row.update(parse_generate(err))
            if case == "phases":
                m = re.search(r"^PHASES (.*)$", out, re.M)
                if m:
                    row["phases"] = json.loads(m.group(1))
            if case == "importtime":
                row["top_imports"] = top_imports(err)
            if case == "profile":
                row.update(parse_generate(err), **top_calls(a.logs / f"generate-{state}.prof"))
            if case == "preset":
                m = re.search(r"^PRESET (.*)$", out, re.M)
                if m:
                    row.update(json.loads(m.group(1)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'case':<10} {'state':<5} {'wall s':>8}  details")
    for r in rows:
        det = {k: v for k, v in r.items() if k not in ("case", "state", "wall_s")}
        print(f"{r['case']:<10} {r['state']:<5} {r['wall_s']:8.1f}  {json.dumps(det)}")
    if a.out:
        import torch
        from bench_engine import git_commit  # (scripts/ is on the path when a script runs)

        doc = {"kind": "startup", "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "rows": rows}
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()

"""Start-up: the breakdown (ddtree.decode.startup) on stderr and in the statistics, the short
prompt's eager prefill, and compile caches that a second process reuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from app_helpers import write_tiny_pair
from conftest import REPO
from ddtree.app.cli import app, cache_dir
from ddtree.decode import startup
from ddtree.decode.startup import PHASES, StartupClock
from ddtree.options import Options
from ddtree.stats import read_json, validate_document


def test_phase_moves_compile_time_into_compile(monkeypatch):
    """A phase's wall time less the compile counter's growth inside it; the compile part apart."""
    ticks = iter([10.0, 13.5])  # the compile counter before and after the block
    monkeypatch.setattr(startup, "compile_seconds", lambda: next(ticks))
    times = iter([100.0, 105.0])
    monkeypatch.setattr(startup.time, "perf_counter", lambda: next(times))
    clock = StartupClock()
    with clock.phase("capture"):
        pass
    assert clock.seconds["compile"] == pytest.approx(3.5)
    assert clock.seconds["capture"] == pytest.approx(1.5)
    assert "graph capture 1.5 s" in clock.line() and "compile 3.5 s" in clock.line()


def test_process_age_is_positive_and_small():
    age = startup.process_age_s()
    if age is None:
        pytest.skip("no /proc here")
    assert 0.0 <= age < 24 * 3600


def test_generate_prints_the_breakdown_and_records_it(tmp_path):
    tdir, ddir = write_tiny_pair(tmp_path / "pair")
    stats = tmp_path / "s.json"
    r = CliRunner().invoke(app, ["generate", "--target", str(tdir), "--drafter", str(ddir), "-n", "6", "--raw",
                                 "--devices", "cpu", "--dtype", "float32", "--max-length", "64",
                                 "--stats-json", str(stats), "hello"])
    assert r.exit_code == 0, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("start-up: ")]
    assert len(lines) == 1, r.stderr
    for phase in ("python", "setup", "weights", "compile", "graph capture", "prefill", "first token"):
        assert phase in lines[0]
    doc = read_json(stats)
    validate_document(doc)
    s = doc["metadata"]["startup"]
    assert set(s) == {f"{p}_s" for p in PHASES} | {"first_token_s"}
    assert s["weights_s"] > 0 and s["prefill_s"] > 0
    assert s["first_token_s"] >= s["weights_s"] + s["prefill_s"]


def test_short_prompts_prefill_through_the_eager_twins():
    """Below options.prefill_fast_min tokens the decoder asks the target for the eager prefill;
    at or above it, for the fast one (compiled layers and fla where they are on)."""
    from ddtree.decode.random_pair import build_random_pair

    dec, _ = build_random_pair("hybrid", seed=0, dtype=torch.float32, device="cpu", max_len=96,
                               options=Options(prefill_fast_min=12))
    seen = []
    real = dec.target.prefill
    dec.target.prefill = lambda *a, **k: (seen.append(k["fast"]), real(*a, **k))[1]
    short = dec.generate(list(range(2, 10)), "ar", max_new_tokens=4).token_ids
    long = dec.generate(list(range(2, 14)), "ar", max_new_tokens=4).token_ids
    assert seen == [False, True]
    assert len(short) == len(long) == 4


def test_cli_sets_persistent_caches(monkeypatch, tmp_path):
    """inductor's cache under ddtree's cache folder and Triton's autotuning on disk, unless set."""
    from ddtree.app import cli

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_CACHE_AUTOTUNING", "0")
    cli._persistent_caches()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ddtree" / "inductor")
    assert cache_dir() == tmp_path / "ddtree"
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"  # the user's setting wins


_COMPILE_ONCE = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    from ddtree.app import cli
    cli._persistent_caches()
    import torch
    from torch._dynamo.utils import counters
    f = torch.compile(lambda x: (x * 2).sin() + x.cos())
    f(torch.randn(64))
    print(json.dumps(dict(counters["inductor"])))
""")


@pytest.mark.slow
def test_second_process_reuses_the_compile_cache(tmp_path):
    """A second process finds the first one's compiled graph in ddtree's cache folder (CPU inductor)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env.update(XDG_CACHE_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    code = _COMPILE_ONCE.format(repo=str(REPO))
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        if p.returncode != 0 and "CppCompileError" in p.stderr + p.stdout:
            pytest.skip("no working C++ compiler for CPU inductor here")
        assert p.returncode == 0, p.stderr[-2000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert runs[0].get("fxgraph_cache_miss", 0) >= 1
    assert runs[1].get("fxgraph_cache_hit", 0) >= 1, runs
    assert (tmp_path / "ddtree" / "inductor").is_dir()


def test_freeze_heap_freezes_after_new_work_only():
    """The heap is frozen once per runner state (its keys run, the compile counter): again only
    after something new was captured or compiled; a chat's settle calls it (ddtree.app.chat)."""
    import gc
    from types import SimpleNamespace

    from ddtree.decode.startup import freeze_heap

    runner = SimpleNamespace(new_keys=3)
    gc.unfreeze()
    try:
        assert freeze_heap(runner) is True
        assert gc.get_freeze_count() > 0
        assert freeze_heap(runner) is False  # nothing new since
        runner.new_keys += 1  # a capture
        assert freeze_heap(runner) is True
        assert freeze_heap(SimpleNamespace(new_keys=4)) is True  # another decoder's runner
    finally:
        gc.unfreeze()

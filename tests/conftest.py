"""Shared test helpers: the ../shared codepair fixture (skipped with a reason when absent) and
the environment for running the `ddtree` command in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The test models are tiny, and CI runs a pytest process per core (-n 2 on 2 cores): one thread
# each for torch's and numpy's BLAS (Triton's interpreter computes in numpy), set before either
# starts its thread pool. With a thread per core the two processes' threads spin against each
# other: the whole suite took 691 s on a 2-core machine, 583 s on one thread.
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU, Triton kernels (ddtree.ops.*) run under Triton's interpreter on CPU tensors;
# the interpreter must be chosen before triton is first imported (its own library functions are
# decorated at import). With a GPU the kernels are compiled and tested on it.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # tests/triton_interpreter.py: less bookkeeping a call
    from triton_interpreter import install as _lighter_interpreter

    _lighter_interpreter()

torch.set_num_threads(1)  # (where a plugin imported torch first)

REPO = Path(__file__).resolve().parents[1]
# ../shared/fixtures/codepair, or DDTREE_FIXTURE (a copy anywhere else)
FIXTURE_DIR = Path(os.environ.get("DDTREE_FIXTURE") or Path(__file__).parents[1].parent / "shared" / "fixtures" / "codepair")
FIXTURE_REASON = (
    f"codepair fixture not found at {FIXTURE_DIR}: clone the project with its ../shared folder beside it"
)


def have_fixture() -> bool:
    return (FIXTURE_DIR / "target" / "config.json").is_file() and (FIXTURE_DIR / "drafter" / "config.json").is_file()


def skip_without_fixture() -> None:
    """Call at the top of a test that needs ../shared/fixtures/codepair."""
    if not have_fixture():
        pytest.skip(FIXTURE_REASON)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """The `slow` tests first, in their order, then the rest: under xdist's worksteal (pyproject's
    addopts) the long ones start at once and an idle worker takes short tests from the end of the
    other's queue, so the workers end together instead of one running a minute-long test alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture
def fixture_dir() -> Path:
    """../shared/fixtures/codepair (target/, drafter/, prompts.jsonl); skips the test when absent."""
    skip_without_fixture()
    return FIXTURE_DIR


def cli_env() -> dict:
    """Environment for `python -m ddtree` subprocesses: one CPU thread (tiny models; avoids thread
    oversubscription on small CI machines), the repo importable, no network."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_ddtree(*args: str, stdin: str | None = None, timeout: float = 300, cwd: Path | None = None):
    """Run `python -m ddtree ARGS` from the repo root; returns the CompletedProcess (text)."""
    return subprocess.run(
        [sys.executable, "-m", "ddtree", *map(str, args)], input=stdin, capture_output=True, text=True,
        timeout=timeout, cwd=str(cwd or REPO), env=cli_env(),
    )


@pytest.fixture
def one_thread():
    """torch on one thread for the test (tiny models; restores the previous count)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

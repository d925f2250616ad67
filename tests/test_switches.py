"""The engine switches (ddtree.options): one declaration each, read from the environment once,
bad values as one error line, and the table of docs/USAGE.md made from them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ddtree.errors import DDTreeError
from ddtree.options import Options, markdown_table, table

REPO = Path(__file__).resolve().parents[1]


def test_defaults_and_environment():
    o = Options.from_env({})
    assert o == Options()
    got = Options.from_env({"DDTREE_NO_COMPILE": "1", "DDTREE_TRITON_TREE": "1", "DDTREE_TREE_PROLOGUE": "0",
                            "DDTREE_HOST_ROUNDS": "1", "DDTREE_ATTENTION": "sdpa", "DDTREE_EAGER_SPLIT": "1"})
    assert (got.compile, got.tree_kernel, got.tree_prologue, got.host_rounds, got.attention, got.split_graphs) == \
        (False, "on", 0, True, "sdpa", False)
    assert Options.from_env({"DDTREE_NO_COMPILE": "0"}).compile  # only =1 turns it off
    assert Options().split_graphs and Options.from_env({"DDTREE_EAGER_SPLIT": "0"}).split_graphs  # graphed by default


@pytest.mark.parametrize("env,value", [("DDTREE_TRITON_TREE", "maybe"), ("DDTREE_TREE_PROLOGUE", "-3"),
                                       ("DDTREE_ATTENTION", "flash"), ("DDTREE_TREE_PRECISION", "fp8")])
def test_bad_value_is_one_line(env, value):
    with pytest.raises(DDTreeError) as e:
        Options.from_env({env: value})
    assert env in str(e.value) and "\n" not in str(e.value)


def test_every_switch_declared_once_and_recorded_whole():
    envs = [row[1] for row in table()]
    assert len(envs) == len(set(envs)) == len(dataclasses.fields(Options))
    assert set(Options().to_dict()) == {f.name for f in dataclasses.fields(Options)}


def test_usage_switch_table_is_the_code():
    assert markdown_table() in (REPO / "docs" / "USAGE.md").read_text(), \
        "docs/USAGE.md's engine switch table differs from ddtree.options.markdown_table(): paste it"


def test_no_module_reads_a_switch_but_options():
    """Every DDTREE_* variable of the package is read in ddtree/options.py only."""
    offenders = []
    for path in (REPO / "ddtree").rglob("*.py"):
        if path.name == "options.py" and path.parent.name == "ddtree":
            continue
        text = path.read_text()
        for row in table():
            if f'environ.get("{row[1]}"' in text or f"environ['{row[1]}'" in text or f'environ["{row[1]}"' in text:
                offenders.append(f"{path.relative_to(REPO)}: {row[1]}")
    assert not offenders, offenders


def test_every_script_decoder_takes_the_environments_switches():
    """A Decoder built without options takes Options(), the defaults, whatever the environment says:
    every Decoder a script builds gets Options.from_env() (or keyword arguments holding it), so that
    `DDTREE_BLAS=cublas python scripts/bench_multigpu.py` measures what it names, as the CLI would."""
    import re

    offenders = []
    for path in sorted((REPO / "scripts").glob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"(?<![\w.])Decoder\(", text):
            depth, i = 1, m.end()
            while depth:  # the call's arguments, to its closing parenthesis
                depth += {"(": 1, ")": -1}.get(text[i], 0)
                i += 1
            args = text[m.end():i - 1]
            kw = re.search(r"\*\*(\w+)", args)
            passed = "options=" in args or kw is not None and re.search(rf"{kw.group(1)} = dict\([^\n]*options=", text)
            if not (passed and "Options.from_env()" in text):
                offenders.append(f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: Decoder({args})")
    assert not offenders, offenders


def test_changed_names_the_switches_off_their_default():
    env = {"DDTREE_NO_COMPILE": "1", "DDTREE_TREE_PROLOGUE": "8", "DDTREE_ATTENTION": "auto"}  # auto: the default
    o = Options.from_env(env)
    assert o.changed(env) == {"DDTREE_NO_COMPILE": "1", "DDTREE_TREE_PROLOGUE": "8"}
    assert Options().changed({}) == {}


def test_blas_switch_sets_torch_blas_library_on_cuda_only(monkeypatch):
    """DDTREE_BLAS: torch's preferred BLAS library, set once a CUDA target takes its options;
    auto and CPU targets leave torch's choice alone."""
    import torch

    from ddtree.ops.dispatch import apply_blas

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", lambda b=None: calls.append(b))
    assert Options.from_env({"DDTREE_BLAS": "cublaslt"}).blas == "cublaslt"
    assert not apply_blas(Options(), [torch.device("cuda", 0)])
    assert not apply_blas(Options(blas="cublaslt"), [torch.device("cpu")])
    assert apply_blas(Options(blas="cublaslt"), [torch.device("cpu"), torch.device("cuda", 1)])
    assert calls == ["cublaslt"]


def test_blas_auto_takes_cublaslt_on_hopper_alone():
    """DDTREE_BLAS=auto: cuBLASLt where every CUDA device of the target is Hopper (measured faster
    there), torch's choice on Ampere, on a mix, on a CPU target and where no CUDA is visible; a
    named library wherever the target is on CUDA."""
    from ddtree.ops.dispatch import blas_library
    from ddtree.ops.triton_util import Arch

    h100, h200, a6000 = Arch(9, 0, 232448, 132), Arch(9, 0, 232448, 132), Arch(8, 6, 101376, 84)
    assert blas_library(Options(), [h100]) == "cublaslt" == blas_library(Options(), [h100, h200])
    assert blas_library(Options(), [a6000]) is None and blas_library(Options(), [h100, a6000]) is None
    assert blas_library(Options(), []) is None and blas_library(Options(), [None]) is None
    for lib in ("cublas", "cublaslt"):
        assert blas_library(Options(blas=lib), [a6000]) == lib == blas_library(Options(blas=lib), [h100])
        assert blas_library(Options(blas=lib), []) is None

"""The `ddtree` command line: selftest, generate on the codepair fixture, and one-line errors.

Most cases run in-process through typer's CliRunner (fast); a few run `python -m ddtree` in a
subprocess to check the real process: exit codes, stdout holding only the generated text, no
traceback.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import FIXTURE_DIR, REPO, run_ddtree, skip_without_fixture
from ddtree.app.cli import app
from ddtree.stats import read_json, validate_document

PROMPT = "def fibonacci(n):"


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def invoke(*args, input: str | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], input=input)


def assert_one_line_error(stderr: str, stdout: str = "", code: int | None = None, exit_code: int = 2):
    assert code is None or code == exit_code, (code, stderr)
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, f"expected one stderr line, got:\n{stderr}"
    assert lines[0].startswith("error: "), lines[0]
    assert len(lines[0]) > len("error: ") + 10
    assert stdout == "", stdout


def fixture_args(method: str, n: int = 16) -> list[str]:
    args = ["--target", FIXTURE_DIR / "target", "--method", method, "--max-new-tokens", str(n),
            "--dtype", "float32", "--devices", "cpu", "--raw"]
    if method != "ar":
        args += ["--drafter", FIXTURE_DIR / "drafter", "--budget", "8"]
    return args


# ------------------------------------------------------------------------------------------ selftest


def test_selftest_subprocess():
    r = run_ddtree("selftest", "--max-new-tokens", "24", "--device", "cpu", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "selftest passed" in r.stdout
    for label in ("ar", "dflash", "ddtree 4", "ddtree 32"):
        assert label in r.stdout
    assert "tok/s" in r.stdout and "acceptance length" in r.stdout
    assert "Traceback" not in r.stderr


def test_version_and_help():
    r = invoke("--version")
    assert r.exit_code == 0 and r.stdout.startswith("ddtree ")
    r = invoke("generate", "--help")
    assert r.exit_code == 0
    for opt in ("--target", "--drafter", "--method", "--budget", "--stats-json", "--top1-first", "--config", "--tp"):
        assert opt in r.stdout


# ------------------------------------------------------------------------------------------ generate


def test_generate_methods_agree_and_stats_json(tmp_path):
    """ar (prompt from stdin), dflash and ddtree print the same greedy text; stdout is exactly the
    generated text plus a newline; --stats-json writes a valid document."""
    skip_without_fixture()
    out = {}
    r = invoke("generate", "-", *fixture_args("ar"), input=PROMPT)
    assert r.exit_code == 0, r.stderr
    out["ar"] = r.stdout
    r = invoke("generate", PROMPT, *fixture_args("dflash"))
    assert r.exit_code == 0, r.stderr
    out["dflash"] = r.stdout
    stats = tmp_path / "stats" / "gen.json"
    r = invoke("generate", PROMPT, *fixture_args("ddtree"), "--stats-json", stats)
    assert r.exit_code == 0, r.stderr
    out["ddtree"] = r.stdout
    assert out["ar"] == out["dflash"] == out["ddtree"], out
    assert out["ar"].endswith("\n") and out["ar"].strip()
    assert "new tokens" in r.stderr and "tok/s" in r.stderr and "time to first token" in r.stderr
    assert "mean acceptance length" in r.stderr and "rounds" in r.stderr

    doc = read_json(stats)
    validate_document(doc)
    (run,) = doc["runs"]
    assert run["method"] == "ddtree" and run["budget"] == 8
    (p,) = run["prompts"]
    assert out["ddtree"] == p["text"] + "\n"  # stdout holds the generated text and nothing else
    assert p["new_tokens"] == len(p["token_ids"]) <= 16
    assert sum(p["rounds"]["committed"]) + 1 == p["new_tokens"]
    assert run["aggregate"]["num_accepted_tokens"] == sum(p["rounds"]["accepted"])
    meta = doc["metadata"]
    assert meta["method"] == "ddtree" and meta["dtype"] == "float32" and meta["target_config_sha256"]


def test_generate_readme_example_subprocess():
    """The README's fixture command (shorter), in a real process from the repo root."""
    skip_without_fixture()
    r = run_ddtree("generate", "--config", "configs/codepair.toml", "--max-new-tokens", "12", PROMPT)
    assert r.returncode == 0, r.stderr
    assert r.stdout.endswith("\n") and r.stdout.strip()
    assert "loading" not in r.stdout and "tok/s" not in r.stdout  # logs and summary go to stderr
    assert "tok/s" in r.stderr and "Traceback" not in r.stderr


def test_generate_config_overridden_by_flags(tmp_path):
    """A config sets the models; a flag overrides its method; the config's bench keys are ignored."""
    skip_without_fixture()
    cfg = tmp_path / "configs" / "c.toml"
    cfg.parent.mkdir()
    cfg.write_text(f'target = "{FIXTURE_DIR / "target"}"\ndrafter = "{FIXTURE_DIR / "drafter"}"\n'
                   'method = "dflash"\nmax_new_tokens = 6\ndevices = "cpu"\nraw = true\nbudgets = "4,8"\n')
    stats = tmp_path / "s.json"
    r = invoke("generate", "--config", cfg, "--method", "ar", "--stats-json", stats, PROMPT)
    assert r.exit_code == 0, r.stderr
    doc = read_json(stats)
    assert doc["runs"][0]["method"] == "ar"
    assert doc["runs"][0]["prompts"][0]["new_tokens"] == 6
    assert doc["metadata"]["dtype"] == "float32"  # the cpu default


# ------------------------------------------------------------------------------------------ errors


def _target_dir(tmp_path: Path, config: str | None, weights: bool = False) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(config)
    if weights:
        import torch
        from safetensors.torch import save_file

        save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(d / "model.safetensors"))
    return d


def _bad_prompts(tmp_path: Path) -> Path:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "a", "prompt": "x"}\n{"id": "b", "prompt": \n')
    return p


LLAMA = json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8,
                    "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 16})

# name -> (args builder(tmp_path), needs fixture)
ERROR_CASES = {
    "missing-target-path": (lambda t: ["generate", "--target", t / "nope", "hi"], False),
    "target-without-config": (lambda t: ["generate", "--target", _target_dir(t, None), "hi"], False),
    "malformed-config": (lambda t: ["generate", "--target", _target_dir(t, '{"model_type": "qwen3_5",'), "hi"], False),
    "unsupported-model-type": (lambda t: ["generate", "--target", _target_dir(t, LLAMA, weights=True), "hi"], False),
    "no-target": (lambda t: ["generate", "hi"], False),
    "bad-devices": (lambda t: ["generate", "--target", t / "x", "--devices", "gpu:0", "hi"], False),
    "cuda-not-available": (lambda t: ["generate", "--target", t / "x", "--devices", "cuda:7", "hi"], False),
    "unknown-method": (lambda t: ["generate", "--target", t / "x", "--method", "beam", "hi"], False),
    "bad-budget": (lambda t: ["generate", "--target", t / "x", "--budget", "lots", "hi"], False),
    "bad-dtype": (lambda t: ["generate", "--target", t / "x", "--dtype", "int3", "hi"], False),
    "negative-temperature": (lambda t: ["generate", "--target", t / "x", "--temperature", "-1", "hi"], False),
    "missing-config-file": (lambda t: ["generate", "--config", t / "nope.toml", "hi"], False),
    "missing-drafter-for-dflash": (lambda t: ["generate", "--target", FIXTURE_DIR / "target", "--method", "dflash", "hi"], True),
    "empty-prompt": (lambda t: ["generate", "--target", FIXTURE_DIR / "target", "   "], True),
    "no-prompt": (lambda t: ["generate", "--target", FIXTURE_DIR / "target"], True),
    "prompt-longer-than-max-length": (
        lambda t: ["generate", "--target", FIXTURE_DIR / "target", "--max-length", "8", "--raw", PROMPT * 4], True),
    "missing-drafter-path": (
        lambda t: ["generate", "--target", FIXTURE_DIR / "target", "--drafter", t / "nodrafter", "hi"], True),
    "bench-unknown-suite": (
        lambda t: ["bench", "--target", FIXTURE_DIR / "target", "--drafter", FIXTURE_DIR / "drafter", "--prompts", "poetry"], False),
    "bench-bad-prompts-file": (
        lambda t: ["bench", "--target", FIXTURE_DIR / "target", "--drafter", FIXTURE_DIR / "drafter", "--prompts", _bad_prompts(t)],
        False),
    "bench-missing-prompts-file": (lambda t: ["bench", "--target", t / "x", "--prompts", t / "none.jsonl"], False),
    "bench-unknown-method": (lambda t: ["bench", "--target", t / "x", "--methods", "ar,medusa"], False),
    "bench-missing-drafter": (
        lambda t: ["bench", "--target", FIXTURE_DIR / "target", "--prompts", "code", "--methods", "ar,ddtree"], True),
    "plot-missing-results": (lambda t: ["plot", t / "none.json"], False),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_input_one_line_exit_2(case, tmp_path):
    build, needs_fixture = ERROR_CASES[case]
    if needs_fixture:
        skip_without_fixture()
    r = invoke(*build(tmp_path))
    assert r.exit_code == 2, (r.exit_code, r.stdout, r.stderr, r.exception)
    assert isinstance(r.exception, SystemExit)
    assert_one_line_error(r.stderr, r.stdout)


def test_repo_not_cached_offline(tmp_path, monkeypatch):
    """A hub id that is not in the local cache while offline: one line naming the fix."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    r = invoke("generate", "--target", "no-such-org/no-such-model", "hi")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert "not in the local Hugging Face cache" in r.stderr


def test_bad_input_subprocess_has_no_traceback(tmp_path):
    d = _target_dir(tmp_path, "{not json")
    r = run_ddtree("generate", "--target", d, "hello")
    assert r.returncode == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert "malformed" in r.stderr


def test_usage_errors_exit_2():
    r = invoke("generate", "--max-new-tokens", "many", "hi")
    assert r.exit_code == 2
    r = invoke("frobnicate")
    assert r.exit_code == 2


def test_tp_without_module_is_one_line(monkeypatch):
    """--tp N when ddtree.parallel.tp is absent: one line, exit 2."""
    import sys

    import ddtree.parallel

    monkeypatch.setitem(sys.modules, "ddtree.parallel.tp", None)  # makes `from ddtree.parallel import tp` fail
    monkeypatch.delattr(ddtree.parallel, "tp", raising=False)
    r = invoke("generate", "--target", REPO / "nope", "--tp", "2", "hi")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert "tensor parallelism not available" in r.stderr


def test_out_of_memory_is_one_line(monkeypatch):
    """CUDA OOM anywhere in a command: one line naming the stage and the fixes, exit 2."""
    import torch

    import ddtree.app.bench

    skip_without_fixture()

    def oom(spec, max_len, with_drafter, stage=None, **kw):
        stage("loading the target")
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(ddtree.app.bench, "load_models", oom)
    r = invoke("generate", *fixture_args("ar", 4), PROMPT)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert "out of GPU memory while loading the target" in r.stderr and "--devices cuda:0,cuda:1" in r.stderr

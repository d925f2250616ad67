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
    r = run_ddtree("selftest", "--max-new-tokens", "24", "--devices", "cpu", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "selftest passed" in r.stdout
    for label in ("ar", "dflash", "ddtree 4", "ddtree 32"):
        assert label in r.stdout
    assert "tok/s" in r.stdout and "acceptance length" in r.stdout
    assert "Traceback" not in r.stderr


def _selftest_options(monkeypatch, opts: dict) -> list:
    """Run `ddtree selftest` in-process with opts; -> the Options its random pair was built with."""
    import ddtree.decode.random_pair as random_pair
    from ddtree.app.selftest import run_selftest

    seen = []
    real = random_pair.build_random_pair

    def spy(*a, **kw):
        seen.append(kw.get("options"))
        return real(*a, **kw)

    monkeypatch.setattr(random_pair, "build_random_pair", spy)
    run_selftest(opts, lambda s: None)
    return seen


def test_selftest_takes_the_switches(monkeypatch, capsys):
    """`ddtree selftest` decodes with the DDTREE_* switches of the environment (here the host-tree
    round loop and the dense-mask attention twin), names them in its header, and still passes."""
    monkeypatch.setenv("DDTREE_HOST_ROUNDS", "1")
    monkeypatch.setenv("DDTREE_ATTENTION", "sdpa")
    seen = _selftest_options(monkeypatch, {"devices": "cpu", "max_new_tokens": 12})
    out = capsys.readouterr().out
    assert seen and seen[0].host_rounds and seen[0].attention == "sdpa"
    assert "switches DDTREE_ATTENTION=sdpa DDTREE_HOST_ROUNDS=1" in out and "selftest passed" in out


@pytest.mark.parametrize("compiled", [False, True])
def test_selftest_layers_eager_unless_compiled(monkeypatch, compiled):
    """`ddtree selftest` builds its pair with the eager layers (no torch.compile: on a GPU that costs
    more than the decoding) unless --compiled; the environment's other switches stay."""
    monkeypatch.setenv("DDTREE_ATTENTION", "sdpa")
    seen = _selftest_options(monkeypatch, {"devices": "cpu", "max_new_tokens": 8, "compiled": compiled})
    assert seen[0].compile is compiled and seen[0].attention == "sdpa"


def test_selftest_bad_switch_is_one_error_line(monkeypatch):
    monkeypatch.setenv("DDTREE_ATTENTION", "flash")
    r = invoke("selftest", "--devices", "cpu")
    assert r.exit_code == 2
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "DDTREE_ATTENTION" in lines[0], r.output


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
    """The README's CPU command (shorter), in a real process from the repo root."""
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

    import ddtree.app.setup

    skip_without_fixture()

    def oom(spec, max_len, with_drafter, stage=None, **kw):
        stage("loading the target")
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(ddtree.app.setup, "load_models", oom)
    r = invoke("generate", *fixture_args("ar", 4), PROMPT)
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert "out of GPU memory while loading the target" in r.stderr and "--devices cuda:0,cuda:1" in r.stderr


# ------------------------------------------------------------------------------------------ one line, every time

from app_helpers import tiny_pair_fixture  # noqa: E402

tiny_pair = tiny_pair_fixture()


def tiny_args(tiny_pair, method: str = "ar", n: int = 6) -> list:
    tdir, ddir = tiny_pair
    args = ["--target", tdir, "--devices", "cpu", "--method", method, "--max-new-tokens", str(n)]
    return args + (["--drafter", ddir] if method != "ar" else [])


def test_click_parse_errors_are_one_line(tmp_path):
    """What click itself rejects reads like every other bad input: one line naming the flag."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    cases = {
        ("generate", "--max-new-tokens", "abc", "hi"): "--max-new-tokens",
        ("generate", "--stats-json", tmp_path, "hi"): "--stats-json",
        ("generate", "--top-p", "2", "hi"): "--top-p",
        ("generate", "--frobnicate", "hi"): "--frobnicate",
        ("frobnicate",): "frobnicate",
        ("plot",): "RESULTS",
        ("plot", afile, "--out", afile): "--out",
        ("bench", "--warmup", "-1"): "--warmup",
        ("selftest", "--devices", "nonsense"): "--devices",
        ("selftest", "--device", "nonsense"): "--devices",  # the alias: the message names the flag the help shows
    }
    for args, flag in cases.items():
        r = invoke(*args)
        assert r.exit_code == 2, (args, r.stderr)
        assert_one_line_error(r.stderr, r.stdout)
        assert flag in r.stderr, (args, r.stderr)
        assert "Usage:" not in r.stderr and "╭" not in r.stderr


BAD_FAST = [  # (args, in the message): each wrong before any model is needed
    (["generate", "--method", "beam", "hi"], "--method"),
    (["generate", "--budget", "lots", "hi"], "--budget"),
    (["generate", "--temperature", "-1", "hi"], "--temperature"),
    (["generate", "--dtype", "int3", "hi"], "--dtype"),
    (["generate", "--devices", "gpu:0", "hi"], "--devices"),
    (["generate", "--target", "/no/such/model", "hi"], "not found"),
    (["generate", "--config", "/no/such.toml", "hi"], "config file"),
    (["bench", "--methods", "ar,medusa"], "--methods"),
    (["plot", "/no/such/results.json"], "not found"),
    (["selftest", "--devices", "tpu"], "--devices"),
]


def test_bad_arguments_cost_no_torch_import(tiny_pair, tmp_path):
    """Arguments and paths are checked before torch or transformers is imported: in a fresh
    process every bad input below ends in one line, exit 2, with neither imported."""
    tdir, ddir = tiny_pair
    cases = [a for a, _ in BAD_FAST] + [
        ["generate", "--target", ddir, "hi"],  # a DFlash drafter as the target
        ["generate", "--target", tdir, "--stats-json", tmp_path, "hi"],  # a directory
        ["bench", "--target", tdir, "--drafter", ddir, "--prompts", "poetry"],
        ["bench", "--target", tdir, "--drafter", ddir, "--out", tmp_path],
    ]
    script = (
        "import json, sys\nfrom typer.main import get_command\nfrom ddtree.app.cli import app\n"
        "cmd = get_command(app)\nout = []\n"
        "for args in json.loads(sys.argv[1]):\n"
        "    try:\n        cmd.main(args, prog_name='ddtree')\n    except SystemExit as e:\n        out.append(e.code)\n"
        "print(json.dumps({'codes': out, 'heavy': sorted(m for m in ('torch', 'transformers') if m in sys.modules)}))\n"
    )
    import json
    import subprocess
    import sys

    from conftest import cli_env

    r = subprocess.run([sys.executable, "-c", script, json.dumps([[str(a) for a in c] for c in cases])],
                       capture_output=True, text=True, cwd=str(REPO), env=cli_env(), timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["codes"] == [2] * len(cases), r.stderr
    assert res["heavy"] == [], "imported before the argument check: " + ", ".join(res["heavy"])
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == len(cases) and all(ln.startswith("error: ") for ln in lines), r.stderr
    for (args, needle), line in zip(BAD_FAST, lines):
        assert needle in line, (args, line)
    assert "is a DFlash drafter: pass it as --drafter" in lines[len(BAD_FAST)]
    assert "--stats-json" in lines[len(BAD_FAST) + 1] and "--out" in lines[-1]


def test_bad_argument_process_is_fast():
    """A mistake costs well under a second, process start included (it used to take ~4 s)."""
    import time

    t0 = time.monotonic()
    r = run_ddtree("generate", "--method", "beam", "--target", "/no/such/model", "hi")
    wall = time.monotonic() - t0
    assert r.returncode == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert wall < 1.5, f"{wall:.2f} s"


def test_output_paths_checked_before_loading(tiny_pair, tmp_path):
    """--stats-json / --out that cannot be written fail before any model loads, naming the flag;
    a missing folder is created, and said so."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    r = invoke("generate", *tiny_args(tiny_pair), "--stats-json", afile / "s.json", "hi")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert "--stats-json" in r.stderr and "--out" not in r.stderr
    r = invoke("bench", *tiny_args(tiny_pair)[:4], "--methods", "ar", "--prompts", "code", "--out", afile / "r.json")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert "--out" in r.stderr
    stats = tmp_path / "new" / "sub" / "s.json"
    r = invoke("generate", *tiny_args(tiny_pair), "--stats-json", stats, "hi")
    assert r.exit_code == 0, r.stderr
    assert f"created folder {stats.parent} for --stats-json" in r.stderr
    validate_document(read_json(stats))


def test_target_checks_name_the_problem(tiny_pair, tmp_path):
    """A DFlash drafter as --target, a target folder without tokenizer files, an empty tokenizer:
    one line each; no internal prompt id in any message."""
    import shutil

    tdir, ddir = tiny_pair
    r = invoke("generate", "--target", ddir, "hi")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert f"--target {ddir} is a DFlash drafter: pass it as --drafter" in r.stderr
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in tdir.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, bare / f.name)
    r = invoke("generate", "--target", bare, "--devices", "cpu", "hi")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert "has no tokenizer files" in r.stderr and "encodes to no tokens" not in r.stderr
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(bare / "tokenizer.json"))  # a vocabulary of nothing
    r = invoke("generate", "--target", bare, "--devices", "cpu", "hi")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, r.stdout)
    assert "tokenizer" in r.stderr and "is empty" in r.stderr
    assert "'cli'" not in r.stderr and "'stdin'" not in r.stderr


def test_prompt_messages_name_no_internal_id():
    from types import SimpleNamespace

    from ddtree.app.prompts import Prompt
    from ddtree.app.setup import encode_prompt
    from ddtree.errors import DDTreeError

    spec = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None, encode=lambda text, add_special_tokens: []))
    with pytest.raises(DDTreeError) as e:
        encode_prompt(spec, Prompt(id="cli", text="x", from_cli=True), raw=True, thinking=False)
    assert str(e.value).startswith("the prompt encodes to no tokens") and "cli" not in str(e.value)
    with pytest.raises(DDTreeError, match="prompt 'p7' encodes to no tokens"):
        encode_prompt(spec, Prompt(id="p7", text="x"), raw=True, thinking=False)


def test_stdin_loses_one_trailing_newline(tiny_pair, tmp_path):
    """`echo x | ddtree generate -` sees the prompt `ddtree generate x` sees; the summary says
    how long the prompt was, and 1 round is "1 round"."""
    docs = {}
    for name, args, stdin in (("arg", ["hello world"], None), ("stdin", ["-"], "hello world\n"),
                              ("crlf", ["-"], "hello world\r\n"), ("two", ["-"], "hello world\n\n")):
        stats = tmp_path / f"{name}.json"
        r = invoke("generate", *tiny_args(tiny_pair, n=2), "--stats-json", stats, *args, input=stdin)
        assert r.exit_code == 0, r.stderr
        docs[name] = read_json(stats)["runs"][0]["prompts"][0]
        assert f"2 new tokens from a {docs[name]['prompt_tokens']}-token prompt" in r.stderr
        assert "over 1 round" in r.stderr and "1 rounds" not in r.stderr
    assert docs["arg"]["prompt_tokens"] == docs["stdin"]["prompt_tokens"] == docs["crlf"]["prompt_tokens"] == 11
    assert docs["two"]["prompt_tokens"] == 12  # exactly one newline is dropped
    assert docs["arg"]["token_ids"] == docs["stdin"]["token_ids"]


def test_generate_jsonl_one_object_per_prompt(tiny_pair, tmp_path):
    import json

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "first"}\n{"id": "b", "prompt": "second one"}\n')
    stats = tmp_path / "s.json"
    r = invoke("generate", *tiny_args(tiny_pair, "dflash", 5), "--prompts", prompts, "--jsonl", "--stats-json", stats)
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2
    objs = [json.loads(line) for line in lines]
    doc = read_json(stats)["runs"][0]["prompts"]
    assert [o["id"] for o in objs] == ["a", "b"]
    for o, p in zip(objs, doc):
        assert o["text"] == p["text"] and o["new_tokens"] == p["new_tokens"] == 5 and o["interrupted"] is False
        assert o["prompt_tokens"] == p["prompt_tokens"] and o["method"] == "dflash"
        assert o["tokens_per_target_forward"] == pytest.approx(p["tokens_per_target_forward"])
    # without --jsonl: the texts one after another, each ending with a newline, and a hint
    r = invoke("generate", *tiny_args(tiny_pair, "dflash", 5), "--prompts", prompts)
    assert r.stdout == "".join(p["text"] + "\n" for p in doc)
    assert "--jsonl prints one JSON object per prompt" in r.stderr


def test_generate_freezes_the_heap_before_later_prompts(tiny_pair, tmp_path, monkeypatch):
    """The command keeps one decoder for its prompts: from the second prompt on, what the prompts
    before left behind (compiled layers, captured graphs) is frozen, as chat does between turns, so
    no full collection rescans it inside a prompt; the first prompt waits for no collection."""
    import gc

    from app_helpers import heap_frozen_at_each_generate

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "first"}\n{"id": "b", "prompt": "second"}\n{"id": "c", "prompt": "third"}\n')
    frozen = heap_frozen_at_each_generate(monkeypatch)
    try:
        r = invoke("generate", *tiny_args(tiny_pair, "dflash", 3), "--prompts", prompts)
        assert r.exit_code == 0, r.stderr
        assert frozen == [False, True, True]
    finally:
        gc.unfreeze()


def test_ignored_options_warn_once_and_bad_input_stays_one_line(tiny_pair, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "first"}\n')
    r = invoke("generate", *tiny_args(tiny_pair), "--budget", "8", "--thinking", "--top-k", "4", "--prompts", prompts,
               "hello")
    assert r.exit_code == 0, r.stderr
    warnings = [ln for ln in r.stderr.splitlines() if " W " in ln]
    assert any("--budget is ignored" in w and "the method is ar" in w for w in warnings)
    assert any("--thinking is ignored" in w and "no chat template" in w for w in warnings)
    assert any("--top-k is ignored" in w for w in warnings)
    assert any("--prompts is ignored" in w and "PROMPT" in w for w in warnings)
    assert len(warnings) == len(set(warnings)) == 4
    r = invoke("bench", *tiny_args(tiny_pair, n=2)[:4], "--methods", "ar", "--budgets", "4", "--prompts", prompts,
               "--warmup", "0", "--out", tmp_path / "b.json")
    assert r.exit_code == 0, r.stderr
    assert "--budgets is ignored: --methods has no ddtree" in r.stderr
    # a flag that would only warn, next to bad input: still exactly the one error line
    r = invoke("generate", *tiny_args(tiny_pair), "--budget", "8", "--max-length", "4", "hello")
    assert r.exit_code == 2
    assert_one_line_error(r.stderr, r.stdout)


def test_verbose_logs_what_a_run_took(tiny_pair):
    r = invoke("generate", *tiny_args(tiny_pair, "ddtree", 4), "--budget", "4", "-v", "hello")
    assert r.exit_code == 0, r.stderr
    for needle in ("placement: target layers 0-3 on cpu", "dtype float32; state length", "paths: cuda_graphs False",
                   "rounds_ahead", "kernels", "tokenizer ", "the prompt: 5 tokens"):
        assert needle in r.stderr, needle
    quiet = invoke("generate", *tiny_args(tiny_pair, "ddtree", 4), "--budget", "4", "hello")
    assert "placement:" not in quiet.stderr and " D " not in quiet.stderr
    assert quiet.stdout == r.stdout


def test_generate_budget_auto_stats_plot(tiny_pair, tmp_path):
    """generate --budget auto --stats-json: budget null, budget_setting auto; ddtree plot reads it."""
    pytest.importorskip("matplotlib")
    stats = tmp_path / "auto.json.gz"
    r = invoke("generate", *tiny_args(tiny_pair, "ddtree", 12), "--budget", "auto", "--stats-json", stats, "hello")
    assert r.exit_code == 0, r.stderr
    doc = read_json(stats)
    validate_document(doc)
    (run,) = doc["runs"]
    assert run["budget"] is None and run["budget_setting"] == "auto" and doc["metadata"]["budget"] == "auto"
    a = run["aggregate"]
    assert a["num_plain_steps"] + a["num_drafts"] == a["rounds"]
    assert f"{a['tokens_per_target_forward']:.2f} tokens per target forward over" in r.stderr
    r = invoke("plot", stats)
    assert r.exit_code == 0, r.stderr
    assert len(r.stdout.splitlines()) == 3 and str(tmp_path / "auto-plots") in r.stdout


def split_paths(tiny_pair, tmp_path, devices: str, monkeypatch, eager: bool) -> dict:
    """generate over a layer split (`--devices` with two entries) -> the statistics' decoder paths."""
    if eager:
        monkeypatch.setenv("DDTREE_EAGER_SPLIT", "1")
    else:
        monkeypatch.delenv("DDTREE_EAGER_SPLIT", raising=False)
    stats = tmp_path / f"split-{eager}.json"
    args = tiny_args(tiny_pair, "ddtree", 6)
    args[args.index("--devices") + 1] = devices
    r = invoke("generate", *args, "--budget", "4", "--dtype", "float32", "--stats-json", stats, "hello")
    assert r.exit_code == 0, r.stderr
    return read_json(stats)["metadata"]


@pytest.mark.parametrize("eager", [False, True])
def test_split_default_on_cpu_is_the_eager_twin(tiny_pair, tmp_path, monkeypatch, eager):
    """--devices cpu,cpu: the graphed split is the default switch (DDTREE_EAGER_SPLIT=1 turns it
    off), but a CPU has no CUDA graphs, so both run the eager split (tests/decode/test_split_gpu.py
    checks the graphed path on CUDA)."""
    meta = split_paths(tiny_pair, tmp_path, "cpu,cpu", monkeypatch, eager)
    assert meta["devices"] == ["cpu", "cpu"]
    assert meta["options"]["split_graphs"] is (not eager)
    assert meta["cuda_graphs"] is False

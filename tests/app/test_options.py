"""The option table (ddtree.app.options) is the one definition: every command's flags, every TOML
key and the options table of docs/USAGE.md come from it and agree with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.main import get_command

from ddtree.app.cli import app, resolve_options
from ddtree.app.options import BY_NAME, COMMANDS, OPTIONS, defaults, markdown_table, options_for
from ddtree.app.settings import KNOWN_KEYS, load_settings

REPO = Path(__file__).resolve().parents[2]

# a valid value other than the default, per option (a new option needs one here)
EXAMPLES = {
    "target": "some/target", "drafter": "some/drafter", "method": "dflash", "budget": "auto", "methods": "ar,ddtree",
    "budgets": "4,auto", "prompts": "math", "limit": 3, "max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9,
    "top_k": 5, "seed": 11, "dtype": "float16", "devices": "cpu", "max_length": 999, "raw": True, "thinking": False,
    "top1_first": True, "tp": 2, "stats_json": "s.json", "jsonl": True, "warmup": 0, "interleave": True, "out": "r.json",
    "verbose": True, "gpu_memory": "2x48GiB", "attention": "math", "prompt_tokens": 4096, "system": "be brief",
    "chat": True, "compiled": True, "server": "http://127.0.0.1:9", "api_key": "k", "host": "0.0.0.0", "port": 9,
    "max_queue": 3,
}


def test_every_command_has_exactly_the_table_options():
    click_app = get_command(app)
    assert set(click_app.commands) == set(COMMANDS)
    for name in COMMANDS:
        params = {p.name for p in click_app.commands[name].params}
        want = {o.name for o in options_for(name)}  # (click adds --help when the context is made)
        assert params == want, name


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_is_a_settings_key(command, tmp_path):
    """Each option of each command, set in a TOML file, is accepted and reaches that command's
    options (plot takes `out` from its flag only: a config's `out` is bench's result file)."""
    for o in options_for(command):
        if o.argument or o.name == "config":
            continue
        assert o.name in KNOWN_KEYS, o.name
        value = EXAMPLES[o.name]
        assert value != o.default_for(command), o.name
        cfg = tmp_path / f"{command}-{o.name}.toml"
        cfg.write_text(f"[section]\n{o.name.replace('_', '-')} = {_toml(value)}\n")
        assert load_settings(cfg) == {o.name: value}
        opts, given = resolve_options(command, {"config": cfg})
        assert given == frozenset()
        want = value if o.file_applies(command) else o.default_for(command)
        assert opts[o.name] == want, (command, o.name)


def test_selftest_device_alias(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('device = "cpu"\n')
    assert load_settings(cfg) == {"devices": "cpu"}
    r = get_command(app).commands["selftest"]
    assert {"--devices", "--device"} <= set(next(p for p in r.params if p.name == "devices").opts)


def test_flags_override_file_and_file_overrides_defaults(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('max_new_tokens = 9\nwarmup = 3\nmethod = "ar"\n')
    opts, given = resolve_options("bench", {"config": cfg, "warmup": 0, "max_new_tokens": None})
    assert opts["max_new_tokens"] == 9 and opts["warmup"] == 0 and given == {"warmup"}
    assert "method" not in opts  # generate's key: left to generate
    assert opts["budgets"] == defaults("bench")["budgets"]


@pytest.mark.parametrize("text, message", [
    ("max_new_tokens = 0\n", "make it at least 1"),
    ("top_p = 1.5\n", "make it at most 1"),
    ("warmup = -1\n", "make it at least 0"),
    ("jsonl = 1\n", "true/false"),
])
def test_settings_values_checked_like_flags(tmp_path, text, message):
    from ddtree.errors import DDTreeError

    cfg = tmp_path / "c.toml"
    cfg.write_text(text)
    with pytest.raises(DDTreeError, match=message):
        load_settings(cfg)


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return str(v)


def test_usage_options_table_is_the_code():
    usage = (REPO / "docs" / "USAGE.md").read_text()
    table = markdown_table()
    assert table in usage, "docs/USAGE.md's options table differs from ddtree.app.options.markdown_table(): paste it"
    # and the table covers every option once
    rows = [ln for ln in table.splitlines()[2:]]
    assert len(rows) == len(OPTIONS)
    for o in OPTIONS:
        assert sum(r.split("|")[1].strip().startswith(f"`{o.flag}" + ("`" if o.argument or o.negative or not o.metavar else " "))
                   for r in rows) == 1, o.name


def test_help_states_what_the_docs_promise():
    from typer.testing import CliRunner

    def help_of(cmd):
        r = CliRunner().invoke(app, [cmd, "--help"], env={"COLUMNS": "200"})
        assert r.exit_code == 0
        return " ".join(r.stdout.split())

    gen = help_of("generate")
    assert "hf:DATASET" in gen and "auto" in gen
    assert "<bool>" not in gen and "ddtree.parallel" not in gen
    bench = help_of("bench")
    assert "auto is a budget too" in bench
    assert re.search(r"--warmup N\s+Uncounted warm-up generations", bench)
    plot = help_of("plot")
    assert "ddtree plot [OPTIONS] RESULTS" in plot and "{" not in plot.split("Options:")[0]
    assert "--devices, --device" in help_of("selftest")


def test_methods_defined_once():
    import ddtree.app.setup as setup
    import ddtree.decode.decoder as decoder
    from ddtree.decode.methods import METHODS

    assert decoder.METHODS is METHODS and setup.METHODS is METHODS
    assert BY_NAME["method"].help.startswith("ar, dflash")

"""TOML settings: loading, flattening, path resolution, precedence."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddtree.errors import DDTreeError
from ddtree.app.settings import KNOWN_KEYS, load_settings, merge

REPO = Path(__file__).resolve().parents[2]


def _toml(tmp_path, text, name="c.toml"):
    d = tmp_path / "configs"
    d.mkdir(exist_ok=True)
    p = d / name
    p.write_text(text)
    return p


def test_load_flattens_sections(tmp_path):
    p = _toml(tmp_path, '''
seed = 1
[model]
target = "Qwen/Qwen3.6-27B"
drafter = "z-lab/Qwen3.6-27B-DFlash"
[runtime]
devices = ["cuda:0", "cuda:1"]
dtype = "bfloat16"
[decoding]
max-new-tokens = 64
temperature = 0
budget = 32
[bench]
budgets = [4, 8]
raw = true
''')
    s = load_settings(p)
    assert s == {
        "seed": 1,
        "target": "Qwen/Qwen3.6-27B",
        "drafter": "z-lab/Qwen3.6-27B-DFlash",
        "devices": "cuda:0,cuda:1",
        "dtype": "bfloat16",
        "max_new_tokens": 64,
        "temperature": 0.0,
        "budget": 32,
        "budgets": "4,8",
        "raw": True,
    }
    assert isinstance(s["temperature"], float)


def test_missing_and_bad_toml(tmp_path):
    with pytest.raises(DDTreeError, match="not found"):
        load_settings(tmp_path / "nope.toml")
    p = _toml(tmp_path, 'target = "a"\nbudget = = 3\n')
    with pytest.raises(DDTreeError) as e:
        load_settings(p)
    assert "not valid TOML" in str(e.value) and "line 2" in str(e.value) and "\n" not in str(e.value)


def test_unknown_key_lists_known(tmp_path):
    p = _toml(tmp_path, '[decoding]\nmax_tokens = 5\n')
    with pytest.raises(DDTreeError) as e:
        load_settings(p)
    msg = str(e.value)
    assert "unknown key 'decoding.max_tokens'" in msg
    for k in KNOWN_KEYS:
        assert k in msg


def test_bad_types_and_duplicates(tmp_path):
    with pytest.raises(DDTreeError, match="max_new_tokens"):
        load_settings(_toml(tmp_path, 'max_new_tokens = "many"\n'))
    with pytest.raises(DDTreeError, match="true/false"):
        load_settings(_toml(tmp_path, 'raw = 1\n'))
    with pytest.raises(DDTreeError, match='integer or "auto"'):
        load_settings(_toml(tmp_path, 'budget = "lots"\n'))
    with pytest.raises(DDTreeError, match="sets 'seed' twice"):
        load_settings(_toml(tmp_path, 'seed = 1\n[x]\nseed = 2\n'))


def test_relative_paths(tmp_path, monkeypatch):
    # <tmp>/configs/c.toml; a model folder under the "repo root" <tmp>
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n')
    p = _toml(tmp_path, 'target = "models/tiny"\ndrafter = "z-lab/Qwen3-8B-DFlash-b16"\nprompts = "p.jsonl"\n')
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    s = load_settings(p)
    assert s["target"] == str(tmp_path / "models" / "tiny")
    assert s["prompts"] == str(tmp_path / "p.jsonl")
    assert s["drafter"] == "z-lab/Qwen3-8B-DFlash-b16"  # a hub id, kept
    # the current directory wins when the path exists there
    (cwd / "models" / "tiny").mkdir(parents=True)
    assert load_settings(p)["target"] == str(cwd / "models" / "tiny")


def test_merge_precedence():
    defaults = {"budget": "auto", "max_new_tokens": 256, "temperature": 0.0, "raw": False, "seed": 0}
    settings = {"max_new_tokens": 512, "temperature": 0.7, "raw": True}
    cli = {"max_new_tokens": 64, "temperature": None, "raw": None, "seed": None, "out": "r.json"}
    m = merge(settings, cli, defaults)
    assert m == {
        "budget": "auto",  # default
        "max_new_tokens": 64,  # CLI over file over default
        "temperature": 0.7,  # file over default (CLI unset)
        "raw": True,
        "seed": 0,
        "out": "r.json",
    }
    assert merge({}, {"raw": False}, {"raw": True})["raw"] is False  # an explicit False wins


@pytest.mark.parametrize("name", ["qwen3.6-27b-dflash", "qwen3.5-27b-dflash", "qwen3-8b-dflash", "codepair"])
def test_shipped_configs_load(name):
    s = load_settings(REPO / "configs" / f"{name}.toml")
    assert s["target"] and s["drafter"] and s["dtype"]
    if name == "codepair":
        assert s["devices"] == "cpu" and s["raw"] is True and s["max_new_tokens"] == 192
        assert s["methods"] == "ar,dflash,ddtree" and s["budgets"] == "4,8,16,32,64,128"
        if (REPO.parent / "shared" / "fixtures" / "codepair").is_dir():
            assert Path(s["target"]).is_dir() and Path(s["prompts"]).is_file()
    else:
        assert s["method"] == "ddtree" and s["budget"] == "auto" and s["max_new_tokens"] == 512
        assert s["temperature"] == 0.0

"""Prompt loading (JSONL files, built-in suites, hf: specs) and rendering."""

from __future__ import annotations

import json
import sys
import types

import pytest

from ddtree.errors import DDTreeError
from ddtree.app.prompts import SUITES, Prompt, load_prompts, render_prompt


def _write(tmp_path, lines, name="p.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_jsonl_good(tmp_path):
    p = _write(tmp_path, [
        json.dumps({"id": "x1", "prompt": "def f():"}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"id": 7, "prompt": "y", "source": "ignored.py"}),
    ])
    ps = load_prompts(str(p))
    assert [q.id for q in ps] == ["x1", "p-001", "7"]
    assert ps[0] == Prompt(id="x1", text="def f():", messages=None)
    assert ps[1].text is None and ps[1].messages == [{"role": "user", "content": "hi"}]
    assert [q.id for q in load_prompts(str(p), limit=2)] == ["x1", "p-001"]


def test_missing_file(tmp_path):
    with pytest.raises(DDTreeError) as e:
        load_prompts(str(tmp_path / "x.jsonl"))
    msg = str(e.value)
    assert "x.jsonl' not found" in msg and "code, math, chat" in msg and "\n" not in msg


def test_bad_json_line_number(tmp_path):
    p = _write(tmp_path, [json.dumps({"prompt": "a"}), "", '{"prompt": "b"', json.dumps({"prompt": "c"})])
    with pytest.raises(DDTreeError, match=r"line 3 is not valid JSON"):
        load_prompts(str(p))


def test_missing_field(tmp_path):
    p = _write(tmp_path, [json.dumps({"prompt": "a"}), json.dumps({"id": "q", "text": "oops"})])
    with pytest.raises(DDTreeError, match=r'line 2 has neither "prompt" nor "messages"'):
        load_prompts(str(p))


@pytest.mark.parametrize("line, pattern", [
    ('["a"]', "not an object"),
    ('{"prompt": 3}', 'non-string "prompt"'),
    ('{"messages": [{"role": "user"}]}', 'malformed "messages"'),
    ('{"messages": []}', 'malformed "messages"'),
])
def test_bad_fields(tmp_path, line, pattern):
    with pytest.raises(DDTreeError, match=pattern):
        load_prompts(str(_write(tmp_path, [line])))


def test_duplicate_ids(tmp_path):
    p = _write(tmp_path, [json.dumps({"id": "a", "prompt": "x"}), json.dumps({"id": "a", "prompt": "y"})])
    with pytest.raises(DDTreeError, match="repeats id 'a'"):
        load_prompts(str(p))


def test_empty_file(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_text("\n  \n")
    with pytest.raises(DDTreeError, match="has no prompts"):
        load_prompts(str(p))


def test_bad_limit(tmp_path):
    with pytest.raises(DDTreeError, match="positive integer"):
        load_prompts("code", limit=0)


@pytest.mark.parametrize("name", SUITES)
def test_suites_load(name):
    ps = load_prompts(name)
    assert 8 <= len(ps) <= 12
    assert len({p.id for p in ps}) == len(ps)
    for p in ps:
        if name == "chat":
            assert p.messages and p.messages[-1]["role"] == "user"
        else:
            assert p.text and len(p.text) > 20
    assert len(load_prompts(name, limit=3)) == 3


def test_unknown_suite_lists_known():
    with pytest.raises(DDTreeError) as e:
        load_prompts("poetry")
    msg = str(e.value)
    assert "unknown prompt suite 'poetry'" in msg
    for name in SUITES:
        assert name in msg


def test_codepair_fixture_prompts():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2].parent / "shared/fixtures/codepair/prompts.jsonl"
    if not path.is_file():
        pytest.skip("codepair fixture not present")
    ps = load_prompts(str(path))
    assert len(ps) == 32 and ps[0].id == "dev-000" and ps[0].text


def test_hf_without_datasets(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(DDTreeError, match="pip install datasets"):
        load_prompts("hf:openai/gsm8k@main:test:question")


class _FakeDS(list):
    column_names = ["question", "answer", "id"]


def test_hf_with_fake_datasets(monkeypatch):
    calls = []

    def load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        if name == "missing/ds":
            raise FileNotFoundError("Dataset 'missing/ds' doesn't exist on the Hub\nmore detail")
        rows = [{"question": f"q{i}?", "answer": "a", "id": None} for i in range(5)]
        ds = _FakeDS(rows)
        return ds if split else {"train": _FakeDS(rows[:1]), "test": ds}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    ps = load_prompts("hf:openai/gsm8k@main:test", limit=2)
    assert [p.text for p in ps] == ["q0?", "q1?"] and ps[0].id == "gsm8k-test-00000"
    assert calls[-1] == ("openai/gsm8k", "main", "test")
    ps = load_prompts("hf:openai/gsm8k@main")  # no split: prefers test
    assert len(ps) == 5
    assert load_prompts("hf:x:test:answer")[0].text == "a"
    with pytest.raises(DDTreeError, match="no column 'nope'"):
        load_prompts("hf:x:test:nope")
    with pytest.raises(DDTreeError) as e:
        load_prompts("hf:missing/ds:test")
    assert "could not load Hugging Face dataset 'missing/ds'" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DDTreeError, match="bad dataset spec"):
        load_prompts("hf:")


class FakeTokenizer:
    chat_template = "{% for m in messages %}...{% endfor %}"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking):
        self.calls.append((messages, add_generation_prompt, tokenize, enable_thinking))
        body = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return body + ("<assistant><think>" if enable_thinking else "<assistant>")


def test_render_prompt_chat_template():
    tok = FakeTokenizer()
    p = Prompt(id="a", text="hello")
    assert render_prompt(p, tok, raw=False, thinking=False) == "<user>hello<assistant>"
    assert tok.calls[-1] == ([{"role": "user", "content": "hello"}], True, False, False)
    m = Prompt(id="b", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert render_prompt(m, tok, raw=False, thinking=True) == "<system>s<user>u<assistant><think>"
    assert tok.calls[-1][3] is True


def test_render_prompt_raw_and_no_template():
    tok = FakeTokenizer()
    p = Prompt(id="a", text="def f():")
    assert render_prompt(p, tok, raw=True, thinking=False) == "def f():"
    assert tok.calls == []
    plain = types.SimpleNamespace(chat_template=None)
    m = Prompt(id="b", messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert render_prompt(m, plain, raw=False, thinking=False) == "s\nu"
    assert render_prompt(p, object(), raw=False, thinking=False) == "def f():"

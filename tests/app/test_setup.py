"""The shared model set-up (ddtree.app.setup): the target tokenizes as its own tokenizer.json does,
whatever class transformers maps its model type to."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from ddtree.app import setup as S
from ddtree.app.prompts import load_prompts


def test_fixture_prompts_encode_as_tokenizer_json(fixture_dir):
    """Every fixture prompt gets the ids tokenizers' own Tokenizer.from_file(tokenizer.json) gives
    (the target was trained with them), under the installed transformers; where transformers'
    class disagrees on its own (5.24: Qwen3_5Tokenizer), one notice says so."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    target = fixture_dir / "target"
    S.NOTICES.clear()
    tok = S.load_tokenizer(target)
    ref = Tokenizer.from_file(str(target / "tokenizer.json"))
    prompts = load_prompts(str(fixture_dir / "prompts.jsonl"))
    assert len(prompts) == 32
    spec = SimpleNamespace(tokenizer=tok)
    for p in prompts:
        assert S.encode_prompt(spec, p, raw=True, thinking=False) == ref.encode(p.text).ids, p.id
    assert tok.eos_token_id == 0 and tok.decode(ref.encode(prompts[0].text).ids) == prompts[0].text
    own = AutoTokenizer.from_pretrained(str(target))
    disagrees = sum(own.encode(p.text) != ref.encode(p.text).ids for p in prompts)
    if disagrees:
        assert len(S.NOTICES) == 1 and "tokenizing with tokenizer.json" in S.NOTICES[0]
        assert type(own).__name__ in S.NOTICES[0]
    else:  # a transformers that follows tokenizer.json: nothing to say
        assert S.NOTICES == []
    S.NOTICES.clear()


def test_generate_says_it_once(fixture_dir, one_thread):
    from ddtree.app.cli import app
    from transformers import AutoTokenizer

    r = CliRunner().invoke(app, ["generate", "--target", str(fixture_dir / "target"), "--devices", "cpu", "--method", "ar",
                                 "--raw", "--max-new-tokens", "2", "def f(x):\n    return x  + 1"])
    assert r.exit_code == 0, r.stderr
    own = AutoTokenizer.from_pretrained(str(fixture_dir / "target"))
    expect = 1 if type(own).__name__ != "TokenizersBackend" else 0
    assert r.stderr.count("tokenizing with tokenizer.json") == expect


def test_chat_template_kept_when_tokenizer_json_takes_over(fixture_dir, tmp_path):
    """The special tokens and chat template of tokenizer_config.json survive the switch."""
    import json
    import shutil

    d = tmp_path / "target"
    shutil.copytree(fixture_dir / "target", d, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    (d / "tokenizer_config.json").chmod(0o644)  # copied read-only from the fixture
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = S.load_tokenizer(d)
    S.NOTICES.clear()
    assert tok.chat_template == cfg["chat_template"]
    assert "<|im_start|>" in tok.all_special_tokens and tok.eos_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "<|im_start|>hi<|im_end|>"


@pytest.mark.parametrize("text, want", [("x\n", "x"), ("x\r\n", "x"), ("x\n\n", "x\n"), ("x", "x"), ("\n", "")])
def test_stdin_text_drops_one_newline(monkeypatch, text, want):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert S.stdin_text() == want

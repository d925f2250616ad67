"""The shared model set-up (ddtree.app.setup): the target tokenizes as its own tokenizer.json does,
whatever class transformers maps its model type to, and loads its tokenizer without AutoTokenizer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ddtree.app import setup as S
from ddtree.app.prompts import load_prompts


def test_fixture_prompts_encode_as_tokenizer_json(fixture_dir):
    """Every fixture prompt gets the ids tokenizers' own Tokenizer.from_file(tokenizer.json) gives
    (the target was trained with them), whatever class transformers maps the model type to
    (5.24: Qwen3_5Tokenizer, which splits differently); nothing to say about it."""
    from tokenizers import Tokenizer

    target = fixture_dir / "target"
    S.NOTICES.clear()
    tok = S.load_tokenizer(target)
    ref = Tokenizer.from_file(str(target / "tokenizer.json"))
    prompts = load_prompts(str(fixture_dir / "prompts.jsonl"))
    assert len(prompts) == 32
    spec = SimpleNamespace(tokenizer=tok)
    for p in prompts:
        assert S.encode_prompt(spec, p, raw=True, thinking=False) == ref.encode(p.text).ids, p.id
        assert tok.decode(ref.encode(p.text).ids) == ref.decode(ref.encode(p.text).ids), p.id
    assert tok.eos_token_id == 0 and tok.decode(ref.encode(prompts[0].text).ids) == prompts[0].text
    assert S.NOTICES == []


@pytest.mark.parametrize("extra, want", [
    ({}, ["JsonTokenizer", "8192", "[]"]),  # tokenizer.json through tokenizers alone: no transformers at all
    ({"add_prefix_space": False}, ["TokenizersBackend", "8192", "['transformers']"]),  # a key JsonTokenizer leaves to transformers
])
def test_tokenizer_loads_without_the_model_registry(fixture_dir, tmp_path, extra, want):
    """A fresh process loading the target's tokenizer (tokenizer_config.json naming another class,
    as Qwen's do) imports neither transformers' model registry (AutoTokenizer's import: seconds,
    with torch.distributed.tensor, torch._dynamo and sklearn behind it) nor torch, and warns
    nothing; where the config adds nothing to tokenizer.json, not even transformers."""
    import subprocess
    import sys

    from helpers import tokenizer_checkpoint

    d = tokenizer_checkpoint(fixture_dir, tmp_path, tokenizer_class="Qwen2Tokenizer", **extra)
    code = ("import sys; from pathlib import Path; from loguru import logger; from ddtree.app.setup import load_tokenizer; "
            "logger.remove(); logger.add(sys.stderr, level='INFO'); "  # as the CLI logs without -v
            f"tok = load_tokenizer(Path({str(d)!r})); "
            "print(type(tok).__name__, len(tok), sorted(m for m in sys.modules if m in "
            "('transformers', 'transformers.models.auto.auto_factory', 'torch', 'torch._dynamo', 'sklearn')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.replace(", ", ",").split() == want, r.stdout
    assert r.stderr.strip() == "", r.stderr


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


# ------------------------------------------------------------------------------- --prompt-tokens

CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("templated", [False, True])
def test_fit_prompt_exact_lengths(fixture_dir, templated):
    """Every fixture prompt fits to exactly N tokens for N below, at and far above its length
    (the real BPE merges across the seams of the repeated text); a templated prompt keeps the
    template's head and its generation prompt, and the fitted text is the prompt's own, repeated."""
    from ddtree.app.prompts import Prompt

    tok = S.load_tokenizer(fixture_dir / "target")
    if templated:
        tok.chat_template = CHAT
    spec = SimpleNamespace(tokenizer=tok)
    prompts = load_prompts(str(fixture_dir / "prompts.jsonl"), 6)
    prompts.append(Prompt(id="chat", messages=[{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "def add(a, b):"}]))
    for p in prompts:
        base = S.encode_prompt(spec, p, raw=not templated, thinking=False)
        content = p.text or p.messages[-1]["content"]
        head = len(base) - len(tok.encode(content, add_special_tokens=False))  # the template's tokens
        for n in (len(base) // 2, len(base), len(base) + 1, 3 * len(base) + 7, 2000):
            if n <= head:
                continue
            ids = S.fit_prompt(spec, p, not templated, False, n)
            assert len(ids) == n, (p.id, n)
            if templated:
                tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
                assert ids[-len(tail):] == tail and ids[:4] == base[:4], (p.id, n)
            if n > 2 * len(base):  # the text repeats: its opening comes back
                text = tok.decode(ids)
                first = content[:12]
                assert text.count(first) >= 2, (p.id, n)


def test_fit_prompt_refuses_room_for_no_text(fixture_dir):
    from ddtree.app.prompts import Prompt
    from ddtree.errors import DDTreeError

    tok = S.load_tokenizer(fixture_dir / "target")
    tok.chat_template = CHAT
    spec = SimpleNamespace(tokenizer=tok)
    with pytest.raises(DDTreeError, match="--prompt-tokens 3 leaves no room"):
        S.fit_prompt(spec, Prompt(id="x", text="def f(): pass"), False, False, 3)


class _EvenTokenizer:
    """Encodes to an even number of ids (pads odd texts with id 0): no text has an odd length,
    so fit_prompt must fall back to fitting the ids themselves. Its chat template wraps the
    user's text as <TEXT>A: (A: is the generation prompt)."""

    chat_template = "<{{ content }}>A:"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text] + ([0] if len(text) % 2 else [])

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i)

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, enable_thinking):
        return "<" + messages[-1]["content"] + ">A:"


@pytest.mark.parametrize("n", [7, 9, 41])
def test_fit_prompt_when_no_text_has_the_length(n):
    from ddtree.app.prompts import Prompt

    spec = SimpleNamespace(tokenizer=_EvenTokenizer())
    ids = S.fit_prompt(spec, Prompt(id="x", text="abcdefghij"), False, False, n)
    assert len(ids) == n
    assert ids[-3:] == [ord(c) for c in ">A:"] and ids[0] == ord("<")  # the template's head and end kept
    assert set(ids[1:-3]) <= {ord(c) for c in "abcdefghij"} | {0}

"""JsonTokenizer (tokenizer.json through `tokenizers` alone) against its twin, transformers'
PreTrainedTokenizerFast over the same files: the same ids for random text (special tokens, unicode,
whitespace runs) with and without special tokens, the same text for random ids, the same length,
eos id and chat rendering; and transformers wherever the config asks for more than the file does."""

from __future__ import annotations

import random

import pytest

from ddtree.app import setup as S
from ddtree.app.tokenizer import JsonTokenizer, hf_tokenizer
from helpers import tokenizer_checkpoint

PIECES = ["def ", "f(x):", "\n", "    ", "\t", "return", " x", "  + 1", "12345", "héllo", "世界", "🙂", "\r\n", "'s",
          "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>", "<|im_start", "|>", " ", "class A:", "#", "é"]


@pytest.mark.parametrize("seed", [0, 1])
def test_json_tokenizer_equals_transformers(fixture_dir, tmp_path, seed):
    d = tokenizer_checkpoint(fixture_dir, tmp_path, tokenizer_class="Qwen2Tokenizer")
    tok = S.load_tokenizer(d)
    assert isinstance(tok, JsonTokenizer)
    hf = hf_tokenizer(d, fast=True)
    rng = random.Random(seed)
    assert len(tok) == len(hf) and tok.eos_token_id == hf.eos_token_id
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 30)))
        for special in (False, True):
            assert tok.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special), text
            assert tok(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)["input_ids"]
        ids = [rng.randrange(len(hf)) for _ in range(rng.randint(1, 40))]
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


def test_json_tokenizer_renders_the_template_as_transformers(fixture_dir, tmp_path):
    """A chat template is transformers' to render (loaded on first use); the rendered text's special
    tokens encode to the same ids."""
    chat = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    d = tokenizer_checkpoint(fixture_dir, tmp_path, chat_template=chat)
    tok = S.load_tokenizer(d)
    assert isinstance(tok, JsonTokenizer) and tok.chat_template == chat and tok._hf is None
    hf = hf_tokenizer(d, fast=True)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "def add(a, b):"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert "<|im_start|>" in tok.all_special_tokens  # other attributes: transformers' tokenizer


@pytest.mark.parametrize("extra, why", [
    ({"add_bos_token": True, "bos_token": "<|endoftext|>"}, "adds bos / eos"),
    ({"clean_up_tokenization_spaces": True}, "cleans up"),
    ({"add_prefix_space": True}, "sets add_prefix_space"),
    ({"extra_special_tokens": ["<|mask|>", "<|new|>"]}, "'<|new|>' is not a special added token"),
])
def test_transformers_where_the_config_asks_for_more(fixture_dir, tmp_path, extra, why):
    """A config JsonTokenizer would not follow exactly goes through transformers, which still
    encodes as it always did."""
    d = tokenizer_checkpoint(fixture_dir, tmp_path, **extra)
    tok, reason = JsonTokenizer.load(d)
    assert tok is None and why in reason
    loaded = S.load_tokenizer(d)
    assert not isinstance(loaded, JsonTokenizer)
    assert loaded.encode("def f(x):", add_special_tokens=False) == hf_tokenizer(d, True).encode("def f(x):", add_special_tokens=False)

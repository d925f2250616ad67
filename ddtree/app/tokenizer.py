"""The target's tokenizer without importing transformers where it would add nothing.

transformers' PreTrainedTokenizerFast over a checkpoint's tokenizer.json runs that file's pipeline
(`tokenizers.Tokenizer`) with tokenizer_config.json's special tokens on top. Where the config asks
for nothing the file does not already do (its special tokens are the file's own special added
tokens; no bos / eos added by the config, no clean-up, no extra pre-tokenizer options),
`JsonTokenizer` runs the same pipeline through `tokenizers` directly: importing transformers costs
1.1-1.2 s of a fresh process on the H200 machine (`scripts/bench_startup.py --cases phases`), a
fifth of a one-off prompt's start-up. A chat template is rendered by transformers, loaded on first
use (`apply_chat_template`), so raw prompts never import it. Anything else falls back to
PreTrainedTokenizerFast (ddtree.app.setup.load_tokenizer). Twin: tests/app/test_tokenizer.py
compares both on random text and ids.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# tokenizer_config.json keys that change nothing in how transformers encodes or decodes (given the
# checks in `direct_reason`); any other key sends the checkpoint through transformers
NEUTRAL_KEYS = frozenset({
    "backend", "tokenizer_class", "bos_token", "eos_token", "pad_token", "unk_token", "extra_special_tokens",
    "additional_special_tokens", "added_tokens_decoder", "model_max_length", "clean_up_tokenization_spaces",
    "add_bos_token", "add_eos_token", "padding_side", "truncation_side", "model_input_names", "errors",
    "chat_template", "auto_map", "processor_class", "name_or_path",
})
SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _content(tok: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(tok, dict):
        return tok.get("content")
    return tok if isinstance(tok, str) else None


def config_special_tokens(cfg: dict) -> list[str]:
    """Every token the config declares special (transformers registers each one as special)."""
    out = [_content(cfg.get(k)) for k in SPECIAL_KEYS]
    for key in ("extra_special_tokens", "additional_special_tokens"):
        extra = cfg.get(key) or []
        out += [_content(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
    out += [_content(t) for t in (cfg.get("added_tokens_decoder") or {}).values()]
    return [t for t in out if t]


def direct_reason(cfg: dict, file_added: dict[str, bool]) -> str | None:
    """Why this checkpoint needs transformers to tokenize exactly as PreTrainedTokenizerFast does
    (None: JsonTokenizer does). file_added: tokenizer.json's added tokens -> special flag."""
    extra = sorted(set(cfg) - NEUTRAL_KEYS)
    if extra:
        return f"tokenizer_config.json sets {', '.join(extra)}"
    if cfg.get("add_bos_token") or cfg.get("add_eos_token"):
        return "tokenizer_config.json adds bos / eos tokens"
    if cfg.get("clean_up_tokenization_spaces"):
        return "tokenizer_config.json cleans up decoded spaces"
    for tok in config_special_tokens(cfg):
        if not file_added.get(tok, False):
            return f"special token {tok!r} is not a special added token of tokenizer.json"
    for entry in (cfg.get("added_tokens_decoder") or {}).values():
        if isinstance(entry, dict) and not entry.get("special", True):
            return "tokenizer_config.json adds non-special tokens"
    return None


def chat_template_of(model_dir: Path, cfg: dict) -> Any:
    """The checkpoint's chat template (what transformers would read), or None."""
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    js = model_dir / "chat_template.json"
    if js.is_file():
        return json.loads(js.read_text()).get("chat_template")
    return cfg.get("chat_template")


class JsonTokenizer:
    """tokenizer.json's pipeline, the subset of transformers' tokenizer interface ddtree uses
    (encode, __call__, decode, len, eos_token_id, chat_template, apply_chat_template); any other
    attribute comes from transformers' PreTrainedTokenizerFast, loaded on first use."""

    def __init__(self, model_dir: Path, backend, cfg: dict):
        self.model_dir, self.backend, self.cfg = model_dir, backend, cfg
        self.chat_template = chat_template_of(model_dir, cfg)
        self.eos_token = _content(cfg.get("eos_token"))
        self.eos_token_id = None if self.eos_token is None else backend.token_to_id(self.eos_token)
        self._hf = None

    @classmethod
    def load(cls, model_dir: Path) -> tuple["JsonTokenizer | None", str | None]:
        """-> (the tokenizer, None), or (None, why transformers must load it)."""
        from tokenizers import Tokenizer

        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        backend = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        backend.no_truncation()  # transformers encodes without the file's truncation and padding
        backend.no_padding()
        added = {t.content: t.special for t in backend.get_added_tokens_decoder().values()}
        why = direct_reason(cfg, added)
        return (None, why) if why else (cls(model_dir, backend, cfg), None)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if isinstance(ids, int):
            ids = [ids]
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def hf(self):
        """transformers' tokenizer over the same files (imports transformers: first use only)."""
        if self._hf is None:
            self._hf = hf_tokenizer(self.model_dir, fast=True)
        return self._hf

    def apply_chat_template(self, conversation, **kwargs):
        """transformers renders the template (this object's, which a caller may have replaced; named
        templates, a dict, are transformers' own to pick from)."""
        if isinstance(self.chat_template, str):
            kwargs.setdefault("chat_template", self.chat_template)
        return self.hf.apply_chat_template(conversation, **kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("model_dir", "backend", "cfg"):
            raise AttributeError(name)
        return getattr(self.hf, name)


def hf_tokenizer(model_dir: Path, fast: bool):
    """transformers' tokenizer of model_dir: PreTrainedTokenizerFast over tokenizer.json (fast), or
    AutoTokenizer (a checkpoint without tokenizer.json)."""
    if fast:
        from transformers import PreTrainedTokenizerFast as Loader
    else:
        from transformers import AutoTokenizer as Loader
    with _quiet_transformers():
        return Loader.from_pretrained(str(model_dir))


@contextmanager
def _quiet_transformers():
    """transformers' logger warns when tokenizer_config.json names another class than the one
    loading it (tokenizer_class: Qwen2Tokenizer): here that is the point, not news."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)

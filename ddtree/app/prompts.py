"""Prompts: JSONL files, built-in suites, and Hugging Face datasets.

``load_prompts(spec)`` accepts

* a path to a JSONL file, one JSON object per line with ``"prompt"`` (a string) or
  ``"messages"`` (a chat list of ``{"role", "content"}``) and an optional ``"id"``;
* a built-in suite name (``code``, ``math``, ``chat``), shipped as ``ddtree/app/suites/NAME.jsonl``;
* ``hf:DATASET[:SPLIT[:FIELD]]``, loaded with the ``datasets`` package (``DATASET`` may name a
  config as ``NAME@CONFIG``, e.g. ``hf:openai/gsm8k@main:test:question``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree.errors import DDTreeError

SUITES_DIR = Path(__file__).resolve().parent / "suites"
SUITES: tuple[str, ...] = ("code", "math", "chat")

# fields tried, in order, when hf:DATASET names no FIELD
_HF_FIELDS = ("messages", "conversations", "prompt", "question", "problem", "instruction", "input", "text")


@dataclass
class Prompt:
    id: str
    text: str | None = None
    messages: list[dict] | None = None
    from_cli: bool = False  # the PROMPT argument (or stdin), not an entry of a prompt set

    @property
    def label(self) -> str:
        """How messages name it: its id is internal when it came from the command line."""
        return "the prompt" if self.from_cli else f"prompt {self.id!r}"


def _known() -> str:
    return ", ".join(SUITES)


def _check_limit(limit: int | None) -> None:
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise DDTreeError(f"prompt limit must be a positive integer, got {limit!r}: pass --limit N with N >= 1")


def _valid_messages(msgs: Any) -> bool:
    return (
        isinstance(msgs, list)
        and len(msgs) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in msgs
        )
    )


def _prompt_from_obj(obj: Any, default_id: str, where: str) -> Prompt:
    if not isinstance(obj, dict):
        raise DDTreeError(
            f"{where} is a JSON {type(obj).__name__}, not an object: write one object per line "
            'like {"id": "p1", "prompt": "..."}'
        )
    pid = obj.get("id", default_id)
    pid = default_id if pid is None else str(pid)
    if "messages" in obj and obj["messages"] is not None:
        if not _valid_messages(obj["messages"]):
            raise DDTreeError(
                f'{where} has a malformed "messages" field: use a non-empty list of '
                '{"role": "...", "content": "..."} objects'
            )
        msgs = [{"role": m["role"], "content": m["content"]} for m in obj["messages"]]
        text = obj.get("prompt") if isinstance(obj.get("prompt"), str) else None
        return Prompt(id=pid, text=text, messages=msgs)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise DDTreeError(f'{where} has a non-string "prompt" field: make "prompt" a JSON string')
        return Prompt(id=pid, text=obj["prompt"], messages=None)
    raise DDTreeError(
        f'{where} has neither "prompt" nor "messages": add "prompt": "..." or '
        '"messages": [{"role": "user", "content": "..."}]'
    )


def _load_jsonl(path: Path, label: str, limit: int | None) -> list[Prompt]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DDTreeError(f"prompt file '{label}' is not UTF-8 text: save it as UTF-8 JSONL") from None
    except OSError as e:
        raise DDTreeError(f"cannot read prompt file '{label}' ({e.strerror or e}): check the path and permissions") from None
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DDTreeError(
                f"prompt file '{label}' line {lineno} is not valid JSON ({e.msg} at column {e.colno}): "
                "write one JSON object per line"
            ) from None
        p = _prompt_from_obj(obj, f"{path.stem}-{len(prompts):03d}", f"prompt file '{label}' line {lineno}")
        if p.id in seen:
            raise DDTreeError(
                f"prompt file '{label}' line {lineno} repeats id '{p.id}' (first on line {seen[p.id]}): "
                "give every prompt a unique id"
            )
        seen[p.id] = lineno
        prompts.append(p)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise DDTreeError(
            f"prompt file '{label}' has no prompts: add one JSON object per line with a "
            '"prompt" or "messages" field'
        )
    return prompts


def _load_hf(spec: str, limit: int | None) -> list[Prompt]:
    body = spec[3:]
    parts = body.split(":")
    if not parts[0] or len(parts) > 3:
        raise DDTreeError(
            f"bad dataset spec '{spec}': use hf:DATASET[:SPLIT[:FIELD]], e.g. hf:openai/gsm8k@main:test:question"
        )
    name = parts[0]
    split = parts[1] if len(parts) > 1 and parts[1] else None
    fld = parts[2] if len(parts) > 2 and parts[2] else None
    config = None
    if "@" in name:
        name, config = name.split("@", 1)
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise DDTreeError(
            f"loading '{spec}' needs the datasets package, which is not installed: install it with "
            "pip install datasets (or pass a JSONL file or a built-in suite: " + _known() + ")"
        ) from None

    def _first_line(e: BaseException) -> str:
        msg = str(e).strip().splitlines()
        return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__

    try:
        if split is None:
            dd = datasets.load_dataset(name, config)
            splits = list(dd.keys())
            split = "test" if "test" in splits else splits[0]
            ds = dd[split]
        else:
            ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # network, missing dataset/config/split, offline mode
        raise DDTreeError(
            f"could not load Hugging Face dataset '{name}'"
            + (f" config '{config}'" if config else "")
            + (f" split '{split}'" if split else "")
            + f" ({_first_line(e)}): check the name, split and network, or use a cached copy with HF_DATASETS_OFFLINE=1"
        ) from None

    columns = list(getattr(ds, "column_names", None) or (ds[0].keys() if len(ds) else []))
    if fld is None:
        fld = next((c for c in _HF_FIELDS if c in columns), None)
        if fld is None:
            raise DDTreeError(
                f"dataset '{name}' has no prompt-like column (columns: {', '.join(columns)}): "
                f"name one with hf:{parts[0]}:{split}:FIELD"
            )
    elif fld not in columns:
        raise DDTreeError(
            f"dataset '{name}' has no column '{fld}' (columns: {', '.join(columns)}): pick one of them as FIELD"
        )

    tag = name.rsplit("/", 1)[-1]
    prompts: list[Prompt] = []
    n = len(ds) if limit is None else min(limit, len(ds))
    for i in range(n):
        row = ds[i]
        value = row[fld]
        pid = str(row["id"]) if "id" in row and row["id"] is not None else f"{tag}-{split}-{i:05d}"
        if isinstance(value, str):
            prompts.append(Prompt(id=pid, text=value))
        elif isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
            msgs = []
            for m in value:  # accept both {role, content} and ShareGPT {from, value}
                role = m.get("role", m.get("from"))
                content = m.get("content", m.get("value"))
                role = {"human": "user", "gpt": "assistant"}.get(role, role)
                msgs.append({"role": str(role), "content": str(content)})
            # a chat ending with the assistant's answer: keep the turns before it as the prompt
            while len(msgs) > 1 and msgs[-1]["role"] == "assistant":
                msgs.pop()
            prompts.append(Prompt(id=pid, messages=msgs))
        else:
            raise DDTreeError(
                f"dataset '{name}' column '{fld}' holds {type(value).__name__} values, not text or chat "
                "messages: name a text column as FIELD"
            )
    if not prompts:
        raise DDTreeError(f"dataset '{name}' split '{split}' is empty: pick another split")
    return prompts


def load_prompts(spec: str, limit: int | None = None) -> list[Prompt]:
    """Load prompts from a JSONL path, a built-in suite name, or ``hf:DATASET[:SPLIT[:FIELD]]``.

    ``limit`` keeps the first ``limit`` prompts. Problems raise one-line :class:`DDTreeError`.
    """
    _check_limit(limit)
    spec = str(spec)
    if spec.startswith("hf:"):
        return _load_hf(spec, limit)
    path = Path(spec).expanduser()
    if path.is_file():
        return _load_jsonl(path, spec, limit)
    if spec in SUITES:
        return _load_jsonl(SUITES_DIR / f"{spec}.jsonl", spec, limit)
    if path.is_dir():
        raise DDTreeError(f"prompt file '{spec}' is a directory: pass a JSONL file or a built-in suite ({_known()})")
    looks_like_name = "/" not in spec and "\\" not in spec and "." not in spec
    if looks_like_name:
        raise DDTreeError(
            f"unknown prompt suite '{spec}': use one of {_known()}, a JSONL file path, or hf:DATASET[:SPLIT[:FIELD]]"
        )
    raise DDTreeError(f"prompt file '{spec}' not found: pass an existing JSONL file or a built-in suite ({_known()})")


def render_prompt(prompt: Prompt, tokenizer: Any, raw: bool, thinking: bool) -> str:
    """The text the model sees.

    Unless ``raw``, a tokenizer with a chat template renders ``prompt.messages`` (or the text as a
    single user turn) with the generation prompt added and ``enable_thinking=thinking``.
    Otherwise the plain text (messages without a template: their contents joined by newlines).
    """
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    if not raw and template:
        messages = prompt.messages if prompt.messages else [{"role": "user", "content": prompt.text or ""}]
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, enable_thinking=thinking
        )
        if not isinstance(out, str):
            raise DDTreeError(
                "the tokenizer's chat template did not return text: pass --raw to send prompts without it"
            )
        return out
    if prompt.text is not None:
        return prompt.text
    return "\n".join(m["content"] for m in (prompt.messages or []))

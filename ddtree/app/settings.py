"""TOML settings files (``--config FILE``); command-line flags override them.

A settings file may group keys in any tables (``[model]``, ``[decoding]``, ...) or none; the
tables are flattened, so only the key names matter and each may appear once. Keys are the CLI
option names (``max_new_tokens`` or ``max-new-tokens``), every option of every command but
``--config`` (``ddtree.app.options``); ``device`` is another name for ``devices``. A command takes
the keys it has and leaves the others to the commands they belong to (``methods`` is bench's,
``method`` generate's), so one file can serve both::

    [model]
    target = "Qwen/Qwen3.6-27B"
    drafter = "z-lab/Qwen3.6-27B-DFlash"

    [decoding]
    method = "ddtree"
    budget = "auto"

Relative paths in ``target``, ``drafter`` and ``prompts`` are resolved against the current
working directory if they exist there, else against the parent of the TOML file's folder (the
repository root for ``configs/*.toml``); values that exist in neither place (hub ids, suite
names, ``hf:`` specs) are kept as written. Arrays given for ``devices``, ``methods`` and
``budgets`` are joined into the comma-separated strings the flags take.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

try:  # Python >= 3.11
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from ddtree.errors import DDTreeError

from ddtree.app.options import ALIASES, BY_NAME, toml_keys

#: key -> accepted Python types (as tomllib produces them): every option of every command but --config
KNOWN_KEYS: dict[str, tuple[type, ...]] = toml_keys()

#: keys whose relative paths are resolved (see module docstring)
PATH_KEYS: tuple[str, ...] = ("target", "drafter", "prompts")
#: keys whose TOML arrays become comma-separated strings
LIST_KEYS: tuple[str, ...] = ("devices", "methods", "budgets")

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true/false", list: "an array"}


def _flatten(table: dict, prefix: str, out: dict[str, tuple[Any, str]], path: Path) -> None:
    for raw_key, value in table.items():
        key = raw_key.replace("-", "_")
        where = f"{prefix}{raw_key}"
        if isinstance(value, dict):
            _flatten(value, f"{where}.", out, path)
            continue
        if key not in KNOWN_KEYS:
            raise DDTreeError(
                f"config file '{path}' has unknown key '{where}': use only {', '.join(KNOWN_KEYS)}"
            )
        key = ALIASES.get(key, key)
        if key in out:
            raise DDTreeError(
                f"config file '{path}' sets '{key}' twice ('{out[key][1]}' and '{where}'): keep one of them"
            )
        out[key] = (value, where)


def _type_ok(value: Any, types: tuple[type, ...]) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _resolve_path(value: str, config_path: Path) -> str:
    if value.startswith("hf:"):
        return value
    p = Path(value).expanduser()
    if p.is_absolute():
        return str(p)
    if p.exists():
        return str(p.resolve())
    alt = (config_path.resolve().parent.parent / p).resolve()
    if alt.exists():
        return str(alt)
    return value


def load_settings(path: str | os.PathLike) -> dict:
    """Read a TOML settings file into a flat ``{option: value}`` dict (only the keys it sets)."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise DDTreeError(
            f"config file '{path}' not found: pass an existing TOML file, e.g. configs/qwen3.6-27b-dflash.toml"
        )
    try:
        with open(p, "rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        msg = " ".join(str(e).split())
        raise DDTreeError(f"config file '{path}' is not valid TOML ({msg}): fix the syntax there") from None
    except OSError as e:
        raise DDTreeError(f"cannot read config file '{path}' ({e.strerror or e}): check the path and permissions") from None

    flat: dict[str, tuple[Any, str]] = {}
    _flatten(data, "", flat, p)
    out: dict[str, Any] = {}
    for key, (value, where) in flat.items():
        types = KNOWN_KEYS[key]
        if not _type_ok(value, types):
            want = " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)
            raise DDTreeError(
                f"config file '{path}' key '{where}' is {type(value).__name__} {value!r}: make it {want}"
            )
        if key in LIST_KEYS and isinstance(value, list):
            value = ",".join(str(v) for v in value)
        elif key in LIST_KEYS and isinstance(value, int):
            value = str(value)
        if key == "budget" and isinstance(value, str) and value != "auto" and not value.strip().isdigit():
            raise DDTreeError(f"config file '{path}' key '{where}' is {value!r}: make it an integer or \"auto\"")
        opt = BY_NAME[key]
        if opt.type is float:
            value = float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if opt.min is not None and value < opt.min:
                raise DDTreeError(f"config file '{path}' key '{where}' is {value!r}: make it at least {opt.min:g}")
            if opt.max is not None and value > opt.max:
                raise DDTreeError(f"config file '{path}' key '{where}' is {value!r}: make it at most {opt.max:g}")
        if key in PATH_KEYS:
            value = _resolve_path(value, p)
        out[key] = value
    return out


def merge(settings: dict, cli_values: dict, defaults: dict) -> dict:
    """Defaults, overridden by the settings file, overridden by the flags the user set.

    A CLI value of ``None`` means "not given on the command line", so CLI options must default
    to ``None`` for a file value to show through; ``None`` in the file is ignored likewise.
    """
    out = dict(defaults)
    for source in (settings, cli_values):
        for k, v in source.items():
            if v is not None:
                out[k] = v
    return out

"""Per-round and per-prompt statistics, aggregation, and the versioned JSON result document.

The decoders append one :class:`RoundRecord` per speculative round and return one
:class:`GenerationRecord` per prompt. :func:`aggregate` turns a list of generation records into
vLLM-style counters plus timing summaries; :func:`make_run_document` assembles the JSON document
that ``ddtree bench`` writes (schema ``ddtree.stats/1``, documented in ``docs/stats-schema.md``).
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import gzip
import hashlib
import json
import math
import os
import platform
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.errors import DDTreeError

SCHEMA_VERSION = "ddtree.stats/1"

#: The per-round stages, in pipeline order. Decoders may record other stages too; they are
#: reported after these.
STAGES: tuple[str, ...] = ("draft", "tree", "verify", "commit")


# --------------------------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------------------------


@dataclass
class RoundRecord:
    tree_size: int  # draft nodes verified (root excluded); 0 for ar
    tree_depth: int  # deepest draft node
    accepted: int  # draft tokens accepted (bonus excluded)
    accepted_ranks: list[int]  # sibling rank of each accepted node, root-to-leaf
    committed: int  # tokens emitted this round (accepted + 1, cut by a stop token / max_new_tokens)
    times_ms: dict[str, float]  # 'draft', 'tree', 'verify', 'commit' (device-synchronised at the end)


@dataclass
class GenerationRecord:
    prompt_id: str
    prompt_tokens: int
    new_tokens: int
    token_ids: list[int]
    text: str
    prefill_s: float
    decode_s: float
    ttft_s: float
    method: str  # 'ar' | 'dflash' | 'ddtree'
    budget: int | None = None  # draft nodes per round for ddtree; None otherwise
    rounds: list[RoundRecord] = field(default_factory=list)
    captures: int = 0  # graph pieces captured (or first run compiled) during the rounds: decode_s holds their time

    @property
    def decode_tok_s(self) -> float:
        """New tokens per second of decode time (0.0 when no decode time was measured)."""
        return _ratio(self.new_tokens, self.decode_s)

    @property
    def e2e_tok_s(self) -> float:
        """New tokens per second of prefill + decode time."""
        return _ratio(self.new_tokens, self.prefill_s + self.decode_s)


def _ratio(num: float, den: float) -> float:
    return float(num) / float(den) if den and den > 0 else 0.0


# --------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------


def _stage_order(rounds: list[RoundRecord]) -> list[str]:
    seen = list(STAGES)
    for r in rounds:
        for k in r.times_ms:
            if k not in seen:
                seen.append(k)
    return seen


def _round_counters(rounds: list[RoundRecord], block_size: int | None = None) -> dict[str, Any]:
    """vLLM-style speculative-decoding counters over a list of rounds.

    A *draft* is a round that verified at least one draft node (``tree_size > 0``); every other
    round is a *plain step* (the target verified the bonus token alone: every ``ar`` round, and
    ``--budget auto``'s budget-0 rounds). ``mean_acceptance_length`` (vLLM's ``1 + accepted /
    drafts``) counts drafted rounds only; ``tokens_per_target_forward`` (committed / rounds) counts
    them all and is the figure to compare methods by.
    """
    drafts = [r for r in rounds if r.tree_size > 0]
    committed = sum(r.committed for r in rounds)
    num_drafts = len(drafts)
    num_draft_tokens = sum(r.tree_size for r in drafts)
    num_accepted = sum(r.accepted for r in drafts)

    max_depth = max((r.tree_depth for r in drafts), default=0)
    max_acc = max((r.accepted for r in drafts), default=0)
    n_pos = max(max_depth, max_acc)
    if block_size is not None and num_drafts:
        n_pos = max(n_pos, block_size - 1)
    per_pos = [sum(1 for r in drafts if r.accepted > d) for d in range(n_pos)]

    # per-depth conditional rate: rounds that accepted >= d over rounds whose tree reached depth d
    per_depth: list[float | None] = []
    for d in range(1, max(max_depth, max_acc) + 1):
        reached = sum(1 for r in drafts if r.tree_depth >= d)
        acc = sum(1 for r in drafts if r.accepted >= d)
        per_depth.append(acc / reached if reached else None)

    hist: dict[int, int] = {}
    for r in drafts:
        hist[r.accepted + 1] = hist.get(r.accepted + 1, 0) + 1
    ranks: dict[int, int] = {}
    for r in drafts:
        for k in r.accepted_ranks:
            ranks[int(k)] = ranks.get(int(k), 0) + 1

    return {
        "tokens_per_target_forward": committed / len(rounds) if rounds else 0.0,
        "num_plain_steps": len(rounds) - num_drafts,
        "num_drafts": num_drafts,
        "num_draft_tokens": num_draft_tokens,
        "num_accepted_tokens": num_accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "mean_acceptance_length": 1.0 + num_accepted / num_drafts if num_drafts else 1.0,
        "draft_acceptance_rate": num_accepted / num_draft_tokens if num_draft_tokens else 0.0,
        "acceptance_length_histogram": {str(k): hist[k] for k in sorted(hist)},
        "per_depth_acceptance_rate": per_depth,
        "accepted_rank_histogram": {str(k): ranks[k] for k in sorted(ranks)},
    }


def _tree_size_stats(rounds: list[RoundRecord]) -> dict[str, float]:
    sizes = [r.tree_size for r in rounds]
    if not sizes:
        return {"mean": 0.0, "min": 0, "max": 0, "histogram": {}}
    hist = Counter(sizes)  # --budget auto: how often each budget was chosen
    return {"mean": sum(sizes) / len(sizes), "min": min(sizes), "max": max(sizes),
            "histogram": {str(k): hist[k] for k in sorted(hist)}}


def _stage_times(rounds: list[RoundRecord]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    n = len(rounds)
    for stage in _stage_order(rounds):
        total = sum(float(r.times_ms.get(stage, 0.0)) for r in rounds)
        out[stage] = {"total": total, "mean": total / n if n else 0.0}
    return out


def aggregate(records: list[GenerationRecord], block_size: int | None = None) -> dict:
    """Summarise a run (one method/budget over many prompts).

    ``block_size`` (the drafter's block size, when known) pads ``num_accepted_tokens_per_pos`` to
    ``block_size - 1`` positions (the most draft tokens a round can accept), like vLLM's
    ``num_speculative_tokens``. All keys are documented in ``docs/stats-schema.md``.
    """
    rounds = [r for rec in records for r in rec.rounds]
    new_tokens = sum(r.new_tokens for r in records)
    prefill_s = sum(r.prefill_s for r in records)
    decode_s = sum(r.decode_s for r in records)
    committed = sum(r.committed for r in rounds)
    out: dict[str, Any] = {
        "num_prompts": len(records),
        "prompt_tokens": sum(r.prompt_tokens for r in records),
        "new_tokens": new_tokens,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "total_s": prefill_s + decode_s,
        "decode_tok_s": _ratio(new_tokens, decode_s),
        "e2e_tok_s": _ratio(new_tokens, prefill_s + decode_s),
        "mean_ttft_s": sum(r.ttft_s for r in records) / len(records) if records else 0.0,
        "rounds": len(rounds),
        "captures": sum(r.captures for r in records),
        "committed_tokens": committed,
        "mean_committed_per_round": committed / len(rounds) if rounds else 0.0,
        "block_size": block_size,
    }
    out.update(_round_counters(rounds, block_size))
    out["tree_size"] = _tree_size_stats(rounds)
    out["stage_times_ms"] = _stage_times(rounds)
    return out


# --------------------------------------------------------------------------------------------
# per-prompt entries
# --------------------------------------------------------------------------------------------


def _ms(x: float) -> float:
    return round(float(x), 4)


def generation_to_dict(rec: GenerationRecord) -> dict:
    """One prompt's entry: summary fields plus ``rounds`` as compact column arrays."""
    stages = _stage_order(rec.rounds)
    counters = _round_counters(rec.rounds)
    return {
        "prompt_id": str(rec.prompt_id),
        "method": rec.method,
        "budget": rec.budget,
        "prompt_tokens": int(rec.prompt_tokens),
        "new_tokens": int(rec.new_tokens),
        "prefill_s": float(rec.prefill_s),
        "decode_s": float(rec.decode_s),
        "ttft_s": float(rec.ttft_s),
        "decode_tok_s": rec.decode_tok_s,
        "e2e_tok_s": rec.e2e_tok_s,
        "num_rounds": len(rec.rounds),
        "captures": int(rec.captures),
        **{k: counters[k] for k in _PROMPT_COUNTERS},
        "token_ids": [int(t) for t in rec.token_ids],
        "text": rec.text,
        "rounds": {
            "tree_size": [int(r.tree_size) for r in rec.rounds],
            "tree_depth": [int(r.tree_depth) for r in rec.rounds],
            "accepted": [int(r.accepted) for r in rec.rounds],
            "committed": [int(r.committed) for r in rec.rounds],
            "accepted_ranks": [[int(k) for k in r.accepted_ranks] for r in rec.rounds],
            "times_ms": {s: [_ms(r.times_ms.get(s, 0.0)) for r in rec.rounds] for s in stages},
        },
    }


def generation_from_dict(d: dict) -> GenerationRecord:
    """Inverse of :func:`generation_to_dict` (stage times come back rounded to 0.1 us)."""
    rd = d.get("rounds") or {}
    n = len(rd.get("tree_size", []))
    times = rd.get("times_ms", {})
    rounds = [
        RoundRecord(
            tree_size=rd["tree_size"][i],
            tree_depth=rd["tree_depth"][i],
            accepted=rd["accepted"][i],
            accepted_ranks=list(rd["accepted_ranks"][i]),
            committed=rd["committed"][i],
            times_ms={s: v[i] for s, v in times.items()},
        )
        for i in range(n)
    ]
    return GenerationRecord(
        prompt_id=d["prompt_id"],
        prompt_tokens=d["prompt_tokens"],
        new_tokens=d["new_tokens"],
        token_ids=list(d.get("token_ids", [])),
        text=d.get("text", ""),
        prefill_s=d["prefill_s"],
        decode_s=d["decode_s"],
        ttft_s=d["ttft_s"],
        method=d["method"],
        budget=d.get("budget"),
        rounds=rounds,
        captures=d.get("captures", 0),
    )


# --------------------------------------------------------------------------------------------
# metadata
# --------------------------------------------------------------------------------------------


def _ddtree_version() -> str:
    try:
        from importlib.metadata import version

        return version("ddtree")
    except Exception:
        try:
            import ddtree

            return str(getattr(ddtree, "__version__", "unknown"))
        except Exception:
            return "unknown"


def _module_version(name: str) -> str | None:
    """Installed version of a distribution, without importing it (None if absent)."""
    mod = sys.modules.get(name)
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


def _gpu_names() -> list[str]:
    try:
        import torch

        if torch.cuda.is_available():
            return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:
        pass
    return ["cpu"]


def config_hash(path: str | os.PathLike) -> str:
    """First 16 hex digits of the sha256 of a file's bytes (a directory means its config.json)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = p.read_bytes()
    except OSError as e:
        raise DDTreeError(
            f"cannot hash config file '{p}' ({e.strerror or type(e).__name__}): "
            "pass the path of an existing config.json"
        ) from None
    return hashlib.sha256(data).hexdigest()[:16]


def run_metadata(**kw: Any) -> dict:
    """Environment facts plus whatever the caller passes (model refs, config hashes, dtype,
    devices, sampling settings, seed, ...). Passed keys override the gathered ones."""
    meta: dict[str, Any] = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "ddtree_version": _ddtree_version(),
        "python_version": platform.python_version(),
        "torch_version": _module_version("torch"),
        "transformers_version": _module_version("transformers"),
        "platform": platform.platform(),
        "gpus": _gpu_names(),
        "argv": list(sys.argv),
    }
    meta.update(_jsonable(kw))
    return meta


# --------------------------------------------------------------------------------------------
# document
# --------------------------------------------------------------------------------------------


def make_run_document(metadata: dict, runs: list[dict]) -> dict:
    """Assemble the result document.

    Each entry of ``runs`` is ``{"method", "budget", "records": [GenerationRecord],
    "speedup_vs_ar": float | None}`` with optional ``"block_size"`` (passed to
    :func:`aggregate`), ``"budget_setting"`` (a ddtree run's ``--budget``: an integer or
    ``"auto"``) and ``"interrupted"`` (the run was cut short by Ctrl-C).
    """
    out_runs = []
    for i, run in enumerate(runs):
        for k in ("method", "records"):
            if k not in run:
                raise ValueError(f"runs[{i}] has no '{k}' key: pass method, budget, records, speedup_vs_ar")
        records = list(run["records"])
        out_runs.append(
            {
                "method": run["method"],
                "budget": run.get("budget"),
                "aggregate": aggregate(records, block_size=run.get("block_size")),
                "prompts": [generation_to_dict(r) for r in records],
                "speedup_vs_ar": run.get("speedup_vs_ar"),
                "budget_setting": run.get("budget_setting"),
                "interrupted": bool(run.get("interrupted", False)),
            }
        )
    return {"schema": SCHEMA_VERSION, "metadata": _jsonable(dict(metadata)), "runs": out_runs}


_NUM = {"type": ["number"]}
_INT = {"type": ["integer"]}
_INTS = {"type": "array", "items": {"type": "integer"}}
_COUNT_HIST = {"type": "object", "additionalProperties": {"type": "integer"}}
_OPT_INT = {"type": ["integer", "null"]}

# Keys added after documents were first written: written by this version, not required of a
# document (older ddtree.stats/1 files stay valid; readers fall back, see tokens_per_forward).
_ADDED = {"tokens_per_target_forward", "num_plain_steps", "budget_setting", "interrupted", "interrupted_prompt",
          "captures"}

# what an aggregate and a per-prompt entry both hold
_TOTALS = {"prompt_tokens": _INT, "new_tokens": _INT, "prefill_s": _NUM, "decode_s": _NUM, "decode_tok_s": _NUM,
           "e2e_tok_s": _NUM}
_COUNTERS = {"tokens_per_target_forward": _NUM, "num_plain_steps": _INT, "num_drafts": _INT,
             "num_draft_tokens": _INT, "num_accepted_tokens": _INT, "mean_acceptance_length": _NUM}
#: the round counters a per-prompt entry repeats from _round_counters
_PROMPT_COUNTERS = tuple(_COUNTERS)

_AGGREGATE = {
    "num_prompts": _INT, **_TOTALS, "total_s": _NUM, "mean_ttft_s": _NUM, "rounds": _INT, "captures": _INT,
    "committed_tokens": _INT,
    "mean_committed_per_round": _NUM, "block_size": _OPT_INT, **_COUNTERS,
    "num_accepted_tokens_per_pos": _INTS,
    "draft_acceptance_rate": _NUM,
    "acceptance_length_histogram": _COUNT_HIST,
    "per_depth_acceptance_rate": {"type": "array", "items": {"type": ["number", "null"]}},
    "accepted_rank_histogram": _COUNT_HIST,
    "tree_size": {
        "type": "object",
        "required": ["mean", "min", "max"],
        "properties": {"mean": _NUM, "min": _INT, "max": _INT, "histogram": _COUNT_HIST},
    },
    "stage_times_ms": {
        "type": "object",
        "additionalProperties": {"type": "object", "required": ["total", "mean"],
                                 "properties": {"total": _NUM, "mean": _NUM}},
    },
}

_ROUNDS = {
    "tree_size": _INTS, "tree_depth": _INTS, "accepted": _INTS, "committed": _INTS,
    "accepted_ranks": {"type": "array", "items": _INTS},
    "times_ms": {"type": "object", "additionalProperties": {"type": "array", "items": {"type": "number"}}},
}

_PROMPT = {
    "prompt_id": {"type": "string"}, "method": {"type": "string"}, "budget": _OPT_INT, **_TOTALS,
    "ttft_s": _NUM, "num_rounds": _INT, "captures": _INT, **_COUNTERS, "token_ids": _INTS, "text": {"type": "string"},
    "rounds": {"type": "object", "required": list(_ROUNDS), "properties": _ROUNDS},
}

_RUN = {
    "method": {"type": "string"},
    "budget": _OPT_INT,
    "budget_setting": {"type": ["integer", "string", "null"]},
    "interrupted": {"type": "boolean"},
    "speedup_vs_ar": {"type": ["number", "null"]},
    "aggregate": {"type": "object", "properties": _AGGREGATE},
    "prompts": {"type": "array", "items": {"type": "object", "properties": _PROMPT}},
}

_METADATA = {
    "timestamp": {"type": "string"},
    "ddtree_version": {"type": "string"},
    "python_version": {"type": "string"},
    "torch_version": {"type": ["string", "null"]},
    "transformers_version": {"type": ["string", "null"]},
    "gpus": {"type": "array", "items": {"type": "string"}},
    "interrupted": {"type": "boolean"},
    "interrupted_prompt": {"type": ["string", "null"]},
    # seconds of the process's start-up per phase (ddtree.decode.startup.StartupClock.to_dict)
    "startup": {"type": "object", "additionalProperties": {"type": ["number", "null"]}},
}


def _required(props: dict, *optional: str) -> list[str]:
    return [k for k in props if k not in _ADDED and k not in optional]


_AGGREGATE_SCHEMA = _RUN["aggregate"]
_AGGREGATE_SCHEMA["required"] = _required(_AGGREGATE)
_RUN["prompts"]["items"]["required"] = _required(_PROMPT)

SCHEMA: dict = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": SCHEMA_VERSION,
    "type": "object",
    "required": ["schema", "metadata", "runs"],
    "properties": {
        "schema": {"const": SCHEMA_VERSION},
        "metadata": {"type": "object", "required": ["timestamp", "ddtree_version"], "properties": _METADATA},
        "runs": {"type": "array", "items": {"type": "object", "required": _required(_RUN), "properties": _RUN}},
    },
}


def tokens_per_forward(agg: dict) -> float | None:
    """A run's headline: committed tokens per target forward over all rounds (documents written
    before the key existed: from their committed_tokens and rounds; None when neither is there)."""
    if "tokens_per_target_forward" in agg:
        return float(agg["tokens_per_target_forward"])
    if "committed_tokens" in agg and "rounds" in agg:
        return agg["committed_tokens"] / agg["rounds"] if agg["rounds"] else 0.0
    return None


def plain_steps(agg: dict) -> int | None:
    """Rounds without a draft (older documents: rounds - num_drafts)."""
    if "num_plain_steps" in agg:
        return int(agg["num_plain_steps"])
    if "rounds" in agg and "num_drafts" in agg:
        return int(agg["rounds"]) - int(agg["num_drafts"])
    return None


def is_auto(run: dict) -> bool:
    """A ``--budget auto`` ddtree run (older generate documents wrote budget null and no
    budget_setting; a fixed-budget run always has its budget)."""
    if run.get("method") != "ddtree":
        return False
    return run.get("budget_setting") == "auto" or run.get("budget") is None


def _type_ok(value: Any, t: str) -> bool:
    if t == "null":
        return value is None
    if t == "boolean":
        return isinstance(value, bool)
    if t == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "string":
        return isinstance(value, str)
    if t == "array":
        return isinstance(value, list)
    if t == "object":
        return isinstance(value, dict)
    raise AssertionError(f"unknown schema type {t!r}")


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _check(value: Any, schema: dict, where: str) -> None:
    if "const" in schema and value != schema["const"]:
        raise ValueError(f"{where}: expected {schema['const']!r}, got {value!r}")
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_type_ok(value, t) for t in types):
            raise ValueError(f"{where}: expected {' or '.join(types)}, got {_type_name(value)}")
    if isinstance(value, dict):
        for k in schema.get("required", []):
            if k not in value:
                raise ValueError(f"{where}: missing required key '{k}'")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            if k in props:
                _check(v, props[k], f"{where}.{k}")
            elif isinstance(extra, dict):
                _check(v, extra, f"{where}.{k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            _check(v, schema["items"], f"{where}[{i}]")


def validate_document(doc: Any) -> None:
    """Raise ``ValueError`` naming the first offending path (e.g. ``runs[1].aggregate.rounds``)
    if ``doc`` is not a valid ``ddtree.stats/1`` document."""
    if isinstance(doc, dict) and "schema" in doc and doc["schema"] != SCHEMA_VERSION:
        raise ValueError(
            f"schema: this ddtree reads '{SCHEMA_VERSION}' documents, got {doc['schema']!r}"
        )
    _check(doc, SCHEMA, "doc")


# --------------------------------------------------------------------------------------------
# JSON I/O
# --------------------------------------------------------------------------------------------


def _jsonable(x: Any) -> Any:
    """Plain JSON types: Paths to str, tuples/sets to lists, numpy/torch scalars to Python,
    dataclasses to dicts, non-finite floats to None."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return _jsonable(dataclasses.asdict(x))
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in x]
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, os.PathLike):
        return os.fspath(x)
    if hasattr(x, "item") and callable(x.item):  # numpy / torch scalars
        try:
            return _jsonable(x.item())
        except Exception:
            pass
    if hasattr(x, "tolist"):
        return _jsonable(x.tolist())
    return str(x)


def _dumps(x: Any, indent: int = 0) -> str:
    """Indented JSON, but arrays of scalars on one line (per-round arrays stay compact)."""
    pad = "  " * indent
    if isinstance(x, dict):
        if not x:
            return "{}"
        items = [f'{pad}  {json.dumps(k)}: {_dumps(v, indent + 1)}' for k, v in x.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(x, list):
        if all(not isinstance(v, (dict, list)) for v in x) or all(
            isinstance(v, list) and all(not isinstance(w, (dict, list)) for w in v) for v in x
        ):
            return json.dumps(x, separators=(",", ":"), allow_nan=False)
        items = [f"{pad}  {_dumps(v, indent + 1)}" for v in x]
        return "[\n" + ",\n".join(items) + "\n" + pad + "]"
    return json.dumps(x, ensure_ascii=False, allow_nan=False)


def write_json(doc: dict, path: str | os.PathLike, flag: str = "--out") -> Path:
    """Write ``doc`` as UTF-8 JSON, gzipped when the name ends in ``.gz`` (parent folders
    created); returns the path. ``flag`` names the option in the error message."""
    p = Path(path)
    data = (_dumps(_jsonable(doc)) + "\n").encode("utf-8")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.suffix == ".gz":
            with gzip.open(p, "wb") as f:
                f.write(data)
        else:
            p.write_bytes(data)
    except OSError as e:
        raise DDTreeError(
            f"cannot write results to '{p}' ({e.strerror or type(e).__name__}): pick a writable {flag} path"
        ) from None
    return p


def read_json(path: str | os.PathLike) -> dict:
    """Read a JSON document, plain or gzipped (told apart by the gzip magic bytes, not the
    name). Not validated: call :func:`validate_document`."""
    p = Path(path)
    if p.is_dir():
        raise DDTreeError(f"results file '{p}' is a directory: pass the JSON file written by ddtree bench")
    if not p.is_file():
        raise DDTreeError(f"results file '{p}' not found: pass the JSON file written by ddtree bench")
    try:
        data = p.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        return json.loads(data.decode("utf-8"))
    except (gzip.BadGzipFile, EOFError) as e:
        raise DDTreeError(f"results file '{p}' is a damaged gzip file ({e}): pass the file written by ddtree bench") from None
    except json.JSONDecodeError as e:
        raise DDTreeError(
            f"results file '{p}' is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}): "
            "pass the JSON file written by ddtree bench"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise DDTreeError(f"cannot read results file '{p}' ({e}): check the path and permissions") from None

"""The model set-up that ``ddtree generate`` and ``ddtree bench`` share.

Two halves. The first imports no torch: option checks, model references and output paths, so a
mistake ends in one ``error: ...`` line well under a second after the command starts. The
second reads the configs and the tokenizer (still no weights: bad input fails before loading),
encodes prompts, sizes the state and loads the target (+ drafter).
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from loguru import logger

from ddtree.app.prompts import Prompt, render_prompt
from ddtree.app.tokenizer import JsonTokenizer, hf_tokenizer
from ddtree.decode.methods import METHODS
from ddtree.errors import DDTreeError

#: room kept past prompt + new tokens when --max-length is not given (plus the tree itself)
LENGTH_SLACK = 256
#: tree size assumed for the length budget when --budget is "auto"
AUTO_BUDGET_ROOM = 256
#: --dtype spellings (ddtree.model.checkpoint.parse_dtype maps them)
DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")
#: files that hold a tokenizer's vocabulary (one of them must be in the target's folder)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
#: a text on which the tokenizer class must agree with the checkpoint's tokenizer.json: runs of
#: spaces and newlines, digits, contractions, accents and CJK split differently between pipelines
TOKENIZER_PROBE = "def f(x):\n    return x  + 12345  # It's héllo, 世界!\n\n\tclass A:  pass\r\n"


# ============================================================================================
# option checks (no torch)
# ============================================================================================


def parse_method(method: str | None, have_drafter: bool) -> str:
    if method is None:
        return "ddtree" if have_drafter else "ar"
    m = str(method).strip().lower()
    if m not in METHODS:
        raise DDTreeError(f"unknown --method {method!r}: use one of {', '.join(METHODS)}")
    return m


def parse_methods(spec: str | list | None) -> list[str]:
    """'ar,dflash,ddtree' -> ['ar', 'dflash', 'ddtree'] (ar first, added when missing; no duplicates)."""
    items = spec if isinstance(spec, list) else str(spec or "").split(",")
    out: list[str] = []
    for raw in items:
        m = str(raw).strip().lower()
        if not m:
            continue
        if m not in METHODS:
            raise DDTreeError(f"unknown method {raw!r} in --methods: use a comma-separated list of {', '.join(METHODS)}")
        if m not in out:
            out.append(m)
    if not out:
        raise DDTreeError("--methods is empty: pass e.g. --methods ar,dflash,ddtree")
    if "ar" in out:
        out.remove("ar")
    return ["ar"] + out


def parse_budget(value: Any, flag: str = "--budget") -> int | str:
    """An integer >= 1, or the string 'auto' (passed through to the decoder)."""
    if isinstance(value, bool):
        raise DDTreeError(f"{flag} {value!r} is not a number: pass a positive integer or auto")
    if isinstance(value, int):
        n = value
    else:
        s = str(value).strip().lower()
        if s == "auto":
            return "auto"
        try:
            n = int(s)
        except ValueError:
            raise DDTreeError(f"{flag} {value!r} is not a number: pass a positive integer (e.g. 31) or auto") from None
    if n < 1:
        raise DDTreeError(f"{flag} {n} must be at least 1: pass the number of draft nodes per round, e.g. 31")
    return n


def parse_budgets(spec: Any) -> list[int | str]:
    items = [spec] if isinstance(spec, int) else (spec if isinstance(spec, list) else str(spec or "").split(","))
    out: list[int | str] = []
    for raw in items:
        if isinstance(raw, str) and not raw.strip():
            continue
        b = parse_budget(raw, "--budgets entry")
        if b not in out:
            out.append(b)
    if not out:
        raise DDTreeError("--budgets is empty: pass e.g. --budgets 8,16,32,64 (auto counts as a budget)")
    return out


def positive_int(value: Any, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DDTreeError(f"{flag} {value!r} must be a positive integer")
    return value


def check_sampling(temperature: float, top_p: float, top_k: int) -> None:
    """The checks SamplingParams makes, before torch is imported (same messages)."""
    if temperature < 0:
        raise DDTreeError(f"--temperature {temperature} is negative: use 0 for greedy or a positive value")
    if not 0 < top_p <= 1:
        raise DDTreeError(f"--top-p {top_p} is outside (0, 1]: use e.g. 0.95, or 1 to disable")
    if top_k < 0:
        raise DDTreeError(f"--top-k {top_k} is negative: use 0 to disable")


def check_dtype(dtype: str | None) -> None:
    if dtype is not None and str(dtype).strip().lower() not in DTYPES + ("",):
        raise DDTreeError(f"unknown --dtype {dtype!r}: use bfloat16, float16 or float32")


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def check_devices(devices: Any, one: bool = False) -> None:
    """--devices syntax (which GPUs exist is checked once torch is imported)."""
    items = devices if isinstance(devices, list) else str(devices or "auto").split(",")
    names = [str(d).strip().lower() for d in items]
    for d in names:
        if not _DEVICE.match(d):
            raise DDTreeError(f"unsupported device {d!r} in --devices: use auto, cpu or cuda:N (e.g. cuda:0,cuda:1)")
    if len(names) > 1 and ("auto" in names or ("cpu" in names and set(names) != {"cpu"})):
        # repeats are stages on one device (cpu,cpu; cuda:0,cuda:0)
        raise DDTreeError("--devices mixes auto or cpu with other devices: pass auto or cpu alone (cpu may repeat), "
                          "or cuda devices only")
    if one and len(names) > 1:
        raise DDTreeError(f"--devices {','.join(names)} names several devices: this command runs on one, e.g. --devices cuda:0")


def check_model_options(opts: dict) -> tuple[str, int | str]:
    """The torch-free checks of every command that runs the models (generate, chat): the method,
    the budget (checked even where the method ignores it), sampling, dtype, devices, and a drafter
    where the method needs one. -> (method, budget as given)."""
    method = parse_method(opts["method"], bool(opts["drafter"]))
    budget = parse_budget(opts["budget"])
    check_sampling(float(opts["temperature"]), float(opts["top_p"]), int(opts["top_k"]))
    check_dtype(opts["dtype"])
    check_devices(opts["devices"])
    if method != "ar" and not opts["drafter"]:
        raise DDTreeError(f"--method {method} needs a drafter: pass --drafter REF (e.g. z-lab/Qwen3.6-27B-DFlash) "
                          "or use --method ar")
    return method, budget


def looks_local(ref: str) -> bool:
    """A path rather than a Hugging Face repo id (org/name)."""
    return ref.startswith((".", "/", "~")) or ref.count("/") != 1 or os.sep in ref.replace("/", "", 1)


def is_dflash_drafter(raw: dict) -> bool:
    return any("DFlash" in str(a) for a in raw.get("architectures") or []) or "dflash_config" in raw


def check_target_dir(model_dir: Path, ref: str) -> None:
    """The target's config.json (malformed, unsupported, or a DFlash drafter's) and its tokenizer
    files, read without torch (ddtree.model.config has none)."""
    from ddtree.model.config import TargetConfig, read_json

    path = model_dir / "config.json"
    raw = read_json(path)
    if isinstance(raw, dict) and is_dflash_drafter(raw):
        raise DDTreeError(f"--target {ref} is a DFlash drafter: pass it as --drafter, and the model it drafts for as --target")
    TargetConfig.from_dict(raw, str(path))
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise DDTreeError(
            f"--target {ref} has no tokenizer files (tokenizer.json, tokenizer_config.json): "
            "copy them from the model's repository into that folder"
        )


def precheck_model(ref: str | None, what: str) -> Path | None:
    """Check a local model folder before anything heavy is imported; None for a repo id (the hub
    cache is consulted later, by ddtree.model.checkpoint.resolve_model_dir)."""
    if not ref:
        if what == "target":
            raise DDTreeError("no target model: pass --target REF (a local directory or a repo id like Qwen/Qwen3.6-27B) or set target in --config")
        raise DDTreeError("this method needs a drafter: pass --drafter REF (e.g. z-lab/Qwen3.6-27B-DFlash) or use --method ar")
    p = Path(str(ref)).expanduser()
    if not p.exists():
        if looks_local(str(ref)):
            raise DDTreeError(f"{what} path {ref} not found: pass an existing checkpoint directory or a repo id like Qwen/Qwen3.6-27B")
        return None
    if not p.is_dir() or not (p / "config.json").is_file():
        raise DDTreeError(f"{what} path {ref} has no config.json: pass a checkpoint directory or a Hugging Face repo id")
    if what == "target":
        check_target_dir(p, str(ref))
    return p


def check_output(path: str | os.PathLike, flag: str, kind: str = "file") -> Path:
    """An output path, checked before any work: a file (`kind="file"`) or a folder ("dir") that
    can be written. Missing folders are created when the output is written (and said so)."""
    p = Path(path).expanduser()
    if kind == "file":
        if p.is_dir():
            raise DDTreeError(f"{flag} {path} is a directory: name a file in it, e.g. {flag} {p / 'stats.json'}")
        if p.exists() and not os.access(p, os.W_OK):
            raise DDTreeError(f"{flag} {path} is not writable: pick another path or fix its permissions")
        folder = p.parent
    else:
        if p.exists() and not p.is_dir():
            raise DDTreeError(f"{flag} {path} is a file: name a folder (it is created if missing)")
        folder = p
    existing = folder
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise DDTreeError(f"{flag} {path}: {existing} is a file, not a folder: pick another path")
    try:  # a real write (os.access says yes to root everywhere, and knows no read-only mounts)
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise DDTreeError(f"{flag} {path}: folder {existing} is not writable ({e.strerror or e}): pick a writable path") from None
    return p


def make_parent(path: Path, flag: str, kind: str = "file") -> None:
    """Create the missing folders of an output checked by check_output, saying which."""
    folder = path.parent if kind == "file" else path
    if folder.exists():
        return
    try:
        folder.mkdir(parents=True)
    except OSError as e:
        raise DDTreeError(f"cannot create folder {folder} for {flag} ({e.strerror or e}): pick a writable path") from None
    logger.info(f"created folder {folder} for {flag}")


def write_document(doc: dict, path: Path, flag: str) -> Path:
    from ddtree.stats import validate_document, write_json

    try:
        validate_document(doc)
    except ValueError as e:  # our own document: a bug, but say where
        raise DDTreeError(f"internal error: the statistics document does not validate ({e}); please report it") from None
    make_parent(path, flag)
    out = write_json(doc, path, flag=flag)
    logger.info(f"wrote {out}")
    return out


#: warnings held back until every input check has passed: bad input ends in exactly one line
NOTICES: list[str] = []


def notice(message: str) -> None:
    if message not in NOTICES:
        NOTICES.append(message)


def flush_notices() -> None:
    """Print the held-back warnings, once each; called when the work itself starts."""
    for m in NOTICES:
        logger.warning(m)
    NOTICES.clear()


def warn_ignored(flag: str, why: str) -> None:
    """An option that has no effect in the combination given: one warning line, not an error."""
    notice(f"{flag} is ignored: {why}")


# ============================================================================================
# models: inspect (configs and tokenizer only), then load
# ============================================================================================


@dataclass
class ModelSpec:
    """What the configs say, read before any weight is loaded."""

    target_ref: str
    target_dir: Path
    target_cfg: Any  # ddtree.model.config.TargetConfig
    drafter_ref: str | None = None
    drafter_dir: Path | None = None
    drafter_cfg: Any = None  # ddtree.model.config.DrafterConfig
    devices: list = field(default_factory=list)  # torch.device
    dtype: Any = None  # torch.dtype
    tokenizer: Any = None
    stop_ids: frozenset = frozenset()

    @property
    def block_size(self) -> int | None:
        return self.drafter_cfg.block_size if self.drafter_cfg is not None else None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


@dataclass
class Loaded:
    spec: ModelSpec
    decoder: Any  # ddtree.decode.decoder.Decoder
    max_len: int


def parse_device_list(devices: Any) -> list:
    from ddtree.model.checkpoint import parse_devices

    check_devices(devices)
    return parse_devices(devices)


def resolve_dtype(dtype: Any, devices: list):
    """--dtype, or bfloat16 on cuda / float32 on cpu."""
    import torch

    from ddtree.model.checkpoint import parse_dtype

    if dtype is None or str(dtype).strip().lower() in ("", "auto"):
        return torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    return parse_dtype(str(dtype).strip().lower())


def sampling_params(opts: dict):
    from ddtree.decode.sampling import SamplingParams

    return SamplingParams(temperature=float(opts["temperature"]), top_p=float(opts["top_p"]), top_k=int(opts["top_k"]))


def tree_room(method: str, budget: int | str | None, block_size: int | None) -> int:
    """Most tree nodes one round verifies (root included)."""
    if method == "ar":
        return 1
    if method == "dflash":
        return block_size or 16
    return AUTO_BUDGET_ROOM + 1 if budget == "auto" else int(budget) + 1


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def load_tokenizer(model_dir: Path):
    """The target's tokenizer as its checkpoint ships it: tokenizer.json's pipeline with the special
    tokens and chat template of tokenizer_config.json.

    Through `tokenizers` alone where transformers would add nothing to that file
    (ddtree.app.tokenizer.JsonTokenizer: importing transformers is 1.1-1.2 s of a fresh process on
    the H200 machine), else transformers' PreTrainedTokenizerFast. Not AutoTokenizer, where
    tokenizer.json exists: transformers may map a model type to a class whose own pre-tokenizer
    splits text differently from the file the model was trained with (5.24: every qwen3_5
    checkpoint to Qwen3_5Tokenizer), and importing AutoTokenizer pulls in transformers' model
    registry (torch.distributed.tensor, torch._dynamo, sklearn where it is installed): 5.9 s of a
    fresh process on the H200 machine (`scripts/bench_startup.py --cases phases`). A checkpoint
    without tokenizer.json (a sentencepiece model only) goes through AutoTokenizer."""
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise DDTreeError(f"{model_dir} has no tokenizer files (tokenizer.json, tokenizer_config.json): "
                          "copy them from the model's repository into that folder")
    fast = (model_dir / "tokenizer.json").is_file()
    tok = None
    try:
        if fast:
            tok, why = JsonTokenizer.load(model_dir)
            if why:
                logger.debug(f"tokenizer through transformers: {why}")
        if tok is None:
            tok = hf_tokenizer(model_dir, fast)
    except Exception as e:  # unreadable tokenizer files, unknown tokenizer class, ...
        raise DDTreeError(
            f"cannot load the tokenizer from {model_dir} ({type(e).__name__}: {_first_line(e)}): "
            "the target directory needs the model's tokenizer files (tokenizer.json, tokenizer_config.json)"
        ) from None
    if len(tok) == 0 or not tok.encode(TOKENIZER_PROBE, add_special_tokens=False):
        raise DDTreeError(f"the tokenizer in {model_dir} is empty (no vocabulary): copy the model's tokenizer files "
                          "(tokenizer.json, tokenizer_config.json) into that folder")
    return tok


def stop_token_ids(model_dir: Path, tokenizer: Any, cfg: Any) -> frozenset:
    """generation_config.json eos_token_id (int or list) | tokenizer.eos_token_id | config eos ids."""
    ids: set[int] = set()

    def add(v):
        if v is None:
            return
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(t, int) and not isinstance(t, bool):
                ids.add(t)

    gc = model_dir / "generation_config.json"
    if gc.is_file():
        try:
            add(json.loads(gc.read_text()).get("eos_token_id"))
        except (json.JSONDecodeError, OSError, AttributeError) as e:
            logger.warning(f"ignoring unreadable {gc} ({type(e).__name__}); stop tokens come from the tokenizer and config")
    add(getattr(tokenizer, "eos_token_id", None))
    add(cfg.eos_token_ids)
    return frozenset(ids)


def inspect_models(target: str | None, drafter: str | None, devices: Any, dtype: Any, need_drafter: bool) -> ModelSpec:
    """Resolve references, parse configs, devices, dtype and tokenizer; no weights yet."""
    import torch

    from ddtree.model.checkpoint import resolve_model_dir
    from ddtree.model.config import DrafterConfig, TargetConfig

    precheck_model(target, "target")
    devs = parse_device_list(devices)
    dt = resolve_dtype(dtype, devs)
    if dt != torch.float32 and devs[0].type == "cpu":
        logger.debug(f"{dt} on cpu is slow; --dtype float32 is the usual choice there")
    tdir = resolve_model_dir(str(target), "target")
    check_target_dir(tdir, str(target))  # a repo id: now that it is on disk
    tcfg = TargetConfig.from_file(tdir / "config.json")
    spec = ModelSpec(target_ref=str(target), target_dir=tdir, target_cfg=tcfg, devices=devs, dtype=dt)
    if need_drafter:
        precheck_model(drafter, "drafter")
        ddir = resolve_model_dir(str(drafter), "drafter")
        spec.drafter_ref, spec.drafter_dir = str(drafter), ddir
        spec.drafter_cfg = DrafterConfig.from_file(ddir / "config.json", tcfg.num_layers)
    spec.tokenizer = load_tokenizer(tdir)
    spec.stop_ids = stop_token_ids(tdir, spec.tokenizer, tcfg)
    logger.debug(f"tokenizer {type(spec.tokenizer).__name__} ({len(spec.tokenizer)} tokens, chat template "
                 f"{'yes' if getattr(spec.tokenizer, 'chat_template', None) else 'none'}), stop ids {sorted(spec.stop_ids)}")
    return spec


def has_chat_template(spec: ModelSpec) -> bool:
    return bool(getattr(spec.tokenizer, "chat_template", None))


def warn_template(spec, opts: dict, given: frozenset) -> None:
    """--no-raw / --thinking that no chat template will read."""
    template = has_chat_template(spec)
    if "raw" in given and not opts["raw"] and not template:
        warn_ignored("--no-raw", "the target's tokenizer has no chat template, so prompts are sent as they are")
    if "thinking" in given and (opts["raw"] or not template):
        flag = "--thinking" if opts["thinking"] else "--no-thinking"
        warn_ignored(flag, "--raw sends prompts without the chat template" if opts["raw"]
                     else "the target's tokenizer has no chat template")


def encode_prompt(spec: ModelSpec, prompt: Prompt, raw: bool, thinking: bool) -> list[int]:
    if prompt.messages is None and not (prompt.text or "").strip():
        where = "" if prompt.from_cli else f" ({prompt.label})"
        raise DDTreeError(f"empty prompt{where}: pass a non-empty prompt (argument, '-' for stdin, or a prompt file)")
    tok = spec.tokenizer
    templated = not raw and has_chat_template(spec)
    text = render_prompt(prompt, tok, raw, thinking)
    ids = tok.encode(text, add_special_tokens=not templated)
    if not ids:
        raise DDTreeError(f"{prompt.label} encodes to no tokens: pass a non-empty prompt")
    return [int(i) for i in ids]


def fit_prompt(spec: ModelSpec, prompt: Prompt, raw: bool, thinking: bool, n_tokens: int) -> list[int]:
    """-> the prompt's ids at exactly ``n_tokens``: its text (a chat prompt's last user turn)
    repeated or cut at token boundaries, inside the chat template, so a long-context run keeps
    the template's head and its generation prompt at the end. Re-encoding the repeated text can
    merge tokens at the seams; the text is refitted until the count is exact."""
    tok = spec.tokenizer
    base = encode_prompt(spec, prompt, raw, thinking)
    if len(base) == n_tokens:
        return base
    turn = _fit_turn(prompt)
    unit = tok.encode((turn[1] if turn else prompt.text) or "", add_special_tokens=False)
    if not unit:
        raise DDTreeError(f"{prompt.label} has no text to repeat: --prompt-tokens needs a text prompt")
    head = len(base) - len(unit)  # the template's own tokens around the text
    if n_tokens <= head:
        raise DDTreeError(
            f"--prompt-tokens {n_tokens} leaves no room for the text of {prompt.label} (the chat template "
            f"alone is {head} tokens): pass a larger N or --raw"
        )
    want = n_tokens - head
    ids = base
    for _ in range(8):
        body = (unit * (want // len(unit) + 1))[:want]
        ids = encode_prompt(spec, _with_text(prompt, turn, tok.decode(body)), raw, thinking)
        if len(ids) == n_tokens:
            return ids
        want += n_tokens - len(ids)
        if want < 1:
            break
    # the tokenizer keeps merging at a seam: cut or pad the ids themselves, keeping the end (the
    # generation prompt) intact
    if len(ids) > n_tokens:
        return ids[:head // 2] + ids[len(ids) - (n_tokens - head // 2):]
    return ids[:head // 2] + (unit * (n_tokens // len(unit) + 1))[:n_tokens - len(ids)] + ids[head // 2:]


def _fit_turn(prompt: Prompt) -> tuple[int, str] | None:
    """(index, content) of the chat prompt's last user turn; None for a text prompt."""
    if prompt.messages is None:
        return None
    for i in range(len(prompt.messages) - 1, -1, -1):
        if prompt.messages[i].get("role") == "user":
            return i, str(prompt.messages[i]["content"])
    raise DDTreeError(f"{prompt.label} has no user turn to repeat: --prompt-tokens needs one")


def _with_text(prompt: Prompt, turn: tuple[int, str] | None, text: str) -> Prompt:
    from dataclasses import replace

    if turn is None:
        return replace(prompt, text=text)
    msgs = [dict(m) for m in prompt.messages]
    msgs[turn[0]]["content"] = text
    return replace(prompt, messages=msgs)


def check_length(n_prompt: int, max_new_tokens: int, room: int, max_length: int | None, what: str = "prompt") -> int:
    """-> the state length to allocate (--max-length, or what the longest run needs plus slack)."""
    if max_length is None:
        return n_prompt + max_new_tokens + LENGTH_SLACK + room
    if n_prompt + max_new_tokens + room > max_length:
        raise DDTreeError(
            f"{what} ({n_prompt} tokens) + --max-new-tokens {max_new_tokens} + tree ({room}) exceeds "
            f"--max-length {max_length}: raise --max-length or shorten the prompt"
        )
    return max_length


def load_models(spec: ModelSpec, max_len: int, with_drafter: bool, stage: Callable[[str], None] | None = None,
                room: int | None = None, auto: bool = False, snapshots: int = 0) -> Loaded:
    from ddtree.app.plan import plan_for_devices
    from ddtree.decode.decoder import Decoder
    from ddtree.decode.round import DeferredContext, reserve_deferred
    from ddtree.model.checkpoint import load_drafter, load_target
    from ddtree.options import Options

    stage = stage or (lambda s: None)
    options = Options.from_env()
    dev_names = ",".join(str(d) for d in spec.devices)
    stage("planning memory")  # before any weight is read: one error line naming what fits (None on CPU)
    split = plan_for_devices(spec.target_cfg, spec.drafter_cfg if with_drafter else None, spec.devices, max_len,
                             spec.dtype, room, name=spec.target_ref, auto=auto, snapshots=snapshots)
    deferred = None
    if auto and with_drafter and spec.drafter_dir is not None and split is not None:
        # --budget auto's deferred context before the weights: its block is then its own request
        # (made later, the allocator may hand it a free block up to 1 MB larger whole)
        deferred = DeferredContext.for_models(spec.target_cfg, spec.drafter_cfg, split.drafter_device, spec.dtype)
    stage("loading the target")
    logger.info(f"loading target {spec.target_ref} ({spec.dtype_name}, {dev_names}, max length {max_len})")
    target, _ = load_target(str(spec.target_dir), spec.devices, spec.dtype, max_len,
                            layer_stages=split.layer_stages if split else None)
    drafter = None
    if with_drafter and spec.drafter_dir is not None:
        stage("loading the drafter")
        logger.info(f"loading drafter {spec.drafter_ref} (block size {spec.block_size})")
        drafter, _ = load_drafter(str(spec.drafter_dir), target, spec.dtype, max_len,
                                  device=split.drafter_device if split else None,
                                  stage=split.drafter_stage if split else None)
    loaded = Loaded(spec=spec, decoder=Decoder(target, drafter, max_len=max_len, options=options), max_len=max_len)
    if auto and drafter is not None:  # --budget auto's deferred context with the models, as the plan counts it
        if deferred is not None and deferred.rows.device == drafter.device:
            loaded.decoder.deferred = deferred
        reserve_deferred(loaded.decoder)  # (where it was not made above: on a CPU)
    log_setup(loaded)
    return loaded


def _runs(items: list) -> str:
    """[cpu, cpu, cuda:1] -> 'layers 0-1 on cpu, 2 on cuda:1'."""
    parts, start = [], 0
    for i in range(1, len(items) + 1):
        if i == len(items) or items[i] != items[start]:
            span = f"{start}" if i - 1 == start else f"{start}-{i - 1}"
            parts.append(f"{span} on {items[start]}")
            start = i
    return "layers " + ", ".join(parts) if parts else "no layers"


def decoder_paths(dec) -> dict:
    """Which paths a Decoder takes (bench and generate metadata, -v logs)."""
    import dataclasses

    return {
        "cuda_graphs": bool(dec.use_graphs),
        "compiled_layers": bool(dec.compile),  # torch.compile'd layers (DDTREE_NO_COMPILE=1: eager)
        "rounds_ahead": not dec.options.host_rounds,  # DDTREE_HOST_ROUNDS=1: the host-tree loop
        "options": dec.options.to_dict(),  # every engine switch (ddtree.options)
        "kernels": dataclasses.asdict(dec.kernels),  # the fast paths they resolved to on the target's device
    }


def startup_clock(dec, python_s: float, setup_s: float, weights_s: float):
    """The decoder's start-up clock with the phases before it existed added (ddtree.decode.startup)."""
    clock = dec.startup
    for phase, seconds in (("python", python_s), ("setup", setup_s), ("weights", weights_s)):
        clock.add(phase, seconds)
    return clock


def log_setup(loaded: Loaded) -> None:
    """-v: what a slow or odd run is diagnosed from."""
    dec, spec = loaded.decoder, loaded.spec
    tgt = dec.target
    devs = [str(d) for d in getattr(tgt, "layer_devices", [])]
    embed = getattr(getattr(tgt, "embed_tokens", None), "weight", None)
    head = getattr(getattr(tgt, "lm_head", None), "weight", None)
    logger.debug(f"placement: target {_runs(devs)}; embeddings on {getattr(embed, 'device', '?')}, "
                 f"lm_head on {getattr(head, 'device', '?')}"
                 + (f"; drafter on {next(dec.drafter.parameters()).device}" if dec.drafter is not None else ""))
    logger.debug(f"dtype {spec.dtype_name}; state length {loaded.max_len} tokens"
                 + (f"; drafter block size {spec.block_size}" if spec.block_size else ""))
    paths = decoder_paths(dec)
    logger.debug("paths: " + ", ".join(f"{k} {v}" for k, v in paths.items()))


def model_metadata(spec: ModelSpec, opts: dict, **extra) -> dict:
    from ddtree.stats import config_hash, run_metadata

    meta = dict(
        target=spec.target_ref,
        drafter=spec.drafter_ref,
        target_config_sha256=config_hash(spec.target_dir),
        drafter_config_sha256=config_hash(spec.drafter_dir) if spec.drafter_dir is not None else None,
        dtype=spec.dtype_name,
        devices=[str(d) for d in spec.devices],
        tp=opts.get("tp", 1),
        temperature=float(opts["temperature"]),
        top_p=float(opts["top_p"]),
        top_k=int(opts["top_k"]),
        seed=opts["seed"],
        max_new_tokens=opts["max_new_tokens"],
        raw=bool(opts["raw"]),
        thinking=bool(opts["thinking"]),
        block_size=spec.block_size,
        tokenizer=type(spec.tokenizer).__name__,
        interrupted=False,
    )
    meta.update(extra)
    return run_metadata(**meta)


def decode_text_fn(tokenizer) -> Callable[[list[int]], str]:
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def tp_module():
    try:
        from ddtree.parallel import tp
    except ModuleNotFoundError as e:
        if e.name in ("ddtree.parallel.tp",):
            raise DDTreeError("tensor parallelism not available in this build: drop --tp, or split layers with --devices cuda:0,cuda:1") from None
        raise
    if not hasattr(tp, "run_generate_tp_jobs"):
        raise DDTreeError("tensor parallelism not available in this build: drop --tp, or split layers with --devices cuda:0,cuda:1")
    return tp


def tp_args(spec: ModelSpec, opts: dict, max_len: int, tp: int) -> dict:
    """The options every generate job under ddtree.parallel.tp shares (a job overrides method,
    budget, prompt_ids, prompt_id, max_new_tokens)."""
    return dict(
        target=str(spec.target_dir), drafter=str(spec.drafter_dir) if spec.drafter_dir is not None else None,
        temperature=float(opts["temperature"]), top_p=float(opts["top_p"]), top_k=int(opts["top_k"]), seed=opts["seed"],
        dtype=spec.dtype_name, device_type=spec.devices[0].type, max_length=max_len,
        stop_ids=sorted(spec.stop_ids), tp=tp, top1_first=bool(opts.get("top1_first")),
        max_new_tokens=int(opts["max_new_tokens"]),
    )


def stdin_text() -> str:
    """The prompt piped in, less exactly one trailing newline (what `echo` adds)."""
    if sys.stdin is None:
        raise DDTreeError("'-' reads the prompt from stdin, but there is no stdin: pass the prompt as an argument")
    text = sys.stdin.read()
    if text.endswith("\r\n"):
        return text[:-2]
    return text[:-1] if text.endswith("\n") else text

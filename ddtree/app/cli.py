"""The ``ddtree`` command line: ``generate``, ``bench``, ``plan``, ``plot``, ``selftest``.

Every command takes ``--config FILE`` (TOML, ``ddtree.app.settings``); flags given on the command
line override the file, the file overrides the defaults. Options a file can set therefore
default to ``None`` here and get their real defaults in ``settings.merge``.

Output discipline: ``generate`` writes the generated text, and only it, to stdout as it is
produced; logs (loguru), progress bars and summaries go to stderr. A user-facing problem
(:class:`ddtree.errors.DDTreeError`) is printed as one ``error: ...`` line on stderr with exit
status 2 and no traceback; so is running out of GPU memory.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from loguru import logger

from ddtree.errors import DDTreeError

app = typer.Typer(
    name="ddtree",
    help="Exact DDTree speculative decoding for Qwen3.5/3.6 Gated-DeltaNet hybrids and Qwen3 with z-lab DFlash drafters.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

GENERATE_DEFAULTS: dict[str, Any] = {
    "target": None,
    "drafter": None,
    "method": None,  # ddtree when a drafter is given, else ar
    "budget": 32,
    "max_new_tokens": 256,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "seed": 0,
    "dtype": None,  # bfloat16 on cuda, float32 on cpu
    "devices": "auto",
    "max_length": None,
    "raw": False,
    "thinking": True,
    "prompts": None,
    "tp": 1,
}

OOM_MESSAGE = "out of GPU memory while {stage}: lower --max-length / --budget or add devices with --devices cuda:0,cuda:1"

_stage = ["starting"]


def _set_stage(what: str) -> None:
    _stage[0] = what


# ============================================================================================
# plumbing: logging, errors, settings
# ============================================================================================


def _setup_logging(verbose: bool) -> None:
    logger.remove()
    logger.add(
        lambda m: sys.stderr.write(m),  # resolved at write time (works under test runners too)
        level="DEBUG" if verbose else "INFO",
        format="<dim>{time:HH:mm:ss}</dim> <level>{level.name[0]}</level> {message}",
        colorize=bool(getattr(sys.stderr, "isatty", lambda: False)()),
    )
    try:
        import transformers

        if not verbose:
            transformers.logging.set_verbosity_error()
    except Exception:  # pragma: no cover - transformers always installed
        pass


def _fail(message: str, code: int = 2) -> None:
    sys.stdout.flush()
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


def _oom_types() -> tuple[type, ...]:
    import torch

    types = [getattr(torch.cuda, "OutOfMemoryError", None), getattr(torch, "OutOfMemoryError", None)]
    return tuple(t for t in types if isinstance(t, type)) or (MemoryError,)


def _guarded(fn: Callable) -> Callable:
    """Run a command body: DDTreeError and CUDA OOM become one stderr line and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _set_stage("starting")
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except DDTreeError as e:
            _fail(str(e))
        except KeyboardInterrupt:
            sys.stdout.flush()
            print("\ninterrupted", file=sys.stderr, flush=True)
            raise typer.Exit(130) from None
        except BrokenPipeError:  # e.g. `ddtree generate ... | head`
            try:
                sys.stdout = open("/dev/null", "w")  # noqa: SIM115 - silence the flush at exit
            except OSError:
                pass
            raise typer.Exit(0) from None
        except Exception as e:
            if isinstance(e, _oom_types()):
                _fail(OOM_MESSAGE.format(stage=_stage[0]))
            raise

    return wrapper


def _merge(config: Optional[Path], cli_values: dict, defaults: dict) -> dict:
    from ddtree.app.settings import load_settings, merge

    settings = load_settings(config) if config is not None else {}
    return merge(settings, cli_values, defaults)


# typer option factories (shared between commands) -------------------------------------------

def _opt_config():
    return typer.Option(None, "--config", "-c", help="TOML settings file (configs/*.toml); flags override it.",
                        dir_okay=False)


def _opt_verbose():
    return typer.Option(False, "--verbose", "-v", help="Debug logging on stderr.")


# ============================================================================================
# generate
# ============================================================================================


class _Streamer:
    """Prints the newly decoded suffix of the whole generation as tokens arrive.

    Decoding the whole id list keeps multi-token characters and byte-level merges right; a text
    ending in U+FFFD (an incomplete UTF-8 sequence) is held back until the next tokens complete it.
    """

    def __init__(self, tokenizer, out=None):
        self.tok = tokenizer
        self.out = out
        self.ids: list[int] = []
        self.printed = ""

    def _write(self, s: str) -> None:
        out = self.out or sys.stdout
        out.write(s)
        out.flush()

    def _emit(self, text: str) -> None:
        if len(text) > len(self.printed):
            self._write(text[len(self.printed):])
            self.printed = text

    def __call__(self, toks: list[int]) -> None:
        self.ids.extend(int(t) for t in toks)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self._emit(text)

    def finish(self) -> None:
        self._emit(self.tok.decode(self.ids, skip_special_tokens=True))
        self._write("\n")


def _read_prompts(prompt: Optional[str], prompts_spec: Optional[str], limit: Optional[int]):
    from ddtree.app.prompts import Prompt, load_prompts

    if prompt is not None:
        if prompt == "-":
            if sys.stdin is None:
                raise DDTreeError("'-' reads the prompt from stdin, but there is no stdin: pass the prompt as an argument")
            prompt = sys.stdin.read()
        if not prompt.strip():
            raise DDTreeError("empty prompt: pass a non-empty prompt (argument, '-' for stdin, or --prompts FILE|SUITE)")
        return [Prompt(id="cli", text=prompt)]
    if prompts_spec:
        return load_prompts(str(prompts_spec), limit)
    raise DDTreeError("no prompt: pass PROMPT as an argument, '-' to read it from stdin, or --prompts FILE|SUITE")


def _summary(rec, budget: int | str = "auto") -> str:
    from ddtree.stats import aggregate

    a = aggregate([rec])
    return (
        f"{rec.new_tokens} new tokens, {rec.decode_tok_s:.1f} tok/s decode, "
        f"time to first token {rec.ttft_s * 1e3:.0f} ms, mean acceptance length {a['mean_acceptance_length']:.2f}, "
        f"{len(rec.rounds)} rounds ({rec.method}{f' {rec.budget or budget}' if rec.method == 'ddtree' else ''})"
    )


def _tp_module():
    try:
        from ddtree.parallel import tp as tp_module
    except ModuleNotFoundError as e:
        if e.name in ("ddtree.parallel.tp",):
            raise DDTreeError("tensor parallelism not available in this build: drop --tp, or split layers with --devices cuda:0,cuda:1") from None
        raise
    if not hasattr(tp_module, "run_generate_tp"):
        raise DDTreeError("tensor parallelism not available in this build: drop --tp, or split layers with --devices cuda:0,cuda:1")
    return tp_module


def _generate_tp(tp_module, opts: dict, spec, encoded: list, streamers: list, max_len: int, top1_first: bool) -> list:
    """Run the prompts under tensor parallelism (ddtree.parallel.tp spawns the ranks); rank 0's tokens stream here."""
    args = dict(
        target=str(spec.target_dir), drafter=str(spec.drafter_dir) if spec.drafter_dir is not None else None,
        method=opts["method"], budget=opts["budget"], max_new_tokens=opts["max_new_tokens"],
        temperature=float(opts["temperature"]), top_p=float(opts["top_p"]), top_k=int(opts["top_k"]), seed=opts["seed"],
        dtype=str(spec.dtype).replace("torch.", ""), device_type=spec.devices[0].type, max_length=max_len,
        stop_ids=sorted(spec.stop_ids), tp=int(opts["tp"]), top1_first=top1_first,
    )
    decode_text = lambda ids: spec.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    _set_stage(f"generating ({opts['method']}, tensor parallel over {args['tp']} ranks)")
    if len(encoded) > 1 and hasattr(tp_module, "run_generate_tp_jobs"):
        current = [0]

        def on_tokens(i, toks):
            while current[0] < i:  # the previous prompt is done
                streamers[current[0]].finish()
                current[0] += 1
            streamers[i](toks)

        jobs = [dict(prompt_ids=ids, prompt_id=p.id) for p, ids in encoded]
        records = tp_module.run_generate_tp_jobs(args, jobs, on_tokens=on_tokens, decode_text=decode_text)
        for s in streamers[current[0]:]:
            s.finish()
        return list(records)
    records = []
    for (p, ids), streamer in zip(encoded, streamers):
        rec = tp_module.run_generate_tp(dict(args, prompt_ids=ids, prompt_id=p.id), on_tokens=streamer,
                                        decode_text=decode_text)
        streamer.finish()
        records.append(rec)
    return records


def run_generate(opts: dict, prompt: Optional[str], limit: Optional[int] = None, top1_first: bool = False,
                 stats_json: Optional[Path] = None) -> list:
    """`ddtree generate` after option merging; returns the GenerationRecords."""
    from ddtree.app.bench import (check_length, decode_text_fn, encode_prompt, inspect_models, load_models,
                              model_metadata, parse_budget, parse_method, positive_int, sampling_params, tree_room)
    from ddtree.stats import make_run_document, validate_document, write_json

    method = parse_method(opts["method"], bool(opts["drafter"]))
    budget = parse_budget(opts["budget"])
    if method != "ddtree":
        budget = 32  # unused by ar / dflash (a config's "auto" must not reach them)
    max_new = positive_int(opts["max_new_tokens"], "--max-new-tokens")
    if opts["max_length"] is not None:
        positive_int(opts["max_length"], "--max-length")
    tp = positive_int(opts["tp"], "--tp")
    sp = sampling_params(opts)
    if method != "ar" and not opts["drafter"]:
        raise DDTreeError(f"--method {method} needs a drafter: pass --drafter REF (e.g. z-lab/Qwen3.6-27B-DFlash) or use --method ar")
    prompts = _read_prompts(prompt, opts.get("prompts") if prompt is None else None, limit)
    tp_module = None
    if tp > 1:
        tp_module = _tp_module()
        if budget == "auto":
            raise DDTreeError("--budget auto is not supported with --tp yet: pass a number, e.g. --budget 32")

    spec = inspect_models(opts["target"], opts["drafter"], opts["devices"], opts["dtype"], need_drafter=method != "ar")
    encoded = [(p, encode_prompt(spec, p, bool(opts["raw"]), bool(opts["thinking"]))) for p in prompts]
    room = tree_room(method, budget, spec.block_size)
    longest = max(len(ids) for _, ids in encoded)
    max_len = check_length(longest, max_new, room, opts["max_length"])

    records = []
    if tp_module is not None:
        streamers = [_Streamer(spec.tokenizer) for _ in encoded]
        records = _generate_tp(tp_module, dict(opts, method=method, budget=budget, max_new_tokens=max_new), spec,
                               encoded, streamers, max_len, top1_first)
        for rec in records:
            print(_summary(rec, budget), file=sys.stderr, flush=True)
    else:
        loaded = load_models(spec, max_len, method != "ar", _set_stage, room=room, auto=method == "ddtree" and budget == "auto")
        decode_text = decode_text_fn(spec.tokenizer)
        for i, (p, ids) in enumerate(encoded):
            if len(encoded) > 1:
                logger.info(f"prompt {p.id} ({i + 1}/{len(encoded)}, {len(ids)} tokens)")
            _set_stage(f"generating ({method})")
            streamer = _Streamer(spec.tokenizer)
            rec = loaded.decoder.generate(
                ids, method=method, budget=budget, sampling=sp, max_new_tokens=max_new, stop_ids=spec.stop_ids,
                seed=opts["seed"], top1_first=top1_first, on_tokens=streamer, prompt_id=p.id, decode_text=decode_text,
            )
            streamer.finish()
            records.append(rec)
            print(_summary(rec, budget), file=sys.stderr, flush=True)

    if stats_json is not None:
        run_budget = records[0].budget if method == "ddtree" and isinstance(records[0].budget, int) else None
        meta = model_metadata(spec, opts, method=method, budget=budget if method == "ddtree" else None, max_length=max_len, top1_first=top1_first,
                              prompts=opts.get("prompts") if prompt is None else None)
        doc = make_run_document(meta, [dict(method=method, budget=run_budget, records=records, speedup_vs_ar=None,
                                            block_size=spec.block_size if method != "ar" else None)])
        try:
            validate_document(doc)
        except ValueError as e:
            raise DDTreeError(f"internal error: the stats document does not validate ({e}); please report it") from None
        path = write_json(doc, stats_json)
        logger.info(f"wrote {path}")
    return records


@app.command()
@_guarded
def generate(
    prompt: Optional[str] = typer.Argument(None, help="Prompt text, or '-' to read it from stdin.", show_default=False),
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Target model: local directory or hub id (Qwen/Qwen3.6-27B)."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="DFlash drafter: local directory or hub id (z-lab/Qwen3.6-27B-DFlash)."),
    method: Optional[str] = typer.Option(None, "--method", "-m", help="ar | dflash | ddtree (default: ddtree with a drafter, else ar)."),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Draft-tree nodes per round (ddtree), or auto (default: 32)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Tokens to generate (default: 256)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="0 = greedy (default: 0)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass (default: 1)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Top-k sampling, 0 = off (default: 0)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (default: 0)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16 | float16 | float32 (default: bfloat16 on cuda, float32 on cpu)."),
    devices: Optional[str] = typer.Option(None, "--devices", help="auto, cpu, or cuda:0,cuda:1 (target layers split over them) (default: auto)."),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="State length to allocate (prompt + new tokens + tree) (default: what the prompt needs)."),
    raw: Optional[bool] = typer.Option(None, "--raw/--no-raw", help="Send the prompt as is, without the chat template (default: no-raw).", show_default=False),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking", help="enable_thinking in the chat template (default: thinking).", show_default=False),
    top1_first: bool = typer.Option(False, "--top1-first", help="Grow the drafter's top-1 chain first, then best-first."),
    stats_json: Optional[Path] = typer.Option(None, "--stats-json", help="Write per-round statistics (ddtree.stats/1 JSON) here.", dir_okay=False),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="Without PROMPT: generate for each prompt of a JSONL file or suite (code, math, chat)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="With --prompts: the first N prompts."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel degree (needs ddtree.parallel.tp) (default: 1)."),
    config: Optional[Path] = _opt_config(),
    verbose: bool = _opt_verbose(),
):
    """Generate text for one prompt; only the generated text goes to stdout, streamed."""
    _setup_logging(verbose)
    opts = _merge(config, dict(target=target, drafter=drafter, method=method, budget=budget, max_new_tokens=max_new_tokens,
                               temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, dtype=dtype, devices=devices,
                               max_length=max_length, raw=raw, thinking=thinking, prompts=prompts, tp=tp),
                  GENERATE_DEFAULTS)
    run_generate(opts, prompt, limit=limit, top1_first=top1_first, stats_json=stats_json)


# ============================================================================================
# bench
# ============================================================================================


@app.command()
@_guarded
def bench(
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Target model: local directory or hub id."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="DFlash drafter: local directory or hub id."),
    prompts: Optional[str] = typer.Option(None, "--prompts", "-p", help="JSONL file, built-in suite (code, math, chat) or hf:DATASET[:SPLIT[:FIELD]] (default: code)."),
    methods: Optional[str] = typer.Option(None, "--methods", help="Comma-separated; ar is always run first (default: ar,dflash,ddtree)."),
    budgets: Optional[str] = typer.Option(None, "--budgets", help="ddtree budgets, comma-separated (default: 8,16,32,64)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Tokens per prompt (default: 256)."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="0 = greedy (default: 0)."),
    top_p: Optional[float] = typer.Option(None, "--top-p", help="Nucleus sampling mass (default: 1)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Top-k sampling, 0 = off (default: 0)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (default: 0)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16 | float16 | float32 (default: bfloat16 on cuda, float32 on cpu)."),
    devices: Optional[str] = typer.Option(None, "--devices", help="auto, cpu, or cuda:0,cuda:1 (default: auto)."),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="State length (default: longest prompt + new tokens + tree + 256)."),
    raw: Optional[bool] = typer.Option(None, "--raw/--no-raw", help="No chat template (default: no-raw).", show_default=False),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking", help="enable_thinking in the chat template (default: thinking).", show_default=False),
    limit: Optional[int] = typer.Option(None, "--limit", help="Only the first N prompts."),
    warmup: int = typer.Option(1, "--warmup", help="Uncounted warm-up rounds per run (each generates the shortest and the longest prompt in full, so every graph is captured before timing)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Result JSON (ddtree.stats/1) (default: results/bench.json).", dir_okay=False),
    top1_first: bool = typer.Option(False, "--top1-first", help="Grow the drafter's top-1 chain first."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel degree (not supported by bench yet).", hidden=True),
    config: Optional[Path] = _opt_config(),
    verbose: bool = _opt_verbose(),
):
    """Benchmark ar / dflash / ddtree (per budget) on a prompt set: table + JSON."""
    from ddtree.app.bench import BENCH_DEFAULTS, run_bench

    _setup_logging(verbose)
    opts = _merge(config, dict(target=target, drafter=drafter, prompts=prompts, methods=methods, budgets=budgets,
                               max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                               seed=seed, dtype=dtype, devices=devices, max_length=max_length, raw=raw,
                               thinking=thinking, out=str(out) if out is not None else None, tp=tp),
                  dict(BENCH_DEFAULTS, target=None))
    opts = {k: v for k, v in opts.items() if k not in ("method", "budget")}  # generate-only keys of a shared config
    opts.update(limit=limit, warmup=warmup, top1_first=top1_first)
    run_bench(**opts, stage=_set_stage)


# ============================================================================================
# plan (ddtree.app.plan)
# ============================================================================================


@app.command()
@_guarded
def plan(
    target: Optional[str] = typer.Option(None, "--target", "-t", help="Target model: local directory or hub id (only config.json is read)."),
    drafter: Optional[str] = typer.Option(None, "--drafter", "-d", help="DFlash drafter: local directory or hub id."),
    devices: Optional[str] = typer.Option(None, "--devices", help="cuda:0,cuda:1 (entries may repeat) (default: one per --gpu-memory entry, else cuda:0)."),
    gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="Memory per GPU: 2x48GiB, 48GiB,48GiB, 80GB (default: the visible GPUs' total)."),
    max_length: Optional[int] = typer.Option(None, "--max-length", help="State length to plan for (default: the model's max_position_embeddings)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="bfloat16 | float16 | float32 (default: bfloat16)."),
    budget: Optional[str] = typer.Option(None, "--budget", "-b", help="Draft-tree nodes per round, or auto (default: 32)."),
    attention: str = typer.Option("auto", "--attention", help="SDPA path of the verify's and draft's masked attention: math (torch's fallback: A6000, A100), fused (cuDNN: H100/H200), auto (ask the visible GPUs; math with --gpu-memory). The prefill takes flash attention either way."),
    config: Optional[Path] = _opt_config(),
    verbose: bool = _opt_verbose(),
):
    """Memory plan from the configs alone: the layer split and each GPU's bytes; fails if it does not fit."""
    from ddtree.app.plan import PLAN_DEFAULTS, run_plan

    opts = _merge(config, dict(target=target, drafter=drafter, devices=devices, max_length=max_length, dtype=dtype,
                               budget=budget), PLAN_DEFAULTS)
    run_plan(opts, gpu_memory, attention, setup=lambda: _setup_logging(verbose))


# ============================================================================================
# plot
# ============================================================================================


@app.command()
@_guarded
def plot(
    results: Path = typer.Argument(..., help="Result JSON written by ddtree bench (or generate --stats-json).", dir_okay=False),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Folder for the PNGs (default: RESULTS without .json, plus -plots).", file_okay=False),
    config: Optional[Path] = _opt_config(),
    verbose: bool = _opt_verbose(),
):
    """Speedup vs budget, acceptance-length histograms and stage times as PNG files."""
    from ddtree.app.plot import plot_results

    _setup_logging(verbose)
    if config is not None:
        _merge(config, {}, {})  # validated for consistency; a config's `out` is bench's JSON path, not a folder
    folder = out if out is not None else results.with_name(results.stem + "-plots")
    for p in plot_results(str(results), folder):
        print(p, flush=True)


# ============================================================================================
# selftest
# ============================================================================================

SELFTEST_LAYERS = ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + ("full_attention",)


@app.command()
@_guarded
def selftest(
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda:N (default: cuda if available, else cpu)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", "-n", help="Tokens per method (default: 48)."),
    config: Optional[Path] = _opt_config(),
    verbose: bool = _opt_verbose(),
):
    """Decode a random prompt on a tiny random Qwen3.6-style hybrid pair with ar, dflash and ddtree
    (budgets 4 and 32) and check every greedy output equals ar's. No download."""
    import torch

    from ddtree.app.bench import parse_device_list, positive_int

    _setup_logging(verbose)
    opts = _merge(config, dict(devices=device, max_new_tokens=max_new_tokens), {"devices": "auto", "max_new_tokens": 48})
    n_new = positive_int(opts["max_new_tokens"], "--max-new-tokens")
    dev = parse_device_list(opts["devices"])[0]
    _set_stage("building the random pair")
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # a tiny model: more threads only add synchronisation
    try:
        _selftest(dev, n_new)
    finally:
        torch.set_num_threads(threads)


def _selftest(dev, n_new: int) -> None:
    import time

    import torch

    from ddtree.app.bench import LENGTH_SLACK
    from ddtree.stats import aggregate
    from ddtree.model.synthetic import build_random_pair

    t0 = time.perf_counter()
    vocab, n_prompt = 24, 20  # a small vocabulary: random drafts are accepted often enough to exercise long paths
    decoder, raw_cfg = build_random_pair("hybrid", seed=0, dtype=torch.float32, device=dev,
                                         max_len=n_prompt + n_new + LENGTH_SLACK + 33, vocab=vocab, layers=SELFTEST_LAYERS)
    gen = torch.Generator().manual_seed(1234)
    prompt = torch.randint(2, vocab, (n_prompt,), generator=gen).tolist()
    print(f"selftest: tiny random Qwen3.6-style hybrid (8 layers: 3 Gated DeltaNet + 1 gated attention, x2; "
          f"vocab {vocab}) + 1-layer DFlash drafter (block {decoder.block_size}), {dev}, float32, "
          f"{n_prompt}-token prompt, {n_new} new tokens, greedy", flush=True)
    runs = [("ar", None), ("dflash", None), ("ddtree", 4), ("ddtree", 32)]
    _set_stage("decoding the selftest prompt")
    for method, budget in runs:  # warm-up (kernels, allocator)
        decoder.generate(prompt, method=method, budget=budget or 32, max_new_tokens=min(8, n_new))
    results = {}
    for method, budget in runs:
        rec = decoder.generate(prompt, method=method, budget=budget or 32, max_new_tokens=n_new)
        results[(method, budget)] = rec
        a = aggregate([rec])
        label = method if budget is None else f"{method} {budget}"
        print(f"  {label:<10} {rec.decode_tok_s:8.1f} tok/s   mean acceptance length {a['mean_acceptance_length']:.2f}"
              f"   {len(rec.rounds)} rounds", flush=True)
    ref = results[("ar", None)].token_ids
    bad = []
    for (method, budget), rec in results.items():
        if rec.token_ids != ref:
            first = next((i for i, (x, y) in enumerate(zip(rec.token_ids, ref)) if x != y), min(len(ref), len(rec.token_ids)))
            bad.append(f"{method}{'' if budget is None else ' ' + str(budget)} (first difference at token {first})")
    if len(ref) != n_new:
        bad.append(f"ar produced {len(ref)} tokens instead of {n_new}")
    if bad:
        print(f"selftest FAILED: greedy outputs differ from ar's: {'; '.join(bad)}", file=sys.stderr, flush=True)
        raise typer.Exit(1)
    print(f"selftest passed: every greedy output equals ar's ({time.perf_counter() - t0:.1f} s)", flush=True)


# ============================================================================================


def _version(value: bool):
    if value:
        from ddtree import __version__

        print(f"ddtree {__version__}")
        raise typer.Exit(0)


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
):
    """Exact DDTree speculative decoding: ddtree generate | bench | plan | plot | selftest."""


if __name__ == "__main__":  # pragma: no cover
    app()

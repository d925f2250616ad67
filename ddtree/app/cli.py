"""The ``ddtree`` command line: ``generate``, ``chat``, ``serve``, ``bench``, ``plan``, ``plot``, ``selftest``.

Every option is defined once, in ``ddtree.app.options``; the commands are built from that
table. Every command takes ``--config FILE`` (TOML, ``ddtree.app.settings``): flags given on the
command line override the file, the file overrides the defaults.

Output discipline: ``generate`` writes the generated text, and only it, to stdout as it is
produced (or, with ``--jsonl``, one JSON object per prompt); logs (loguru), progress bars and
summaries go to stderr. Bad input of any kind, including what click itself rejects (an option
value that does not parse, an unknown option), is printed as one ``error: ...`` line on stderr
with exit status 2 and no traceback; so is running out of GPU memory. Arguments and paths are
checked before torch or transformers is imported. Ctrl-C keeps what was finished (summary,
statistics, bench runs) and exits with status 130.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer
from loguru import logger
from typer.core import TyperCommand, TyperGroup

from ddtree.app.options import BY_NAME, defaults, options_for
from ddtree.app.streaming import Streamer
from ddtree.app.textio import jsonl_record, partial_line, print_jsonl, read_prompts, run_label, summary_line
from ddtree.errors import DDTreeError
from ddtree.options import DEFAULT_BUDGET

OOM_MESSAGE = "out of GPU memory while {stage}: lower --max-length / --budget or add devices with --devices cuda:0,cuda:1"

_stage = ["starting"]


def _set_stage(what: str) -> None:
    _stage[0] = what


# ============================================================================================
# plumbing: one-line errors, logging, settings
# ============================================================================================


def _one_line(message: str) -> str:
    return " ".join(str(message).split())


def _fail(message: str, code: int = 2) -> None:
    sys.stdout.flush()
    print(f"error: {_one_line(message)}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


# the click exceptions typer raises (recent typers vendor their own click)
_click = sys.modules[typer.BadParameter.__module__]
_NoArgsIsHelp = getattr(_click, "NoArgsIsHelpError", ())


def _usage_line(e) -> str:
    """click's usage error as one line naming the help to read."""
    msg = _one_line(e.format_message()).rstrip(".")
    msg = msg[:1].lower() + msg[1:]
    ctx = getattr(e, "ctx", None)
    where = ctx.command_path if ctx is not None else "ddtree"
    return f"error: {msg}: see '{where} --help'"


class OneLineErrors(TyperGroup):
    """click's parse errors (an option value that does not parse, an unknown option, a missing
    argument) as one ``error: ...`` line with exit status 2, like every other bad input."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NoArgsIsHelp as e:  # plain `ddtree`: the help is the answer
            e.show()
            sys.exit(e.exit_code)
        except _click.ClickException as e:
            sys.stdout.flush()
            print(_usage_line(e), file=sys.stderr, flush=True)
            sys.exit(2 if isinstance(e, _click.UsageError) else e.exit_code)
        except typer.Abort:
            print("error: aborted", file=sys.stderr, flush=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


class _Command(TyperCommand):
    """Usage line: RESULTS, not typer's {RESULTS}, for a required argument."""

    def collect_usage_pieces(self, ctx):
        return [p[1:-1] if p.startswith("{") and p.endswith("}") else p for p in super().collect_usage_pieces(ctx)]


app = typer.Typer(
    name="ddtree",
    cls=OneLineErrors,
    help="Exact DDTree speculative decoding for Qwen3.5/3.6 Gated-DeltaNet hybrids and Qwen3 with z-lab DFlash drafters.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def setup_logging(verbose: bool) -> None:
    """ddtree's log lines on stderr: INFO and up, DEBUG too when verbose (--budget auto then writes a
    line per round). Scripts that drive the library call it too: loguru's default sink takes DEBUG,
    and a line per round would time the logging with the rounds."""
    logger.remove()
    logger.add(
        lambda m: sys.stderr.write(m),  # resolved at write time (works under test runners too)
        level="DEBUG" if verbose else "INFO",
        format="<dim>{time:HH:mm:ss}</dim> <level>{level.name[0]}</level> {message}",
        colorize=bool(getattr(sys.stderr, "isatty", lambda: False)()),
    )
    if not verbose:  # read when transformers is imported (importing it here would cost seconds)
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def cache_dir() -> Path:
    """ddtree's folder under the user's cache directory (XDG_CACHE_HOME, else ~/.cache)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ddtree"


def _persistent_caches() -> None:
    """Compile once per machine, not once per process: inductor's caches (FX graphs, AOTAutograd)
    under ddtree's cache folder rather than /tmp, and Triton's autotuning results on disk beside
    its kernels (fla's chunk kernels tune dozens of configurations per shape). Set before torch
    is imported; a variable the user set wins."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")


def _oom_types() -> tuple[type, ...]:
    if "torch" not in sys.modules:  # nothing ran on a GPU yet
        return ()
    import torch

    types = [getattr(torch.cuda, "OutOfMemoryError", None), getattr(torch, "OutOfMemoryError", None)]
    return tuple(t for t in types if isinstance(t, type))


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
            print("interrupted", file=sys.stderr, flush=True)
            raise typer.Exit(130) from None
        except BrokenPipeError:  # e.g. `ddtree generate ... | head`
            try:
                sys.stdout = open("/dev/null", "w")  # noqa: SIM115 - silence the flush at exit
            except OSError:
                pass
            raise typer.Exit(0) from None
        except Exception as e:
            oom = _oom_types()
            if oom and isinstance(e, oom):
                _fail(OOM_MESSAGE.format(stage=_stage[0]))
            raise

    return wrapper


def resolve_options(command: str, values: dict) -> tuple[dict, frozenset]:
    """Defaults < the --config file's keys that this command takes < the flags given.
    Returns the options and the names given on the command line."""
    from ddtree.app.settings import load_settings, merge

    settings = load_settings(values["config"]) if values.get("config") is not None else {}
    mine = {o.name for o in options_for(command) if o.file_applies(command)}
    from_file = {k: v for k, v in settings.items() if k in mine}
    flags = {k: v for k, v in values.items() if v is not None and k != "config" and not BY_NAME[k].argument}
    return merge(from_file, flags, defaults(command)), frozenset(flags)


# typer parameters from the option table ------------------------------------------------------


def _typer_default(o, command: str):
    text = o.help_for(command)
    shown = o.default_text(command)
    if shown and not o.argument:
        text += f" (default: {shown})"
    if o.argument:
        return typer.Argument(None if o.name == "prompt" else ..., metavar=o.flag, help=text, show_default=False)
    decls = [f"{o.flag}/{o.negative}" if o.negative else o.flag, *o.flags[1:]]
    return typer.Option(None, *decls, help=text, metavar=o.metavar, min=o.min, max=o.max, show_default=False,
                        envvar=o.env, show_envvar=bool(o.env))


def _command(name: str, body: Callable[..., Any], doc: str) -> None:
    """Register `ddtree NAME` with the options the table gives it; body(opts, given, **arguments)."""
    table = options_for(name)
    params = [inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=_typer_default(o, name),
                                annotation=Optional[o.type]) for o in table]

    @_guarded
    def command(**values):
        from ddtree.app.setup import NOTICES

        NOTICES.clear()  # (in-process runs: nothing left over from a command that failed)
        arguments = {o.name: values.pop(o.name) for o in table if o.argument}
        opts, given = resolve_options(name, values)
        setup_logging(bool(opts["verbose"]))
        _persistent_caches()
        opts.pop("verbose")
        return body(opts, given, **arguments)

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    command.__doc__ = doc
    command.__name__ = name
    app.command(name, cls=_Command)(command)


# ============================================================================================
# generate
# ============================================================================================


def _warn_generate(opts: dict, given: frozenset, method: str, prompt: Optional[str]) -> None:
    from ddtree.app.setup import warn_ignored

    if "budget" in given and method != "ddtree":
        warn_ignored("--budget", f"it sizes ddtree's trees, and the method is {method}")
    if "top1_first" in given and method != "ddtree":
        warn_ignored("--top1-first", f"it shapes ddtree's trees, and the method is {method}")
    if prompt is not None:
        for name in ("prompts", "limit"):
            if name in given:
                warn_ignored(BY_NAME[name].flag, "PROMPT is given, and it is the prompt")
    elif "limit" in given and not opts["prompts"]:
        warn_ignored("--limit", "it limits --prompts, and there is none")
    _warn_sampling(opts, given)


def _warn_sampling(opts: dict, given: frozenset) -> None:
    from ddtree.app.setup import warn_ignored

    if float(opts["temperature"]) == 0:
        for name in ("top_p", "top_k", "seed"):
            if name in given:
                warn_ignored(BY_NAME[name].flag, "--temperature 0 is greedy")


def run_generate(opts: dict, given: frozenset = frozenset(), prompt: Optional[str] = None) -> list:
    """`ddtree generate` after option merging; returns the GenerationRecords."""
    if opts.get("server"):  # the work done by a running `ddtree serve` (no torch here)
        from ddtree.app.serve.client import run_generate_remote

        return run_generate_remote(opts, given, prompt)
    from ddtree.app import setup as S
    from ddtree.decode.startup import freeze_heap, process_age_s

    t_entry, age = time.perf_counter(), process_age_s() or 0.0  # the start-up line counts from the command
    method, budget, tp, stats_path = _check_generate(S, opts)  # every check that needs no torch, first
    prompts_spec = opts["prompts"] if prompt is None else None
    prompts = read_prompts(prompt, prompts_spec, opts["limit"])
    _warn_generate(opts, given, method, prompt)

    # ---- configs and tokenizer, then the weights
    spec = S.inspect_models(opts["target"], opts["drafter"], opts["devices"], opts["dtype"], need_drafter=method != "ar")
    S.warn_template(spec, opts, given)
    encoded = [(p, S.encode_prompt(spec, p, bool(opts["raw"]), bool(opts["thinking"]))) for p in prompts]
    room = S.tree_room(method, budget, spec.block_size)
    max_new = int(opts["max_new_tokens"])
    max_len = S.check_length(max(len(ids) for _, ids in encoded), max_new, room, opts["max_length"],
                             what="prompt" if len(encoded) == 1 else "the longest prompt")
    for p, ids in encoded:
        logger.debug(f"{p.label}: {len(ids)} tokens")
    label = run_label(method, budget)
    jsonl = bool(opts["jsonl"])
    if len(encoded) > 1 and not jsonl:
        logger.info(f"{len(encoded)} prompts: their texts follow one another on stdout, each ending with a newline "
                    "(--jsonl prints one JSON object per prompt)")

    records: list = []
    current: dict = {}  # the prompt being generated: p, n (prompt tokens), streamer

    def start(p, ids):
        current.update(p=p, n=len(ids), streamer=Streamer(spec.tokenizer, echo=not jsonl))
        return current["streamer"]

    def done(p, rec, streamer):
        current.clear()
        streamer.finish()
        if jsonl:
            print_jsonl(jsonl_record(p, rec))
        records.append(rec)
        tag = label if len(encoded) == 1 else f"{p.id} ({label})"
        print(summary_line(rec, tag), file=sys.stderr, flush=True)
        if len(records) == 1 and clocks:  # once: the first generation holds the start-up
            clock = clocks[0]
            clock.first_token_s = (streamer.t_first or time.perf_counter()) - t_entry + age
            paths["startup"] = clock.to_dict()
            print(clock.line(), file=sys.stderr, flush=True)

    paths: dict = {}
    clocks: list = []  # the decoder's start-up clock, once the models are loaded
    try:
        if tp > 1:
            S.flush_notices()
            _generate_tp(S, spec, dict(opts, max_new_tokens=max_new), method, budget, encoded, max_len, start, done)
        else:
            t_load = time.perf_counter()
            loaded = S.load_models(spec, max_len, method != "ar", _set_stage, room=room,
                                   auto=method == "ddtree" and budget == "auto")
            S.flush_notices()  # after the last thing that can fail on bad input
            paths = S.decoder_paths(loaded.decoder)
            clocks.append(S.startup_clock(loaded.decoder, age, t_load - t_entry, time.perf_counter() - t_load))
            paths["startup"] = clocks[0].to_dict()
            sp = S.sampling_params(opts)
            decode_text = S.decode_text_fn(spec.tokenizer)
            for i, (p, ids) in enumerate(encoded):
                if i:  # the process keeps this decoder: what the prompts before compiled or captured, frozen (as chat)
                    freeze_heap(loaded.decoder.graphs)
                if len(encoded) > 1:  # (after the freeze: the line says the prompt has started)
                    logger.info(f"prompt {p.id} ({i + 1}/{len(encoded)}, {len(ids)} tokens)")
                _set_stage(f"generating ({method})")
                streamer = start(p, ids)
                rec = loaded.decoder.generate(
                    ids, method=method, budget=budget if budget is not None else DEFAULT_BUDGET, sampling=sp, max_new_tokens=max_new,
                    stop_ids=spec.stop_ids, seed=opts["seed"], top1_first=bool(opts["top1_first"]), on_tokens=streamer,
                    prompt_id=p.id, decode_text=decode_text,
                )
                done(p, rec, streamer)
    except KeyboardInterrupt:
        _keep_interrupted(S, spec, dict(opts, prompts=prompts_spec), method, budget, records, max_len, paths, current,
                          label, stats_path, tp)
        raise

    if stats_path is not None:
        doc = _generate_document(S, spec, dict(opts, prompts=prompts_spec), method, budget, records, max_len, paths)
        S.write_document(doc, stats_path, "--stats-json")
    return records


def _keep_interrupted(S, spec, opts: dict, method: str, budget, records: list, max_len: int, paths: dict,
                      current: dict, label: str, stats_path, tp: int) -> None:
    """Ctrl-C in generate: the cut prompt's text and summary so far, and the finished prompts'
    statistics (opts: with the prompt set's spec under "prompts")."""
    cut = current.get("p")
    if cut is not None:
        current["streamer"].finish()
        if bool(opts["jsonl"]):
            print_jsonl(jsonl_record(cut, None, current["streamer"], current["n"]))
        print(partial_line(cut, current["n"], current["streamer"], label), file=sys.stderr, flush=True)
    if stats_path is not None:
        if records:
            doc = _generate_document(S, spec, opts, method, budget, records, max_len, paths,
                                     interrupted=True, interrupted_prompt=cut.id if cut is not None else None)
            S.write_document(doc, stats_path, "--stats-json")
        elif tp > 1:  # the workers hand their records back at the end
            logger.warning("interrupted: under --tp no record comes back before the last prompt, --stats-json not written")
        else:
            logger.warning("no prompt finished before the interrupt: --stats-json not written")


def _check_generate(S, opts: dict) -> tuple:
    """generate's checks that need no torch, before any heavy import -> (method, budget (None
    unless ddtree), tensor-parallel ranks, the --stats-json path | None)."""
    import importlib.util

    method, budget = S.check_model_options(opts)
    budget = budget if method == "ddtree" else None
    tp = int(opts["tp"])
    if tp > 1:
        if importlib.util.find_spec("ddtree.parallel.tp") is None:
            raise DDTreeError("tensor parallelism not available in this build: drop --tp, or split layers with --devices cuda:0,cuda:1")
        if budget == "auto":
            raise DDTreeError("--budget auto is not supported with --tp yet: pass a number, e.g. --budget 32")
    stats_path = S.check_output(opts["stats_json"], "--stats-json") if opts["stats_json"] is not None else None
    S.precheck_model(opts["target"], "target")
    if method != "ar":
        S.precheck_model(opts["drafter"], "drafter")
    return method, budget, tp, stats_path


def _generate_document(S, spec, opts, method, budget, records, max_len, paths, interrupted=False, interrupted_prompt=None):
    from ddtree.stats import make_run_document

    meta = S.model_metadata(spec, opts, method=method, budget=budget, max_length=max_len,
                            top1_first=bool(opts["top1_first"]), prompts=opts.get("prompts"), interrupted=interrupted,
                            interrupted_prompt=interrupted_prompt, **paths)
    return make_run_document(meta, [dict(
        method=method, budget=budget if isinstance(budget, int) else None, budget_setting=budget, records=records,
        speedup_vs_ar=None, block_size=spec.block_size if method != "ar" else None, interrupted=interrupted,
    )])


def _generate_tp(S, spec, opts: dict, method: str, budget, encoded: list, max_len: int, start, done) -> None:
    """The prompts under tensor parallelism (ddtree.parallel.tp loads the shards once and spawns
    the ranks); rank 0's tokens stream here."""
    tp = S.tp_module()
    args = dict(S.tp_args(spec, opts, max_len, int(opts["tp"])), method=method, budget=budget or DEFAULT_BUDGET)
    streamers: list = []

    def on_tokens(i, toks):
        while len(streamers) <= i:  # job i started: the text of the one before it is complete
            if streamers:
                streamers[-1].finish()
            p, ids = encoded[len(streamers)]
            streamers.append(start(p, ids))
        streamers[i](toks)

    _set_stage(f"generating ({method}, tensor parallel over {args['tp']} ranks)")
    jobs = [dict(prompt_ids=ids, prompt_id=p.id) for p, ids in encoded]
    records = tp.run_generate_tp_jobs(args, jobs, on_tokens=on_tokens, decode_text=S.decode_text_fn(spec.tokenizer))
    for i, ((p, ids), rec) in enumerate(zip(encoded, records)):
        done(p, rec, streamers[i] if i < len(streamers) else start(p, ids))


# ============================================================================================
# bench, plot, selftest
# ============================================================================================


def run_bench_command(opts: dict, given: frozenset) -> dict:
    from ddtree.app.bench import run_bench

    return run_bench(**opts, stage=_set_stage, given=given)


def default_plot_folder(results: Path) -> Path:
    """results/x.json and results/x.json.gz -> results/x-plots."""
    name = results.name
    for suffix in (".json.gz", ".json", ".gz"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
            break
    return results.with_name(name + "-plots")


def run_plot(opts: dict, given: frozenset, results: Path) -> list:
    from ddtree.app.setup import check_output, make_parent

    folder = Path(opts["out"]) if opts["out"] is not None else default_plot_folder(Path(results))
    check_output(folder, "--out", kind="dir")
    from ddtree.app.plot import _import_matplotlib, checked_document, plot_results

    _import_matplotlib()
    doc = checked_document(results)  # a missing, unreadable or foreign file fails before any folder is made
    make_parent(folder, "--out", kind="dir")
    paths = plot_results(doc, folder, source=str(results))
    for p in paths:
        print(p, flush=True)
    return paths


def _chat(opts: dict, given: frozenset) -> int:
    if opts.get("server"):
        from ddtree.app.serve.client import run_chat_remote

        return run_chat_remote(opts, given)
    from ddtree.app.chat import run_chat

    return run_chat(opts, given, _set_stage)


def _serve(opts: dict, given: frozenset) -> int:
    from ddtree.app.serve.server import run_serve

    return run_serve(opts, given, _set_stage)


def run_plan_command(opts: dict) -> None:
    from ddtree.app.plan import run_plan

    run_plan(opts, opts.pop("gpu_memory"), opts.pop("attention"))


def run_selftest_command(opts: dict, given: frozenset) -> None:
    from ddtree.app.selftest import run_selftest

    run_selftest(opts, _set_stage)


_command("generate", lambda opts, given, prompt: run_generate(opts, given, prompt),
         "Generate text for PROMPT (or each prompt of --prompts); only the generated text goes to stdout, streamed.")
_command("chat", lambda opts, given: _chat(opts, given),
         "Chat with the target: each turn streams a reply and keeps the conversation's state, so the next turn "
         "prefills only its new tokens; /help lists the commands.")
_command("serve", _serve,
         "Serve the models over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health, "
         "/metrics): loaded and warmed up once, one generation at a time, the state kept between requests; "
         "generate and chat take --server URL.")
_command("bench", run_bench_command,
         "Benchmark ar / dflash / ddtree (per budget) on a prompt set: a table on stdout, a ddtree.stats/1 JSON file.")
_command("plan", lambda opts, given: run_plan_command(opts),
         "Memory plan from the configs alone: the layer split and each GPU's bytes at --max-length; fails in one line, "
         "naming what would fit, when it does not fit.")
_command("plot", lambda opts, given, results: run_plot(opts, given, results),
         "Speedup and acceptance vs budget, acceptance-length histograms and stage times as PNG files.")
_command("selftest", run_selftest_command,
         "Decode a random prompt on a tiny random Qwen3.6-style hybrid pair with ar, dflash and ddtree (budgets 4 and "
         "32) and check every greedy output equals ar's. No download.")

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
    """Exact DDTree speculative decoding: ddtree generate | chat | serve | bench | plan | plot | selftest."""


if __name__ == "__main__":  # pragma: no cover
    app()

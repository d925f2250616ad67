"""Every command-line option, defined once: flags, type, default, help, the commands that take it.

The typer commands (``ddtree.app.cli``), the TOML settings keys (``ddtree.app.settings``), the
defaults applied after merging, and the options table of docs/USAGE.md (``markdown_table``; a
test compares it with that file) are all built from :data:`OPTIONS`. Nothing here imports torch: the
command line parses and validates its arguments before any heavy import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddtree.options import DEFAULT_BUDGET

COMMANDS: tuple[str, ...] = ("generate", "bench", "plan", "plot", "selftest", "chat", "serve")
GEN, BENCH, PLAN, PLOT, SELFTEST, CHAT, SERVE = COMMANDS
MODEL = (GEN, BENCH)  # the commands that load a checkpoint pair for a prompt set
LOADS = (GEN, CHAT, BENCH, SERVE)  # the commands that load one


@dataclass(frozen=True)
class Opt:
    name: str  # Python name and TOML key (a TOML file may also spell it with dashes)
    flags: tuple[str, ...]  # first = the name shown; an argument has its metavar here
    type: type  # str, int, float, bool or Path
    commands: tuple[str, ...]
    help: str | dict[str, str]  # one text, or per command
    default: Any = None  # the value after merging when nobody set it; a dict: per command
    default_doc: str | dict[str, str] | None = None  # how --help and docs/USAGE.md state a computed default
    metavar: str | None = None
    min: float | None = None
    max: float | None = None
    negative: str | None = None  # a bool's off switch, e.g. --no-raw
    toml_types: tuple[type, ...] = ()  # TOML value types accepted besides the option's own
    file_commands: tuple[str, ...] | None = None  # commands that take the value from a --config file (default: all)
    argument: bool = False  # positional (PROMPT, RESULTS): not a TOML key
    env: str | None = None  # an environment variable read when the flag is not given

    @property
    def flag(self) -> str:
        return self.flags[0]

    def default_for(self, command: str) -> Any:
        return self.default.get(command) if isinstance(self.default, dict) else self.default

    def help_for(self, command: str) -> str:
        return self.help[command] if isinstance(self.help, dict) else self.help

    def default_text(self, command: str | None = None) -> str | None:
        """The default as --help and docs/USAGE.md say it (None: no default worth stating)."""
        doc = self.default_doc
        if command and isinstance(self.default, dict) and not isinstance(doc, dict):  # --help: this command's
            value = self.default.get(command)
            return None if value is None else _show(value, self)
        if isinstance(doc, dict):
            return doc.get(command) if command else "; ".join(f"{c}: {d}" for c, d in doc.items())
        if doc is not None:
            return doc
        if command is None and isinstance(self.default, dict):
            return "; ".join(f"{c}: {_show(d)}" for c, d in self.default.items() if d is not None) or None
        value = self.default_for(command) if command else self.default
        return None if value is None else _show(value, self)

    def file_applies(self, command: str) -> bool:
        return not self.argument and command in (self.file_commands or self.commands)


def _show(value: Any, opt: Opt | None = None) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


OPTIONS: tuple[Opt, ...] = (
    Opt("prompt", ("PROMPT",), str, (GEN,), "Prompt text; - reads it from stdin (one trailing newline is dropped)",
        argument=True),
    Opt("results", ("RESULTS",), Path, (PLOT,), "Result JSON written by ddtree bench or generate --stats-json (.json or .json.gz)",
        argument=True),
    Opt("target", ("--target", "-t"), str, LOADS + (PLAN,),
        "Target model: local directory or Hugging Face repo id (Qwen/Qwen3.6-27B); plan reads its config.json only",
        metavar="REF"),
    Opt("drafter", ("--drafter", "-d"), str, LOADS + (PLAN,),
        "DFlash drafter: local directory or Hugging Face repo id (z-lab/Qwen3.6-27B-DFlash)", metavar="REF"),
    Opt("method", ("--method", "-m"), str, (GEN, CHAT, SERVE),
        "ar, dflash (DFlash chain) or ddtree (draft tree); serve: a request's default",
        default_doc="ddtree with a drafter, else ar", metavar="M"),
    Opt("budget", ("--budget", "-b"), str, (GEN, CHAT, SERVE, PLAN),
        "Draft-tree nodes verified per round (ddtree only), or auto: each round drafts the arm with the most expected "
        "tokens per millisecond (the chain, a best-first tree of 4, 8, 15, 31 or 63 nodes, or 0: a plain target step; "
        "drafter path probabilities times the acceptance seen so far, over each arm's whole-round wall time measured "
        "on this machine)",
        default=DEFAULT_BUDGET, metavar="N|auto", toml_types=(int,)),
    Opt("methods", ("--methods",), str, (BENCH,), "Methods to compare, comma-separated (ar is added and runs first)",
        default="ar,dflash,ddtree", metavar="LIST", toml_types=(list,)),
    Opt("budgets", ("--budgets",), str, (BENCH,), "One ddtree run per budget, comma-separated; auto is a budget too (e.g. 8,16,auto)",
        default="8,15,31,63", metavar="LIST", toml_types=(int, list)),
    Opt("prompts", ("--prompts", "-p"), str, MODEL,
        "Prompt set: a JSONL file (one object per line with \"prompt\" or chat \"messages\", optional \"id\"), a built-in "
        "suite (code, math, chat) or hf:DATASET[:SPLIT[:FIELD]] (needs the datasets package); generate takes it "
        "instead of PROMPT", default={GEN: None, BENCH: "code"}, default_doc={BENCH: "code"}, metavar="SPEC"),
    Opt("limit", ("--limit",), int, MODEL, "Only the first N prompts of --prompts", default_doc="all", metavar="N", min=1),
    Opt("prompt_tokens", ("--prompt-tokens",), int, (BENCH,),
        "Fit every prompt to exactly N tokens (its text repeated, or cut, inside the chat template): long-context "
        "runs from any prompt set", default_doc="as written", metavar="N", min=1),
    Opt("max_new_tokens", ("--max-new-tokens", "-n"), int, (GEN, CHAT, BENCH, SELFTEST, SERVE),
        "Tokens to generate per prompt (chat: per reply; serve: a request's default max_tokens)",
        default={GEN: 256, CHAT: 256, BENCH: 256, SELFTEST: 48, SERVE: 256}, default_doc="256 (selftest: 48)", metavar="N", min=1),
    Opt("temperature", ("--temperature",), float, LOADS, "Sampling temperature; 0 = greedy", default=0.0, metavar="T", min=0),
    Opt("top_p", ("--top-p",), float, LOADS, "Nucleus sampling mass, in (0, 1]", default=1.0, metavar="P", min=0, max=1),
    Opt("top_k", ("--top-k",), int, LOADS, "Top-k sampling; 0 = off", default=0, metavar="K", min=0),
    Opt("seed", ("--seed",), int, LOADS, "Sampling seed", default=0, metavar="S"),
    Opt("dtype", ("--dtype",), str, LOADS + (PLAN,), "bfloat16, float16 or float32",
        default={PLAN: "bfloat16"}, default_doc={GEN: "bfloat16 on cuda, float32 on cpu", CHAT: "bfloat16 on cuda, float32 on cpu",
                                                BENCH: "bfloat16 on cuda, float32 on cpu",
                                                SERVE: "bfloat16 on cuda, float32 on cpu", PLAN: "bfloat16"}, metavar="D"),
    Opt("devices", ("--devices", "--device"), str, (GEN, CHAT, BENCH, PLAN, SELFTEST, SERVE),
        "auto, cpu, cuda:0, or cuda:0,cuda:1 (target layers split over the GPUs by the memory plan; a device may repeat: "
        "cuda:0,cuda:0 is two stages on one GPU; selftest takes one)",
        default={GEN: "auto", CHAT: "auto", BENCH: "auto", PLAN: None, SELFTEST: "auto", SERVE: "auto"},
        default_doc={GEN: "auto (cuda:0 if available, else cpu)", CHAT: "auto (cuda:0 if available, else cpu)",
                     BENCH: "auto (cuda:0 if available, else cpu)", SERVE: "auto (cuda:0 if available, else cpu)",
                     PLAN: "one per --gpu-memory entry, else cuda:0", SELFTEST: "auto (cuda:0 if available, else cpu)"},
        metavar="LIST", toml_types=(list,)),
    Opt("max_length", ("--max-length",), int, LOADS + (PLAN,),
        {GEN: "Length of the state buffers (K/V cache) in tokens",
         CHAT: "Length of the state buffers (K/V cache) in tokens: the longest conversation",
         BENCH: "Length of the state buffers (K/V cache) in tokens", PLAN: "State length to plan for, in tokens",
         SERVE: "Length of the state buffers (K/V cache) in tokens: the longest request, prompt and reply"},
        default_doc={GEN: "longest prompt + new tokens + tree + 256", CHAT: "the model's max_position_embeddings, at most 32768",
                     BENCH: "longest prompt + new tokens + tree + 256", PLAN: "the model's max_position_embeddings",
                     SERVE: "the model's max_position_embeddings, at most 32768"},
        metavar="L", min=1),
    Opt("gpu_memory", ("--gpu-memory",), str, (PLAN,),
        "Memory per GPU to plan for, on any machine: 2x48GiB, 48GiB,48GiB or 80GB", default_doc="the visible GPUs' total",
        metavar="SPEC"),
    Opt("attention", ("--attention",), str, (PLAN,),
        "The verify's and draft's attention path to plan for: kernel (the split-KV kernel, no mask), math (SDPA's "
        "dense-mask fallback), fused (cuDNN), auto (what the GPUs planned for run: with --gpu-memory, the split-KV kernel "
        "of any CUDA GPU; else what the visible GPUs run)", default="auto", metavar="PATH"),
    Opt("raw", ("--raw",), bool, LOADS,
        "Send the prompt as is, without the tokenizer's chat template (chat: a plain transcript)", default=False,
        default_doc="--no-raw", negative="--no-raw"),
    Opt("thinking", ("--thinking",), bool, LOADS, "enable_thinking in the chat template", default=True,
        default_doc="--thinking", negative="--no-thinking"),
    Opt("top1_first", ("--top1-first",), bool, LOADS, "Put the drafter's top-1 chain in the tree first, then grow best-first",
        default=False, negative="--no-top1-first"),
    Opt("compiled", ("--compiled",), bool, (SELFTEST,),
        "Also run the layers through torch.compile, as generate does on a GPU (the eager layers are the default: the "
        "check is the pipeline's exactness, and compiling costs more than the decoding; the first compile on a "
        "machine takes about a minute)", default=False, negative="--no-compiled"),
    Opt("tp", ("--tp",), int, MODEL, "Tensor parallelism: shard the target over N ranks (NCCL on GPUs, gloo on CPU)",
        default=1, metavar="N", min=1),
    Opt("system", ("--system",), str, (CHAT,),
        "The system prompt: TEXT, or @FILE to read it from a file (a target without a chat template: the transcript's "
        "first line)", metavar="TEXT|@FILE"),
    Opt("chat", ("--chat",), bool, (PLAN,),
        "Plan for ddtree chat: add its snapshots of the GDN states at turn boundaries", default=False,
        negative="--no-chat"),
    Opt("stats_json", ("--stats-json",), Path, (GEN,),
        "Write the per-round statistics of the run (ddtree.stats/1 JSON; gzipped when PATH ends in .gz)", metavar="PATH"),
    Opt("jsonl", ("--jsonl",), bool, (GEN,),
        "Print one JSON object per prompt (id, text and the summary numbers) instead of streaming the text",
        default=False, negative="--no-jsonl"),
    Opt("warmup", ("--warmup",), int, (BENCH,),
        "Uncounted warm-up generations per run (each generates the shortest and the longest prompt in full, so every "
        "graph is captured before timing)", default=1, metavar="N", min=0),
    Opt("interleave", ("--interleave",), bool, (BENCH,),
        "Time the runs prompt by prompt in turn (every run on the first prompt, then on the second, ...) instead of one "
        "run over every prompt, then the next: a slow spell of the machine (a shared or throttling CPU) hits every "
        "run alike", default=False, negative="--no-interleave"),
    Opt("out", ("--out", "-o"), Path, (BENCH, PLOT),
        {BENCH: "Result JSON (ddtree.stats/1; gzipped when PATH ends in .gz)",
         PLOT: "Folder for the PNGs (a --config file's out is bench's result file, not this folder)"},
        default={BENCH: "results/bench.json", PLOT: None}, default_doc={BENCH: "results/bench.json", PLOT: "RESULTS-plots/"},
        metavar="PATH", file_commands=(BENCH,)),
    Opt("server", ("--server",), str, (GEN, CHAT),
        "Send the work to a running `ddtree serve` at URL (e.g. http://127.0.0.1:8000), whose models stay loaded: "
        "the same output, no start-up", metavar="URL"),
    Opt("api_key", ("--api-key",), str, (GEN, CHAT, SERVE),
        {GEN: "The server's key (with --server)", CHAT: "The server's key (with --server)",
         SERVE: "Require this key on every /v1 route (Authorization: Bearer KEY)"},
        metavar="KEY", env="DDTREE_API_KEY"),
    Opt("host", ("--host",), str, (SERVE,), "Address to listen on (0.0.0.0: every interface)", default="127.0.0.1",
        metavar="ADDR"),
    Opt("port", ("--port",), int, (SERVE,), "Port to listen on (0: a free one, printed)", default=8000, metavar="N",
        min=0, max=65535),
    Opt("max_queue", ("--max-queue",), int, (SERVE,),
        "Requests that may wait while one generates (first come, first served); past them a 429 with Retry-After",
        default=16, metavar="N", min=0),
    Opt("config", ("--config", "-c"), Path, COMMANDS, "TOML settings file (keys: these option names); flags override it",
        metavar="FILE"),
    Opt("verbose", ("--verbose", "-v"), bool, COMMANDS,
        "Debug logs on stderr: placement, dtype, kernels and paths, state length", default=False, negative="--no-verbose"),
)

BY_NAME: dict[str, Opt] = {o.name: o for o in OPTIONS}
#: TOML key aliases (a flag's other spelling) -> option name
ALIASES: dict[str, str] = {"device": "devices"}


def options_for(command: str) -> list[Opt]:
    return [o for o in OPTIONS if command in o.commands]


def defaults(command: str) -> dict[str, Any]:
    return {o.name: o.default_for(command) for o in options_for(command) if not o.argument and o.name != "config"}


def toml_keys() -> dict[str, tuple[type, ...]]:
    """Settings-file key -> accepted TOML value types: every option but --config and the arguments."""
    own = {str: (str,), Path: (str,), int: (int,), float: (float, int), bool: (bool,)}
    keys = {o.name: own[o.type] + o.toml_types for o in OPTIONS if not o.argument and o.name != "config"}
    keys.update({alias: keys[name] for alias, name in ALIASES.items()})
    return keys


def flag_text(o: Opt) -> str:
    """`--budget N|auto`, `--raw` / `--no-raw`, `PROMPT`."""
    if o.argument:
        return f"`{o.flag}`"
    if o.negative:
        return f"`{o.flag}` / `{o.negative}`"
    return f"`{o.flag} {o.metavar}`" if o.metavar else f"`{o.flag}`"


def markdown_table() -> str:
    """docs/USAGE.md's options table (tests/app/test_options.py checks that file holds exactly this)."""
    rows = ["| option | commands | default | meaning |", "|---|---|---|---|"]
    for o in OPTIONS:
        commands = "all" if o.commands == COMMANDS else ", ".join(o.commands)
        default = o.default_text() or ""
        meaning = "; ".join(f"{c}: {h}" for c, h in o.help.items()) if isinstance(o.help, dict) else o.help
        if len(o.flags) > 1 and o.flags[1].startswith("--"):
            meaning += f" (also `{o.flags[1]}`)"
        if o.env:
            meaning += f" (also from `${o.env}`)"
        cells = [flag_text(o), commands, default, meaning]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)

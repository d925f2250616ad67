"""`ddtree chat`: a conversation in the terminal whose state is kept between turns.

The models load once. Each turn renders the whole conversation with the target's chat template
(or, without one, as a plain transcript: every message on its own line, the reply continuing
it), and `ddtree.decode.conversation.Conversation` prefills only what the committed state does
not hold. After a reply the state is settled at the point every next turn shares (the renders of
two different next messages agree up to it), while the user reads the reply.

Input: prompt_toolkit's line editor when stdin and stdout are a terminal (history on the up
arrow; Esc Enter or a paste adds lines to a message; Ctrl-C clears the line, Ctrl-D leaves),
else one message per line from stdin (a line ending in a backslash continues on the next).
The reply streams to stdout; everything else goes to stderr.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from loguru import logger

from ddtree.errors import DDTreeError, TooLongError

#: --max-length when none is given: the model's positions, at most this many
CHAT_MAX_LENGTH = 32768
#: the /save document's schema (docs/stats-schema.md)
CHAT_SCHEMA = "ddtree.chat/1"
#: two next messages that start differently: what the renders of both share, any next turn shares
PROBES = ("a", "\n b")

HELP = """commands:
  /reset          start over (the system prompt stays)
  /system TEXT    set the system prompt (/system alone clears it)
  /method M       ar, dflash or ddtree
  /budget N|auto  ddtree's draft-tree budget
  /stats          the last turn: new tokens, decode tok/s, TTFT, tokens per target forward, reused / prefilled
  /save FILE      the messages and per-turn statistics as JSON (ddtree.chat/1)
  /load FILE      continue a saved conversation
  /exit           leave (Ctrl-D too)
a line starting with // sends the rest with one slash; Esc Enter (or a paste) adds lines to a message"""


def read_system(value: str | None) -> str | None:
    """--system TEXT, or @FILE: the file's text."""
    if value is None or not value.startswith("@"):
        return value
    path = Path(value[1:]).expanduser()
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = getattr(e, "strerror", None) or type(e).__name__
        raise DDTreeError(f"--system {value}: cannot read {path} ({why}): pass an existing UTF-8 file after @") from None


@dataclass
class TurnResult:
    text: str
    stats: dict  # the /save row (turn_stats)
    record: Any  # the GenerationRecord, or None when interrupted


class Chat:
    """The conversation without its terminal: messages, settings and the kept state."""

    def __init__(self, spec, decoder, opts: dict, template: bool, system: str | None = None):
        from ddtree.app.setup import sampling_params
        from ddtree.decode.conversation import Conversation

        self.spec, self.dec, self.opts = spec, decoder, opts
        self.conv = Conversation(decoder)
        self.template = template
        self.thinking = bool(opts["thinking"])
        self.method = opts["method"]
        self.budget = opts["budget"]
        self.sampling = sampling_params(opts)
        self.max_new = int(opts["max_new_tokens"])
        self.messages: list[dict] = []
        self.turns: list[dict] = []
        self._head: tuple[str | None, int] = (None, 0)
        self.set_system(system)

    # ---------------------------------------------------------------- rendering
    def encode(self, messages: list[dict]) -> list[int]:
        """The conversation's tokens, as `ddtree generate` would encode the same prompt."""
        from ddtree.app.setup import encode_prompt

        return encode_prompt(self.spec, self.prompt(messages), not self.template, self.thinking)

    def prompt(self, messages: list[dict]):
        """The prompt `generate` takes for this conversation: its messages (with a chat template),
        else the plain transcript's text."""
        from ddtree.app.prompts import Prompt

        if self.template:
            return Prompt(id="chat", messages=[dict(m) for m in messages])
        return Prompt(id="chat", text="".join(m["content"] + "\n" for m in messages))

    def _shared(self, messages: list[dict]) -> list[int]:
        """The tokens every next turn after `messages` starts with (the probes' common prefix)."""
        from ddtree.decode.conversation import common_prefix

        a, b = (self.encode(messages + [{"role": "user", "content": p}]) for p in PROBES)
        return a[:common_prefix(a, b)]

    def head(self) -> int:
        """Where the system prompt's rendering ends (0 without one): a boundary kept for good."""
        system = self.system
        if system is None:
            return 0
        if self._head[0] != system:
            self._head = (system, len(self._shared(self.messages[:1])))
        return self._head[1]

    # ---------------------------------------------------------------- settings
    @property
    def system(self) -> str | None:
        return self.messages[0]["content"] if self.messages and self.messages[0]["role"] == "system" else None

    def set_system(self, text: str | None) -> None:
        rest = self.messages[1:] if self.system is not None else self.messages
        self.messages = ([{"role": "system", "content": text}] if text else []) + rest

    def reset(self) -> None:
        self.messages = self.messages[:1] if self.system is not None else []

    def set_method(self, value: str) -> None:
        from ddtree.app.setup import parse_method

        m = parse_method(value, self.dec.drafter is not None)
        if m != "ar" and self.dec.drafter is None:
            raise DDTreeError(f"/method {m} needs a drafter: restart with --drafter REF")
        self.method = m

    def set_budget(self, value: str) -> None:
        from ddtree.app.setup import parse_budget

        self.budget = parse_budget(value, "/budget")

    def label(self) -> str:
        return method_label(self.method, self.budget)

    # ---------------------------------------------------------------- turns
    def streamer(self, out):
        """What prints a reply to `out` as its tokens come."""
        from ddtree.app.streaming import Streamer

        return Streamer(self.spec.tokenizer, out=out)

    def send(self, text: str, on_tokens: Callable[[list[int]], None] | None = None) -> TurnResult:
        """One turn: the reply to `text`, streamed to on_tokens. A turn that does not fit
        --max-length raises DDTreeError with the conversation unchanged; Ctrl-C keeps the partial
        reply (the result's record is None)."""
        msgs = self.messages + [{"role": "user", "content": text}]
        ids = self.encode(msgs)
        try:
            job = self.dec.job(self.method, self.budget, self.sampling, self.max_new, self.opts["seed"],
                               bool(self.opts["top1_first"]), len(ids))
        except TooLongError:
            raise DDTreeError(f"this message does not fit: the conversation would be {len(ids)} tokens, and with "
                              f"--max-new-tokens {self.max_new} it passes --max-length {self.dec.max_len}; the "
                              "conversation is kept (/save it, /reset, or restart with a larger --max-length)") from None
        head = self.head()
        reply: list[int] = []

        def got(toks: list[int]) -> None:
            reply.extend(toks)
            if on_tokens:
                on_tokens(toks)

        rec, interrupted = None, False
        try:
            rec = self.conv.turn(ids, job, self.spec.stop_ids, got, marks=(head,), pin=(head,))
        except KeyboardInterrupt:
            interrupted = True
        reuse = self.conv.last
        answer = self.spec.tokenizer.decode(reply, skip_special_tokens=True)
        self.messages = msgs + [{"role": "assistant", "content": answer}]
        stats = turn_stats(len(self.messages) - 1, self.method, self.budget, len(ids), reuse, rec, len(reply),
                           interrupted)
        self.turns.append(stats)
        return TurnResult(answer, stats, rec)

    def settle(self) -> None:
        """Bring the kept state to what every next turn shares (after a reply, a /load)."""
        from ddtree.decode.startup import freeze_heap

        t0 = time.perf_counter()
        ids = self._shared(self.messages)
        r = self.conv.settle(ids, taps=self.method != "ar")
        if self.turns:
            self.turns[-1].update(settle_reused_tokens=r.reused, settle_prefilled_tokens=r.prefilled,
                                  settle_s=time.perf_counter() - t0)
        logger.debug(f"settled at {len(ids)} tokens: {r.reused} kept, {r.prefilled} prefilled"
                     + (" (a boundary restored)" if r.restored else ""))
        if freeze_heap(self.dec.graphs):  # while the reply is read: no full collection inside a turn
            logger.debug("froze the heap after new compiled or captured work")

    # ---------------------------------------------------------------- /save, /load
    def document(self) -> dict:
        from ddtree.app.setup import model_metadata

        meta = model_metadata(self.spec, self.opts, method=self.method, budget=self.budget,
                              max_length=self.dec.max_len, transcript="chat template" if self.template else "plain")
        return {"schema": CHAT_SCHEMA, "metadata": meta, "messages": self.messages, "turns": self.turns}

    def save(self, path: str) -> Path:
        from ddtree.app.setup import check_output, make_parent

        p = check_output(path, "/save")
        make_parent(p, "/save")
        p.write_text(json.dumps(self.document(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        return p

    def load(self, path: str) -> int:
        """Continue a saved conversation: its messages and statistics; prefills it once. -> tokens prefilled."""
        from ddtree.app.prompts import _valid_messages

        p = Path(path).expanduser()
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise DDTreeError(f"/load {path}: cannot read it ({getattr(e, 'strerror', None) or type(e).__name__})") from None
        except json.JSONDecodeError as e:
            raise DDTreeError(f"/load {path} is not JSON ({e.msg}): pass a file written by /save") from None
        if not isinstance(doc, dict) or doc.get("schema") != CHAT_SCHEMA or not (
                doc.get("messages") == [] or _valid_messages(doc.get("messages"))):
            raise DDTreeError(f"/load {path} is not a {CHAT_SCHEMA} document: pass a file written by /save")
        self.messages = [{"role": m["role"], "content": m["content"]} for m in doc["messages"]]
        self.turns = [t for t in doc.get("turns") or [] if isinstance(t, dict)]
        self.settle()
        return self.conv.last.prefilled


def turn_stats(message: int, method: str, budget, prompt_tokens: int, reuse, rec, n_new: int,
               interrupted: bool) -> dict:
    """A turn's row in the /save document (docs/stats-schema.md, ddtree.chat/1)."""
    from ddtree.stats import aggregate

    a = aggregate([rec]) if rec is not None else {}
    return {
        "message": message, "method": method, "budget": budget if method == "ddtree" else None,
        "prompt_tokens": prompt_tokens,
        "common_prefix_tokens": reuse.common if reuse else None,
        "reused_tokens": reuse.reused if reuse else 0,
        "prefilled_tokens": reuse.prefilled if reuse else 0,
        "restored_snapshot": bool(reuse and reuse.restored),
        "new_tokens": n_new, "interrupted": interrupted,
        "ttft_s": rec.ttft_s if rec else None, "decode_s": rec.decode_s if rec else None,
        "decode_tok_s": rec.decode_tok_s if rec else None,
        "rounds": a.get("rounds"), "tokens_per_target_forward": a.get("tokens_per_target_forward"),
        "mean_acceptance_length": a.get("mean_acceptance_length"), "num_drafts": a.get("num_drafts"),
        "num_plain_steps": a.get("num_plain_steps"),
        "settle_reused_tokens": None, "settle_prefilled_tokens": 0, "settle_s": 0.0,
    }


def method_label(method: str, budget) -> str:
    """'ddtree 32', 'dflash', 'ar': a method as the chat names it."""
    return f"ddtree {budget}" if method == "ddtree" else method


def stats_line(t: dict) -> str:
    """/stats: the last turn in one line."""
    head = f"{method_label(t['method'], t['budget'])}: {t['new_tokens']} new tokens from a {t['prompt_tokens']}-token conversation"
    if t["interrupted"] or t["ttft_s"] is None:
        head += " (interrupted)"
    else:
        head += f", {t['decode_tok_s']:.1f} tok/s decode, time to first token {t['ttft_s'] * 1e3:.0f} ms"
        if t["rounds"]:
            head += f", {t['tokens_per_target_forward']:.2f} tokens per target forward"
    return head + (f"; {t['reused_tokens']} tokens reused, {t['prefilled_tokens']} prefilled"
                   f" (then {t['settle_prefilled_tokens']} settled after the reply)")


# ============================================================================================
# input: a terminal (prompt_toolkit) or lines from a pipe
# ============================================================================================


class LineInput:
    """Messages one per line from a stream; a line ending in a backslash continues."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdin

    def read(self) -> str | None:
        parts = []
        while True:
            line = self.stream.readline()
            if not line:
                return "\n".join(parts) if parts else None
            line = line.rstrip("\r\n")
            if line.endswith("\\"):
                parts.append(line[:-1])
                continue
            parts.append(line)
            return "\n".join(parts)


class TerminalInput:
    """prompt_toolkit's line editor: history on the up arrow, Esc Enter for a new line (pastes
    keep theirs), Ctrl-C clears the line, Ctrl-D ends."""

    def __init__(self):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        keys = KeyBindings()

        @keys.add("escape", "enter")
        def _newline(event):
            event.current_buffer.insert_text("\n")

        self.editor = PromptSession(history=InMemoryHistory(), key_bindings=keys, multiline=False,
                                    prompt_continuation="... ")

    def read(self) -> str | None:
        while True:
            try:
                return self.editor.prompt(">>> ")
            except KeyboardInterrupt:
                continue  # the line is cleared
            except EOFError:
                return None


# ============================================================================================
# the loop
# ============================================================================================


class Repl:
    """Reads messages and commands, streams replies; -> the exit status (0)."""

    def __init__(self, chat: Chat, source, out=None):
        self.s, self.source = chat, source
        self.out = out or sys.stdout

    def say(self, line: str) -> None:
        self.out.flush()
        print(line, file=sys.stderr, flush=True)

    def run(self) -> int:
        while True:
            line = self.source.read()
            if line is None:
                return 0
            if not line.strip():
                continue
            try:
                if line.startswith("/") and not line.startswith("//"):
                    if self.command(line.strip()) == "exit":
                        return 0
                else:
                    self.reply(line[1:] if line.startswith("//") else line)
            except DDTreeError as e:
                self.say(f"error: {' '.join(str(e).split())}")
            except KeyboardInterrupt:  # before the reply began (or a command): nothing was sent
                self.say("interrupted")

    def reply(self, text: str) -> None:
        streamer = self.s.streamer(self.out)
        result = self.s.send(text, streamer)
        streamer.finish()
        t = result.stats
        logger.debug(f"turn {len(self.s.turns)}: {t['prompt_tokens']} tokens, {t['reused_tokens']} reused (common "
                     f"prefix {t['common_prefix_tokens']}" + (", a boundary restored" if t["restored_snapshot"] else "")
                     + f"), {t['prefilled_tokens']} prefilled")
        if result.record is None:
            self.say("interrupted: the partial reply is kept in the conversation")
        try:
            self.s.settle()
        except KeyboardInterrupt:
            pass  # the state stays consistent: the next turn prefills what the settle did not

    def command(self, line: str) -> str | None:
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        s = self.s
        if name in ("/exit", "/quit"):
            return "exit"
        if name == "/help":
            self.say(HELP)
        elif name == "/reset":
            s.reset()
            self.say("the conversation starts over" + (" (the system prompt stays)" if s.system else ""))
        elif name == "/system":
            s.set_system(arg or None)
            self.say("system prompt set" if arg else "system prompt cleared")
        elif name == "/method":
            s.set_method(arg)
            self.say(f"method {s.label()}")
        elif name == "/budget":
            s.set_budget(arg)
            self.say(f"budget {s.budget}" + ("" if s.method == "ddtree" else f" (used by ddtree; the method is {s.method})"))
        elif name == "/stats":
            self.say(stats_line(s.turns[-1]) if s.turns else "no turn yet")
        elif name == "/save":
            if not arg:
                raise DDTreeError("/save needs a file: /save chat.json")
            self.say(f"saved {len(s.messages)} messages to {s.save(arg)}")
        elif name == "/load":
            if not arg:
                raise DDTreeError("/load needs a file: /load chat.json")
            n = s.load(arg)
            self.say(f"loaded {len(s.messages)} messages ({n} tokens prefilled)")
        else:
            raise DDTreeError(f"unknown command {name}: /help lists them")
        return None


def run_chat(opts: dict, given: frozenset, stage: Callable[[str], None]) -> int:
    """`ddtree chat` after option merging."""
    from ddtree.app import setup as S
    from ddtree.decode.conversation import SNAPSHOTS

    method, budget = S.check_model_options(opts)
    S.precheck_model(opts["target"], "target")
    if opts["drafter"]:
        S.precheck_model(opts["drafter"], "drafter")
    system = read_system(opts["system"])
    if "budget" in given and method != "ddtree":
        S.warn_ignored("--budget", f"it sizes ddtree's trees, and the method is {method} (/method ddtree uses it)")

    spec = S.inspect_models(opts["target"], opts["drafter"], opts["devices"], opts["dtype"],
                            need_drafter=bool(opts["drafter"]))
    S.warn_template(spec, opts, given)
    template = S.has_chat_template(spec) and not opts["raw"]
    if not template:
        S.notice(("--raw" if opts["raw"] else "the target's tokenizer has no chat template") + ": a plain transcript "
                 "(every message on its own line, the reply continuing it)")
    max_len = opts["max_length"] or min(spec.target_cfg.max_position_embeddings, CHAT_MAX_LENGTH)
    room = max(S.tree_room(method, budget, spec.block_size), S.tree_room("dflash", None, spec.block_size)
               if spec.drafter_cfg is not None else 1)
    loaded = S.load_models(spec, max_len, spec.drafter_cfg is not None, stage, room=room,
                           auto=budget == "auto", snapshots=SNAPSHOTS)
    S.flush_notices()
    chat = Chat(spec, loaded.decoder, dict(opts, method=method, budget=budget), template, system)
    stage(f"chatting ({method})")
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    if tty:
        print(f"ddtree chat: {spec.target_ref} ({chat.label()}); /help lists the commands, Ctrl-D leaves",
              file=sys.stderr, flush=True)
    return Repl(chat, TerminalInput() if tty else LineInput()).run()

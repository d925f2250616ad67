"""`ddtree generate --server URL` and `ddtree chat --server URL`: the same commands, the work done
by a running `ddtree serve`.

The same stdout (the text streamed as it comes, or --jsonl's objects), the same stderr summary
line, the same --stats-json document: the server returns each generation's whole record
(`"ddtree": {"record": true}`: usage.ddtree.record and .metadata, ddtree.stats' per-prompt entry
and run metadata) and this side prints it with generate's own functions (ddtree.app.textio).
A prompt goes to /v1/chat/completions where the server renders a chat template (its model card
says so) and the command does not pass --raw, else its text to /v1/completions, so the server
encodes it as `generate` would. Sampling settings, the method and the budget are sent where the
command sets them (a flag, or a --config value other than the default); elsewhere the server's
options apply. Ctrl-C closes the stream: the server ends that generation after its round.

This module and what it imports import neither torch nor transformers (tests check it in a
fresh process): HTTP through httpx, server-sent events through httpx-sse.
"""

from __future__ import annotations

import json
import sys
import time
from types import SimpleNamespace
from typing import Callable

# A client command's start-up is its latency: httpx imports its own command-line client (click,
# rich, pygments: 40-60 ms) unless that module is absent, and ddtree never runs it.
sys.modules.setdefault("httpx._main", None)
import httpx  # noqa: E402
from httpx_sse import connect_sse  # noqa: E402

from ddtree.app.chat import CHAT_SCHEMA, Chat, TurnResult, turn_stats
from ddtree.app.options import BY_NAME, defaults
from ddtree.errors import DDTreeError

#: the model options that only the server's command line sets
SERVER_SIDE = ("target", "drafter", "dtype", "devices", "max_length", "tp")
CONNECT_S = 3.0


def normalize_url(url: str) -> str:
    url = str(url).strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url


class Remote:
    """A running `ddtree serve`: its URL, the key, its model card."""

    def __init__(self, url: str, api_key: str | None):
        self.url = normalize_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # plain http:// uses no certificates: skip loading them (~20 ms of a client command's start)
        self.http = httpx.Client(base_url=self.url, headers=headers, trust_env=False,
                                 verify=not self.url.startswith("http://"),
                                 timeout=httpx.Timeout(None, connect=CONNECT_S))
        self._card: dict | None = None

    def _refused(self, response: httpx.Response) -> DDTreeError:
        try:
            message = response.json()["error"]["message"]
        except Exception:
            message = f"HTTP {response.status_code}"
        if response.status_code == 401:
            return DDTreeError(f"the server at {self.url} refused the key ({message}): pass its key with --api-key "
                               "KEY or DDTREE_API_KEY")
        if response.status_code == 503:
            return DDTreeError(f"the server at {self.url} is not ready ({message}): retry when its /health answers 200")
        return DDTreeError(f"the server at {self.url} refused the request: {message}")

    def _unreachable(self, e: Exception) -> DDTreeError:
        why = str(e) or type(e).__name__
        return DDTreeError(f"no ddtree server answers at {self.url} ({why}): start one with 'ddtree serve --target REF "
                           "...', or pass the URL it prints with --server")

    def card(self) -> dict:
        """The model card (GET /v1/models): its id and the server's settings (`ddtree`)."""
        if self._card is None:
            try:
                r = self.http.get("/v1/models")
            except httpx.HTTPError as e:
                raise self._unreachable(e) from None
            if r.status_code != 200:
                raise self._refused(r)
            try:
                self._card = r.json()["data"][0]
                self._card["ddtree"]["chat_template"]
            except Exception:
                raise DDTreeError(f"{self.url} is not a ddtree server (its /v1/models has no ddtree model card): "
                                  "pass the URL that 'ddtree serve' prints") from None
        return self._card

    def stream(self, path: str, body: dict, on_text: Callable[[str, list, int | None], None]) -> dict:
        """POST a streamed request; on_text(text, token ids, prompt tokens) per chunk. -> the usage of the reply."""
        usage = None
        try:
            with connect_sse(self.http, "POST", path, json=body) as source:
                if source.response.status_code != 200:
                    source.response.read()
                    raise self._refused(source.response)
                for event in source.iter_sse():
                    if event.data == "[DONE]":
                        break
                    obj = json.loads(event.data)
                    if "error" in obj:
                        raise DDTreeError(f"the server at {self.url} stopped the reply: {obj['error']['message']}")
                    if obj.get("usage"):
                        usage = obj["usage"]
                    for choice in obj.get("choices") or []:
                        text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                        ids = choice.get("token_ids") or []
                        if text or ids:
                            on_text(text or "", ids, choice.get("prompt_tokens"))
        except httpx.HTTPError as e:
            raise self._unreachable(e) from None
        if usage is None or "record" not in usage.get("ddtree", {}):
            raise DDTreeError(f"the server at {self.url} sent no usage record: update it to this ddtree's version")
        return usage


class TextStreamer:
    """The text of a reply as the server streams it (generate's streamer, for text deltas): on
    stdout as it comes (echo), with the times the cut-short line reads."""

    def __init__(self, echo: bool = True, out=None):
        self.echo, self.out = echo, out
        self.parts: list[str] = []
        self.ids: list[int] = []
        self.prompt_tokens = 0
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.finished = False

    def __call__(self, text: str, ids: list, prompt_tokens: int | None = None) -> None:
        self.t_last = time.perf_counter()
        if self.t_first is None:
            self.t_first = self.t_last
        self.prompt_tokens = prompt_tokens or self.prompt_tokens
        self.ids.extend(ids)
        if text:
            self.parts.append(text)
            if self.echo:
                out = self.out or sys.stdout
                out.write(text)
                out.flush()

    def text(self) -> str:
        return "".join(self.parts)

    def finish(self) -> None:
        if self.echo and not self.finished:
            out = self.out or sys.stdout
            out.write("\n")
            out.flush()
        self.finished = True


def request_fields(command: str, opts: dict, given: frozenset) -> dict:
    """The request fields the command sets (a flag, or a --config value other than the default)."""
    base = defaults(command)

    def set_(name: str) -> bool:
        return name in given or (opts.get(name) is not None and opts.get(name) != base.get(name))

    body: dict = {}
    for name, field in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed"),
                        ("max_new_tokens", "max_tokens")):
        if set_(name):
            body[field] = opts[name]
    knobs = {k: opts[k] for k in ("method", "budget", "top1_first") if set_(k)}
    if "budget" in knobs:
        from ddtree.app.setup import parse_budget

        knobs["budget"] = parse_budget(knobs["budget"])
    body["ddtree"] = dict(knobs, record=True)
    if set_("thinking"):
        body["chat_template_kwargs"] = {"enable_thinking": bool(opts["thinking"])}
    return body


def _checks(command: str, opts: dict, given: frozenset) -> None:
    """The torch-free checks of generate / chat with --server, and warnings for the model options
    the server's own command line sets."""
    from ddtree.app import setup as S

    if opts["method"] is not None:
        S.parse_method(opts["method"], True)
    S.parse_budget(opts["budget"])
    S.check_sampling(float(opts["temperature"]), float(opts["top_p"]), int(opts["top_k"]))
    for name in SERVER_SIDE:
        if name in given and name in opts:
            S.warn_ignored(BY_NAME[name].flag, f"the server at {normalize_url(opts['server'])} runs its own models")


# ============================================================================================
# generate --server
# ============================================================================================


def run_generate_remote(opts: dict, given: frozenset, prompt: str | None) -> list:
    """`ddtree generate --server URL`: the prompts, one request each; the records come back."""
    from ddtree.app import setup as S
    from ddtree.app.prompts import render_prompt
    from ddtree.app.textio import jsonl_record, partial_line, print_jsonl, read_prompts, run_label, summary_line
    from ddtree.stats import generation_from_dict

    _checks("generate", opts, given)
    stats_path = S.check_output(opts["stats_json"], "--stats-json") if opts["stats_json"] is not None else None
    prompts_spec = opts["prompts"] if prompt is None else None
    prompts = read_prompts(prompt, prompts_spec, opts["limit"])
    remote = Remote(opts["server"], opts["api_key"])
    card = remote.card()
    S.flush_notices()
    templated = bool(card["ddtree"]["chat_template"]) and not opts["raw"]
    jsonl = bool(opts["jsonl"])
    base = request_fields("generate", opts, given)
    records, metas = [], []
    label = ""
    for p in prompts:
        body = dict(base, model=card["id"], stream=True, stream_options={"include_usage": True})
        if templated:
            path = "/v1/chat/completions"
            body["messages"] = p.messages or [{"role": "user", "content": p.text}]
            body.setdefault("chat_template_kwargs", {"enable_thinking": bool(opts["thinking"])})
        else:
            path = "/v1/completions"
            body["prompt"] = render_prompt(p, None, True, bool(opts["thinking"]))
            body.pop("chat_template_kwargs", None)
        streamer = TextStreamer(echo=not jsonl)
        try:
            usage = remote.stream(path, body, streamer)
        except KeyboardInterrupt:
            streamer.finish()
            d = card["ddtree"]
            label = run_label(opts["method"] or d["method"], opts["budget"] if "budget" in body["ddtree"] else d["budget"])
            if jsonl:
                print_jsonl(jsonl_record(p, None, streamer, streamer.prompt_tokens))
            print(partial_line(p, streamer.prompt_tokens, streamer, label), file=sys.stderr, flush=True)
            if stats_path is not None and records:
                _write_stats(S, remote, metas[-1], records, prompts_spec, stats_path, interrupted_prompt=p.id)
            raise
        streamer.finish()
        d = usage["ddtree"]
        rec = generation_from_dict(d["record"])
        label = run_label(d["method"], d["budget"])
        if jsonl:
            print_jsonl(jsonl_record(p, rec))
        records.append(rec)
        metas.append(d["metadata"])
        print(summary_line(rec, label if len(prompts) == 1 else f"{p.id} ({label})"), file=sys.stderr, flush=True)
    if stats_path is not None:
        _write_stats(S, remote, metas[-1], records, prompts_spec, stats_path)
    return records


def _write_stats(S, remote: Remote, meta: dict, records: list, prompts_spec, path, interrupted_prompt=None) -> None:
    """generate's --stats-json, from the records and the server's run metadata (this command's argv)."""
    import datetime

    from ddtree.stats import make_run_document

    meta = dict(meta, argv=list(sys.argv), server=remote.url, prompts=prompts_spec,
                timestamp=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                interrupted=interrupted_prompt is not None, interrupted_prompt=interrupted_prompt)
    method, budget = meta.get("method"), meta.get("budget")
    doc = make_run_document(meta, [dict(
        method=method, budget=budget if isinstance(budget, int) else None, budget_setting=budget, records=records,
        speedup_vs_ar=None, block_size=meta.get("block_size") if method != "ar" else None,
        interrupted=interrupted_prompt is not None)])
    S.write_document(doc, path, "--stats-json")


# ============================================================================================
# chat --server
# ============================================================================================


class RemoteChat(Chat):
    """`ddtree chat`'s conversation, each turn a request to the server (which keeps the state)."""

    def __init__(self, remote: Remote, opts: dict, given: frozenset, system: str | None = None):
        card = remote.card()
        d = card["ddtree"]
        self.remote, self.model = remote, card["id"]
        self.spec = self.dec = None
        self.opts, self.template = opts, bool(d["chat_template"])
        self.base = request_fields("chat", opts, given)
        self.method = self.base["ddtree"].get("method") or d["method"]
        self.budget = self.base["ddtree"].get("budget") or d["budget"]
        self.thinking = bool(opts["thinking"])
        self.messages, self.turns, self._head = [], [], (None, 0)
        self.conv = SimpleNamespace(last=SimpleNamespace(prefilled=0))  # /load: the server prefills on the next turn
        self.set_system(system)

    def streamer(self, out):
        return TextStreamer(out=out)

    def set_method(self, value: str) -> None:
        from ddtree.app.setup import parse_method

        self.method = self.base["ddtree"]["method"] = parse_method(value, True)

    def set_budget(self, value: str) -> None:
        super().set_budget(value)
        self.base["ddtree"]["budget"] = self.budget

    def settle(self) -> None:
        """(The server settles its state after each reply.)"""

    def send(self, text: str, on_tokens=None) -> TurnResult:
        from ddtree.stats import generation_from_dict

        msgs = self.messages + [{"role": "user", "content": text}]
        body = dict(self.base, model=self.model, messages=msgs, stream=True, stream_options={"include_usage": True})
        out = on_tokens if isinstance(on_tokens, TextStreamer) else TextStreamer(echo=False)
        usage, interrupted = None, False
        try:
            usage = self.remote.stream("/v1/chat/completions", body, out)
        except KeyboardInterrupt:
            interrupted = True
        answer = out.text()
        self.messages = msgs + [{"role": "assistant", "content": answer}]
        rec, reuse = None, None
        if usage is not None:
            d = usage["ddtree"]
            rec = generation_from_dict(d["record"])
            reuse = SimpleNamespace(common=d["common_prefix_tokens"], reused=d["reused_tokens"],
                                    prefilled=d["prefilled_tokens"], restored=d["restored_snapshot"])
            self.meta = d["metadata"]
        stats = turn_stats(len(self.messages) - 1, self.method, self.budget,
                           rec.prompt_tokens if rec else out.prompt_tokens, reuse, rec, len(out.ids), interrupted)
        self.turns.append(stats)
        return TurnResult(answer, stats, rec)

    def document(self) -> dict:
        meta = dict(getattr(self, "meta", {}), method=self.method, budget=self.budget, server=self.remote.url,
                    transcript="chat template" if self.template else "plain")
        return {"schema": CHAT_SCHEMA, "metadata": meta, "messages": self.messages, "turns": self.turns}


def run_chat_remote(opts: dict, given: frozenset) -> int:
    """`ddtree chat --server URL` (the loop of ddtree.app.chat, each turn a request)."""
    from ddtree.app import setup as S
    from ddtree.app.chat import LineInput, Repl, TerminalInput, read_system

    _checks("chat", opts, given)
    system = read_system(opts["system"])
    remote = Remote(opts["server"], opts["api_key"])
    chat = RemoteChat(remote, opts, given, system)
    if "raw" in given:
        S.warn_ignored("--raw" if opts["raw"] else "--no-raw", f"the server at {remote.url} renders conversations "
                       "with its own --raw")
    S.flush_notices()
    tty = sys.stdin.isatty() and sys.stdout.isatty()
    if tty:
        print(f"ddtree chat: {remote.url} ({chat.label()}); /help lists the commands, Ctrl-D leaves",
              file=sys.stderr, flush=True)
    return Repl(chat, TerminalInput() if tty else LineInput()).run()

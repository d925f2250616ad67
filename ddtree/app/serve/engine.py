"""The engine side of `ddtree serve`: the models, loaded once, and one generation at a time.

One thread (the engine's) loads the models, warms them up, then takes requests first come,
first served from a queue of at most --max-queue waiting ones. The handlers (asyncio) render and
tokenize a request and validate it against the decoder (`Decoder.job`) before it is queued, so
bad input never reaches the engine; the engine hands tokens back through the request's asyncio
queue (`Work.emit`). A request's `cancel` event (its client left, the server stops) ends its
generation after the round in flight (on_tokens returns True: ddtree.decode.decoder).

The state between requests is `ddtree chat`'s (ddtree.app.chat.Chat over
ddtree.decode.conversation.Conversation): a request prefills only what the committed state does
not hold (the longest common prefix, the GDN states restored from the latest snapshot inside
it); a system message's end is a snapshot kept for good. After every reply the state is settled
at the point every next turn shares (for a chat, the conversation with the reply as the template
re-renders it; for a completion, the prompt and the completion), so the next turn of the
conversation (or the next completion of the same document) prefills only its own new tokens, even
when it was sent the moment the reply ended. The settle prefills the reply's tokens: what that
next turn would prefill anyway; a request from another conversation waits for it.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from loguru import logger

from ddtree.app.serve.protocol import ApiError
from ddtree.errors import DDTreeError, TooLongError

#: the warm-up's conversation: a first turn, its settle, a second turn (the paths requests take)
WARMUP = ("Hello", "Thank you")


@dataclass
class Work:
    """One request's generation, between its handler (asyncio) and the engine thread."""

    id: str
    ids: list[int]  # the prompt's tokens
    messages: list[dict] | None  # a chat's conversation (its head snapshot and the settle after it)
    text: str | None  # a completion's prompt
    thinking: bool
    method: str
    budget: Any  # int | "auto" (ddtree), else the server's
    job: Any  # ddtree.decode.decoder.Job
    stops: list[str]
    want_ids: bool  # stream chunks carry their token ids; usage carries the record and metadata
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    cancel: threading.Event = field(default_factory=threading.Event)
    why: str = ""  # what cancelled it: "disconnected" or "shutdown"
    t_arrive: float = field(default_factory=time.perf_counter)
    t_start: float | None = None

    def stop(self, why: str) -> None:
        """End the generation after its round in flight (a no-op once it was stopped)."""
        if not self.cancel.is_set():
            self.why = self.why or why
            self.cancel.set()

    def emit(self, *event) -> None:
        """("delta", text, ids | None), ("done", Result | None), ("error", ApiError), to the handler."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server stopped
            pass


@dataclass
class Result:
    text: str
    finish: str  # stop | length | cancelled
    usage: dict


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


class TextOut:
    """A generation's on_tokens: the reply's text as it grows (the whole id list decoded, a tail
    that ends in U+FFFD held back until the next tokens complete it, and as many characters as the
    longest stop string less one held back until no stop string can start there), to the handler;
    True (end the generation) at a stop string or when the request is cancelled."""

    def __init__(self, tokenizer, work: Work):
        self.tok, self.w = tokenizer, work
        self.ids: list[int] = []
        self.sent = 0
        self.cut: int | None = None  # where a stop string starts
        self.hold = max((len(s) for s in work.stops), default=1) - 1

    def text(self) -> str:
        return self.tok.decode(self.ids, skip_special_tokens=True)

    def _find_stop(self, text: str) -> int | None:
        starts = [i for s in self.w.stops if (i := text.find(s, max(0, self.sent - len(s)))) >= 0]
        return min(starts) if starts else None

    def _send(self, upto: str, toks: list[int]) -> None:
        delta = upto[self.sent:] if len(upto) > self.sent else ""
        if delta or (self.w.want_ids and toks):
            self.w.emit("delta", delta, list(toks) if self.w.want_ids else None)
        self.sent = max(self.sent, len(upto))

    def __call__(self, toks: list[int]) -> bool:
        if self.cut is not None:
            return True
        self.ids.extend(int(t) for t in toks)
        text = self.text()
        cut = self._find_stop(text) if self.w.stops else None
        if cut is not None:
            self.cut = cut
            self._send(text[:cut], toks)
            return True
        end = len(text) - self.hold
        if text.endswith("\ufffd"):
            end = min(end, len(text.rstrip("\ufffd")))
        self._send(text[:max(end, 0)], toks)
        return self.w.cancel.is_set()

    def close(self, rec, stop_ids, max_new: int) -> tuple[str, str]:
        """-> (the reply's text, its finish reason), the rest of the text sent."""
        text = self.text()
        if self.cut is None and self.w.stops:
            self.cut = self._find_stop(text)
        final = text if self.cut is None else text[:self.cut]
        self._send(final, [])
        if self.cut is not None or (rec.token_ids and rec.token_ids[-1] in stop_ids):
            finish = "stop"
        elif rec.new_tokens >= max_new:
            finish = "length"
        else:
            finish = "cancelled"
        return final, finish


class Engine:
    """The loaded models and the queue in front of them (see the module docstring)."""

    def __init__(self, spec, opts: dict, method: str, budget, max_len: int, room: int, template: bool, metrics,
                 stage: Callable[[str], None], t_entry: float, age: float, load: Callable[[], Any] | None = None):
        """load: makes the Decoder (default: the checkpoints of spec, ddtree.app.setup.load_models;
        scripts/bench_serve.py passes a pair of random weights)."""
        self.spec, self.opts, self.method, self.budget = spec, opts, method, budget
        self.max_len, self.room, self.template, self.metrics, self.stage = max_len, room, template, metrics, stage
        self.t_entry, self.age = t_entry, age
        self.max_queue = int(opts["max_queue"])
        self.ready = threading.Event()
        self.idle = threading.Event()  # set while the engine thread waits for work (nothing runs, nothing settles)
        self.error: BaseException | None = None
        self.stopping = False
        self.dec = self.chat = self.conv = None
        self.paths: dict = {}
        self.startup: dict = {}
        self._cv = threading.Condition()
        self._queue: deque[Work] = deque()
        self.current: Work | None = None
        self._last: tuple[Work, str] | None = None  # the last reply, for the settle
        self._gen_s = 1.0  # a generation's mean wall time (Retry-After)
        self._thread = threading.Thread(target=self._main, name="ddtree-engine", daemon=True)
        self._on_fail: Callable[[], None] = lambda: None
        self._load = load

    # ================================================================ the handlers' side
    def start(self, on_fail: Callable[[], None]) -> None:
        self._on_fail = on_fail
        self._thread.start()

    def submit(self, w: Work) -> None:
        """Queue a validated request, or refuse it: 503 when stopping, 429 past --max-queue."""
        with self._cv:
            if self.stopping:
                raise ApiError(503, "the server is shutting down: send the request to another server or retry later",
                               type="server_error", code="shutting_down")
            busy = len(self._queue) + (self.current is not None)
            if busy > self.max_queue:
                wait = max(1, math.ceil(self._gen_s * busy))
                raise ApiError(429, f"the queue is full ({len(self._queue)} requests wait for the one generating; "
                               f"--max-queue {self.max_queue}): retry after {wait} s", type="rate_limit_exceeded",
                               code="queue_full", headers={"Retry-After": str(wait)})
            self._queue.append(w)
            self.metrics.waiting.set(len(self._queue))
            self._cv.notify_all()

    def shutdown(self) -> None:
        """Stop taking requests; the waiting ones get a 503, the one generating ends after its round."""
        with self._cv:
            self.stopping = True
            while self._queue:
                w = self._queue.popleft()
                w.why = "shutdown"
                w.emit("error", ApiError(503, "the server is shutting down: retry on another server",
                                         type="server_error", code="shutting_down"))
            self.metrics.waiting.set(0)
            if self.current is not None:
                self.current.stop("shutdown")
            self._cv.notify_all()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def encode_chat(self, messages: list[dict], thinking: bool) -> list[int]:
        """A conversation's tokens as `ddtree chat` renders it (its template, else a plain transcript)."""
        from ddtree.app.setup import encode_prompt

        return encode_prompt(self.spec, self.chat.prompt(messages), not self.template, thinking)

    def encode_text(self, text: str) -> list[int]:
        """A completion prompt's tokens: the text as it is, as `generate --raw` encodes it."""
        from ddtree.app.prompts import Prompt
        from ddtree.app.setup import encode_prompt

        return encode_prompt(self.spec, Prompt(id="completion", text=text), True, False)

    def job(self, method: str, budget, sampling, max_new: int, seed, top1_first: bool, n_prompt: int):
        """Decoder.job, with its length error in a request's words (ApiError 400)."""
        try:
            return self.dec.job(method, budget, sampling, max_new, seed, top1_first, n_prompt)
        except TooLongError:
            raise ApiError(400, f"the prompt ({n_prompt} tokens) + max_tokens {max_new} + the draft tree "
                               f"exceeds the server's --max-length {self.max_len}: lower max_tokens or shorten the "
                               "prompt", param="max_tokens", code="context_length_exceeded") from None
        except DDTreeError as e:
            raise ApiError(400, str(e), code="invalid_value") from None

    # ================================================================ the engine thread
    def _main(self) -> None:
        try:
            self._prepare()
        except BaseException as e:  # (reported by the command once uvicorn has stopped)
            self.error = e
            self._on_fail()
            return
        self.ready.set()
        while True:
            with self._cv:
                while not self._queue and not self.stopping:
                    self.idle.set()
                    self._cv.wait()
                if self.stopping:
                    return
                self.idle.clear()
                w = self.current = self._queue.popleft()
                self.metrics.waiting.set(len(self._queue))
                self.metrics.running.set(1)
            try:
                self._serve(w)
            finally:
                with self._cv:
                    self.current = None
            if not self.stopping:
                self._settle()
            self.metrics.running.set(0)  # (after the settle: the engine is free)

    def _prepare(self) -> None:
        from ddtree.app import setup as S
        from ddtree.app.chat import Chat
        from ddtree.decode.conversation import SNAPSHOTS

        t_load = time.perf_counter()
        if self._load is not None:
            self.dec = self._load()
        else:
            self.dec = S.load_models(self.spec, self.max_len, self.spec.drafter_cfg is not None, self.stage,
                                     room=self.room, auto=self.budget == "auto", snapshots=SNAPSHOTS).decoder
        S.flush_notices()
        self.paths = S.decoder_paths(self.dec)
        clock = S.startup_clock(self.dec, self.age, t_load - self.t_entry, time.perf_counter() - t_load)
        self.chat = Chat(self.spec, self.dec, dict(self.opts, method=self.method, budget=self.budget), self.template)
        self.conv = self.chat.conv
        self.stage("warming up")
        t0 = time.perf_counter()
        steps = self._warm_up()
        warm = time.perf_counter() - t0
        self.startup = dict(clock.to_dict(), warmup_s=round(warm, 4),
                            ready_s=round(time.perf_counter() - self.t_entry + self.age, 4))
        parts = clock.line().split(": ", 1)[1]
        steps = ", ".join(f"{k} {v:.1f}" for k, v in steps.items())
        logger.info(f"ready {self.startup['ready_s']:.1f} s after the command: {parts} (the warm-up's "
                    f"{warm:.1f} s holds its compile, capture and prefill: {steps} s)")
        self.stage("serving")

    def _warm_up(self) -> dict[str, float]:
        """Compile and capture what requests use: a conversation of two turns with the default
        method, its settles between them; then the state is cleared. -> seconds per turn and
        settle (where a slow start went)."""
        from ddtree.app.setup import sampling_params
        from ddtree.decode.startup import freeze_heap

        msgs: list[dict] = []
        n = int(self.opts["max_new_tokens"])
        steps: dict[str, float] = {}
        for i, text in enumerate(WARMUP, 1):
            t0 = time.perf_counter()
            msgs.append({"role": "user", "content": text})
            ids = self.encode_chat(msgs, bool(self.opts["thinking"]))
            job = self.dec.job(self.method, self.budget, sampling_params(self.opts), n, self.opts["seed"],
                               bool(self.opts["top1_first"]), len(ids))
            rec = self.conv.turn(ids, job, self.spec.stop_ids)
            msgs.append({"role": "assistant", "content": self.spec.tokenizer.decode(rec.token_ids, skip_special_tokens=True)})
            self.chat.messages, self.chat.thinking = msgs, bool(self.opts["thinking"])
            t1 = time.perf_counter()
            self.conv.settle(self.chat._shared(msgs), taps=self.method != "ar")
            steps.update({f"turn {i}": t1 - t0, f"settle {i}": time.perf_counter() - t1})
        self.conv.reset()
        freeze_heap(self.dec.graphs)
        return steps

    def _serve(self, w: Work) -> None:
        w.t_start = time.perf_counter()
        if w.cancel.is_set():  # its client left while it waited
            w.emit("done", None)
            return
        try:
            result = self._generate(w)
        except Exception as e:  # a bug or the GPU: the request fails, the server goes on from a clean state
            logger.opt(exception=e).error(f"{w.id} failed: {type(e).__name__}: {e}")
            self.conv.reset()
            w.emit("error", ApiError(500, f"the generation failed ({type(e).__name__}): the server's log has the "
                                     "traceback", type="server_error", code="internal_error"))
            return
        self._gen_s = 0.8 * self._gen_s + 0.2 * (time.perf_counter() - w.t_start)
        w.emit("done", result)

    def _generate(self, w: Work) -> Result:
        from ddtree.app.textio import run_label, summary_line
        from ddtree.stats import aggregate, generation_to_dict

        chat, conv = self.chat, self.conv
        head = 0
        chat.thinking = w.thinking
        if w.messages is not None:
            chat.messages = w.messages
            head = chat.head()  # the system prompt's end: a snapshot kept for good
        out = TextOut(self.spec.tokenizer, w)
        rec = conv.turn(w.ids, w.job, self.spec.stop_ids, out, marks=(head,), pin=(head,))
        reuse = conv.last
        text, finish = out.close(rec, self.spec.stop_ids, w.job.max_new_tokens)
        finish_label = f"cancelled ({w.why or 'cancelled'})" if finish == "cancelled" else finish
        rec.text, rec.prompt_id = text, w.id
        self._last = (w, text)
        a = aggregate([rec])
        now = time.perf_counter()
        ddtree = {
            "method": w.method, "budget": w.budget if w.method == "ddtree" else None,
            "tokens_per_target_forward": a["tokens_per_target_forward"],
            "mean_acceptance_length": a["mean_acceptance_length"], "decode_tok_s": rec.decode_tok_s,
            "ttft_s": rec.ttft_s, "reused_tokens": reuse.reused, "prefilled_tokens": reuse.prefilled,
            "common_prefix_tokens": reuse.common, "restored_snapshot": reuse.restored,
            "queue_s": w.t_start - w.t_arrive, "rounds": a["rounds"], "num_drafts": a["num_drafts"],
            "num_draft_tokens": a["num_draft_tokens"], "num_accepted_tokens": a["num_accepted_tokens"],
        }
        if w.want_ids:
            ddtree["record"] = generation_to_dict(rec)
            ddtree["metadata"] = self._metadata(w)
        usage = {"prompt_tokens": rec.prompt_tokens, "completion_tokens": rec.new_tokens,
                 "total_tokens": rec.prompt_tokens + rec.new_tokens, "ddtree": ddtree}
        self.metrics.generation(rec, a, reuse.reused, reuse.prefilled, finish, w.t_start - w.t_arrive, now - w.t_arrive)
        logger.info(f"{w.id}: {summary_line(rec, run_label(w.method, w.budget))}; {reuse.reused} tokens reused, "
                    f"{reuse.prefilled} prefilled, {(w.t_start - w.t_arrive) * 1e3:.0f} ms queued; {finish_label}")
        return Result(text, finish, usage)

    def _metadata(self, w: Work) -> dict:
        """The run metadata of `generate --stats-json` for this request's settings."""
        from ddtree.app.setup import model_metadata

        s = w.job.sampling
        opts = dict(self.opts, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=w.job.seed,
                    max_new_tokens=w.job.max_new_tokens, thinking=w.thinking)
        return model_metadata(self.spec, opts, method=w.method, budget=w.budget if w.method == "ddtree" else None,
                              max_length=self.max_len, top1_first=w.job.top1_first, startup=self.startup,
                              **self.paths)

    def _settle(self) -> None:
        """Bring the kept state to what the next turn of the last request shares (see the module docstring)."""
        from ddtree.app.chat import PROBES
        from ddtree.decode.conversation import common_prefix
        from ddtree.decode.startup import freeze_heap

        if self._last is None:
            return
        w, text = self._last
        self._last = None
        try:
            if w.messages is not None:
                self.chat.messages, self.chat.thinking = w.messages, w.thinking
                ids = self.chat._shared(w.messages + [{"role": "assistant", "content": text}])
            else:
                a, b = (self.encode_text(w.text + text + p) for p in PROBES)
                ids = a[:common_prefix(a, b)]
            if ids and len(ids) < self.max_len:
                r = self.conv.settle(ids, taps=w.method != "ar")
                logger.debug(f"settled at {len(ids)} tokens: {r.reused} kept, {r.prefilled} prefilled")
            freeze_heap(self.dec.graphs)
        except Exception as e:
            logger.opt(exception=e).warning(f"settling after {w.id} failed ({type(e).__name__}): the state starts over")
            self.conv.reset()

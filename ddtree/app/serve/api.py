"""The HTTP side of `ddtree serve`: a FastAPI app (uvicorn serves it) speaking OpenAI's API.

    POST /v1/chat/completions, POST /v1/completions   (stream: server-sent events through sse-starlette, data: [DONE] last)
    GET  /v1/models, /health (503 until the models are ready), /metrics (Prometheus text)

Every error is OpenAI's shape, {"error": {"message", "type", "param", "code"}}: FastAPI's
validation errors (422) become 400s naming the field. A pure ASGI guard in front of the app
answers a body over MAX_BODY with 413 from its Content-Length alone (or as soon as a chunked
body passes it), a /v1 request without the key (--api-key) with 401, and counts responses.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from ddtree.app.serve.engine import Engine, Result, Work, new_id
from ddtree.app.serve.protocol import ApiError, ChatRequest, CompletionRequest, error_body, validation_error
from ddtree.errors import DDTreeError
from ddtree.options import DEFAULT_BUDGET

#: the largest request body taken (a 128K-token conversation is well under it)
MAX_BODY = 8 * 1024 * 1024
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


def _json(status: int, body: dict, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


class Guard:
    """Pure ASGI, in front of the app: the body limit (413), the key on /v1 routes (401), and the
    response counter of /metrics."""

    def __init__(self, app, api_key: str | None, metrics, limit: int = MAX_BODY):
        self.app, self.key, self.metrics, self.limit = app, api_key, metrics, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        route = path if path in ROUTES else "other"
        status: list[int] = []

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                return await refusal(scope, receive, counted)
            seen, answered = [0], [False]

            async def limited():  # a body without Content-Length (chunked): 413 once it passes the limit
                message = await receive()
                if message["type"] == "http.request" and not answered[0]:
                    seen[0] += len(message.get("body", b""))
                    if seen[0] > self.limit:
                        if not status:
                            await self._too_large()(scope, receive, counted)
                        answered[0] = True
                        return {"type": "http.disconnect"}
                return message

            async def app_send(message):
                if not answered[0]:  # (the app's answer to the cut body goes nowhere)
                    await counted(message)

            await self.app(scope, limited, app_send)
        finally:
            if status:
                self.metrics.http.labels(route, str(status[0])).inc()

    def _too_large(self) -> JSONResponse:
        return _json(413, error_body(f"the request body is over {self.limit // (1024 * 1024)} MiB: send a shorter "
                                     "prompt", code="request_too_large"), headers={"Connection": "close"})

    def _refusal(self, scope) -> JSONResponse | None:
        headers = dict(scope.get("headers") or [])
        if self.key and scope.get("path", "").startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            if not auth:
                return _json(401, error_body("no API key: this server needs one, as the header 'Authorization: Bearer "
                                             "KEY' (the server's --api-key)", code="missing_api_key"))
            scheme, _, given = auth.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), self.key.encode()):
                return _json(401, error_body("wrong API key: pass the server's --api-key as 'Authorization: Bearer KEY'",
                                             code="invalid_api_key"))
        length = headers.get(b"content-length")
        if length is not None:
            try:
                if int(length) > self.limit:
                    return self._too_large()
            except ValueError:
                return _json(400, error_body("the Content-Length header is not a number", code="invalid_request"))
        return None


def create_app(engine: Engine, metrics, model_id: str, api_key: str | None) -> Guard:
    """The ASGI app of the server: Guard around FastAPI."""
    # A signal ends a stream through the engine (an error event, then [DONE]; server.py), not by
    # sse-starlette cancelling it the moment uvicorn starts to stop.
    AppStatus.disable_automatic_graceful_drain()
    app = FastAPI(title="ddtree serve", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request, e: ApiError):
        return _json(e.status, e.body(), e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        err = validation_error(list(e.errors()))
        return _json(err.status, err.body())

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = {404: f"no route {request.url.path}: see GET /v1/models, POST /v1/chat/completions, POST /v1/completions",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return _json(e.status_code, error_body(msg, code=code), getattr(e, "headers", None))

    @app.get("/health")
    async def health():
        if engine.ready.is_set() and not engine.stopping:
            return {"status": "ready"}
        state = "stopping" if engine.stopping else ("failed" if engine.error is not None else "loading")
        return _json(503, {"status": state})

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.text(), media_type=metrics.content_type)

    def model_card() -> dict:
        spec = engine.spec
        return {"id": model_id, "object": "model", "created": created, "owned_by": "ddtree",
                "max_model_len": engine.max_len,
                "ddtree": {"target": spec.target_ref, "drafter": spec.drafter_ref, "dtype": spec.dtype_name,
                           "devices": [str(d) for d in spec.devices], "method": engine.method,
                           "budget": engine.budget, "chat_template": engine.template,
                           "max_new_tokens": int(engine.opts["max_new_tokens"]), "ready": engine.ready.is_set()}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != model_id:
            raise _unknown_model(name, model_id)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        messages = [m.as_dict() for m in body.messages]
        thinking = bool(engine.opts["thinking"])
        if body.chat_template_kwargs is not None and body.chat_template_kwargs.enable_thinking is not None:
            thinking = body.chat_template_kwargs.enable_thinking
        w = await _work(body, request, lambda: engine.encode_chat(messages, thinking), "messages",
                        messages=messages, thinking=thinking)
        return await _answer(w, body, request, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        text = body.text()
        w = await _work(body, request, lambda: engine.encode_text(text), "prompt", text=text,
                        thinking=bool(engine.opts["thinking"]))
        return await _answer(w, body, request, "completion")

    # ------------------------------------------------------------------ a request -> Work
    async def _work(body, request: Request, encode, what: str, messages=None, text=None, thinking=True) -> Work:
        from ddtree.decode.sampling import SamplingParams

        if engine.stopping:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
        if not engine.ready.is_set():
            raise ApiError(503, "the models are still loading: retry when GET /health answers 200", type="server_error",
                           code="not_ready", headers={"Retry-After": "5"})
        if body.model != model_id:
            raise _unknown_model(body.model, model_id)
        o = engine.opts
        d = body.ddtree
        method = (d.method if d is not None and d.method else None) or engine.method
        if method != "ar" and engine.dec.drafter is None:
            raise ApiError(400, f"method {method} needs a drafter, and this server has none (start it with --drafter "
                           "REF): use method ar", param="ddtree.method", code="invalid_value")
        budget = (d.budget if d is not None and d.budget is not None else None) or engine.budget
        top1_first = d.top1_first if d is not None and d.top1_first is not None else bool(o["top1_first"])
        sampling = SamplingParams(
            temperature=float(o["temperature"] if body.temperature is None else body.temperature),
            top_p=float(o["top_p"] if body.top_p is None else body.top_p),
            top_k=int(o["top_k"] if body.top_k is None else body.top_k))
        seed = o["seed"] if body.seed is None else body.seed
        max_new = body.limit() or int(o["max_new_tokens"])
        try:
            ids = await run_in_threadpool(encode)
        except DDTreeError:
            raise ApiError(400, f"the {what} encodes to no tokens: send a non-empty {what}", param=what,
                           code="invalid_value") from None
        job = engine.job(method, budget if method == "ddtree" else DEFAULT_BUDGET, sampling, max_new, seed, top1_first, len(ids))
        return Work(id=new_id("chatcmpl" if messages is not None else "cmpl"), ids=ids, messages=messages, text=text,
                    thinking=thinking, method=method, budget=budget if method == "ddtree" else None, job=job,
                    stops=body.stops(), want_ids=bool(d is not None and d.record), loop=asyncio.get_running_loop(),
                    events=asyncio.Queue())

    async def _answer(w: Work, body, request: Request, kind: str):
        engine.submit(w)
        if body.stream:  # (EventSourceResponse watches for the client leaving: _stream's finally cancels)
            return EventSourceResponse(_stream(w, body, kind), sep="\n")
        watcher = asyncio.create_task(_watch(request, w))
        try:
            text, result = "", None
            while True:
                ev = await w.events.get()
                if ev[0] == "delta":
                    text += ev[1]
                elif ev[0] == "error":
                    raise ev[1]
                else:
                    result = ev[1]
                    break
        finally:
            watcher.cancel()
        if _stopped(w, result):
            raise ApiError(503, STOPPED, type="server_error", code="shutting_down")
        return _completion(w, kind, result, model_id)

    async def _stream(w: Work, body, kind: str):
        usage_field = body.include_usage()
        head = {"id": w.id, "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": model_id}

        def chunk(delta: str | None, finish: str | None = None, ids=None, role: bool = False) -> str:
            if kind == "chat":
                d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish}
            if w.want_ids:  # (the client counts tokens and the prompt's, as generate does)
                choice.update(token_ids=ids or [], prompt_tokens=len(w.ids))
            obj = dict(head, choices=[choice])
            if usage_field:
                obj["usage"] = None
            return _sse(obj)

        try:
            if kind == "chat":
                yield chunk(None, role=True)
            while True:
                ev = await w.events.get()
                if ev[0] == "delta":
                    yield chunk(ev[1], ids=ev[2])
                    continue
                if ev[0] == "error":
                    yield _sse(ev[1].body())
                    break
                result: Result | None = ev[1]
                if _stopped(w, result):
                    yield _sse(error_body(STOPPED, type="server_error", code="shutting_down"))
                    break
                yield chunk(None, finish=result.finish)
                if usage_field:
                    yield _sse(dict(head, choices=[], usage=result.usage))
                break
            yield "[DONE]"
        finally:
            w.stop("disconnected")  # (nothing to do once it finished)

    return Guard(app, api_key, metrics)


STOPPED = "the server is shutting down: the generation was stopped"


def _stopped(w: Work, result: Result | None) -> bool:
    """Whether the server's shutdown ended the generation (no result, or one cut short by it)."""
    return result is None or (result.finish == "cancelled" and w.why == "shutdown")


def _sse(obj: dict) -> str:
    """One server-sent event's data: compact JSON (no newline inside)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _unknown_model(name: str, model_id: str) -> ApiError:
    return ApiError(404, f"the model '{name}' is not served here: use '{model_id}' (GET /v1/models)", param="model",
                    code="model_not_found")


async def _watch(request: Request, w: Work) -> None:
    """Cancel the generation when the client goes away (uvicorn reports http.disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            w.stop("disconnected")
            return


def _completion(w: Work, kind: str, r: Result, model_id: str) -> dict:
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                  "finish_reason": r.finish}
    else:
        choice = {"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish}
    return {"id": w.id, "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model_id, "choices": [choice], "usage": r.usage}

"""The OpenAI requests `ddtree serve` takes, as pydantic models, and OpenAI's error shape.

A field OpenAI defines that the engine does not support (n > 1, logprobs, tools, response_format,
penalties, ...) is refused with a 400 naming it, as is any field nobody defines: nothing is
silently ignored. Omitted sampling fields take the server's options (--temperature, --top-p,
--top-k, --seed, --max-new-tokens), not OpenAI's defaults. Extensions: `top_k` (as vLLM),
`chat_template_kwargs.enable_thinking` (as vLLM), and `ddtree`: the method and budget of this
request, and `record` (the whole generation record and run metadata in `usage.ddtree`, for
`generate --server --stats-json`).
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: how the server names unsupported fields (OpenAI's, with why)
UNSUPPORTED = {
    "n": "one choice per request (n 1)",
    "best_of": "one choice per request (best_of 1)",
    "logprobs": "no log-probabilities",
    "top_logprobs": "no log-probabilities",
    "echo": "no echo of the prompt",
    "presence_penalty": "no penalties (0)",
    "frequency_penalty": "no penalties (0)",
}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _only(name: str, value, allowed: tuple):
    if value is not None and value not in allowed:
        raise ValueError(f"'{name}' {value!r} is not supported: ddtree serve supports {UNSUPPORTED[name]}")
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DDTreeParams(_Strict):
    """The `ddtree` request field: this request's method and budget, and whether usage.ddtree
    carries the whole generation record."""

    method: Literal["ar", "dflash", "ddtree"] | None = None
    budget: Union[int, Literal["auto"], None] = Field(None, description="draft-tree nodes per round, or auto")
    top1_first: bool | None = None
    record: bool = False

    @field_validator("budget")
    @classmethod
    def _budget(cls, v):
        if isinstance(v, int) and (isinstance(v, bool) or v < 1):
            raise ValueError("budget must be a positive integer or \"auto\"")
        return v


class StreamOptions(_Strict):
    include_usage: bool = False


class TemplateKwargs(_Strict):
    enable_thinking: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]

    def as_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class _Common(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id: no effect on the output
    ddtree: DDTreeParams | None = None
    # OpenAI's fields with one supported value
    n: int | None = None
    logprobs: Union[bool, int, None] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("stop takes at most 4 strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("n", "logprobs", "presence_penalty", "frequency_penalty")
    @classmethod
    def _one_value(cls, v, info):
        return _only(info.field_name, v, (None, False, 0) if info.field_name == "logprobs" else
                     (None, 1) if info.field_name == "n" else (None, 0))

    @model_validator(mode="after")
    def _options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream true")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    chat_template_kwargs: TemplateKwargs | None = None

    @model_validator(mode="after")
    def _tokens(self):
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ValueError("max_tokens and max_completion_tokens differ: pass one of them")
        return self

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Common):
    prompt: Union[str, list[str]]
    echo: bool | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("prompt takes one string (a list of one): ddtree serve answers one prompt per request")
        return v

    @field_validator("echo", "best_of")
    @classmethod
    def _one_value_too(cls, v, info):
        return _only(info.field_name, v, (None, False) if info.field_name == "echo" else (None, 1))

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]

    def limit(self) -> int | None:
        return self.max_tokens


def validation_error(errors: list[dict]) -> ApiError:
    """FastAPI's validation errors (pydantic's list) as one 400 naming the first field at fault."""
    e = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request"}
    loc = [str(x) for x in e.get("loc", ()) if x != "body"]
    kind = e.get("type", "")
    if kind == "json_invalid":
        why = (e.get("ctx") or {}).get("error") or e.get("msg")
        return ApiError(400, f"the body is not valid JSON ({why}): send one JSON object", code="invalid_json")
    # a field inside a union reports the union member's name too (e.g. stop.str): keep the field's path
    path = ".".join(x for x in loc if x.isdigit() or x in _FIELDS)
    param = path or None
    if kind == "extra_forbidden":
        name = loc[-1] if loc else "?"
        path = ".".join(x for x in loc[:-1] if x.isdigit() or x in _FIELDS) + ("." if len(loc) > 1 else "") + name
        return ApiError(400, f"unsupported parameter '{path}': ddtree serve does not take it (docs/SERVE.md lists "
                        "what it takes)", param=path, code="unsupported_parameter")
    if kind == "missing":
        return ApiError(400, f"missing required parameter '{path}'", param=param, code="missing_required_parameter")
    if kind in ("model_attributes_type", "dict_type") and not loc:
        if isinstance(e.get("input"), (bytes, str)):
            return ApiError(400, "the body is not JSON: send a JSON object with the header 'Content-Type: "
                            "application/json'", code="invalid_json")
        return ApiError(400, "the body must be a JSON object", code="invalid_json")
    msg = str(e.get("msg", "invalid value"))
    if kind == "value_error":  # ours: the message names the field
        msg = msg[len("Value error, "):] if msg.startswith("Value error, ") else msg
        code = "unsupported_parameter" if "is not supported" in msg else "invalid_value"
        return ApiError(400, msg, param=param, code=code)
    where = f"'{path}': " if path else ""
    shown = repr(e.get("input"))[:60] if "input" in e else None
    return ApiError(400, f"invalid {where}{msg}" + (f" (got {shown})" if shown else ""), param=param,
                    code="invalid_value")


_FIELDS = set(ChatRequest.model_fields) | set(CompletionRequest.model_fields) | set(Message.model_fields) \
    | set(DDTreeParams.model_fields) | {"include_usage", "enable_thinking", "text", "type"}

"""The JSON a client sends, checked field by field before anything runs.

Requests are OpenAI's (``/v1/completions``, ``/v1/chat/completions``); every refusal is an
``ApiError`` that becomes OpenAI's error object (``{"error": {"message", "type", "param",
"code"}}``) with a 4xx status and a message naming the field, the value and what is allowed.
Fields this server does not implement (logprobs, penalties, tools, ...) are refused when set to
anything but their neutral value; fields it does not know are ignored, as vLLM does.

Extensions beside OpenAI's fields (vLLM's names where vLLM has one): ``priority`` ("high",
"normal", "low" or the level 2, 1, 0; also the ``X-Priority`` header), ``min_tokens``,
``return_token_ids``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

# the task levels of oxygen_torch.task's named priorities: a closed set, so the metrics' class
# label takes three values whatever clients send
PRIORITY_OF_LEVEL = {2: "high", 1: "normal", 0: "low"}


class ApiError(Exception):
    """A refusal: HTTP status, OpenAI's error object, optional response headers."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             408: "timeout_error", 413: "invalid_request_error", 429: "rate_limit_error",
             503: "overloaded_error"}  # fmt: skip

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "server_error" if self.status >= 500 else "api_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for."""

    max_n: int = 16  # choices per prompt
    max_rows: int = 64  # prompts x n: the rows of one generate() call
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_stop: int = 4  # stop strings (OpenAI's limit)
    max_stop_chars: int = 256
    max_messages: int = 4096
    # below 0.01 the logits over temperature overflow in half precision; 0 is greedy
    min_temperature: float = 0.01
    max_temperature: float = 2.0

    def __post_init__(self):
        for name in ("max_n", "max_rows", "max_prompts", "max_stop", "max_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name}: {getattr(self, name)} is not allowed; >= 1")


@dataclass
class Sampling:
    """The generation settings of one request, checked."""

    max_tokens: int | None = None  # None: the room left in the context
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: tuple[str, ...] = ()
    seed: int | None = None
    priority: str = "normal"
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False


@dataclass
class Request:
    """A checked request: its settings, and its prompts (completions) or messages (chat)."""

    sampling: Sampling
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    model: str | None = None


def parse_json(body: bytes) -> dict:
    """The body as a JSON object; NaN, Infinity, numbers past float range, invalid UTF-8 and
    nesting deeper than the interpreter's recursion limit are refused (400), not raised."""

    def constant(name):
        raise ValueError(f"{name} is not a JSON number")

    def finite(text):
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"the number {text[:40]} is out of range")
        return value

    try:
        data = json.loads(body, parse_constant=constant, parse_float=finite)
    except RecursionError:
        raise ApiError(400, "the JSON body nests too deeply") from None
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError, huge integers
        raise ApiError(400, f"the body is not valid JSON: {str(err)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(data).__name__}")
    return data


# --- fields -------------------------------------------------------------------------------------


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, int) or abs(value) < 10**30 else "a huge int"
    return text if len(text) <= 60 else text[:57] + "..."


def _int(body: dict, name: str, lo: int, hi: int, default: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise bad(name, f"{_shown(value)} is not allowed; allowed: an integer from {lo} to {hi}")
    return value


def _number(body: dict, name: str, default: float, allowed: str, ok) -> float:
    value = body.get(name)
    if value is None:
        return default
    # ints compare exactly (10**400 is not converted to float first)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise bad(name, f"{_shown(value)} is not allowed; allowed: {allowed}")
    return float(value)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(name, f"{_shown(value)} is not allowed; allowed: true or false")
    return value


def _neutral(body: dict, name: str, *neutral: Any) -> None:
    """A field this server does not implement: only its neutral value (or absence) passes."""
    value = body.get(name)
    if value is None or any(value == v and type(value) is type(v) for v in neutral):
        return
    raise bad(name, f"{_shown(value)} is not supported by this server")


def priority_of(value: Any, param: str = "priority") -> str:
    """'high' / 'normal' / 'low' from a name or the level 2 / 1 / 0 (also as a header's text)."""
    # the three ASCII digits only: str.isdigit() passes "²", which int() refuses
    if isinstance(value, str) and value.strip() in ("2", "1", "0"):
        value = int(value)
    if isinstance(value, str) and value.strip().lower() in PRIORITY_OF_LEVEL.values():
        return value.strip().lower()
    if isinstance(value, int) and not isinstance(value, bool) and value in PRIORITY_OF_LEVEL:
        return PRIORITY_OF_LEVEL[value]
    raise bad(param, f"{_shown(value)} is not allowed; allowed: high, normal, low, or 2, 1, 0")


def _stop(body: dict, lim: Limits) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    allowed = (
        f"a non-empty string of at most {lim.max_stop_chars} characters, or a list of at "
        f"most {lim.max_stop} of them"
    )
    if not isinstance(items, list) or len(items) > lim.max_stop:
        raise bad("stop", f"{_shown(value)} is not allowed; allowed: {allowed}")
    for s in items:
        if not isinstance(s, str) or not s or len(s) > lim.max_stop_chars:
            raise bad("stop", f"{_shown(s)} is not allowed; allowed: {allowed}")
    return tuple(dict.fromkeys(items))


def sampling(body: dict, lim: Limits, header_priority: str | None, chat: bool) -> Sampling:
    """The settings both endpoints share, checked."""
    for name, neutral in (("presence_penalty", (0, 0.0)), ("frequency_penalty", (0, 0.0)),
                          ("logit_bias", ({},)), ("best_of", (1,)), ("echo", (False,)),
                          ("suffix", ("",)), ("logprobs", (False, 0) if chat else (0,)),
                          ("top_logprobs", (0,)), ("tools", ([],)), ("functions", ([],)),
                          ("tool_choice", ("none",)), ("function_call", ("none",)),
                          ("response_format", ({"type": "text"},))):  # fmt: skip
        _neutral(body, name, *neutral)
    lo, hi = lim.min_temperature, lim.max_temperature
    temperature = _number(
        body, "temperature", 1.0, f"0 (greedy) or a number from {lo} to {hi}",
        lambda v: v == 0 or lo <= v <= hi,
    )  # fmt: skip
    top_p = _number(body, "top_p", 1.0, "a number in (0, 1]", lambda v: 0 < v <= 1)
    n = _int(body, "n", 1, lim.max_n, 1)
    max_name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    max_tokens = _int(body, max_name, 1, 1 << 31, None if chat else 16)
    min_tokens = _int(body, "min_tokens", 0, 1 << 31, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad("min_tokens", f"{min_tokens} is more than {max_name} ({max_tokens})")
    seed = _int(body, "seed", 0, (1 << 63) - 1, None)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict):
            raise bad("stream_options", f"{_shown(options)} is not allowed; allowed: an object")
        if not stream:
            raise bad("stream_options", "is only allowed with stream: true")
        include_usage = _bool(options, "include_usage")
    given = body.get("priority")
    priority = priority_of(given) if given is not None else "normal"
    if given is None and header_priority is not None:
        priority = priority_of(header_priority, "X-Priority")
    return Sampling(
        max_tokens=max_tokens, min_tokens=min_tokens, temperature=temperature, top_p=top_p, n=n,
        stop=_stop(body, lim), seed=seed, priority=priority, stream=stream,
        include_usage=include_usage, return_token_ids=_bool(body, "return_token_ids"),
    )  # fmt: skip


def _model(body: dict) -> str | None:
    value = body.get("model")
    if value is not None and not isinstance(value, str):
        raise bad("model", f"{_shown(value)} is not allowed; allowed: a model name")
    return value


def completion_request(body: dict, lim: Limits, vocab: int,
                       header_priority: str | None = None) -> Request:  # fmt: skip
    """/v1/completions: prompt is a string, a list of strings, a list of token ids, or a list
    of lists of token ids."""
    s = sampling(body, lim, header_priority, chat=False)
    prompt = body.get("prompt")
    allowed = (
        "a string, a list of strings, a list of token ids, or a list of lists of token ids "
        f"(ids in [0, {vocab}); at most {lim.max_prompts} prompts)"
    )
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
    ):
        prompts = [prompt]
    elif isinstance(prompt, list) and 0 < len(prompt) <= lim.max_prompts:
        prompts = prompt
    else:
        raise bad("prompt", f"{_shown(prompt)} is not allowed; allowed: {allowed}")
    for p in prompts:
        if isinstance(p, str):
            continue
        if not (isinstance(p, list) and p) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in p
        ):
            raise bad("prompt", f"{_shown(p)} is not allowed; allowed: {allowed}")
    if len(prompts) * s.n > lim.max_rows:
        raise bad("n", f"{len(prompts)} prompts x n {s.n} is more than {lim.max_rows} choices")
    return Request(s, prompts=prompts, model=_model(body))


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if content is None and message.get("role") == "assistant":
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):  # fmt: skip
                raise bad(f"messages[{i}].content", "only text parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"messages[{i}].content", f"{_shown(content)} is not allowed; allowed: a string")


def chat_request(body: dict, lim: Limits, header_priority: str | None = None) -> Request:
    """/v1/chat/completions: messages of role system / user / assistant (/ developer, tool)
    with text content, through the checkpoint's chat template."""
    s = sampling(body, lim, header_priority, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not 0 < len(messages) <= lim.max_messages:
        raise bad(
            "messages",
            f"{_shown(messages)} is not allowed; allowed: a list of 1 to {lim.max_messages} "
            "messages",
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", f"{_shown(m)} is not allowed; allowed: an object")
        role = m.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(
                f"messages[{i}].role",
                f"{_shown(role)} is not allowed; allowed: system, developer, user, assistant, tool",
            )
        out.append({"role": role, "content": _content(m, i)})
    if s.n > lim.max_rows:
        raise bad("n", f"{s.n} is more than {lim.max_rows} choices")
    return Request(s, messages=out, model=_model(body))

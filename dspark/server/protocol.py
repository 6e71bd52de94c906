"""The OpenAI wire format: request validation and response bodies.

Requests are parsed by hand (not by a schema library) so that every bad field
becomes an OpenAI-style error naming the field:
`{"error": {"message", "type", "param", "code"}}` with a 4xx status.
Features that would silently change the meaning of a request (logprobs, echo,
penalties, tools, n > 1 ...) are refused rather than ignored.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass


class APIError(Exception):
    """An error answered as OpenAI-style JSON with an HTTP status."""

    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error",
        param: str | None = None, code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    kind: str  # "completion" | "chat"
    model: str
    prompt: str | list[int] | None  # completions: text or token ids
    messages: list[dict[str, str]] | None  # chat: [{"role", "content"}], roles system/user/assistant
    max_tokens: int | None  # None: fill the context (chat) / 16 (completions, set by the parser)
    temperature: float
    top_p: float
    top_k: int  # 0 = off
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    ignore_eos: bool  # extension: keep generating past end-of-sequence


# ----------------------------------------------------------- field readers
def _number(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"'{name}' must be a number, got {value!r}", name)
    if value > hi or value < lo or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(f"'{name}' must be in {interval}, got {value}", name)
    return float(value)


def _integer(body: dict, name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{name}' must be an integer, got {value!r}", name)
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(f"'{name}' must be {bound}, got {value}", name)
    return value


def _flag(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{name}' must be true or false, got {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stops) > 4:
        raise bad(f"'stop' takes at most 4 strings, got {len(stops)}", "stop")
    return tuple(stops)


def _refuse_unsupported(body: dict, kind: str) -> None:
    """Features we do not implement: refuse unless set to their no-op value."""
    noop = {
        "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
        "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
        "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
        "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    }
    for name, allowed in noop.items():
        value = body.get(name)
        if any(value == a and type(value) is type(a) for a in allowed) or value is None:
            continue
        if name == "n":
            raise bad("only n=1 is supported; send separate requests for more completions", "n")
        raise bad(f"'{name}' is not supported by this server; remove it", name)
    fmt = body.get("response_format")
    if kind == "chat" and fmt is not None and fmt != {"type": "text"}:
        raise bad("only response_format {'type': 'text'} is supported", "response_format")


def _common(body: dict, kind: str, prompt, messages, default_max: int | None) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: pass the name listed by /v1/models", "model")
    _refuse_unsupported(body, kind)
    max_tokens = _integer(body, "max_tokens", None, 1)
    if kind == "chat":
        max_tokens = _integer(body, "max_completion_tokens", max_tokens, 1)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    top_k = _integer(body, "top_k", 0, -1)
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=default_max if max_tokens is None else max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        top_k=max(top_k, 0),  # -1 (vLLM's "off") and 0 both disable it
        seed=_integer(body, "seed", None, 0, 2**63 - 1),
        stop=_stop(body),
        stream=_flag(body, "stream"),
        include_usage=bool(options and _flag(options, "include_usage")),
        ignore_eos=_flag(body, "ignore_eos"),
    )


def parse_completion(body: dict) -> GenerationRequest:
    """Validate a /v1/completions body (max_tokens defaults to 16, as in OpenAI's API)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise bad("batched prompts are not supported: send one prompt (text or token ids) per request", "prompt")
    elif not isinstance(prompt, str):
        raise bad("'prompt' must be a string or a list of token ids", "prompt")
    return _common(body, "completion", prompt, None, default_max=16)


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _message(i: int, message) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise bad(f"{param} must be an object with 'role' and 'content'", param)
    role = _ROLES.get(message.get("role"))
    if role is None:
        raise bad(f"{param}.role must be one of system, developer, user, assistant; got {message.get('role')!r}",
                  f"{param}.role")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"{param}.content: only text parts are supported", f"{param}.content")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise bad(f"{param}.content must be a string or a list of text parts", f"{param}.content")
    return {"role": role, "content": content}


def parse_chat(body: dict) -> GenerationRequest:
    """Validate a /v1/chat/completions body (max_tokens defaults to the rest of the context)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    parsed = [_message(i, m) for i, m in enumerate(messages)]
    return _common(body, "chat", None, parsed, default_max=None)


# ------------------------------------------------------------- responses
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(kind: str, rid: str, created: int, model: str, text: str, finish_reason: str | None,
                  usage_: dict, extra: dict | None = None) -> dict:
    """The non-streaming body of a completion or chat completion."""
    if kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice], "usage": usage_}
    if extra:
        body.update(extra)
    return body


def chunk(kind: str, rid: str, created: int, model: str, text: str | None, finish_reason: str | None,
          role: bool = False) -> dict:
    """One streaming chunk; `role` opens a chat stream with the assistant role."""
    if kind == "chat":
        delta: dict = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def usage_chunk(kind: str, rid: str, created: int, model: str, usage_: dict) -> dict:
    """The last chunk of a stream with stream_options.include_usage: no choices, usage filled."""
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_}

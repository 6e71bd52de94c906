"""The OpenAI-compatible HTTP API over an `AsyncEngine` (FastAPI).

    POST /v1/completions        text or token-id prompt
    POST /v1/chat/completions   messages through the tokenizer's chat template
    GET  /v1/models             the one served model
    GET  /health                200 while the engine loop runs, else 503 (no auth)
    GET  /metrics               Prometheus text (see dspark.engine.metrics)

Both generation endpoints stream with `"stream": true`: server-sent events,
one chunk per committed token batch (text deltas in order), a final chunk
with `finish_reason`, then `data: [DONE]`. A client that disconnects cancels
its request, which frees its KV cache between two engine steps.

Every error is OpenAI-style JSON, `{"error": {"message", "type", "param",
"code"}}`, with a 4xx status for bad requests (401 without the API key when
one is set, 404 unknown model, 413 oversized body) and 5xx for engine
failures; the server keeps serving. No tensors here: token ids in, token ids
out.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dspark.engine.async_engine import AsyncEngine, EngineStopped, RequestFailed, RequestStream
from dspark.engine.metrics import CONTENT_TYPE
from dspark.errors import UserError
from dspark.server.protocol import (
    APIError, GenerationRequest, bad, chunk, full_response, new_id, now, parse_chat, parse_completion, usage,
    usage_chunk,
)
from dspark.models.chat import encode_chat, encode_text
from dspark.server.textio import TextStream
from dspark.types import SamplingParams

log = logging.getLogger("dspark.server")
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class EventStreamResponse(StreamingResponse):
    """Server-sent events that call `on_close` however the stream ends
    (finished, failed, or the client went away)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except RuntimeError:  # still running in a cancelled task: it closes itself
                    pass


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class _Server:
    """The app's state and handlers (one per app)."""

    def __init__(self, engine: AsyncEngine, tokenizer, model_name: str, api_key: str | None,
                 max_body_bytes: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.context_len = engine.engine.max_seq_len
        self.created = now()

    # ------------------------------------------------------------ checks
    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           type="invalid_request_error", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
        limit = self.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._too_large(int(declared))
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > limit:
                raise self._too_large(len(raw))
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise bad(f"the request body is not valid JSON ({err})", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad("the request body must be a JSON object", code="invalid_json")
        return body

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"the request body has {size} bytes or more, past the limit of {self.max_body_bytes}; "
                        "send a shorter request", code="request_too_large")

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        if req.kind == "chat":
            try:
                return encode_chat(self.tokenizer, req.messages)
            except (ValueError, KeyError, TypeError) as err:
                raise bad(f"cannot apply the chat template ({err}); use /v1/completions with a plain prompt",
                          "messages") from None
        if isinstance(req.prompt, list):
            return list(req.prompt)
        return encode_text(self.tokenizer, req.prompt)

    def sampling(self, req: GenerationRequest, num_prompt: int) -> SamplingParams:
        param = "messages" if req.kind == "chat" else "prompt"
        if num_prompt == 0:
            raise bad("the prompt is empty: give at least one token of text", param)
        room = self.context_len - num_prompt
        if room < 1:
            raise bad(f"the prompt has {num_prompt} tokens but the context holds {self.context_len}; "
                      "shorten the prompt", param, code="context_length_exceeded")
        max_tokens = room if req.max_tokens is None else req.max_tokens
        if max_tokens > room:
            raise bad(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                      f"{self.context_len} tokens; lower max_tokens to {room} or less", "max_tokens",
                      code="context_length_exceeded")
        return SamplingParams(
            temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed,
            max_new_tokens=max_tokens, stop=req.stop, ignore_eos=req.ignore_eos,
        )

    # --------------------------------------------------------- generation
    async def generate(self, request: Request, kind: str) -> Response:
        self.check_auth(request)
        body = await self.read_json(request)
        req = parse_chat(body) if kind == "chat" else parse_completion(body)
        if req.model != self.model_name:
            raise APIError(404, f"the model {req.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        ids = self.prompt_ids(req)
        params = self.sampling(req, len(ids))
        rid = new_id(kind)
        stream = self.engine.submit(ids, params, request_id=rid)
        try:
            await stream.accepted()
        except UserError as err:
            if isinstance(err, EngineStopped):
                raise
            raise bad(str(err), "messages" if kind == "chat" else "prompt") from None
        text = TextStream(self.tokenizer, req.stop)
        if req.stream:
            on_close = lambda: None if stream.finished else self.engine.cancel(rid)  # noqa: E731
            return EventStreamResponse(self.events(req, rid, len(ids), stream, text), on_close)
        return await self.complete(request, req, rid, len(ids), stream, text)

    async def complete(self, request: Request, req: GenerationRequest, rid: str, num_prompt: int,
                       stream: RequestStream, text: TextStream) -> Response:
        consume = asyncio.create_task(self._consume(rid, stream, text))
        gone = asyncio.create_task(_wait_disconnect(request))
        done, _ = await asyncio.wait({consume, gone}, return_when=asyncio.FIRST_COMPLETED)
        if consume not in done:  # the client went away: free the request
            consume.cancel()
            self.engine.cancel(rid)
            return Response(status_code=499)
        gone.cancel()
        reason = consume.result()
        m = stream.metrics
        extra = None if m is None else {"dspark": {
            "ttft_s": m.ttft_s, "tpot_s": m.tpot_s, "rounds": m.stats.rounds,
            "acceptance_length": m.stats.mean_accepted_length, "mean_verify_length": m.stats.mean_verify_length,
        }}
        body = full_response(req.kind, rid, now(), self.model_name, text.text, reason,
                             usage(num_prompt, len(text.token_ids)), extra)
        return JSONResponse(body)

    async def _consume(self, rid: str, stream: RequestStream, text: TextStream) -> str | None:
        """Read the request to its end; cancel it early when a stop string shows up."""
        reason = None
        async for out in stream:
            text.push(out.new_token_ids, final=out.finished)
            if text.stopped and reason is None:
                reason = "stop"
                if not out.finished:
                    self.engine.cancel(rid)  # drain until the engine confirms the abort
            if out.finished:
                return reason or out.finish_reason
        return reason

    async def events(self, req: GenerationRequest, rid: str, num_prompt: int, stream: RequestStream,
                     text: TextStream) -> AsyncIterator[str]:
        created, model, kind = now(), self.model_name, req.kind
        if kind == "chat":
            yield _sse(chunk(kind, rid, created, model, None, None, role=True))
        try:
            reason = None
            async for out in stream:
                delta = text.push(out.new_token_ids, final=out.finished)
                if delta:
                    yield _sse(chunk(kind, rid, created, model, delta, None))
                if text.stopped or out.finished:
                    reason = "stop" if text.stopped else out.finish_reason
                    break
            yield _sse(chunk(kind, rid, created, model, None, reason))
            if req.include_usage:
                yield _sse(usage_chunk(kind, rid, created, model, usage(num_prompt, len(text.token_ids))))
        except (RequestFailed, EngineStopped) as err:
            yield _sse(APIError(500 if isinstance(err, RequestFailed) else 503, str(err), type="server_error").body())
        yield _sse("[DONE]")

    # -------------------------------------------------------------- misc
    def models(self, request: Request) -> dict:
        self.check_auth(request)
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "dspark",
            "max_model_len": self.context_len,
        }]}


async def _wait_disconnect(request: Request) -> None:
    """Return when the client closes the connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(UserError)
    async def user_error(request: Request, err: UserError) -> JSONResponse:
        if isinstance(err, EngineStopped):
            return _error_response(APIError(503, str(err), type="server_error", code="engine_stopped"))
        return _error_response(bad(str(err)))

    @app.exception_handler(RequestFailed)
    async def failed(request: Request, err: RequestFailed) -> JSONResponse:
        return _error_response(APIError(500, str(err), type="server_error"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        return _error_response(APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}",
                                        code=code))

    @app.exception_handler(Exception)
    async def internal(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_response(APIError(500, f"internal server error ({type(err).__name__})", type="server_error"))


def create_app(
    async_engine: AsyncEngine,
    tokenizer,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    *,
    shutdown_drain_s: float = 0.0,
) -> FastAPI:
    """The API app. Its lifespan starts `async_engine` (if not started) and shuts it
    down on exit, giving running requests `shutdown_drain_s` seconds to finish."""
    if max_body_bytes < 1:
        raise UserError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    server = _Server(async_engine, tokenizer, model_name, api_key or None, max_body_bytes)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        await asyncio.to_thread(async_engine.shutdown, shutdown_drain_s)

    app = FastAPI(title="dspark", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    _install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.generate(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        return server.models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = async_engine.is_alive
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        server.check_auth(request)
        return PlainTextResponse(async_engine.metrics.render(), media_type=CONTENT_TYPE)

    return app

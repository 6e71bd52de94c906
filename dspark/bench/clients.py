"""What the load generator and the soak drive: the HTTP API of a running
`dspark serve` (streaming chat completions, loopback only) or an `AsyncEngine`
in this process.

Both clients fill a `RequestSample` while a request streams (so a request cut
at the wall-time limit still says what it got) and read the engine's counters
through the same Prometheus text (`/metrics`, or `ServingMetrics.render()` in
process), so the two modes report identical quantities.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from dspark.errors import UserError
from dspark.types import SamplingParams


# --------------------------------------------------------------- records
@dataclass(frozen=True)
class BenchPrompt:
    """One replayed benchmark prompt: the first user turn, as chat messages."""

    id: str  # "<benchmark>/<record id>"
    messages: tuple[dict, ...]  # [{"role": "user", "content": str}]


@dataclass(frozen=True)
class SamplingSpec:
    """How every request of a run samples (the same for every arm)."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy, so every lossless arm generates the same tokens
    seed: int | None = None  # per-request seed (sampled runs); None: the engine draws one
    ignore_eos: bool = False  # generate exactly max_new_tokens

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, seed=self.seed,
                              max_new_tokens=self.max_new_tokens, ignore_eos=self.ignore_eos)


@dataclass
class RequestSample:
    """One request as the client saw it; times in seconds from the level start."""

    prompt_id: str
    start_s: float
    status: str = "running"  # "ok" | "failed" | "cut" (cancelled at the level's wall-time limit)
    end_s: float | None = None
    first_token_s: float | None = None
    output_tokens: int | None = None  # None: unknown (an HTTP request cut before its usage chunk)
    finish_reason: str | None = None
    error: str | None = None
    verify_length: float | None = None  # in-process only: mean verify length of this request's rounds
    acceptance_length: float | None = None  # in-process only: committed tokens per round (tau)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Mean seconds per output token after the first."""
        n = self.output_tokens
        if self.status != "ok" or self.first_token_s is None or self.end_s is None or not n or n < 2:
            return None
        return (self.end_s - self.first_token_s) / (n - 1)

    @property
    def tokens_per_s_user(self) -> float | None:
        tpot = self.tpot_s
        return None if not tpot else 1.0 / tpot

    def fail(self, error: str, now: float) -> None:
        self.status, self.error, self.end_s = "failed", error, now

    def as_dict(self) -> dict:
        return {
            "prompt_id": self.prompt_id, "status": self.status, "start_s": self.start_s, "end_s": self.end_s,
            "ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "tokens_per_s_user": self.tokens_per_s_user,
            "output_tokens": self.output_tokens, "finish_reason": self.finish_reason, "error": self.error,
            "verify_length": self.verify_length, "acceptance_length": self.acceptance_length,
        }


_COUNTERS = {
    "generated_tokens": "dspark_generation_tokens_total",
    "rounds": "dspark_spec_rounds_total",
    "verified_draft_tokens": "dspark_spec_verified_draft_tokens_total",
    "accepted_tokens": "dspark_spec_accepted_tokens_total",
    "committed_tokens": "dspark_spec_committed_tokens_total",
    "kv_tokens_in_use": "dspark_kv_tokens_in_use",
    "running": "dspark_requests_running",
    "queue_depth": "dspark_queue_depth",
    "failed": "dspark_requests_failed_total",
}
_DRAFTED_STEPS = "dspark_decode_steps_total"  # labelled drafted="all" | "some" | "none"
DRAFTED_KINDS = ("all", "some", "none")
# labelled kind="prefill" | "plain" | "drafted" (dspark.engine.metrics.STEP_KINDS); optional (older servers)
_STEP_KIND_FAMILIES = {"steps": "dspark_engine_steps_total", "seconds": "dspark_engine_step_seconds_total",
                       "positions": "dspark_engine_step_positions_total",
                       "forward_seconds": "dspark_engine_step_forward_seconds_total"}
_STEP_KIND_OPTIONAL = ("forward_seconds",)  # servers before session 49 do not time the forward apart
_IDLE = "dspark_engine_idle_seconds_total"


@dataclass(frozen=True)
class ServerCounters:
    """The engine's counters and gauges at one moment (see dspark.engine.metrics)."""

    generated_tokens: int
    rounds: int  # speculative rounds: one per decoding request per step
    verified_draft_tokens: int  # sum of verify lengths
    accepted_tokens: int
    committed_tokens: int  # accepted + one bonus/recovered token per round
    kv_tokens_in_use: int
    running: int
    queue_depth: int
    failed: int
    drafted_steps: tuple[int, int, int]  # decode steps that drafted all, some, none of their requests
    # {kind: {"steps", "seconds", "positions", "forward_seconds"}} per step kind, and the loop's idle
    # seconds (where the engine's time went); empty / None from a server without those families
    # ("forward_seconds", the target forward's part of the seconds, absent from older servers)
    step_kinds: dict = field(default_factory=dict)
    idle_seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> "ServerCounters":
        """Read the unlabelled samples of the families above, and the drafted-steps
        family by its label, from Prometheus text."""
        values: dict[str, float] = {}
        drafted: dict[str, int] = {}
        kinds: dict[str, dict[str, float]] = {}
        for line in text.splitlines():
            if line.startswith("#") or " " not in line:
                continue
            name, _, value = line.rpartition(" ")
            family, _, labels = name.partition("{")
            if not labels:
                values[name] = float(value)
            elif family == _DRAFTED_STEPS:
                for kind in DRAFTED_KINDS:
                    if f'drafted="{kind}"' in labels:
                        drafted[kind] = int(float(value))
            else:
                for what, metric in _STEP_KIND_FAMILIES.items():
                    if family == metric and labels.startswith('kind="'):
                        kinds.setdefault(labels[6:].split('"', 1)[0], {})[what] = float(value)
        missing = [m for m in _COUNTERS.values() if m not in values]
        missing += [f'{_DRAFTED_STEPS}{{drafted="{k}"}}' for k in DRAFTED_KINDS if k not in drafted]
        if missing:
            raise UserError(f"the server's /metrics lacks {', '.join(missing)}; is it a dspark server of this "
                            "version? Upgrade the server to the load generator's version")
        return cls(**{name: int(values[metric]) for name, metric in _COUNTERS.items()},
                   drafted_steps=tuple(drafted[k] for k in DRAFTED_KINDS),
                   step_kinds={k: v for k, v in kinds.items()
                               if all(w in v for w in _STEP_KIND_FAMILIES if w not in _STEP_KIND_OPTIONAL)},
                   idle_seconds=values.get(_IDLE))

    @property
    def idle(self) -> bool:
        return self.running == 0 and self.queue_depth == 0


# -------------------------------------------------------------- loopback
def loopback_url(url: str) -> str:
    """`url` without a trailing slash, if it is http(s) on a loopback host; else UserError."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise UserError(f"bad server URL {url!r}: use http://127.0.0.1:PORT")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise UserError(f"the load benchmark only drives servers on this machine; {host!r} is not a loopback "
                        "address: use http://127.0.0.1:PORT")
    if parts.path not in ("", "/", "/v1", "/v1/"):
        raise UserError(f"bad server URL {url!r}: give the server root, e.g. http://127.0.0.1:8000")
    return f"{parts.scheme}://{parts.netloc}"


# ------------------------------------------------------------------ HTTP
def sse_payloads(lines):
    """Async generator: the JSON payloads of an SSE stream's `data:` lines, then "[DONE]"."""

    async def gen():
        async for line in lines:
            if line.startswith("data: "):
                data = line[6:]
                yield data if data == "[DONE]" else json.loads(data)

    return gen()


class HttpClient:
    """Streaming chat completions against a running server on 127.0.0.1."""

    def __init__(self, url: str, *, api_key: str | None = None, max_connections: int = 128,
                 timeout_s: float = 600.0) -> None:
        import httpx

        self.base_url = loopback_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = httpx.AsyncClient(base_url=self.base_url, headers=headers, limits=limits,
                                      timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.model: str | None = None

    async def connect(self) -> None:
        """Find the served model's name (GET /v1/models)."""
        import httpx

        try:
            resp = await self.http.get("/v1/models")
        except httpx.HTTPError as err:
            raise UserError(f"cannot reach a dspark server at {self.base_url} ({err}); start one with "
                            "`dspark serve`") from None
        if resp.status_code != 200:
            raise UserError(f"{self.base_url}/v1/models answered {resp.status_code}: {resp.text[:200]}")
        self.model = resp.json()["data"][0]["id"]

    def body(self, prompt: BenchPrompt, spec: SamplingSpec) -> dict:
        body = {"model": self.model, "messages": list(prompt.messages), "max_tokens": spec.max_new_tokens,
                "temperature": spec.temperature, "stream": True, "stream_options": {"include_usage": True}}
        if spec.seed is not None:
            body["seed"] = spec.seed
        if spec.ignore_eos:
            body["ignore_eos"] = True
        return body

    async def generate(self, prompt: BenchPrompt, spec: SamplingSpec, sample: RequestSample, t0: float) -> None:
        import httpx

        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=self.body(prompt, spec)) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    sample.fail(f"HTTP {resp.status_code}: {text[:300]}", time.perf_counter() - t0)
                    return
                await self._read(resp, sample, t0)
        except httpx.HTTPError as err:
            sample.fail(f"{type(err).__name__}: {err}", time.perf_counter() - t0)

    @staticmethod
    async def _read(resp, sample: RequestSample, t0: float) -> None:
        done = False
        async for payload in sse_payloads(resp.aiter_lines()):
            now = time.perf_counter() - t0
            if payload == "[DONE]":
                done = True
                break
            if "error" in payload:
                sample.fail(str(payload["error"].get("message")), now)
                return
            for choice in payload.get("choices", []):
                if choice.get("delta", {}).get("content") and sample.first_token_s is None:
                    sample.first_token_s = now
                if choice.get("finish_reason"):
                    sample.finish_reason = choice["finish_reason"]
            if payload.get("usage"):
                sample.output_tokens = int(payload["usage"]["completion_tokens"])
        now = time.perf_counter() - t0
        if not done or sample.finish_reason is None:
            sample.fail("the stream ended without a finish_reason and [DONE]", now)
            return
        sample.status, sample.end_s = "ok", now

    async def counters(self) -> ServerCounters:
        resp = await self.http.get("/metrics")
        resp.raise_for_status()
        return ServerCounters.parse(resp.text)

    async def aclose(self) -> None:
        await self.http.aclose()


# ------------------------------------------------------------ in process
class ChatEncoder:
    """Token ids of a prompt through the tokenizer's chat template (cached)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids: dict[str, list[int]] = {}

    def __call__(self, prompt: BenchPrompt) -> list[int]:
        from dspark.models.chat import encode_chat

        if prompt.id not in self._ids:
            self._ids[prompt.id] = encode_chat(self.tokenizer, list(prompt.messages))
        return self._ids[prompt.id]


class EngineClient:
    """Requests straight into an `AsyncEngine` (no HTTP)."""

    def __init__(self, async_engine, encoder: ChatEncoder) -> None:
        self.async_engine = async_engine
        self.encoder = encoder

    async def generate(self, prompt: BenchPrompt, spec: SamplingSpec, sample: RequestSample, t0: float) -> None:
        from dspark.engine.async_engine import RequestFailed

        stream = self.async_engine.submit(self.encoder(prompt), spec.params())
        try:
            await stream.accepted()
            count = 0
            async for out in stream:
                if out.new_token_ids and sample.first_token_s is None:
                    sample.first_token_s = time.perf_counter() - t0
                count += len(out.new_token_ids)
                sample.output_tokens = count
                if out.finished:
                    sample.finish_reason = out.finish_reason
        except (UserError, RequestFailed) as err:
            sample.fail(f"{type(err).__name__}: {err}", time.perf_counter() - t0)
            return
        except asyncio.CancelledError:
            self.async_engine.cancel(stream.request_id)
            raise
        sample.status, sample.end_s = "ok", time.perf_counter() - t0
        if stream.metrics is not None and stream.metrics.stats.rounds:
            stats = stream.metrics.stats
            sample.verify_length, sample.acceptance_length = stats.mean_verify_length, stats.mean_accepted_length

    async def counters(self) -> ServerCounters:
        return ServerCounters.parse(self.async_engine.metrics.render())

    async def aclose(self) -> None:
        await asyncio.to_thread(self.async_engine.shutdown)

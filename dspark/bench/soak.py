"""Soak test of a running `dspark serve` on 127.0.0.1:

    run_soak(url, settings) -> SoakReport

Many concurrent streaming chat clients replay benchmark prompts for a bounded
number of requests and seconds. Mixed in (seeded): clients that disconnect
mid-stream (cancellation), malformed requests (bad JSON, bad fields, unknown
model), and greedy requests of a few fixed prompts whose text is compared
with the same request run alone on the idle server before the soak.

It passes when no well-formed request failed (every stream that was not
abandoned ended with a finish_reason and [DONE], and the engine's failure
counter did not move), every malformed request got a 4xx OpenAI-style error,
the KV cache returned to its baseline (`/metrics` kv_tokens_in_use), every
greedy output equalled its run-alone output, and /health is still 200.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass, field

from dspark.bench.clients import BenchPrompt, HttpClient, SamplingSpec, sse_payloads
from dspark.errors import UserError

# body overrides (or raw bodies) the server must refuse with a 4xx
MALFORMED: tuple[object, ...] = (
    b'{"model": "x", "messages": [',  # truncated JSON
    b"[1, 2, 3]",  # not an object
    {"messages": None},
    {"temperature": 5.0},
    {"n": 3},
    {"model": "no-such-model"},
    {"max_tokens": -1},
    {"messages": [{"role": "robot", "content": "hi"}]},
)


@dataclass(frozen=True)
class SoakSettings:
    clients: int = 16  # concurrent streaming clients
    requests: int = 200  # requests in total, of every kind
    max_seconds: float = 300.0  # no request starts after this
    cancel_fraction: float = 0.2  # streams the client abandons after 1-3 chunks
    malformed_fraction: float = 0.1
    greedy_fraction: float = 0.3  # greedy requests of the checked prompts
    greedy_prompts: int = 4  # prompts whose greedy output is checked against running alone
    max_new_tokens: int = 32
    bench: str = "all"  # benchmark prompt sets replayed
    max_prompt_chars: int = 400
    seed: int = 0
    settle_seconds: float = 30.0  # how long the KV cache may take to return to its baseline

    def __post_init__(self) -> None:
        fractions = (self.cancel_fraction, self.malformed_fraction, self.greedy_fraction)
        if self.clients < 1 or self.requests < 1 or self.max_seconds <= 0 or self.max_new_tokens < 1:
            raise UserError("soak settings clients, requests, max_seconds and max_new_tokens must be positive")
        if any(f < 0 for f in fractions) or sum(fractions) > 1:
            raise UserError("soak fractions must be >= 0 and sum to at most 1")


@dataclass
class SoakReport:
    wall_s: float
    sent: int
    completed: int  # well-formed requests that ran to their end
    failed: int  # well-formed requests that did not (status, error event, no [DONE], transport error)
    cancelled: int  # streams abandoned by the client on purpose
    malformed: int
    malformed_rejected: int  # answered with a 4xx and an OpenAI error body
    greedy_checked: int
    greedy_mismatches: int
    engine_failures: int  # growth of dspark_requests_failed_total during the soak
    kv_baseline: int
    kv_end: int
    healthy: bool  # /health answered 200 at the end
    errors: list[str] = field(default_factory=list)  # the first few problems, for the log

    @property
    def passed(self) -> bool:
        return (self.failed == 0 and self.engine_failures == 0 and self.malformed_rejected == self.malformed
                and self.greedy_mismatches == 0 and self.kv_end == self.kv_baseline and self.healthy)

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}

    def summary(self) -> str:
        return (f"soak {'PASSED' if self.passed else 'FAILED'} in {self.wall_s:.1f} s: {self.sent} requests, "
                f"{self.completed} completed, {self.failed} failed, {self.cancelled} cancelled, "
                f"{self.malformed_rejected}/{self.malformed} malformed refused, greedy {self.greedy_checked} "
                f"checked / {self.greedy_mismatches} mismatched, engine failures {self.engine_failures}, "
                f"KV {self.kv_baseline} -> {self.kv_end}, health {'ok' if self.healthy else 'DOWN'}")


@dataclass
class _Tally:
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    malformed: int = 0
    malformed_rejected: int = 0
    greedy_checked: int = 0
    greedy_mismatches: int = 0
    errors: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.errors) < 10:
            self.errors.append(text)


async def _stream_text(client: HttpClient, body: dict, abandon_after: int | None) -> tuple[str, str | None]:
    """Stream one chat completion -> (outcome, text or error). Outcomes: "ok",
    "cancelled" (abandoned after `abandon_after` content chunks), "failed"."""
    async with client.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return "failed", f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        pieces, finish, chunks = [], None, 0
        async for payload in sse_payloads(resp.aiter_lines()):
            if payload == "[DONE]":
                return ("ok", "".join(pieces)) if finish else ("failed", "[DONE] without a finish_reason")
            if "error" in payload:
                return "failed", f"error event: {payload['error'].get('message')}"
            for choice in payload.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    pieces.append(content)
                    chunks += 1
                finish = choice.get("finish_reason") or finish
            if abandon_after is not None and chunks >= abandon_after and finish is None:
                return "cancelled", None  # leaving the block closes the connection mid-stream
        return "failed", "the stream ended without [DONE]"


async def _malformed(client: HttpClient, bad: object, base: dict, tally: _Tally) -> None:
    tally.malformed += 1
    if isinstance(bad, bytes):
        resp = await client.http.post("/v1/chat/completions", content=bad, headers={"content-type": "application/json"})
    else:
        resp = await client.http.post("/v1/chat/completions", json={**base, **bad})
    try:
        ok = 400 <= resp.status_code < 500 and "message" in resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        ok = False
    if ok:
        tally.malformed_rejected += 1
    else:
        tally.problem(f"malformed {bad!r} answered {resp.status_code}: {resp.text[:200]}")


def _plan(settings: SoakSettings, prompts: list[BenchPrompt], greedy: list[BenchPrompt]) -> list[tuple]:
    """The seeded list of (kind, prompt, extra) the clients work through."""
    rng = random.Random(settings.seed)
    plan = []
    for i in range(settings.requests):
        u = rng.random()
        if u < settings.malformed_fraction:
            plan.append(("malformed", prompts[i % len(prompts)], MALFORMED[rng.randrange(len(MALFORMED))]))
        elif u < settings.malformed_fraction + settings.cancel_fraction:
            plan.append(("cancel", prompts[i % len(prompts)], rng.randint(1, 3)))
        elif u < settings.malformed_fraction + settings.cancel_fraction + settings.greedy_fraction and greedy:
            plan.append(("greedy", greedy[rng.randrange(len(greedy))], None))
        else:
            plan.append(("sampled", prompts[i % len(prompts)], rng.randrange(2**31)))
    return plan


async def _one(client: HttpClient, settings: SoakSettings, job: tuple, reference: dict[str, str],
               tally: _Tally) -> None:
    import httpx

    kind, prompt, extra = job
    spec = SamplingSpec(max_new_tokens=settings.max_new_tokens, temperature=0.0 if kind == "greedy" else 0.8,
                        seed=extra if kind == "sampled" else None)
    body = client.body(prompt, spec)
    if kind == "malformed":
        await _malformed(client, extra, body, tally)
        return
    try:
        outcome, text = await _stream_text(client, body, extra if kind == "cancel" else None)
    except httpx.HTTPError as err:
        outcome, text = "failed", f"{type(err).__name__}: {err}"
    if outcome == "failed":
        tally.failed += 1
        tally.problem(f"{kind} request of {prompt.id} failed: {text}")
    elif outcome == "cancelled":
        tally.cancelled += 1
    else:
        tally.completed += 1
        if kind == "greedy":
            tally.greedy_checked += 1
            if text != reference[prompt.id]:
                tally.greedy_mismatches += 1
                tally.problem(f"greedy {prompt.id}: {text!r} under load, {reference[prompt.id]!r} alone")


async def _kv_back(client: HttpClient, baseline: int, timeout_s: float):
    """Counters once the engine is idle and its KV back at `baseline` (or at the timeout)."""
    deadline = time.perf_counter() + timeout_s
    counters = await client.counters()
    while (not counters.idle or counters.kv_tokens_in_use != baseline) and time.perf_counter() < deadline:
        await asyncio.sleep(0.05)
        counters = await client.counters()
    return counters


async def _references(client: HttpClient, prompts: list[BenchPrompt], max_new_tokens: int) -> dict[str, str]:
    """Each greedy prompt run alone on the idle server."""
    out = {}
    for prompt in prompts:
        body = client.body(prompt, SamplingSpec(max_new_tokens=max_new_tokens, temperature=0.0))
        outcome, text = await _stream_text(client, body, None)
        if outcome != "ok":
            raise UserError(f"the greedy reference request of {prompt.id} failed on the idle server: {text}")
        out[prompt.id] = text
    return out


async def _soak(url: str, settings: SoakSettings, prompts: list[BenchPrompt], api_key: str | None,
                progress: bool) -> SoakReport:
    from tqdm import tqdm

    from dspark.bench.loadgen import settled_counters

    client = HttpClient(url, api_key=api_key, max_connections=settings.clients + 4)
    try:
        await client.connect()
        before = await settled_counters(client, settings.settle_seconds)
        greedy = prompts[: settings.greedy_prompts]
        reference = await _references(client, greedy, settings.max_new_tokens)
        jobs = iter(_plan(settings, prompts, greedy))  # shared by the clients: each job is taken once
        tally, start, sent = _Tally(), time.perf_counter(), 0
        with tqdm(total=settings.requests, desc="soak", unit="req", disable=not progress) as bar:
            async def user() -> None:
                nonlocal sent
                for job in jobs:
                    if time.perf_counter() - start >= settings.max_seconds:
                        return
                    sent += 1
                    await _one(client, settings, job, reference, tally)
                    bar.update(1)

            await asyncio.gather(*(user() for _ in range(settings.clients)))
        wall = time.perf_counter() - start
        after = await _kv_back(client, before.kv_tokens_in_use, settings.settle_seconds)
        healthy = (await client.http.get("/health")).status_code == 200
    finally:
        await client.aclose()
    return SoakReport(
        wall_s=wall, sent=sent, completed=tally.completed, failed=tally.failed, cancelled=tally.cancelled,
        malformed=tally.malformed, malformed_rejected=tally.malformed_rejected,
        greedy_checked=tally.greedy_checked, greedy_mismatches=tally.greedy_mismatches,
        engine_failures=after.failed - before.failed, kv_baseline=before.kv_tokens_in_use,
        kv_end=after.kv_tokens_in_use, healthy=healthy, errors=tally.errors,
    )


def run_soak(url: str, settings: SoakSettings = SoakSettings(), *, api_key: str | None = None,
             progress: bool = True) -> SoakReport:
    """Soak the server at `url` (loopback only); see the module docstring.
    Prints the one-line summary when `progress`."""
    from dspark.bench.load import load_prompts

    prompts = load_prompts(settings.bench, settings.max_prompt_chars, settings.seed)
    report = asyncio.run(_soak(url, settings, prompts, api_key, progress))
    if progress:
        print(report.summary())
    return report

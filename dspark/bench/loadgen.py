"""The two load patterns and what one (arm, level) measures.

Closed loop: `concurrency` clients, each sending its next request as soon as
the last one finished, until `num_requests` were sent or `deadline_s` passed.
Open loop: requests arrive at Poisson times of rate `rate` (the same seeded
arrival times for every arm), whatever the server's speed.

At the deadline every request still running is cancelled (status "cut"); the
level's output tokens come from the engine's own counter, so the tokens a cut
request got inside the window still count towards aggregate throughput, while
per-request latencies only use requests that finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dspark.bench.clients import DRAFTED_KINDS, BenchPrompt, RequestSample, SamplingSpec, ServerCounters
from dspark.errors import UserError

OnDone = Callable[[RequestSample], None]


def request_spec(spec: SamplingSpec, index: int) -> SamplingSpec:
    """Request `index`'s sampling: a seeded run gives request i the seed `seed + i`
    (the same in every arm, so sampled outputs match across lossless arms)."""
    return spec if spec.seed is None else dataclasses.replace(spec, seed=spec.seed + index)


async def _drive(client, prompt: BenchPrompt, spec: SamplingSpec, sample: RequestSample, t0: float,
                 on_done: OnDone) -> None:
    """One request; a client bug or an unexpected reply fails the request, not the run."""
    try:
        await client.generate(prompt, spec, sample, t0)
    except Exception as exc:  # noqa: BLE001 - recorded on the sample and reported
        sample.fail(f"{type(exc).__name__}: {exc}", time.perf_counter() - t0)
    on_done(sample)


async def _finish(tasks: list[asyncio.Task], samples: list[RequestSample], t0: float, deadline_s: float) -> float:
    """Wait for `tasks` until the deadline, cancel the rest; -> elapsed seconds."""
    if tasks:
        remaining = max(0.0, deadline_s - (time.perf_counter() - t0))
        _, pending = await asyncio.wait(tasks, timeout=remaining)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    elapsed = min(time.perf_counter() - t0, deadline_s)
    for sample in samples:
        if sample.status == "running":
            sample.status, sample.end_s = "cut", elapsed
    return elapsed


def think_seconds(mean_s: float, seed: int, client: int, request: int) -> float:
    """A closed-loop client's pause before its `request`-th request: exponential with mean
    `mean_s` (0: none), drawn from (seed, client, request) alone, so every arm sees the same."""
    if mean_s <= 0:
        return 0.0
    return random.Random(f"think {seed} {client} {request}").expovariate(1.0 / mean_s)


async def closed_loop(client, prompts: Sequence[BenchPrompt], concurrency: int, num_requests: int,
                      spec: SamplingSpec, deadline_s: float, on_done: OnDone, think_s: float = 0.0,
                      seed: int = 0) -> tuple[list[RequestSample], float]:
    """`concurrency` clients in a closed loop -> (samples, elapsed seconds). With `think_s` > 0
    each client pauses before each of its requests (`think_seconds`): without pauses, requests
    that finish in the same engine step send their successors together, and greedy decoding to a
    length cap can keep such groups together for a whole level (docs/LOAD.md, run BG)."""
    t0 = time.perf_counter()
    samples: list[RequestSample] = []
    sent = 0

    async def user(me: int) -> None:
        nonlocal sent
        mine = 0
        while sent < num_requests and time.perf_counter() - t0 < deadline_s:
            pause = think_seconds(think_s, seed, me, mine)
            mine += 1
            if pause > 0:
                await asyncio.sleep(min(pause, max(0.0, deadline_s - (time.perf_counter() - t0))))
                if sent >= num_requests or time.perf_counter() - t0 >= deadline_s:
                    break
            index, sent = sent, sent + 1
            prompt = prompts[index % len(prompts)]
            sample = RequestSample(prompt.id, start_s=time.perf_counter() - t0)
            samples.append(sample)
            await _drive(client, prompt, request_spec(spec, index), sample, t0, on_done)

    tasks = [asyncio.create_task(user(me)) for me in range(concurrency)]
    return samples, await _finish(tasks, samples, t0, deadline_s)


def poisson_offsets(rate: float, num_requests: int, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process of `rate` per second."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        out.append(t)
    return out


async def poisson_arrivals(client, prompts: Sequence[BenchPrompt], rate: float, num_requests: int,
                           spec: SamplingSpec, deadline_s: float, seed: int,
                           on_done: OnDone) -> tuple[list[RequestSample], float]:
    """Open-loop Poisson arrivals -> (samples, elapsed seconds)."""
    t0 = time.perf_counter()
    samples: list[RequestSample] = []

    async def arrive(index: int, at: float) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        prompt = prompts[index % len(prompts)]
        sample = RequestSample(prompt.id, start_s=time.perf_counter() - t0)
        samples.append(sample)
        await _drive(client, prompt, request_spec(spec, index), sample, t0, on_done)

    offsets = [at for at in poisson_offsets(rate, num_requests, seed) if at < deadline_s]
    tasks = [asyncio.create_task(arrive(i, at)) for i, at in enumerate(offsets)]
    return samples, await _finish(tasks, samples, t0, deadline_s)


async def settled_counters(client, timeout_s: float = 30.0, poll_s: float = 0.05) -> ServerCounters:
    """The engine's counters once it holds no running or queued request (so no
    request is counted both as running and as finished)."""
    deadline = time.perf_counter() + timeout_s
    counters = await client.counters()
    while not counters.idle and time.perf_counter() < deadline:
        await asyncio.sleep(poll_s)
        counters = await client.counters()
    return counters


# ---------------------------------------------------------------- summary
def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class LevelPoint:
    """One arm at one load level in one repeat."""

    arm: str
    pattern: str  # "closed" | "poisson"
    level: float  # closed: concurrency; poisson: offered requests/s
    repeat: int
    requests: int  # sent
    completed: int
    failed: int
    cut: int  # cancelled at the level's wall-time limit
    duration_s: float
    output_tokens: int  # generated in the window (engine counter)
    throughput: float  # aggregate output tokens/s
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tpot_mean_s: float | None
    tps_user_mean: float | None  # mean over finished requests of 1 / TPOT
    tps_user_p50: float | None
    rounds: int  # speculative rounds (one per decoding request per step)
    verify_length: float | None  # mean draft tokens verified per request per round
    verify_budget: float | None  # 1 + verify_length: tokens per request in one target forward
    acceptance_length: float | None  # tau: committed tokens per round
    achieved_rate: float  # finished requests/s
    drafted_steps: dict[str, int] = field(default_factory=dict)  # decode steps that drafted all/some/none requests
    # where the engine's time went: {kind: {"steps", "seconds", "positions", "forward_seconds"}} per step
    # kind (prefill, plain, drafted) and the seconds its loop waited idle; empty / None from an older
    # server ("forward_seconds", the target forward's part, absent before session 49)
    step_kinds: dict[str, dict[str, float]] = field(default_factory=dict)
    idle_s: float | None = None
    # interleaved arms (LoadSettings.interleave): the seconds of the arm's own engine steps, the clock
    # its throughput and request rate are measured on; None: the level's wall time
    busy_s: float | None = None
    errors: list[str] = field(default_factory=list)  # the first few distinct errors
    samples: list[dict] = field(default_factory=list)


def summarize(arm: str, pattern: str, level: float, repeat: int, samples: list[RequestSample],
              elapsed: float, before: ServerCounters, after: ServerCounters, own_clock: bool = False) -> LevelPoint:
    """One level's point; `own_clock` (interleaved arms) times throughput and the request rate on
    the seconds of the arm's own engine steps instead of the level's wall time."""
    ok = [s for s in samples if s.status == "ok"]
    ttft = [s.ttft_s for s in ok if s.ttft_s is not None]
    tpot = [s.tpot_s for s in ok if s.tpot_s is not None]
    tps = [s.tokens_per_s_user for s in ok if s.tokens_per_s_user is not None]
    tokens = after.generated_tokens - before.generated_tokens
    rounds = after.rounds - before.rounds
    verified = after.verified_draft_tokens - before.verified_draft_tokens
    committed = after.committed_tokens - before.committed_tokens
    verify_length = verified / rounds if rounds else None
    errors = list(dict.fromkeys(s.error for s in samples if s.error))[:3]
    step_kinds = {kind: {what: totals[what] - before.step_kinds[kind][what] for what in totals
                         if what in before.step_kinds[kind]}
                  for kind, totals in after.step_kinds.items() if kind in before.step_kinds}
    busy = sum(k["seconds"] for k in step_kinds.values()) if own_clock else None
    if own_clock and not step_kinds:
        raise UserError("interleaved arms are timed on their own engine steps, and this engine's metrics lack "
                        "the per-kind step counters; run the load generator and engine of one dspark version")
    clock = elapsed if busy is None else busy
    return LevelPoint(
        arm=arm, pattern=pattern, level=level, repeat=repeat, requests=len(samples), completed=len(ok),
        failed=sum(s.status == "failed" for s in samples), cut=sum(s.status == "cut" for s in samples),
        duration_s=elapsed, output_tokens=tokens, throughput=tokens / clock if clock > 0 else 0.0,
        ttft_mean_s=_mean(ttft), ttft_p50_s=_quantile(ttft, 0.5), ttft_p90_s=_quantile(ttft, 0.9),
        tpot_mean_s=_mean(tpot), tps_user_mean=_mean(tps), tps_user_p50=_quantile(tps, 0.5), rounds=rounds,
        verify_length=verify_length, verify_budget=None if verify_length is None else 1.0 + verify_length,
        acceptance_length=committed / rounds if rounds else None,
        achieved_rate=len(ok) / clock if clock > 0 else 0.0, errors=errors, busy_s=busy,
        drafted_steps={k: b - a for k, a, b in zip(DRAFTED_KINDS, before.drafted_steps, after.drafted_steps)},
        step_kinds=step_kinds,
        idle_s=None if None in (before.idle_seconds, after.idle_seconds) else after.idle_seconds - before.idle_seconds,
        samples=[s.as_dict() for s in samples],
    )

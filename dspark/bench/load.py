"""Serving load benchmark (paper 5.3-5.4, Figs 7 and 8): aggregate output
throughput against per-user speed and against concurrency, per arm.

    run_load_bench(arms, settings, ...) -> LoadReport   (`dspark bench serve`)

Arms (see `dspark.bench.arms`) run against running servers on 127.0.0.1
(`Arm.url`: streaming chat completions over HTTP) or in this process (one
target in memory, a fresh `Engine` + `AsyncEngine` per arm and level, no
HTTP). All arms run in the same process and sweep, interleaved: for every
repeat and load level each arm runs once, in an order shuffled per repeat and
level (`arm_order`), so drift of a shared machine, and whatever one arm leaves
behind for the next, hits every arm alike in expectation. Within a minute the
machine's speed can move by more than the effects in question (docs/LOAD.md,
session 47), so in-process runs can also interleave step by step
(`LoadSettings.interleave`, `--interleave`): the arms of a (repeat, level) run at
once, their engines taking steps in turn through one `Turnstile`, and each arm's
throughput is timed on its own steps (per-user speeds then include the other
arms' steps).

Load levels: a closed-loop concurrency sweep and open-loop Poisson arrival
rates. Prompts are the first user turns of the evaluation benchmarks
(`dspark/data/eval`, through the chat template), interleaved across
benchmarks; every arm replays the same prompts in the same order, greedy by
default, so lossless arms generate identical tokens and do identical work.
Each (arm, level) is bounded by a request count and a wall-time limit, and
no level starts after `max_seconds` of timed levels (so a run ends within
max_seconds + level_seconds + warm-up): levels left over are listed, not run.
Before the first timed level every arm runs once, untimed, at the largest
load (`_warm_up_pass`, at most level_seconds an arm), so no arm pays for the
process's first full batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from dspark.bench.arms import Arm
from dspark.bench.clients import BenchPrompt, ChatEncoder, EngineClient, HttpClient, RequestSample, SamplingSpec
from dspark.bench.load_report import LoadReport, environment
from dspark.bench.loadgen import LevelPoint, closed_loop, poisson_arrivals, settled_counters, summarize
from dspark.errors import UserError
from dspark.models.device import hardware_id

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class LoadSettings:
    """What a load run does. Every field is recorded in the JSON."""

    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY  # closed-loop levels (clients)
    rates: tuple[float, ...] = ()  # open-loop Poisson arrival rates (requests/s)
    requests_per_level: int | None = None  # None: closed requests_per_client x concurrency (>= 4); Poisson 20 s
    requests_per_client: int = 2  # closed loop, when requests_per_level is None
    level_seconds: float = 120.0  # wall-time limit of one (arm, level); running requests are cancelled
    max_seconds: float = 3600.0  # no level starts after this (a started one runs <= level_seconds); skipped ones are listed
    repeats: int = 1  # sweeps over every level and arm (>= 2 gives a noise estimate)
    sampling: SamplingSpec = SamplingSpec()
    bench: str = "all"  # benchmark prompt sets: all | math | code | chat | comma list of names
    max_prompt_chars: int = 2000  # skip longer first turns
    seed: int = 0  # prompt order and Poisson arrival times
    warmup_requests: int = 1  # short untimed requests per (arm, level) before timing
    warmup_pass: bool = True  # before the first timed level, each arm once at the largest load, untimed (`_warm_up_pass`)
    think_s: float = 0.0  # closed loop: mean seconds a client pauses before each request (exponential, seeded)
    # in-process: the arms of a (repeat, level) at once, their engines stepping in turn, each arm's
    # throughput timed on its own steps (`_measure_together`); per-user speeds then include the other
    # arms' steps
    interleave: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("concurrency", all(isinstance(c, int) and c >= 1 for c in self.concurrency), "integers >= 1"),
            ("rates", all(r > 0 for r in self.rates), "numbers > 0"),
            ("levels", bool(self.concurrency or self.rates), "at least one concurrency or rate"),
            ("requests_per_level", self.requests_per_level is None or self.requests_per_level >= 1, ">= 1"),
            ("requests_per_client", self.requests_per_client >= 1, ">= 1"),
            ("level_seconds", self.level_seconds > 0, "> 0"),
            ("max_seconds", self.max_seconds > 0, "> 0"),
            ("repeats", self.repeats >= 1, ">= 1"),
            ("max_prompt_chars", self.max_prompt_chars >= 1, ">= 1"),
            ("warmup_requests", self.warmup_requests >= 0, ">= 0"),
            ("think_s", self.think_s >= 0, ">= 0"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise UserError(f"load setting {name} is out of range; use {allowed}")

    def levels(self) -> list[tuple[str, float]]:
        return [("closed", c) for c in self.concurrency] + [("poisson", r) for r in self.rates]

    def num_requests(self, pattern: str, level: float) -> int:
        if self.requests_per_level is not None:
            return self.requests_per_level
        if pattern == "closed":
            return max(4, self.requests_per_client * int(level))
        return max(8, round(20 * level))  # about 20 s of arrivals

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_prompts(bench: str = "all", max_chars: int = 2000, seed: int = 0) -> list[BenchPrompt]:
    """First user turns of the benchmark prompts, shuffled within each benchmark
    (seeded) and interleaved across benchmarks."""
    from dspark.eval.benchmarks import load_suites

    rng = random.Random(seed)
    lanes = []
    for name, prompts in load_suites(bench).items():
        lane = [BenchPrompt(f"{name}/{p.id}", ({"role": "user", "content": p.turns[0]},))
                for p in prompts if len(p.turns[0]) <= max_chars]
        rng.shuffle(lane)
        lanes.append(lane)
    mixed = [p for group in itertools.zip_longest(*lanes) for p in group if p is not None]
    if not mixed:
        raise UserError(f"no benchmark prompt of --bench {bench!r} is at most {max_chars} characters; raise the limit")
    return mixed


# ---------------------------------------------------------------- backends
class HttpBackend:
    """One HTTP client per arm, each on its own running server."""

    def __init__(self, api_key: str | None = None) -> None:
        self.api_key = api_key
        self.clients: dict[str, HttpClient] = {}

    async def open(self, arm: Arm) -> HttpClient:
        if arm.name not in self.clients:
            client = HttpClient(arm.url, api_key=self.api_key)
            await client.connect()
            self.clients[arm.name] = client
        return self.clients[arm.name]

    async def release(self, arm: Arm, client) -> None:
        """Servers stay up between levels."""

    def describe(self, arm: Arm) -> dict:
        client = self.clients.get(arm.name)
        return {"url": arm.url, "model": None if client is None else client.model}

    async def aclose(self) -> None:
        for client in self.clients.values():
            await client.aclose()


class InProcessBackend:
    """One target in memory; a fresh engine per (arm, level), dropped after it."""

    def __init__(self, loaded, prompts: Sequence[BenchPrompt], sampling: SamplingSpec, max_running: int, *,
                 embedded: bool = False, engine_config=None, profile=None, home=None, turnstile=None) -> None:
        from dspark.engine.engine import EngineConfig

        if loaded.tokenizer is None:
            raise UserError(f"the target {loaded.name} has no tokenizer; the load benchmark needs its chat template")
        self.loaded, self.embedded, self.profile, self.home = loaded, embedded, profile, home
        self.turnstile = turnstile  # engines of interleaved arms take their steps in turn through it
        self.encoder = ChatEncoder(loaded.tokenizer)
        longest = max(len(self.encoder(p)) for p in prompts)
        seq = min(longest + sampling.max_new_tokens + 16, loaded.model.config.max_position_embeddings)
        self.engine_config = engine_config or EngineConfig(
            max_running=max_running, max_seq_len=seq, kv_budget_tokens=max_running * seq)
        self._drafters: dict[str, tuple[object, object]] = {}  # arm name -> (drafter, cost table or None)

    def _arm_parts(self, arm: Arm):
        if arm.name not in self._drafters:
            from dspark.draft.registry import load_drafter
            from dspark.engine.profile import ProfileSettings, profile_engine

            model, loaded = self.loaded.model, self.loaded
            drafter = load_drafter(arm.drafter, model, block_size=arm.block_size, embedded=self.embedded,
                                   bf16=arm.drafter_bf16)
            cost = None
            if arm.policy in ("dspark", "dspark-async"):
                settings = self.profile or ProfileSettings(max_requests=min(16, self.engine_config.max_running))
                cost = profile_engine(model, drafter, model_id=f"{loaded.name}@{loaded.path}",
                                      drafter_id=f"{arm.drafter}:{drafter.name}", settings=settings,
                                      tokenizer=loaded.tokenizer, home=self.home, progress=False).cost
            self._drafters[arm.name] = (drafter, cost)
        return self._drafters[arm.name]

    def _engine(self, arm: Arm):
        from dspark.engine.async_engine import AsyncEngine
        from dspark.engine.engine import Engine
        from dspark.schedule import make_policy

        drafter, cost = self._arm_parts(arm)
        options = arm.policy_options
        if arm.policy == "fixed" and options["k"] is None:
            options = {"k": drafter.block_size}
        policy = make_policy(arm.policy, cost, **options)  # fresh: a policy may keep state between steps
        engine = Engine(self.loaded.model, drafter, policy, self.engine_config, tokenizer=self.loaded.tokenizer)
        async_engine = AsyncEngine(engine, turnstile=self.turnstile)
        async_engine.start()
        return async_engine

    async def open(self, arm: Arm) -> EngineClient:
        async_engine = await asyncio.to_thread(self._engine, arm)
        return EngineClient(async_engine, self.encoder)

    async def release(self, arm: Arm, client: EngineClient) -> None:
        await client.aclose()

    def describe(self, arm: Arm) -> dict:
        if arm.name not in self._drafters:
            return {}
        drafter, cost = self._drafters[arm.name]
        return {"drafter_name": drafter.name, "block_size": drafter.block_size,
                "has_confidence": bool(getattr(drafter, "has_confidence", False)),
                "cost_table": None if cost is None else {
                    "forward": [list(point) for point in cost.forward.points()],  # [R, B, s]
                    "draft": [[r, s] for r, s in cost.draft.points()],
                    "project": None if cost.project is None else [[n, s] for n, s in cost.project.points()]}}

    async def aclose(self) -> None:
        """Engines are shut down after each level."""


# ------------------------------------------------------------------- sweep
@dataclass
class _Run:
    """State of one sweep."""

    settings: LoadSettings
    prompts: list[BenchPrompt]
    backend: object
    bar: tqdm
    deadline: float  # perf_counter time the run must end by
    points: list[LevelPoint] = dataclasses.field(default_factory=list)
    skipped: list[dict] = dataclasses.field(default_factory=list)


def _short(sampling: SamplingSpec) -> SamplingSpec:
    """The run's sampling with at most 8 new tokens: what the untimed warm-up requests ask."""
    return dataclasses.replace(sampling, max_new_tokens=min(8, sampling.max_new_tokens))


async def _warm_up(client, run: _Run) -> None:
    spec = _short(run.settings.sampling)
    for i in range(run.settings.warmup_requests):
        sample = RequestSample("warmup", 0.0)
        await client.generate(run.prompts[i % len(run.prompts)], spec, sample, time.perf_counter())


async def _warm_up_pass(arms: Sequence[Arm], run: _Run) -> None:
    """Each arm once, untimed, at the run's largest closed-loop concurrency (16 clients with
    Poisson rates only): that many clients, one short request each (8 new tokens).

    Whatever a process does the first time (growing the allocator's heap for a full batch's
    prefill and decode, touching fresh pages, the drafter's first projections and probes)
    otherwise lands in the first timed levels; and since the arm order of a (repeat, level)
    is a seeded shuffle, on the same arms, at the same arm. Measured (docs/LOAD.md, run AF;
    `python -m dspark.bench.order_bias`): over 36 earlier runs with repeats the first point
    ran at a median 0.963x of the same arm and level in its other repeats, every later point
    at 1.005x (in run AF the DSpark scheduler first, 55.5 tok/s against 62.1-62.6); with
    this pass (run AG) the first point was 1.027x."""
    s = run.settings
    clients = max([c for p, c in s.levels() if p == "closed"], default=16)
    spec = _short(s.sampling)
    for arm in arms:
        run.bar.set_postfix_str(f"{arm.name} warm-up pass, {clients} clients (untimed)")
        client = await run.backend.open(arm)
        try:
            await closed_loop(client, run.prompts, int(clients), int(clients), spec, s.level_seconds, lambda _: None)
        finally:
            await run.backend.release(arm, client)


async def _measure(client, arm: Arm, pattern: str, level: float, repeat: int, run: _Run) -> LevelPoint:
    await _warm_up(client, run)
    return await _timed(client, arm, pattern, level, repeat, run)


async def _measure_together(arms: Sequence[Arm], pattern: str, level: float, repeat: int, run: _Run) -> list[LevelPoint]:
    """`settings.interleave`: the arms of one (repeat, level) at once, each with its own clients and
    engine, the engines taking their steps in turn (`Turnstile`), so that a drift of the machine's
    speed slows every arm alike. Each arm's throughput is its tokens over its own steps' seconds
    (`busy_s`); the level's wall-time limit is scaled by the number of arms."""
    clients = []
    try:
        for arm in arms:
            clients.append(await run.backend.open(arm))
        await asyncio.gather(*(_warm_up(c, run) for c in clients))
        return list(await asyncio.gather(*(_timed(c, a, pattern, level, repeat, run, share=len(arms))
                                           for c, a in zip(clients, arms))))
    finally:
        for arm, client in zip(arms, clients):
            await run.backend.release(arm, client)


async def _timed(client, arm: Arm, pattern: str, level: float, repeat: int, run: _Run, share: int = 1) -> LevelPoint:
    s = run.settings
    before = await settled_counters(client)
    n = s.num_requests(pattern, level)
    limit = s.level_seconds * share
    run.bar.set_postfix_str(f"{arm.name} {pattern} {level:g} (repeat {repeat + 1}/{s.repeats})")
    done = lambda sample: run.bar.update(1)  # noqa: E731
    if pattern == "closed":
        samples, elapsed = await closed_loop(client, run.prompts, int(level), n, s.sampling, limit, done,
                                             think_s=s.think_s, seed=s.seed * 1_000_003 + repeat)
    else:
        seed = s.seed * 1_000_003 + int(level * 1000)  # same arrival times for every arm at this rate
        samples, elapsed = await poisson_arrivals(client, run.prompts, level, n, s.sampling, limit, seed, done)
    after = await settled_counters(client)
    run.bar.update(max(0, n - len(samples)))  # requests never sent (wall-time limit)
    return summarize(arm.name, pattern, level, repeat, samples, elapsed, before, after, own_clock=s.interleave)


def arm_order(arms: Sequence[Arm], repeat: int, level_index: int) -> list[Arm]:
    """The order the arms run in at one (repeat, level): a shuffle seeded by both. Over the
    repeats each arm runs at different positions and after different arms. A rotation keeps the
    cyclic order, so an arm would always follow the same arm, and whatever that one leaves
    behind (a heap grown by drafting, caches) would bias it the same way in every repeat."""
    order = list(arms)
    random.Random(f"arm order {repeat}/{level_index}").shuffle(order)
    return order


async def _sweep(arms: list[Arm], run: _Run) -> None:
    levels = run.settings.levels()
    try:
        if run.settings.warmup_pass:
            started = time.perf_counter()
            await _warm_up_pass(arms, run)
            run.deadline += time.perf_counter() - started  # max_seconds bounds the timed levels
        for repeat in range(run.settings.repeats):
            for index, (pattern, level) in enumerate(levels):
                order = arm_order(arms, repeat, index)
                if run.settings.interleave and time.perf_counter() < run.deadline:
                    run.bar.set_postfix_str(f"all arms {pattern} {level:g} (repeat {repeat + 1}/{run.settings.repeats})")
                    run.points.extend(await _measure_together(order, pattern, level, repeat, run))
                    continue
                for arm in order:
                    if time.perf_counter() >= run.deadline:
                        run.skipped.append({"arm": arm.name, "pattern": pattern, "level": level, "repeat": repeat,
                                            "reason": "the run's max_seconds was spent"})
                        run.bar.update(run.settings.num_requests(pattern, level))
                        continue
                    client = await run.backend.open(arm)
                    try:
                        run.points.append(await _measure(client, arm, pattern, level, repeat, run))
                    finally:
                        await run.backend.release(arm, client)
    finally:
        await run.backend.aclose()


def _check_arms(arms: Sequence[Arm]) -> None:
    if not arms:
        raise UserError("give at least one arm to benchmark")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise UserError(f"arm names must be unique, got {names}")
    if len({a.url is None for a in arms if a.pending is None}) > 1:
        raise UserError("mix of HTTP arms (URL) and in-process arms: benchmark one kind per run")


def _backend(runnable: list[Arm], prompts, settings: LoadSettings, *, target, home, dtype, cpu_kernels, device,
             loaded, engine_config, profile, api_key):
    if not runnable or runnable[0].url is not None:
        if settings.interleave:
            raise UserError("--interleave runs the arms' engines in this process, in turn; it cannot reach the "
                            "engines of HTTP servers: drop --interleave or benchmark in-process arms")
        return HttpBackend(api_key)
    if loaded is None:
        import torch

        from dspark.models import load_target

        if dtype not in ("float32", "bfloat16"):
            raise UserError(f"unknown dtype {dtype!r}; use float32 or bfloat16")
        loaded = load_target(target, home=home, dtype=getattr(torch, dtype), cpu_kernels=cpu_kernels, device=device)
    max_running = max(list(settings.concurrency) + [16 if settings.rates else 1])
    from dspark.engine.async_engine import Turnstile

    return InProcessBackend(loaded, prompts, settings.sampling, max_running, embedded=target is None,
                            engine_config=engine_config, profile=profile, home=home,
                            turnstile=Turnstile() if settings.interleave else None)


def run_load_bench(
    arms: Sequence[Arm],
    settings: LoadSettings = LoadSettings(),
    *,
    target: str | None = None,
    home: str | Path | None = None,
    dtype: str = "float32",
    cpu_kernels: bool = True,
    device: str = "cpu",
    loaded=None,
    engine_config=None,
    profile=None,
    api_key: str | None = None,
    out_dir: str | Path = "runs/load",
    name: str = "load",
    command: str | None = None,
    progress: bool = True,
) -> LoadReport:
    """Run every runnable arm at every level (interleaved), write `<out_dir>/<name>.json`
    and the figures `<name>_throughput_vs_tps.png` (Fig. 7 style),
    `<name>_vs_concurrency.png` (Fig. 8 style) and, with rates, `<name>_poisson.png`.

    In-process arms load `target` (None: the embedded model) once, or use
    `loaded` (a LoadedTarget already in memory); `engine_config` overrides the
    engine limits sized from the prompts, `profile` the SPS(B) profile settings
    of the DSpark schedulers (cached under `home`). HTTP arms need `api_key`
    when their servers were started with one. `command` is recorded as the
    command that produced the results.
    """
    _check_arms(arms)
    arms = list(arms)
    runnable = [a for a in arms if a.pending is None]
    prompts = load_prompts(settings.bench, settings.max_prompt_chars, settings.seed)
    started, env_before = time.perf_counter(), environment()
    backend = _backend(runnable, prompts, settings, target=target, home=home, dtype=dtype, cpu_kernels=cpu_kernels,
                       device=device, loaded=loaded, engine_config=engine_config, profile=profile, api_key=api_key)
    total = settings.repeats * len(runnable) * sum(settings.num_requests(p, lv) for p, lv in settings.levels())
    with tqdm(total=total, desc="load", unit="req", disable=not progress) as bar:
        run = _Run(settings, prompts, backend, bar, deadline=started + settings.max_seconds)
        if runnable:
            asyncio.run(_sweep(runnable, run))
    described = [{**a.as_dict(), **backend.describe(a)} for a in arms]
    if isinstance(backend, InProcessBackend):  # what the steps ran on (an HTTP run's servers say it themselves)
        env_before["device"] = hardware_id(next(backend.loaded.model.parameters()).device)
    report = LoadReport.build(
        mode="http" if isinstance(backend, HttpBackend) else "in-process", settings=settings.as_dict(),
        arms=described, points=run.points, skipped=run.skipped, command=command,
        environment={"before": env_before, "after": environment(), "wall_s": time.perf_counter() - started},
    )
    report.write(out_dir, name)
    if progress:
        print(report.markdown())
    return report

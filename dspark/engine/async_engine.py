"""The engine's step loop in one background thread, for asyncio callers.

The `Engine` is single-threaded. `AsyncEngine` owns it from a loop thread and
talks to the rest of the process through two one-way channels:

    caller (any asyncio loop)  --commands-->  loop thread: add / cancel / stop
    loop thread  --call_soon_threadsafe-->    each request's asyncio.Queue

Commands are applied between steps, in order, so a cancel always follows the
add it refers to. `submit()` returns a `RequestStream`: `await
stream.accepted()` raises the engine's `UserError` for bad input, then
`async for out in stream` yields the request's `StepOutput`s (one per step
that committed tokens for it) until one has `finished`.

A step that raises fails the requests it was running (their streams raise
`RequestFailed`) and the loop carries on with the others. `shutdown()` stops
taking requests, optionally lets the running ones finish, aborts the rest and
joins the thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

from dspark.engine.engine import Engine, StepOutput
from dspark.engine.metrics import EngineGauges, RequestRecord, ServingMetrics
from dspark.errors import UserError
from dspark.types import SamplingParams, SpecStats

log = logging.getLogger("dspark.engine")


class RequestFailed(RuntimeError):
    """The engine raised while running this request; the request was dropped."""


class EngineStopped(UserError):
    """The engine is shut down (or shutting down) and takes no new requests."""


@dataclass
class RequestMetrics:
    """Timing and speculation stats of one finished request."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    ttft_s: float | None  # submit -> first committed token (None: no token)
    tpot_s: float | None  # mean seconds per output token after the first (None: < 2 tokens)
    latency_s: float  # submit -> finish
    stats: SpecStats


class RequestStream:
    """One request's outputs, as an async iterator of `StepOutput`."""

    def __init__(self, request_id: str, prompt_tokens: int, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.submit_time = time.perf_counter()
        self.metrics: RequestMetrics | None = None  # set when the final output arrives
        self._loop = loop
        self._accepted: asyncio.Future = loop.create_future()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False
        # loop-thread bookkeeping (touched only by the engine's thread)
        self.num_output = 0

    async def accepted(self) -> None:
        """Wait until the engine took the request; raises its UserError if it refused."""
        await asyncio.shield(self._accepted)

    @property
    def finished(self) -> bool:
        return self._done

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> StepOutput:
        if self._done:
            raise StopAsyncIteration
        await self.accepted()
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        out, metrics = item
        if out.finished:
            self._done = True
            self.metrics = metrics
        return out

    # ---- called from the engine thread -------------------------------------
    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass

    def _settle(self, error: BaseException | None) -> None:
        def settle() -> None:
            if self._accepted.done():
                return
            if error is None:
                self._accepted.set_result(None)
            else:
                self._accepted.set_exception(error)
                self._done = True

        self._call(settle)

    def _push(self, out: StepOutput, metrics: RequestMetrics | None) -> None:
        self._call(self._queue.put_nowait, (out, metrics))

    def _fail(self, error: BaseException) -> None:
        self._call(self._queue.put_nowait, error)


@dataclass
class _Add:
    stream: RequestStream
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class _Cancel:
    request_id: str


@dataclass
class _Stop:
    deadline: float  # perf_counter time after which running requests are aborted


class Turnstile:
    """Engines on one machine that take their steps one at a time, in turn (a ticket lock: a
    step waits for the steps asked for before it, so engines with work alternate, and one
    without work holds no one up). `dspark bench serve --interleave` runs its arms' engines
    through one, so that the machine's drift slows every arm alike (dspark.bench.load)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0  # the next ticket handed out
        self._serving = 0  # the ticket whose step may run

    @contextlib.contextmanager
    def turn(self):
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            while self._serving != ticket:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._serving += 1
                self._cond.notify_all()


class AsyncEngine:
    """Runs `engine.step()` in a background thread; see the module docstring. With a
    `turnstile`, each step waits for its turn among the engines sharing it (not timed)."""

    def __init__(self, engine: Engine, *, idle_poll_s: float = 0.05, turnstile: Turnstile | None = None) -> None:
        self.engine = engine
        self._turnstile = turnstile
        self.metrics = ServingMetrics(engine.drafter.block_size)
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # owned by the loop thread
        self._idle_poll_s = idle_poll_s
        self._thread: threading.Thread | None = None
        self._accepting = True
        self._stop: _Stop | None = None
        self._pending = 0  # submitted, not yet added (queue depth gauge; guarded by _ids_lock)
        self._ids = 0
        self._ids_lock = threading.Lock()
        self.dead: BaseException | None = None  # set if the loop itself crashed

    # ------------------------------------------------------------- control
    def start(self) -> None:
        """Start the loop thread (idempotent)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="dspark-engine", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def shutdown(self, drain_timeout_s: float = 0.0, join_timeout_s: float = 30.0) -> None:
        """Stop taking requests; let running ones finish for up to `drain_timeout_s`;
        abort the rest (their streams raise `EngineStopped`); join the thread."""
        self._accepting = False
        if self._thread is None:
            return
        self._commands.put(_Stop(deadline=time.perf_counter() + drain_timeout_s))
        self._thread.join(join_timeout_s)

    # ------------------------------------------------------------ requests
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue a request; call from a running asyncio loop. See `RequestStream`."""
        if not self._accepting or not self.is_alive:
            raise EngineStopped("the engine is not running (shut down or crashed); restart the server")
        loop = asyncio.get_running_loop()
        if request_id is None:
            with self._ids_lock:
                self._ids += 1
                request_id = f"async-{self._ids}"
        stream = RequestStream(request_id, len(prompt_ids), loop)
        with self._ids_lock:
            self._pending += 1
        self._commands.put(_Add(stream, list(prompt_ids), params))
        return stream

    def cancel(self, request_id: str) -> None:
        """Abort a request between steps and free its KV; a no-op once it finished. Thread-safe."""
        self._commands.put(_Cancel(request_id))

    # ---------------------------------------------------------- the loop
    def _run(self) -> None:
        try:
            while True:
                self._apply_commands(block=not self.engine.has_work())
                if self._stop is not None and (not self.engine.has_work() or time.perf_counter() >= self._stop.deadline):
                    break
                if self.engine.has_work():
                    self._step()
                self._publish_gauges()
        except BaseException as exc:  # a bug in the loop itself: fail everyone, stay dead
            log.exception("dspark engine loop crashed")
            self.dead = exc
            self._accepting = False
        finally:
            self._abort_all(EngineStopped("the engine shut down before this request finished"))
            self._publish_gauges()

    def _apply_commands(self, block: bool) -> None:
        start = time.perf_counter()
        try:
            cmd = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            if block:
                self.metrics.record_idle(time.perf_counter() - start)
            return
        if block:
            self.metrics.record_idle(time.perf_counter() - start)
        while True:
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd) -> None:
        if isinstance(cmd, _Add):
            with self._ids_lock:
                self._pending -= 1
            self._add(cmd)
        elif isinstance(cmd, _Cancel):
            self._cancel(cmd.request_id)
        elif isinstance(cmd, _Stop):
            self._stop = cmd

    def _add(self, cmd: _Add) -> None:
        stream = cmd.stream
        if self._stop is not None:
            stream._settle(EngineStopped("the engine is shutting down; retry on another server"))
            return
        try:
            rid = self.engine.add_request(cmd.prompt_ids, cmd.params, request_id=stream.request_id)
        except UserError as err:
            stream._settle(err)
            return
        except Exception as exc:  # not the user's fault: report, keep serving
            log.exception("adding request %s failed", stream.request_id)
            stream._settle(RequestFailed(f"the engine could not take the request: {exc}"))
            return
        self._streams[rid] = stream
        self.metrics.record_prompt(len(cmd.prompt_ids))
        stream._settle(None)

    def _cancel(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        req = self.engine.requests.get(request_id)
        if stream is None or req is None or req.finished:
            return
        self.engine.abort(request_id)
        self._finalize(stream, StepOutput(request_id, [], True, "abort"))

    def _step(self) -> None:
        steps_before = self.engine.num_steps
        with self._turnstile.turn() if self._turnstile is not None else contextlib.nullcontext():
            start = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:
                log.exception("engine step failed; failing its running requests")
                self.metrics.record_step_error()
                self._fail_running(exc)
                return
            seconds = time.perf_counter() - start
        if self.engine.num_steps > steps_before:
            self.metrics.record_step(seconds, self.engine.last_step_kind, self.engine.last_step_positions,
                                     self.engine.last_forward_seconds)
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: StepOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:  # a request someone added to the engine directly
            return
        stream.num_output += len(out.new_token_ids)
        self.metrics.record_generated(len(out.new_token_ids))
        if out.finished:
            self._finalize(stream, out)
        else:
            stream._push(out, None)

    def _finalize(self, stream: RequestStream, out: StepOutput, error: BaseException | None = None) -> None:
        """Pop a finished request from the engine, record its metrics, notify its stream."""
        self._streams.pop(stream.request_id, None)
        req = self.engine.pop_finished(stream.request_id)
        end = req.finish_time if req.finish_time is not None else time.perf_counter()
        first = req.first_token_time
        n = len(req.output_ids)
        metrics = RequestMetrics(
            request_id=stream.request_id,
            prompt_tokens=len(req.prompt_ids),
            output_tokens=n,
            finish_reason=out.finish_reason or req.finish_reason or "abort",
            ttft_s=None if first is None else max(0.0, first - stream.submit_time),
            tpot_s=(end - first) / (n - 1) if first is not None and n > 1 else None,
            latency_s=max(0.0, end - stream.submit_time),
            stats=req.stats,
        )
        self.metrics.record_finished(RequestRecord(
            metrics.prompt_tokens, metrics.output_tokens, metrics.finish_reason,
            metrics.ttft_s, metrics.tpot_s, metrics.latency_s, metrics.stats,
        ))
        if error is not None:
            stream._fail(error)
        else:
            stream._push(out, metrics)

    def _fail_running(self, exc: Exception) -> None:
        """After a failed step: drop the requests it ran (or, if none ran, the queued
        ones, so a request that breaks admission cannot wedge the loop)."""
        victims = [r.request_id for r in self.engine.batcher.running] or [
            r.request_id for r in self.engine.batcher.waiting
        ]
        error = RequestFailed(f"the engine failed while running this request ({type(exc).__name__}: {exc})")
        for rid in victims:
            self._drop(rid, error, "error")

    def _abort_all(self, error: BaseException) -> None:
        for rid in list(self._streams):
            self._drop(rid, error, "abort")

    def _drop(self, request_id: str, error: BaseException, reason: str) -> None:
        stream = self._streams.get(request_id)
        try:
            self.engine.abort(request_id)
        except Exception:  # the engine is in a bad state; still answer the caller
            log.exception("aborting %s failed", request_id)
        if stream is None:
            self.engine.requests.pop(request_id, None)
            return
        if request_id in self.engine.requests:
            self._finalize(stream, StepOutput(request_id, [], True, reason), error=error)
        else:
            self._streams.pop(request_id, None)
            stream._fail(error)

    def _publish_gauges(self) -> None:
        engine = self.engine
        live = SpecStats(block_size=max(engine.drafter.block_size, 1))
        for req in engine.batcher.running:
            live.merge(req.stats)
        for req in engine.batcher.waiting:  # preempted requests keep their stats
            live.merge(req.stats)
        self.metrics.set_gauges(EngineGauges(
            running=len(engine.batcher.running),
            waiting=len(engine.batcher.waiting),
            pending=max(self._pending, 0),
            kv_tokens_in_use=engine.kv.tokens_in_use(),
            kv_free_slots=engine.kv.num_free_slots,
            live_stats=live,
            drafted_steps=(engine.num_full_drafts, engine.num_partial_drafts, engine.num_draft_skips),
        ))

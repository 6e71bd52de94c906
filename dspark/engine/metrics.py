"""Serving metrics, exposed in the Prometheus text format (version 0.0.4).

`ServingMetrics` is fed by the async engine's loop thread (steps, finished
requests, a snapshot of the engine's gauges after every step) and rendered by
the server's `/metrics` endpoint from any thread; one lock guards it.

Speculation counters come from `SpecStats` (defined once in `dspark.types`):
the metrics aggregate the stats of every finished request plus a live
snapshot of the running ones, so they grow while long requests run and never
step back when a request finishes (its stats move from "live" to "finished").

Exposed families (all prefixed `dspark_`):

    requests_running, requests_waiting, queue_depth          gauges
    requests_finished_total{reason}, requests_aborted_total,
    requests_failed_total                                    counters
    prompt_tokens_total, generation_tokens_total             counters
    kv_tokens_in_use, kv_free_slots                          gauges
    step_seconds, step_errors_total                          histogram, counter
    engine_steps_total{kind}, engine_step_seconds_total{kind},
    engine_step_positions_total{kind},
    engine_step_forward_seconds_total{kind}                  counters, kind =
        prefill (a step with prompt chunks), plain (decoding only, no draft),
        drafted (decoding only, the drafter proposed for some requests)
    engine_idle_seconds_total                                counter: the loop
        waiting for requests with none to run
    time_to_first_token_seconds, time_per_output_token_seconds,
    request_latency_seconds                                  histograms
    spec_rounds_total, spec_verified_draft_tokens_total,
    spec_accepted_tokens_total, spec_committed_tokens_total  counters
    spec_acceptance_length (tau), spec_mean_verify_length    gauges
    spec_position_reached_total{position},
    spec_position_accepted_total{position}                   counters
    spec_position_acceptance_rate{position}                  gauge
    spec_predicted_accepted_total, spec_calibrated_accepted_total,
    spec_calibrated_rounds_total                             counters
    spec_calibration_error                                   gauge: mean
        (predicted - realised) accepted draft tokens per round
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from dspark.types import SpecStats

STEP_KINDS = ("prefill", "plain", "drafted")
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Histogram:
    """Cumulative-bucket histogram of non-negative observations (seconds)."""

    def __init__(self, buckets: Sequence[float]) -> None:
        if list(buckets) != sorted(set(buckets)):
            raise ValueError("histogram buckets must be strictly increasing")
        self.bounds = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip(self.bounds + (math.inf,), self.counts):
            running += n
            out.append((format_value(bound), running))
        return out


@dataclass
class RequestRecord:
    """What the metrics keep of one finished request."""

    prompt_tokens: int
    output_tokens: int
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    ttft_s: float | None  # submit -> first committed token
    tpot_s: float | None  # mean seconds per output token after the first
    latency_s: float  # submit -> finish
    stats: SpecStats


@dataclass
class EngineGauges:
    """The engine's state after a step, copied by the loop thread."""

    running: int = 0
    waiting: int = 0
    pending: int = 0  # submitted, not yet handed to the engine
    kv_tokens_in_use: int = 0
    kv_free_slots: int = 0
    live_stats: SpecStats | None = None  # merged stats of the running requests
    drafted_steps: tuple[int, int, int] = (0, 0, 0)  # steps with decoding requests: all, some, none drafted


@dataclass
class _Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0})
    aborted: int = 0
    failed: int = 0
    step_errors: int = 0
    idle_seconds: float = 0.0
    # per step kind (STEP_KINDS): [steps, seconds, target positions forwarded]
    # per kind: steps, seconds, target positions, seconds of the target forward
    step_kinds: dict[str, list] = field(default_factory=lambda: {k: [0, 0.0, 0, 0.0] for k in STEP_KINDS})


class ServingMetrics:
    """Thread-safe store of serving metrics; `render()` gives Prometheus text."""

    def __init__(self, block_size: int) -> None:
        self.block_size = max(int(block_size), 1)
        self._lock = threading.Lock()
        self._counters = _Counters()
        self._finished_stats = SpecStats(block_size=self.block_size)
        self._gauges = EngineGauges(live_stats=SpecStats(block_size=self.block_size))
        self._step = Histogram(STEP_BUCKETS)
        self._ttft = Histogram(LATENCY_BUCKETS)
        self._tpot = Histogram(STEP_BUCKETS)
        self._latency = Histogram(LATENCY_BUCKETS)

    # ------------------------------------------------------------- writers
    def record_step(self, seconds: float, kind: str | None = None, positions: int = 0,
                    forward_seconds: float = 0.0) -> None:
        """One engine step's wall time; `kind` (one of STEP_KINDS), the target positions it
        forwarded and its target forward's seconds add it to the per-kind totals, which say where a
        level's time went (and how much of a step is the forward, how much the rest)."""
        with self._lock:
            self._step.observe(seconds)
            if kind is not None:
                totals = self._counters.step_kinds[kind]
                totals[0] += 1
                totals[1] += seconds
                totals[2] += positions
                totals[3] += forward_seconds

    def record_idle(self, seconds: float) -> None:
        with self._lock:
            self._counters.idle_seconds += seconds

    def record_step_error(self) -> None:
        with self._lock:
            self._counters.step_errors += 1

    def record_prompt(self, num_tokens: int) -> None:
        with self._lock:
            self._counters.prompt_tokens += num_tokens

    def record_generated(self, num_tokens: int) -> None:
        with self._lock:
            self._counters.generation_tokens += num_tokens

    def record_finished(self, record: RequestRecord) -> None:
        with self._lock:
            c = self._counters
            if record.finish_reason == "abort":
                c.aborted += 1
            elif record.finish_reason == "error":
                c.failed += 1
            else:
                c.finished[record.finish_reason] = c.finished.get(record.finish_reason, 0) + 1
            self._finished_stats.merge(record.stats)
            if record.ttft_s is not None:
                self._ttft.observe(record.ttft_s)
            if record.tpot_s is not None:
                self._tpot.observe(record.tpot_s)
            self._latency.observe(record.latency_s)

    def set_gauges(self, gauges: EngineGauges) -> None:
        with self._lock:
            self._gauges = gauges

    # ------------------------------------------------------------- readers
    def spec_stats(self) -> SpecStats:
        """Finished requests' stats plus the running ones' (a copy)."""
        with self._lock:
            return self._total_stats()

    def _total_stats(self) -> SpecStats:
        total = SpecStats(block_size=self.block_size)
        total.merge(self._finished_stats)
        if self._gauges.live_stats is not None:
            total.merge(self._gauges.live_stats)
        return total

    def render(self) -> str:
        """All metrics in the Prometheus text exposition format."""
        with self._lock:
            out = _Writer()
            self._render_requests(out)
            self._render_timing(out)
            _render_spec(out, self._total_stats())
            return out.text()

    def _render_requests(self, out: "_Writer") -> None:
        g, c = self._gauges, self._counters
        out.gauge("requests_running", "Requests holding a KV slot (prefilling or decoding).", g.running)
        out.gauge("requests_waiting", "Requests queued in the engine without a KV slot.", g.waiting)
        out.gauge("queue_depth", "Requests not yet running: waiting in the engine plus not yet handed to it.",
                  g.waiting + g.pending)
        out.family("requests_finished_total", "counter", "Requests that finished normally, by finish reason.",
                   [({"reason": r}, n) for r, n in sorted(c.finished.items())])
        out.counter("requests_aborted_total", "Requests cancelled by the client or the server.", c.aborted)
        out.counter("requests_failed_total", "Requests failed by an engine error.", c.failed)
        out.counter("prompt_tokens_total", "Prompt tokens of accepted requests.", c.prompt_tokens)
        out.counter("generation_tokens_total", "Generated (committed, returned) tokens.", c.generation_tokens)
        out.gauge("kv_tokens_in_use", "Tokens held in the KV cache over all requests.", g.kv_tokens_in_use)
        out.gauge("kv_free_slots", "Free request slots in the KV cache.", g.kv_free_slots)
        out.family("decode_steps_total", "counter",
                   "Engine steps with decoding requests, by how many of them the policy drafted for.",
                   [({"drafted": k}, n) for k, n in zip(("all", "some", "none"), g.drafted_steps)])

    def _render_timing(self, out: "_Writer") -> None:
        out.histogram("step_seconds", "Wall time of one engine step (draft, schedule, verify, commit).", self._step)
        out.counter("step_errors_total", "Engine steps that raised (their running requests failed).",
                    self._counters.step_errors)
        kinds = self._counters.step_kinds
        out.family("engine_steps_total", "counter", "Engine steps by kind: prefill (with prompt chunks), plain "
                   "(decoding, no draft), drafted (decoding, the drafter proposed).",
                   [({"kind": k}, kinds[k][0]) for k in STEP_KINDS])
        out.family("engine_step_seconds_total", "counter", "Wall time of engine steps by kind.",
                   [({"kind": k}, kinds[k][1]) for k in STEP_KINDS])
        out.family("engine_step_positions_total", "counter",
                   "Target positions forwarded (prompt chunk, decode and verified draft tokens) by step kind.",
                   [({"kind": k}, kinds[k][2]) for k in STEP_KINDS])
        out.family("engine_step_forward_seconds_total", "counter",
                   "Wall time of engine steps' target forward by step kind (up to the first host read of its "
                   "logits; the rest of a step is batching, drafting, scheduling, verification and commit).",
                   [({"kind": k}, kinds[k][3]) for k in STEP_KINDS])
        out.counter("engine_idle_seconds_total", "Time the engine loop waited for requests with none to run.",
                    self._counters.idle_seconds)
        out.histogram("time_to_first_token_seconds", "Submit to first committed token, per request.", self._ttft)
        out.histogram("time_per_output_token_seconds", "Mean time per output token after the first, per request.",
                      self._tpot)
        out.histogram("request_latency_seconds", "Submit to finish, per request.", self._latency)


def _render_spec(out: "_Writer", s: SpecStats) -> None:
    out.counter("spec_rounds_total", "Speculative rounds (one per decoding request per step).", s.rounds)
    out.counter("spec_verified_draft_tokens_total", "Draft tokens sent to verification (sum of verify lengths).",
                s.draft_tokens)
    out.counter("spec_accepted_tokens_total", "Draft tokens accepted by verification.", s.accepted_tokens)
    out.counter("spec_committed_tokens_total", "Tokens committed by rounds (accepted + recovered/bonus).",
                s.committed_tokens)
    out.gauge("spec_acceptance_length", "Mean acceptance length tau: committed tokens per round.",
              s.mean_accepted_length if s.rounds else math.nan)
    out.gauge("spec_mean_verify_length", "Mean verify length per request per round (verification budget).",
              s.mean_verify_length if s.rounds else math.nan)
    positions = range(1, s.block_size + 1)
    out.family("spec_position_reached_total", "counter",
               "Rounds whose verified prefix reached position k with all earlier positions accepted.",
               [({"position": str(k)}, s.reached[k - 1]) for k in positions])
    out.family("spec_position_accepted_total", "counter", "Rounds where position k was reached and accepted.",
               [({"position": str(k)}, s.accepted_at[k - 1]) for k in positions])
    rates = s.per_position_acceptance
    out.family("spec_position_acceptance_rate", "gauge",
               "Conditional acceptance at position k given positions 1..k-1 accepted.",
               [({"position": str(k)}, math.nan if rates[k - 1] is None else rates[k - 1]) for k in positions])
    out.counter("spec_predicted_accepted_total", "Sum over rounds of predicted expected accepted draft tokens.",
                s.predicted_accepted)
    out.counter("spec_calibrated_accepted_total", "Realised accepted draft tokens in rounds with a prediction.",
                s.calibrated_accepted)
    out.counter("spec_calibrated_rounds_total", "Rounds with a confidence prediction.", s.calibrated_rounds)
    err = s.calibration_error
    out.gauge("spec_calibration_error", "Live calibration error: mean (predicted - realised) accepted draft "
              "tokens per round.", math.nan if err is None else err)


# ------------------------------------------------------------------ format
def format_value(value: float) -> str:
    """A sample value as Prometheus writes it (NaN, +Inf, -Inf, integers without '.0')."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape_label(v)}"' for k, v in labels.items()) + "}"


class _Writer:
    PREFIX = "dspark_"

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: list[tuple[dict[str, str], float]]) -> None:
        full = self.PREFIX + name
        self.lines.append(f"# HELP {full} {_escape_help(help_text)}")
        self.lines.append(f"# TYPE {full} {kind}")
        for labels, value in samples:
            self.lines.append(f"{full}{_labels(labels)} {format_value(value)}")

    def gauge(self, name: str, help_text: str, value: float) -> None:
        self.family(name, "gauge", help_text, [({}, value)])

    def counter(self, name: str, help_text: str, value: float) -> None:
        self.family(name, "counter", help_text, [({}, value)])

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        full = self.PREFIX + name
        self.lines.append(f"# HELP {full} {_escape_help(help_text)}")
        self.lines.append(f"# TYPE {full} histogram")
        for le, n in hist.cumulative():
            self.lines.append(f'{full}_bucket{{le="{le}"}} {n}')
        self.lines.append(f"{full}_sum {format_value(float(hist.total))}")
        self.lines.append(f"{full}_count {hist.count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

"""Analyses replayed from the recorded rounds of a fixed-length run (no model).

Static threshold sweep (paper Fig. 5): for threshold t, a round would have
verified l(t) = the longest prefix whose survival a_j = prod_{i<=j} c_i is
>= t (the `threshold` verify policy). Whether draft token j is accepted
depends only on tokens 1..j and the target, so the same round verified to
l(t) accepts min(a, l(t)) tokens, where a is what it accepted when the whole
block was verified. The sweep replays every round that way: it scores the
confidence head on the same rounds, as the paper's diagnostic does; it is not
a rerun (later rounds of a real threshold run would see other contexts).

Reliability (paper Fig. 6): at draft position k, over rounds that verified
position k, the predicted prefix survival a_k against the realised event
"tokens 1..k were all accepted". The recorded confidences are the drafter's
calibrated c_k = sigmoid(logit_k / T_k); the raw ones are recovered as
sigmoid(logit(c_k) * T_k) with the drafter's STS temperatures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dspark.eval.records import RoundRecord

DEFAULT_THRESHOLDS = tuple(round(0.1 * i, 1) for i in range(10))  # 0.0 .. 0.9


@dataclass(frozen=True)
class SweepPoint:
    threshold: float
    accepted_per_step: float  # accepted draft tokens per round
    rejected_per_step: float  # verified but not accepted draft tokens per round
    acceptance_rate: float | None  # accepted / verified; None when nothing was verified


def survival(confidences: list[float]) -> list[float]:
    out, a = [], 1.0
    for c in confidences:
        a *= c
        out.append(a)
    return out


def replay_length(record: RoundRecord, threshold: float) -> int:
    """Verify length the static-threshold policy would have picked."""
    length = 0
    for a in survival(record.confidences[: record.verify_len]):
        if a < threshold:
            break
        length += 1
    return length


def threshold_sweep(rounds: list[RoundRecord], thresholds=DEFAULT_THRESHOLDS) -> list[SweepPoint]:
    """Accepted/rejected draft tokens per round and acceptance rate at each threshold."""
    points = []
    n = max(len(rounds), 1)
    for t in thresholds:
        accepted = rejected = 0
        for r in rounds:
            length = replay_length(r, t)
            ok = min(r.num_accepted, length)
            accepted += ok
            rejected += length - ok
        verified = accepted + rejected
        points.append(SweepPoint(t, accepted / n, rejected / n, accepted / verified if verified else None))
    return points


def _logit(p: float) -> float:
    p = min(max(p, 1e-7), 1 - 1e-7)
    return math.log(p / (1 - p))


def uncalibrate(confidences: list[float], temperatures: list[float]) -> list[float]:
    """Raw c_k from calibrated c_k = sigmoid(logit_k / T_k)."""
    return [1.0 / (1.0 + math.exp(-_logit(c) * t)) for c, t in zip(confidences, temperatures)]


@dataclass
class ReliabilitySamples:
    position: int  # 1-based draft position
    before: list[float]  # raw predicted prefix survival
    after: list[float]  # calibrated predicted prefix survival
    observed: list[float]  # 1.0 when tokens 1..k were all accepted


def reliability_samples(rounds: list[RoundRecord], temperatures: list[float], position: int) -> ReliabilitySamples:
    """Samples at 1-based `position` from the rounds that verified it."""
    k = position - 1
    out = ReliabilitySamples(position, [], [], [])
    for r in rounds:
        if r.verify_len <= k or len(r.confidences) <= k:
            continue
        out.after.append(survival(r.confidences[: k + 1])[k])
        out.before.append(survival(uncalibrate(r.confidences[: k + 1], temperatures))[k])
        out.observed.append(1.0 if r.num_accepted > k else 0.0)
    return out

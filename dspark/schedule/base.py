"""Records and protocol shared by every verify-length policy.

A policy is a small state machine with two verbs, called by the engine once
per step: `decide` picks each request's verify length l_r in 0..num_drafted_r
from what is known before verification; `commit` receives the realised
outcomes. The engine never asks which policy is on.

Confidences: c_k is the drafter's calibrated estimate of P(draft token k is
accepted | tokens 1..k-1 accepted). The prefix survival probability of
position j is a_j = prod_{i<=j} c_i, and the expected number of accepted draft
tokens when verifying l of them is sum_{j<=l} a_j.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class ScheduleRequest:
    """One request as the scheduler sees it before verification.

    `confidences` may be longer than `num_drafted` (a padded [G] row of the
    proposal); only the first `num_drafted` entries are read.
    """

    request_id: Hashable  # the engine's request id (stable across steps)
    num_drafted: int  # draft tokens available: the largest verify length allowed
    confidences: Sequence[float] | None = None  # c_1..c_G, each in [0, 1]; None: drafter has none

    def __post_init__(self) -> None:
        if self.num_drafted < 0:
            raise ValueError(f"num_drafted must be >= 0, got {self.num_drafted} for {self.request_id!r}")
        if self.confidences is None:
            return
        if len(self.confidences) < self.num_drafted:
            raise ValueError(
                f"request {self.request_id!r}: {len(self.confidences)} confidences for "
                f"{self.num_drafted} draft tokens"
            )
        for c in self.confidences[: self.num_drafted]:
            if not (0.0 <= c <= 1.0):  # also rejects NaN
                raise ValueError(f"request {self.request_id!r}: confidence {c} is not in [0, 1]")


@dataclass(frozen=True)
class ScheduleOutcome:
    """What verification did with one request's scheduled prefix."""

    request_id: Hashable
    verify_len: int  # draft tokens sent to verification (the decided l_r)
    num_accepted: int  # draft tokens accepted, 0..verify_len

    def __post_init__(self) -> None:
        if not (0 <= self.num_accepted <= self.verify_len):
            raise ValueError(
                f"request {self.request_id!r}: num_accepted {self.num_accepted} "
                f"outside 0..verify_len {self.verify_len}"
            )


@dataclass(frozen=True)
class StepTiming:
    """One decode-only engine step as the engine timed it (no prompt chunk in it): what a policy
    that prices steps with a cost profile can check its prices against."""

    requests: int  # decoding requests in the step (R)
    drafted: int  # of them, requests that drafted (R'; 0: a plain decode step)
    budget: int  # tokens the target verified for them: R plus the verified draft tokens (B)
    seconds: float  # the whole step, wall clock
    projected_rows: int = 0  # pending context rows the drafting requests' propose processed first

    def __post_init__(self) -> None:
        if (not (0 <= self.drafted <= self.requests <= self.budget) or self.requests < 1 or not self.seconds > 0
                or self.projected_rows < 0):
            raise ValueError(f"inconsistent step timing {self}")


@runtime_checkable
class VerifyPolicy(Protocol):
    """Chooses verify lengths; the engine calls decide, verifies, then commit."""

    name: str

    def decide(self, requests: list[ScheduleRequest]) -> list[int]:
        """Verify length l_r in 0..requests[r].num_drafted for each request, in order."""
        ...

    def commit(self, outcomes: list[ScheduleOutcome]) -> None:
        """Realised accepted counts of the last verification (stateful policies learn here)."""
        ...


def survival(request: ScheduleRequest) -> list[float]:
    """Prefix survival probabilities a_1..a_l of a request (l = num_drafted).

    Non-increasing in j, exactly so in floating point: multiplying by c <= 1
    never rounds upward past the previous product.
    """
    if request.confidences is None:
        raise ValueError(f"request {request.request_id!r} has no confidences")
    out: list[float] = []
    a = 1.0
    for c in request.confidences[: request.num_drafted]:
        a *= float(c)
        out.append(a)
    return out


def expected_accepted(confidences: Sequence[float], verify_len: int) -> float:
    """Expected accepted draft tokens when verifying the first `verify_len`
    tokens: sum_{j<=l} prod_{i<=j} c_i (the live calibration prediction)."""
    if verify_len < 0 or verify_len > len(confidences):
        raise ValueError(f"verify_len {verify_len} outside 0..{len(confidences)}")
    total, a = 0.0, 1.0
    for c in confidences[:verify_len]:
        a *= float(c)
        total += a
    if not math.isfinite(total):
        raise ValueError(f"confidences {list(confidences)} give a non-finite expectation")
    return total

"""Verify-length policies and the registry that builds them by name.

Every policy implements `VerifyPolicy` (decide, then commit). The simple ones
live here; the hardware-aware prefix schedulers live in `prefix.py`.

| name            | policy                        | needs                      |
|-----------------|-------------------------------|----------------------------|
| `none`          | NoSpeculation                 |                            |
| `fixed`         | FixedLength(k)                | option k                   |
| `threshold`     | StaticThreshold(threshold)    | option threshold, c_k      |
| `dspark`        | PrefixScheduler (Algorithm 1) | cost table, c_k            |
| `dspark-async`  | AsyncPrefixScheduler (5.2)    | cost table, c_k            |
| `retrospective` | negative control (tests only) | cost table, c_k            |

Policies that need confidences verify every drafted token of a request whose
confidences are None (the FixedLength(num_drafted) fallback).
"""

from __future__ import annotations

from collections.abc import Callable

from dspark.errors import UserError
from dspark.schedule.base import ScheduleOutcome, ScheduleRequest, VerifyPolicy, survival
from dspark.schedule.cost import CostTable
from dspark.schedule.prefix import AsyncPrefixScheduler, PrefixScheduler, RetrospectivePrefixScheduler


class NoSpeculation:
    """Verify nothing: plain autoregressive decoding through the same loop."""

    name = "none"

    def choose_drafts(self, request_ids, pending_rows=None) -> list[bool]:
        """Nothing is ever verified, so nothing is drafted."""
        return [False] * len(request_ids)

    def decide(self, requests: list[ScheduleRequest]) -> list[int]:
        return [0 for _ in requests]

    def commit(self, outcomes: list[ScheduleOutcome]) -> None:
        """Stateless."""


class FixedLength:
    """Verify min(k, num_drafted) tokens of every request (MTP-1 is k = 1)."""

    name = "fixed"

    def __init__(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise UserError(f"fixed verify length k must be an integer >= 0, got {k!r}")
        self.k = k

    def decide(self, requests: list[ScheduleRequest]) -> list[int]:
        return [min(self.k, q.num_drafted) for q in requests]

    def commit(self, outcomes: list[ScheduleOutcome]) -> None:
        """Stateless."""


class StaticThreshold:
    """Verify the longest prefix whose survival a_j = prod_{i<=j} c_i is >= threshold.

    The cumulative survival (not the per-token c_j) is thresholded: it is the
    probability that token j is accepted at all, and because it never rises
    with j the verified set is always a prefix. threshold 0 verifies every
    drafted token; threshold 1 only tokens with c = 1. Requests without
    confidences verify all drafted tokens (FixedLength fallback).
    """

    name = "threshold"

    def __init__(self, threshold: float) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not (0.0 <= threshold <= 1.0):
            raise UserError(f"threshold must be a number in [0, 1], got {threshold!r}")
        self.threshold = float(threshold)

    def decide(self, requests: list[ScheduleRequest]) -> list[int]:
        return [self._length(q) for q in requests]

    def _length(self, request: ScheduleRequest) -> int:
        if request.confidences is None:
            return request.num_drafted
        length = 0
        for a in survival(request):
            if a < self.threshold:
                break
            length += 1
        return length

    def commit(self, outcomes: list[ScheduleOutcome]) -> None:
        """Stateless."""


def _needs_cost(name: str, cost: CostTable | None) -> CostTable:
    if cost is None:
        raise UserError(f"verify policy {name!r} needs an SPS cost table; profile the engine first or pick 'fixed'")
    return cost


def _probe_max(options: dict) -> int | None:
    """A scheduler's `probe_max` option: the longest interval, in steps of one load class, the gate's
    probes back off to while they find nothing worth drafting (`DraftGate.max_probe_every`; default
    None: 4 x its base interval of 32)."""
    value = options.get("probe_max")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 32):
        raise UserError(f"probe_max must be an integer >= 32 (the gate's base probe interval), got {value!r}")
    return value


def _switch(options: dict, name: str, default: str) -> bool:
    """A scheduler's on/off gate option: `pending` (default on) prices the context rows a draft
    must process first (`DraftGate`; off: as the gate was before docs/LOAD.md run BH), `choices`
    (default off, run BP) scales the curves the gate chooses on by how its own choices fared."""
    value = options.get(name, default)
    if value not in ("on", "off"):
        raise UserError(f"{name} must be 'on' or 'off', got {value!r}")
    return value == "on"


# name -> (allowed options, factory(cost, options))
_REGISTRY: dict[str, tuple[frozenset[str], Callable[[CostTable | None, dict], VerifyPolicy]]] = {
    "none": (frozenset(), lambda cost, o: NoSpeculation()),
    "fixed": (frozenset({"k"}), lambda cost, o: FixedLength(o["k"])),
    "threshold": (frozenset({"threshold"}), lambda cost, o: StaticThreshold(o["threshold"])),
    "dspark": (frozenset({"pending", "choices", "probe_max"}),
               lambda cost, o: PrefixScheduler(_needs_cost("dspark", cost), price_pending=_switch(o, "pending", "on"),
                                               choices=_switch(o, "choices", "off"), max_probe_every=_probe_max(o))),
    "dspark-async": (
        frozenset({"lag", "pending", "choices", "probe_max"}),
        lambda cost, o: AsyncPrefixScheduler(_needs_cost("dspark-async", cost), lag=o.get("lag", 2),
                                             price_pending=_switch(o, "pending", "on"),
                                             choices=_switch(o, "choices", "off"), max_probe_every=_probe_max(o)),
    ),
    "retrospective": (frozenset(), lambda cost, o: RetrospectivePrefixScheduler(_needs_cost("retrospective", cost))),
}
_REQUIRED = {"fixed": ("k",), "threshold": ("threshold",)}

POLICY_NAMES: tuple[str, ...] = tuple(_REGISTRY)


def make_policy(name: str, cost: CostTable | None = None, **options: object) -> VerifyPolicy:
    """Build a verify-length policy by name (see the module table).

    'retrospective' is a biased negative control for tests, never for serving.
    """
    if name not in _REGISTRY:
        raise UserError(f"unknown verify policy {name!r}; choose one of: {', '.join(POLICY_NAMES)}")
    allowed, factory = _REGISTRY[name]
    unknown = sorted(set(options) - allowed)
    if unknown:
        valid = ", ".join(sorted(allowed)) or "none"
        raise UserError(f"verify policy {name!r} does not take option(s) {', '.join(unknown)}; valid options: {valid}")
    missing = [o for o in _REQUIRED.get(name, ()) if o not in options]
    if missing:
        raise UserError(f"verify policy {name!r} needs option(s) {', '.join(missing)}")
    lag = options.get("lag", 2)
    if name == "dspark-async" and (isinstance(lag, bool) or not isinstance(lag, int) or lag < 1):
        raise UserError(f"dspark-async lag must be an integer >= 1, got {lag!r}")
    return factory(cost, dict(options))


__all__ = [
    "NoSpeculation",
    "FixedLength",
    "StaticThreshold",
    "PrefixScheduler",
    "AsyncPrefixScheduler",
    "RetrospectivePrefixScheduler",
    "POLICY_NAMES",
    "make_policy",
]

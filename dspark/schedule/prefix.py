"""Hardware-aware prefix schedulers (paper section 3.2.2, Algorithm 1; section 5.2).

All three share one picture. Every drafted position j of request r is a
candidate (r, j) worth a_{r,j} = prod_{i<=j} c_{r,i} expected accepted tokens.
Sort the candidates with a > 0 by a, descending; admitting the first n of
them gives the most expected accepts any n draft tokens can give, so the
throughput objective Theta = tau * SPS(B) (tau = R + sum of admitted a, B = R
+ n) only has to be searched along this one *admission path*.

Ties are broken by position j, then by request index r. Because a_{r,j+1} =
a_{r,j} * c_{r,j+1} <= a_{r,j} (exactly, in floating point), (r, j) always
precedes (r, j+1), so every prefix of the path is a set of per-request
prefixes, and the rank of (r, j) on the path never depends on a_{r,j+1} or
later values. Losslessness rests on that.

Why order matters for losslessness: with a Markov confidence head, c_{r,j+1}
is computed from the sampled draft token x_{r,j}. The event "x_{r,j} is
verified" (l_r >= j) must be decided without looking at x_{r,j}, i.e. from
a_{r,1..j} and other requests only (Appendix A shows the output distribution
shifts otherwise).

Requests without confidences verify all their drafted tokens (FixedLength
fallback): those tokens are counted in B, and in tau only as the one token
every request commits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from dspark.schedule.base import ScheduleOutcome, ScheduleRequest, StepTiming, survival
from dspark.schedule.cost import CostTable, SplitCost, curve_for
from dspark.schedule.gate import DraftGate

Candidate = tuple[int, int, float]  # (request index r, position j >= 1, survival a_{r,j})


def ranked_candidates(survivals: Sequence[Sequence[float]]) -> list[Candidate]:
    """The admission path: (r, j, a_{r,j}) for every a > 0, by a descending,
    ties by position j then request index r (so (r, j) precedes (r, j+1))."""
    cands = [(r, j, a) for r, surv in enumerate(survivals) for j, a in enumerate(surv, start=1) if a > 0.0]
    cands.sort(key=lambda c: (-c[2], c[1], c[0]))
    return cands


def greedy_walk(cands: Sequence[Candidate], cost, base_tokens: int, base_accepts: float, early_stop: bool) -> int:
    """Walk the admission path; return how many leading candidates to admit.

    Algorithm 1, lines 5-15: B and tau start at the base (R tokens, R
    accepts), Theta_best = tau * SPS(B). Each candidate adds 1 to B and a to
    tau; a strictly better Theta becomes the best. With `early_stop` the walk
    breaks at the first candidate with Theta <= Theta_best, so the best is
    always the last admitted one; without it the argmax over the whole path
    is returned (first one on ties).
    """
    budget, tau = base_tokens, float(base_accepts)
    best_theta, best_n = tau * cost.sps(budget), 0
    for n, (_, _, a) in enumerate(cands, start=1):
        budget += 1
        tau += a
        theta = tau * cost.sps(budget)
        if theta > best_theta:
            best_theta, best_n = theta, n
        elif early_stop:
            break
    return best_n


@dataclass
class _Batch:
    """Requests split into scheduled ones (with confidences) and pinned ones (without)."""

    survivals: list[list[float]]  # a_{r,1..num_drafted}; empty for pinned requests
    pinned: list[int | None]  # verify length of requests without confidences, else None

    @classmethod
    def of(cls, requests: Sequence[ScheduleRequest]) -> "_Batch":
        survivals = [survival(q) if q.confidences is not None else [] for q in requests]
        pinned = [q.num_drafted if q.confidences is None else None for q in requests]
        return cls(survivals, pinned)

    @property
    def base_tokens(self) -> int:
        """B before any candidate: one token per request plus pinned draft tokens."""
        return len(self.pinned) + sum(p for p in self.pinned if p is not None)

    def lengths(self, admitted: Sequence[Candidate]) -> list[int]:
        lengths = [p if p is not None else 0 for p in self.pinned]
        for r, j, _ in admitted:
            assert lengths[r] == j - 1, "admission path broke prefix order"
            lengths[r] = j
        return lengths


class PrefixScheduler:
    """Algorithm 1 of the paper, exactly: the causal, lossless prefix scheduler.

    Sort candidates (r, j) with a_{r,j} > 0 by a descending (ties: j, then r);
    start from B = R, tau = R, Theta_best = R * SPS(R); admit candidates in
    order while Theta = tau * SPS(B) strictly improves, and stop at the first
    candidate where Theta <= Theta_best.

    Why it is lossless: the walk admits (r, j) only if every candidate before
    it on the path was admitted and Theta improved at (r, j). The candidates
    before (r, j) are those ranked above it: other requests' candidates
    (independent of request r's draft tokens) and r's own earlier positions
    (a_{r,1..j-1}); r's later positions always rank after (r, j). So the event
    l_r >= j is a function of a_{r,1..j} and other requests, never of
    a_{r,j+1} = a_{r,j} * c_{r,j+1}, the first quantity that sees x_{r,j}.
    Early stopping is what makes this true: a walk that looked further
    (RetrospectivePrefixScheduler) would let a_{r,j+1} decide l_r >= j.

    Optimality: the result maximises Theta over all (l_1..l_R) iff Theta is
    unimodal along the path (e.g. time per step affine in B).

    Requests without confidences verify all drafted tokens (FixedLength fallback).

    With a `SplitCost` (target forward F(B) and drafting D(R) measured apart)
    the walk uses SPS(B) = 1 / (F(R, B) + D(R')) for a step of R requests of which R' drafted,
    and `choose_drafts` tells the engine, before drafting, which requests to
    draft at all: none when even the best drafted step would be slower than a
    plain decode step, or only those whose past curves pay for their drafting
    (`DraftGate`). With a single `CostTable` every request drafts every step.
    """

    name = "dspark"

    def __init__(self, cost: CostTable | SplitCost, price_pending: bool = True, choices: bool = False,
                 max_probe_every: int | None = None) -> None:
        self.cost = cost
        self.gate = (DraftGate(cost, price_pending=price_pending, choices=choices, max_probe_every=max_probe_every)
                     if isinstance(cost, SplitCost) else None)

    def choose_drafts(self, request_ids: Sequence[Hashable], pending_rows: Sequence[int] | None = None) -> list[bool]:
        """Before drafting: which requests draft this step? (past confidences only; `pending_rows`:
        the context rows each one's propose would process first, see `DraftGate.choose`)"""
        return [True] * len(request_ids) if self.gate is None else self.gate.choose(request_ids, pending_rows)

    def decide(self, requests: list[ScheduleRequest]) -> list[int]:
        if not requests:
            return []
        if self.gate is not None:
            self.gate.record(requests)
        if not any(q.num_drafted for q in requests):
            return [0] * len(requests)  # a plain step (most steps at high load): nothing to walk
        batch = _Batch.of(requests)
        cands = ranked_candidates(batch.survivals)
        curve = curve_for(self.cost, _drafted(q.num_drafted for q in requests), len(requests))
        n = greedy_walk(cands, curve, batch.base_tokens, len(requests), early_stop=True)
        return batch.lengths(cands[:n])

    def commit(self, outcomes: list[ScheduleOutcome]) -> None:
        """Algorithm 1 is stateless; the draft gate compares outcomes with the curves."""
        if self.gate is not None:
            self.gate.observe_outcomes(outcomes)

    def observe_step(self, timing: StepTiming) -> None:
        """A decode-only step's wall time, for the draft gate's cost ratios."""
        if self.gate is not None:
            self.gate.observe_step(timing)


class RetrospectivePrefixScheduler(PrefixScheduler):
    """NEGATIVE CONTROL, NOT FOR SERVING: Algorithm 1 without the early stop.

    It takes the argmax of Theta over the whole admission path, so whether
    x_{r,j} is verified can depend on a_{r,j+1}, which a Markov confidence
    head computes from x_{r,j} itself: selection bias, not lossless (paper
    Appendix A). It exists so the losslessness tests can show they catch it.
    """

    name = "retrospective"

    def decide(self, requests: list[ScheduleRequest]) -> list[int]:
        if not requests:
            return []
        batch = _Batch.of(requests)
        cands = ranked_candidates(batch.survivals)
        curve = curve_for(self.cost, _drafted(q.num_drafted for q in requests), len(requests))
        n = greedy_walk(cands, curve, batch.base_tokens, len(requests), early_stop=False)
        return batch.lengths(cands[:n])


class AsyncPrefixScheduler:
    """The asynchronous prefix scheduler of paper section 5.2.

    Step t admits the top K candidates of its *current* admission path
    (current confidences, same ranking and tie rule as Algorithm 1). The
    capacity K comes from an unconstrained global search (argmax of Theta over
    the whole path, no early stop, so jagged SPS cliffs cannot trap it) over
    the confidences the requests had two decide() calls earlier, which a
    zero-overhead-scheduling engine knows before step t's drafts exist.

    Why it is lossless: K is a function of step t-2 information only, so it
    is independent of the current draft tokens; and (r, j) is verified iff
    its rank on the current path is < K, where its rank depends only on
    a_{r,1..j} and other requests (r's later positions rank after it). So
    l_r >= j never depends on x_{r,j} or later tokens.

    Batch changes: the search uses the current batch's load (B starts at the
    current R plus pinned tokens) and, for each current request, the survival
    curve it had two calls ago, truncated to its current num_drafted. A
    request that had no snapshot then (it joined since) stands in with the
    mean historical survival curve; requests that left are dropped. K is then
    clipped to the number of current candidates. With no usable history (the
    first two calls, or no confidences two calls ago) the causal
    PrefixScheduler decides instead; it is lossless too.

    Requests without confidences verify all drafted tokens (FixedLength fallback).
    """

    name = "dspark-async"

    def __init__(self, cost: CostTable | SplitCost, lag: int = 2, price_pending: bool = True,
                 choices: bool = False, max_probe_every: int | None = None) -> None:
        if lag < 1:
            raise ValueError(f"lag must be >= 1, got {lag}")
        self.cost = cost
        self.lag = lag
        self._history: deque[list[ScheduleRequest]] = deque(maxlen=lag)
        self._causal = PrefixScheduler(cost)
        self.last_capacity: int | None = None  # K of the last decide before clipping (None: causal fallback, or nothing drafted)
        self.gate = (DraftGate(cost, would_verify=self.would_verify, price_pending=price_pending, choices=choices,
                           max_probe_every=max_probe_every) if isinstance(cost, SplitCost) else None)

    def reset(self) -> None:
        """Forget the history (e.g. after the engine drains)."""
        self._history.clear()
        self.last_capacity = None

    def choose_drafts(self, request_ids: Sequence[Hashable], pending_rows: Sequence[int] | None = None) -> list[bool]:
        """Before drafting: which requests draft this step? (see PrefixScheduler.choose_drafts)"""
        return [True] * len(request_ids) if self.gate is None else self.gate.choose(request_ids, pending_rows)

    def would_verify(self, ids: Sequence[Hashable], curves: Sequence[Sequence[float]], chosen: Sequence[bool]) -> bool:
        """The draft gate's veto under this scheduler: would the next `decide` verify any token if
        the `chosen` requests of `ids` drafted, with these (stale) survival curves standing in for
        the confidences they will have? That decide reads its capacity off the snapshot `lag`
        calls back when it has confidences (its whole-path search), and otherwise falls back to
        Algorithm 1 (early stop); so does the veto. Between the gate's choice and that decide
        no other decide runs, so the snapshot is the same one. Under load most steps draft no
        one, so the snapshot seldom has confidences: run AF (docs/LOAD.md) saw the gate,
        vetoing as if the whole-path search decided, draft 31 of 32 requests that the fallback
        then verified nothing of."""
        past = self._history[0] if len(self._history) == self.lag else None
        if past is not None:
            capacity = self._capacity(past, [(i, len(c), True) if draft else (i, 0, False)
                                             for i, c, draft in zip(ids, curves, chosen)])
            if capacity is not None:
                return capacity > 0
        return self.gate.verified_any(curves, chosen)

    def decide(self, requests: list[ScheduleRequest]) -> list[int]:
        if self.gate is not None and requests:
            self.gate.record(requests)
        past = self._history[0] if len(self._history) == self.lag else None
        self._history.append(list(requests))
        if not requests or not any(q.num_drafted for q in requests):
            self.last_capacity = None  # nothing drafted (a plain step): no capacity to search for
            return [0] * len(requests)
        capacity = self.capacity(past, requests) if past is not None else None
        self.last_capacity = capacity
        if capacity is None:
            return self._causal.decide(requests)
        batch = _Batch.of(requests)
        cands = ranked_candidates(batch.survivals)
        return batch.lengths(cands[:capacity])

    def capacity(self, past: Sequence[ScheduleRequest], requests: Sequence[ScheduleRequest]) -> int | None:
        """K for `requests` from the snapshot `past`; None when `past` has no confidences.

        Reads only `past` and the current requests' ids, num_drafted and
        whether they have confidences, never the current confidences.
        """
        return self._capacity(past, [(q.request_id, q.num_drafted, q.confidences is not None) for q in requests])

    def _capacity(self, past: Sequence[ScheduleRequest], current: Sequence[tuple[Hashable, int, bool]]) -> int | None:
        """`capacity` for current requests given as (request id, num_drafted, has confidences)."""
        by_id: dict[Hashable, list[float]] = {q.request_id: survival(q) for q in past if q.confidences is not None}
        if not by_id:
            return None
        proxy = _mean_curve(list(by_id.values()))
        pinned_tokens = 0
        historical: list[list[float]] = []
        for request_id, num_drafted, has_confidences in current:
            if not has_confidences:
                pinned_tokens += num_drafted
                historical.append([])
            else:
                historical.append(by_id.get(request_id, proxy)[:num_drafted])
        cands = ranked_candidates(historical)
        curve = curve_for(self.cost, _drafted(n for _, n, _ in current), len(current))
        return greedy_walk(cands, curve, len(current) + pinned_tokens, len(current), early_stop=False)

    def commit(self, outcomes: list[ScheduleOutcome]) -> None:
        """History is recorded in decide (it must not wait for verification); the draft gate
        compares outcomes with the curves."""
        if self.gate is not None:
            self.gate.observe_outcomes(outcomes)

    def observe_step(self, timing: StepTiming) -> None:
        """A decode-only step's wall time, for the draft gate's cost ratios."""
        if self.gate is not None:
            self.gate.observe_step(timing)


def _drafted(num_drafted: Iterable[int]) -> int:
    """R' of the drafting cost D(R'), from each request's num_drafted: the requests that drafted
    this step (the engine may draft only some of them, `DraftGate`); at least 1, the smallest
    batch D was measured for."""
    return max(1, sum(n > 0 for n in num_drafted))


def _mean_curve(curves: Sequence[Sequence[float]]) -> list[float]:
    """Position-wise mean of survival curves over the curves that reach each
    position, kept non-increasing (a survival curve never rises)."""
    longest = max((len(c) for c in curves), default=0)
    out: list[float] = []
    for j in range(longest):
        values = [c[j] for c in curves if len(c) > j]
        mean = sum(values) / len(values)
        out.append(min(mean, out[-1]) if out else mean)
    return out

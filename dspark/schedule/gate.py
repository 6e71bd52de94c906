"""Whom to draft: the decision the prefix schedulers make before drafting.

Algorithm 1 chooses verify lengths after the drafts exist, so it treats the
drafting cost as paid. Where drafting is cheap (a GPU: a few percent of a
step) that is harmless. On a CPU one batched `propose` costs 20-40 % of a
round, and a step whose every verify length comes out 0 is a plain decode
step plus that cost: a speculative engine that always drafts loses to no
speculation whenever the drafts are poor or the batch is large.

`DraftGate` decides before drafting, from each request's survival curve of
its last drafted round (the same kind of stale information the asynchronous
scheduler of section 5.2 plans with), with the split step cost
F(B) + D(R) (`SplitCost`). It walks the admission path of those curves
(Algorithm 1's ranking) and prices each prefix of it as a step that drafts
only the requests the prefix reaches:

    rate(n) = (R + a_1 + ... + a_n) / (F(R, R + n) + D(requests among the first n))
    rate(0) = R / F(R, R)                              (one plain decode step)

and drafts the requests of the best prefix: everyone, no one, or the few
whose curves pay for their drafting (a code request copying its prompt
beside chat requests that would not).

Lossless: the choice reads only past confidences and request ids, never
the current draft tokens, so an undrafted request takes a plain decode step
chosen independently of what would have been drafted for it.

Calibration drift: the curves come from the confidence head, calibrated
offline. The gate compares what they promised with what the verifier
accepted on recent drafted rounds (decayed sums) and scales the curves by
realised / predicted, so an over-confident head stops opening the gate.

Cost drift: the profile prices a step on synthetic batches, measured once; a serving step can
cost otherwise (a drafted step of ragged requests, the verifier and commit of more rows, a busier
machine). The engine reports every decode-only step's wall time (`observe_step`), and the gate
keeps, for plain and for drafted steps apart, a decayed mean of measured / priced
(`cost_ratio`) and prices each kind with its own ratio. Measured (docs/LOAD.md, run U): at 16
clients the profile priced a step verifying 18 tokens at 128 ms, 1 ms above a plain one, while the
engine's took 152 ms against 121, so the gate drafted two requests in 12 % of the steps and lost
12 % throughput to no speculation.

Exploration: curves only refresh when a request drafts. A request with no
curve yet (it just started decoding) stands in with the mean of the last
`history` curves recorded from any request (the asynchronous scheduler's
proxy). While no curve was ever recorded, a step drafts a quarter of its
requests (at least one, at most `max_probe`) to learn one. After `probe_every`
consecutive steps of its load class (below) that left some request undrafted, a step also drafts the
stalest quarter of its requests, at most `max_probe` (4) of them (no curve
first, then the oldest curves), so a request whose text turned predictable
(code, a quotation) is noticed within max(4, R / max_probe) x probe_every
steps. Probing a few, not everyone, matters on a CPU: a request's first draft
also projects all its context into the drafter
(`DSparkDrafter.project_pending`), so a probe of all 16 requests at 16
clients cost about half a decode step (docs/LOAD.md, run H), and at 64
requests a probe of a quarter (16) took 1080 ms against a 579 ms plain step,
a probe of four 539 ms against 515 (run AI). Even a few is not free, so when a
probe's fresh curves show nothing worth drafting the next probe waits twice
as long, up to `max_probe_every` steps (default
4 x probe_every); as soon as drafting pays for anyone the interval is back to
`probe_every`. Measured (docs/LOAD.md, run N): at 16 clients on this CPU no
curve paid, and probing every 32 steps (3 % of the steps) cost about 3 % of
throughput against no speculation.

The interval, and the count of steps since the last probe, are kept per load
class (the batch size's power of two: 1, 2-3, 4-7, 8-15, 16-31, ...), since
whether drafting pays depends on the load. In a closed loop at 16 clients the
steps that prefill new requests decode only 10-15 of them and drafting pays
for one or two there; with one clock for all loads those steps kept the probes
at every 32-64 steps while nothing paid at 16 (session 42, step traces of 400
steps: 8 probes and 0.82 s of drafting in 110 s, most of it projecting the
probed requests' prompts; with a clock per class 5 probes and 0.49 s).

Pending context: the DSpark drafter processes a request's context lazily, when the request
is next drafted (`Drafter.pending_rows`), so drafting a request that just joined first
projects its whole prompt, and one drafted long ago what it committed since. `best_drafts`
adds P(the reached requests' pending rows) to a prefix's price (`SplitCost.project_seconds`,
measured in the profile), the engine's step timings carry the rows a step processed, and a
probe among equally stale requests takes the one with the fewest rows. Measured (docs/LOAD.md,
runs BG and BH): at four clients with think time the gate's own choices processed 145 rows a
step (8.7 of their 18.5 ms of propose), priced at D alone, and the causal scheduler ran at
0.971x no speculation; pricing them, 0.996x.

Chosen on stale curves: the gate drafts the requests whose last drafted round promised most,
and a round that went well is followed, on average, by one that goes less well (the winner's
curse of choosing on noisy estimates); the acceptance ratio above cannot see it, since it sets
the fresh curves of each verified round beside what was accepted. So the gate also keeps, over
its own choices alone (not probes), what its scaled stale curves promised for the tokens it
priced and what the verifier then accepted of those requests (`choice_ratio`, decayed sums with
the same prior). Measured (docs/LOAD.md, session 45): over 800-step traces the verifier accepted
0.75 (two requests) and 0.85 (four) of what the stale curves had promised for the gate's choices
(prior included). With `choices=True` the gate scales the curves it chooses on by that ratio too.
Off by default: in an A/B load run (docs/LOAD.md, run BP) the corrected gate drafted in half as
many steps and read 0.958x the uncorrected one at four clients (below in all four repeats) and
1.001x at two.

A drafter without a confidence head never yields a curve: the gate then
drafts everyone, every step (the schedulers verify all its tokens).

Drafts the scheduler would not verify: the gate prices steps with measured
cost ratios, the scheduler that picks verify lengths with the profile alone
(its choice does not depend on one common scale of a drafted step's cost, but
the gate compares drafted with plain steps, whose ratios differ). So before
drafting, the gate asks the scheduler's own rule (`would_verify`) whether it
would verify any token of the requests it chose, on their raw curves, and
drafts no one when it would not: a draft verified for no token is pure cost.
By default that rule is Algorithm 1's walk, which stops at the first candidate
that does not raise Theta (`verified_any`); the asynchronous scheduler passes
its own (its capacity search over the snapshot it will read, or Algorithm 1
when that snapshot has no confidences). Measured (docs/LOAD.md, runs AB and
AC): at 64 clients the gate drafted some requests in 50-75 % of the steps at a
verification budget of 1.003 (plain steps ran at about 1.17x their price,
drafted ones at 1.07x); with the veto, in 5 %. Run AF: the asynchronous
scheduler's gate once vetoed as if its capacity search decided, while at high
load its decide fell back to Algorithm 1 (the snapshot two steps back had
drafted no one) and verified nothing of 31 drafted requests.

Free drafting: when one batched `propose` costs at most `free_fraction`
(2 %) of a plain decode step, D(R) <= free_fraction x F(R), the gate drafts
everyone. A stale curve is the mean of what a request's drafts were worth;
the draft in hand can be worth much more or nothing (prompt lookup: a
3-token match that copies, a 1-token match, no match at all), and Algorithm
1 sees that in the fresh confidences. So drafting has a value the stale
curve underrates (the mean of the best choices is at least the best choice
for the mean), and when drafting is nearly free, skipping it cannot pay.
Prompt lookup costs about 0.1 ms a round against 40 ms for a decode step on
this CPU; the DSpark drafter 10 ms against 26 ms.

Measured (docs/LOAD.md): with a new request forcing a draft, closed-loop
traffic at 16 clients drafted whenever a request joined, and the scheduler
lost 14 % throughput to no speculation; the proxy removes those drafts.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from dspark.schedule.base import ScheduleOutcome, ScheduleRequest, StepTiming, survival
from dspark.schedule.cost import SplitCost

PRIOR_TOKENS = 4.0  # pseudo-count pulling the acceptance ratio towards 1 while few outcomes are in
PRIOR_STEPS = 2.0  # pseudo-count pulling each cost ratio towards 1 while few steps are timed
COST_DECAY = 0.95  # per timed step of a kind: a cost ratio follows about the last 20 steps of its kind
RATIO_CLIP = (0.25, 4.0)  # one step's measured / priced is clipped here (a pause of the process is not a price)


@dataclass
class ProbeClock:
    """The probing state of one load class (see the module docstring)."""

    interval: int  # steps between probes now: doubles while probes find nothing
    skipped: int = 0  # steps of this class since one drafted everyone or probed
    probed: bool = False  # this class's last step probed


class DraftGate:
    """Per step and request: draft (True) or decode plainly (False); see the module docstring."""

    def __init__(self, cost: SplitCost, probe_every: int = 32, history: int = 64, decay: float = 0.98,
                 probe_fraction: float = 0.25, free_fraction: float = 0.02, max_probe_every: int | None = None,
                 max_probe: int = 4,
                 would_verify: Callable[[Sequence[Hashable], Sequence[Sequence[float]], Sequence[bool]], bool]
                 | None = None, price_pending: bool = True, choices: bool = False) -> None:
        if probe_every < 1 or history < 1:
            raise ValueError(f"probe_every and history must be >= 1, got {probe_every} and {history}")
        max_probe_every = 4 * probe_every if max_probe_every is None else max_probe_every
        if max_probe_every < probe_every:
            raise ValueError(f"max_probe_every must be >= probe_every ({probe_every}), got {max_probe_every}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not 0.0 < probe_fraction <= 1.0:
            raise ValueError(f"probe_fraction must be in (0, 1], got {probe_fraction}")
        if not 0.0 <= free_fraction < 1.0:
            raise ValueError(f"free_fraction must be in [0, 1), got {free_fraction}")
        if max_probe < 1:
            raise ValueError(f"max_probe must be >= 1, got {max_probe}")
        self.cost, self.probe_every, self.decay, self.probe_fraction = cost, probe_every, decay, probe_fraction
        self.free_fraction, self.max_probe = free_fraction, max_probe
        self.price_pending = price_pending  # False: pending context rows ignored (the gate before run BH)
        self.choices = choices  # True: curves also scaled by choice_ratio (off by default, see the docstring)
        # the scheduler's rule: would it verify any token if these requests (ids, raw curves) drafted?
        self.would_verify = would_verify or (lambda ids, curves, chosen: self.verified_any(curves, chosen))
        self.vetoed = 0  # choices of drafts the scheduler's own walk would verify nothing of
        self.max_probe_every = max_probe_every
        # per load class (len(ids).bit_length()): steps between probes, doubling while probes find
        # nothing, and the steps of that class since its last probe
        self.clocks: dict[int, ProbeClock] = {}
        self.load_class = 1  # the load class of the last choice
        # accepted draft tokens realised vs predicted by the survival curves (decayed sums)
        self.realised = self.predicted = 0.0
        # the same for the gate's own choices, against what its scaled stale curves promised
        self.chosen_realised = self.chosen_promised = 0.0
        self.promised: dict[Hashable, tuple[float, int]] = {}  # id -> promise of the last own choice
        self.priced: list[tuple[int, int]] = []  # the (request, position) of the prefix best_drafts chose
        self.curves: dict[Hashable, list[float]] = {}  # request id -> survival curve of its last drafted round
        self.refreshed: dict[Hashable, int] = {}  # request id -> step its curve was recorded
        self.recent: deque[list[float]] = deque(maxlen=history)  # last recorded curves of any request
        self.steps = 0
        self.blind = False  # a drafted request came back without confidences: no curves to be had
        self.probed = False  # the last choice included probes
        self.pending: list[int] = []  # the last choice's pending context rows per request
        # measured / priced seconds of recent decode-only steps (decayed sums and counts), per kind
        self.cost_sums = {"plain": 0.0, "drafted": 0.0}
        self.cost_counts = {"plain": 0.0, "drafted": 0.0}

    def choose(self, request_ids: Sequence[Hashable], pending_rows: Sequence[int] | None = None) -> list[bool]:
        """Which of these requests draft this step (in order). `pending_rows`: the context rows
        each one's next propose must process first (`Drafter.pending_rows`; None: none)."""
        self.load_class = len(request_ids).bit_length()
        clock = self.clocks.setdefault(self.load_class, ProbeClock(self.probe_every))
        self.probed, self.promised = False, {}
        if pending_rows is not None and len(pending_rows) != len(request_ids):
            raise ValueError(f"pending_rows has {len(pending_rows)} entries for {len(request_ids)} requests")
        priced = pending_rows is not None and self.price_pending
        self.pending = [int(n) for n in pending_rows] if priced else [0] * len(request_ids)
        chosen = self._choose(list(request_ids), clock)
        clock.probed = self.probed
        clock.skipped = 0 if all(chosen) or self.probed else clock.skipped + 1
        self.steps += 1
        return chosen

    def _choose(self, ids: list[Hashable], clock: ProbeClock) -> list[bool]:
        if not ids or self.blind or self.drafting_is_free(len(ids)):
            return [True] * len(ids)
        if not self.recent:  # no curve was ever seen: draft some requests to learn one
            return self._with_probes(ids, [False] * len(ids))
        proxy = None
        if any(i not in self.curves for i in ids):
            from dspark.schedule.prefix import _mean_curve

            proxy = _mean_curve(list(self.recent))
        ratio = self.acceptance_ratio()
        factor = ratio * self.choice_ratio() if self.choices else ratio
        raw = [self.curves.get(i, proxy) for i in ids]
        chosen = self.best_drafts([[min(1.0, a * factor) for a in c] for c in raw], self.pending)
        if any(chosen) and not self.would_verify(ids, raw, chosen):
            self.vetoed += 1
            chosen = [False] * len(ids)
        self.promised = self._promises(ids, raw, ratio, chosen) if any(chosen) else {}
        if any(chosen):  # drafting pays for someone at this load: probe at the base rate
            clock.interval = self.probe_every
        elif clock.probed:  # this load's last step probed, and the fresh curves pay for none: back off
            clock.interval = min(self.max_probe_every, 2 * clock.interval)
        if clock.skipped >= clock.interval and not all(chosen):
            chosen = self._with_probes(ids, chosen)
        return chosen

    @property
    def probe_interval(self) -> int:
        """Steps between probes at the load class of the last choice (see the module docstring)."""
        clock = self.clocks.get(self.load_class)
        return self.probe_every if clock is None else clock.interval

    def drafting_is_free(self, requests: int) -> bool:
        """D(requests) <= free_fraction x F(requests): drafting everyone costs next to nothing."""
        plain = self.cost.seconds(requests, requests, drafted=False)
        return self.cost.seconds(requests, requests) - plain <= self.free_fraction * plain

    def probe_size(self, requests: int) -> int:
        """How many requests a probe drafts: probe_fraction of them, at least one and at most
        max_probe."""
        return max(1, min(self.max_probe, math.ceil(requests * self.probe_fraction)))

    def _with_probes(self, ids: list[Hashable], chosen: list[bool]) -> list[bool]:
        """`chosen` plus the probe_size stalest requests it leaves out (no curve first, then
        the oldest curves; ties to the fewest pending context rows, the cheapest to draft, then
        batch order)."""
        left_out = [k for k, draft in enumerate(chosen) if not draft]
        left_out.sort(key=lambda k: (self.refreshed.get(ids[k], -1), self.pending[k]))
        probes = set(left_out[: self.probe_size(len(ids))])
        self.probed = True
        return [draft or k in probes for k, draft in enumerate(chosen)]

    def acceptance_ratio(self) -> float:
        """Realised / predicted accepted draft tokens over recent verified rounds, each side
        plus PRIOR_TOKENS (so it starts at 1): the gate scales survival curves by it, so a
        confidence head that promises more than the verifier accepts stops opening the gate."""
        return (self.realised + PRIOR_TOKENS) / (self.predicted + PRIOR_TOKENS)

    def choice_ratio(self) -> float:
        """Accepted / promised draft tokens of the gate's own recent choices (`_promises`), each
        side plus PRIOR_TOKENS (so it starts at 1): below 1 where choosing on stale curves picks
        requests whose good round is behind them (see the module docstring)."""
        return (self.chosen_realised + PRIOR_TOKENS) / (self.chosen_promised + PRIOR_TOKENS)

    def _promises(self, ids: list[Hashable], curves: Sequence[Sequence[float]], ratio: float,
                  chosen: Sequence[bool]) -> dict[Hashable, tuple[float, int]]:
        """request id -> (the accepted draft tokens its curve promised, the draft positions that
        promise covers) over the admission prefix `best_drafts` last priced, for the requests still
        chosen. The raw `curves` are scaled by the acceptance `ratio` alone, so that `choice_ratio`
        estimates the bias of choosing itself, not what is left of it."""
        promise: dict[Hashable, tuple[float, int]] = {}
        for request, position in self.priced:
            if chosen[request]:
                total, positions = promise.get(ids[request], (0.0, 0))
                promise[ids[request]] = (total + min(1.0, curves[request][position - 1] * ratio), positions + 1)
        return promise

    def observe_outcomes(self, outcomes: Sequence[ScheduleOutcome]) -> None:
        """After verification: compare each request's accepted count with its curve's promise,
        and, for the gate's own last choice, with what the gate expected of it."""
        for o in outcomes:
            promise = self.promised.get(o.request_id)
            if promise is not None:  # verified or not: a choice verified for nothing promised in vain
                total, positions = promise  # accepted within the positions the promise covers
                self.chosen_realised = self.decay * self.chosen_realised + min(o.num_accepted, positions)
                self.chosen_promised = self.decay * self.chosen_promised + total
            curve = self.curves.get(o.request_id)
            if curve is None or o.verify_len <= 0:
                continue
            self.realised = self.decay * self.realised + o.num_accepted
            self.predicted = self.decay * self.predicted + sum(curve[: o.verify_len])
        self.promised = {}  # a choice is judged on the one round it was made for

    def observe_step(self, timing: StepTiming) -> None:
        """After a decode-only step: compare its wall time with the profile's price of it."""
        priced = self.cost.seconds(timing.budget, timing.requests, drafted=timing.drafted)
        if self.price_pending:
            priced += self.cost.project_seconds(timing.projected_rows)
        ratio = min(RATIO_CLIP[1], max(RATIO_CLIP[0], timing.seconds / priced))
        kind = "drafted" if timing.drafted else "plain"
        self.cost_sums[kind] = COST_DECAY * self.cost_sums[kind] + ratio
        self.cost_counts[kind] = COST_DECAY * self.cost_counts[kind] + 1.0

    def cost_ratio(self, kind: str) -> float:
        """Measured / priced seconds of recent `kind` ("plain" or "drafted") steps, a decayed mean
        plus PRIOR_STEPS steps at 1 (so it starts at 1: the profile as measured)."""
        return (self.cost_sums[kind] + PRIOR_STEPS) / (self.cost_counts[kind] + PRIOR_STEPS)

    def plain_rate(self, requests: int) -> float:
        """Tokens per second of one plain decode step of `requests` requests."""
        return requests / (self.cost.seconds(requests, requests, drafted=False) * self.cost_ratio("plain"))

    def drafted_rate(self, curves: Sequence[Sequence[float]]) -> float:
        """The best expected tokens per second of a drafted step whose requests have these
        survival curves (global search of the admission path, as the async scheduler's)."""
        from dspark.schedule.prefix import greedy_walk, ranked_candidates

        r = len(curves)
        curve = self.cost.given_requests(r)
        cands = ranked_candidates(curves)
        n = greedy_walk(cands, curve, r, r, early_stop=False)
        return (r + sum(a for _, _, a in cands[:n])) * curve.sps(r + n) / self.cost_ratio("drafted")

    def best_drafts(self, curves: Sequence[Sequence[float]], pending_rows: Sequence[int] | None = None) -> list[bool]:
        """The requests to draft for the highest expected tokens per second: walk the admission
        path of `curves` (Algorithm 1's order) pricing prefix n at F(R, R + n) + D(requests it
        reaches) + P(their pending context rows), against a plain decode step (n = 0), and draft
        the best prefix's requests."""
        from dspark.schedule.prefix import ranked_candidates

        r = len(curves)
        cands = ranked_candidates(curves)
        best_rate, best_n = self.plain_rate(r), 0
        reached: set[int] = set()
        accepts, drafted_ratio, rows, project = float(r), self.cost_ratio("drafted"), 0, 0.0
        forward_seconds, draft = self.cost.forward_seconds, [0.0]  # draft[k] = D(k), read once each
        for n, (request, _, a) in enumerate(cands, start=1):  # R x G candidates a step: kept lean
            if request not in reached:
                reached.add(request)
                if pending_rows and pending_rows[request]:
                    rows += pending_rows[request]
                    project = self.cost.project_seconds(rows)
            accepts += a
            while len(draft) <= len(reached):
                draft.append(self.cost.draft_seconds(len(draft)))
            rate = accepts / ((forward_seconds(r + n, r) + draft[len(reached)] + project) * drafted_ratio)
            if rate > best_rate:
                best_rate, best_n = rate, n
        self.priced = [(request, position) for request, position, _ in cands[:best_n]]
        best_reached = {request for request, _ in self.priced}
        return [i in best_reached for i in range(r)]

    def verified_any(self, curves: Sequence[Sequence[float]], chosen: Sequence[bool]) -> bool:
        """Would Algorithm 1 verify any token if the `chosen` requests drafted with these survival
        curves? Its walk (early stop) over the chosen requests' candidates, on the profile's SPS
        of a step of all R requests with the chosen ones drafting (the curve the scheduler walks)."""
        from dspark.schedule.prefix import greedy_walk, ranked_candidates

        r = len(curves)
        cands = ranked_candidates([c if draft else [] for c, draft in zip(curves, chosen)])
        curve = self.cost.given_requests(sum(chosen), r)
        return greedy_walk(cands, curve, r, r, early_stop=True) > 0

    def record(self, requests: Sequence[ScheduleRequest]) -> None:
        """Remember the survival curve of every request that drafted with confidences;
        forget requests that are gone."""
        live = {q.request_id for q in requests}
        self.curves = {i: c for i, c in self.curves.items() if i in live}
        self.refreshed = {i: t for i, t in self.refreshed.items() if i in live}
        for q in requests:
            if q.num_drafted > 0 and q.confidences is None:
                self.blind = True  # the drafter has no confidence head
            elif q.num_drafted > 0:
                self.curves[q.request_id] = survival(q)
                self.refreshed[q.request_id] = self.steps
                self.recent.append(self.curves[q.request_id])

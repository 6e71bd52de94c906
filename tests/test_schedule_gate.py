"""The draft gate (`dspark.schedule.gate`): the prefix schedulers skip drafting
when even the best drafted step is slower than a plain decode step, judged
from past confidences only; the engine then runs a plain decode step.

Decision tests use hand-made `SplitCost`s, so every expected answer is
computed by hand below. The engine tests check that skipped steps leave the
output exact: greedy token parity with every learned drafter, and the
chi-square distribution test of tests/test_engine_lossless.py through a
policy that skips drafting on seeded coin flips.
"""

from __future__ import annotations

import random

import pytest
import torch

from dspark.engine.engine import Engine, EngineConfig
from dspark.errors import UserError
from dspark.engine.generate import generate
from dspark.engine.policy import build_policy
from dspark.models.tiny import tiny_target
from dspark.schedule import AsyncPrefixScheduler, CostTable, PrefixScheduler, ScheduleRequest
from dspark.schedule.cost import SplitCost
from dspark.schedule.gate import DraftGate
from dspark.types import SamplingParams


def _split(forward_ms: float, per_token_ms: float, draft_ms: float) -> SplitCost:
    """F(B) = forward_ms + per_token_ms * (B - 1); D(R) = draft_ms * R."""
    forward = CostTable({b: (forward_ms + per_token_ms * (b - 1)) / 1e3 for b in (1, 2, 4, 8, 16, 64)})
    draft = CostTable({r: draft_ms * r / 1e3 for r in (1, 2, 4, 8, 16)})
    return SplitCost(forward, draft)


def _req(rid, conf):
    return ScheduleRequest(request_id=rid, num_drafted=len(conf), confidences=conf)


def test_split_cost_adds_drafting_per_request():
    cost = _split(50, 5, 20)
    assert cost.seconds(8, 2) == pytest.approx((50 + 35 + 40) / 1e3)
    assert cost.seconds(8, 2, drafted=False) == pytest.approx(85 / 1e3)
    assert cost.given_requests(2).sps(8) == pytest.approx(1e3 / 125)


def test_gate_drafts_only_when_the_best_drafted_step_beats_plain_decoding():
    # one request, F(1) = 50 ms, +5 ms per token, drafting 20 ms
    gate = DraftGate(_split(50, 5, 20))
    assert gate.choose(["a"]) == [True]  # no curve yet: draft to learn one
    gate.record([_req("a", [0.9, 0.9, 0.9])])
    # best: verify 3 -> (1 + 0.9 + 0.81 + 0.729) / (65 + 20) ms = 40.3 tok/s > 1 / 50 ms = 20
    assert gate.choose(["a"]) == [True]
    gate.record([_req("a", [0.2, 0.1, 0.1])])
    # best: verify 1 -> 1.2 / 75 ms = 16 tok/s; nothing drafted: 1 / 70 ms; plain: 20 tok/s -> skip
    assert gate.choose(["a"]) == [False]
    assert gate.drafted_rate([[0.2, 0.02, 0.002]]) == pytest.approx(1.2 / 0.075)
    assert gate.plain_rate(1) == pytest.approx(20.0)


def test_nearly_free_drafting_drafts_everyone():
    """Prompt lookup: drafting costs 0.05 ms against a 50 ms step (0.1 %), so the gate drafts
    every request even behind poor curves; Algorithm 1 then judges each fresh draft. The same
    curves behind a drafter costing 20 ms a request (40 %) are skipped."""
    curves = [_req(r, [0.2, 0.1, 0.1]) for r in "abc"]
    cheap, dear = DraftGate(_split(50, 5, 0.05)), DraftGate(_split(50, 5, 20))
    for gate in (cheap, dear):
        gate.record(curves)
    assert cheap.drafting_is_free(3) and cheap.choose(list("abc")) == [True] * 3
    assert not dear.drafting_is_free(3) and dear.choose(list("abc")) == [False] * 3
    # the threshold is a fraction of the plain step: 0.5 ms a request for 3 requests is 1.5 / 60 = 2.5 %
    assert not DraftGate(_split(50, 5, 0.5)).drafting_is_free(3)
    assert DraftGate(_split(50, 5, 0.5), free_fraction=0.03).drafting_is_free(3)
    assert not DraftGate(_split(50, 5, 0.05), free_fraction=0.0).drafting_is_free(3)
    with pytest.raises(ValueError, match="free_fraction"):
        DraftGate(_split(50, 5, 0.05), free_fraction=1.0)


def test_gate_discounts_curves_by_the_acceptance_actually_realised():
    """A head that promises 0.9 per token while the verifier accepts almost nothing stops
    opening the gate once the outcomes outweigh the prior; honest outcomes keep it open."""
    from dspark.schedule import ScheduleOutcome
    from dspark.schedule.gate import PRIOR_TOKENS

    liar, honest = DraftGate(_split(50, 5, 20)), DraftGate(_split(50, 5, 20))
    for gate, accepted in ((liar, 0), (honest, 3)):
        gate.record([_req("a", [0.99, 0.99, 0.99])])
        assert gate.acceptance_ratio() == 1.0 and gate.choose(["a"]) == [True]
        for _ in range(6):
            gate.record([_req("a", [0.99, 0.99, 0.99])])
            gate.observe_outcomes([ScheduleOutcome("a", 3, accepted)])
            gate.observe_outcomes([ScheduleOutcome("gone", 3, 3)])  # no curve: ignored
    assert liar.acceptance_ratio() < 0.25 and liar.choose(["a"]) == [False]
    assert honest.acceptance_ratio() == pytest.approx(1.0, abs=0.02) and honest.choose(["a"]) == [True]
    assert PRIOR_TOKENS > 0
    with pytest.raises(ValueError, match="decay"):
        DraftGate(_split(50, 5, 20), decay=0.0)


def test_gate_probes_after_skipping_and_forgets_finished_requests():
    gate = DraftGate(_split(50, 5, 40), probe_every=3, max_probe_every=3)
    gate.record([_req("a", [0.1])])
    decisions = [gate.choose(["a"])[0] for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]
    gate.record([_req("b", [0.99])])  # "a" is gone
    assert set(gate.curves) == {"b"}
    # "c" has no curve yet: it stands in with the mean recent curve (0.545), and at D(2) = 80 ms
    # the best drafted step, 3.535 tokens / 145 ms, loses to plain decoding's 2 / 55 ms
    assert gate.choose(["b", "c"]) == [False, False]


def test_probes_back_off_while_they_find_nothing_and_reset_when_drafting_pays():
    """Probe every 3 steps at first; each probe whose fresh curve pays for nothing doubles the
    wait, up to max_probe_every (default 4 x 3 = 12); a curve worth drafting resets it."""
    gate = DraftGate(_split(50, 5, 40), probe_every=3)
    gate.record([_req("a", [0.1])])
    decisions = []
    for _ in range(40):
        decisions.append(gate.choose(["a"])[0])
        if decisions[-1]:
            gate.record([_req("a", [0.1])])  # the probe's curve: still poor
    assert [i for i, d in enumerate(decisions) if d] == [3, 10, 23, 36]
    assert gate.probe_interval == 12
    gate.record([_req("a", [0.99, 0.99, 0.99])])  # the text turned predictable
    assert gate.choose(["a"]) == [True] and gate.probe_interval == 3
    with pytest.raises(ValueError, match="max_probe_every"):
        DraftGate(_split(50, 5, 40), probe_every=8, max_probe_every=4)


def test_probes_back_off_per_load_class():
    """Whether drafting pays depends on the batch size, so the back-off is kept per load class
    (1, 2-3, 4-7, ...): a small batch where drafting pays (a closed loop's steps that prefill a
    new request) does not reset the probes of the big batch where it does not (session 42)."""
    gate = DraftGate(_split(50, 5, 10), probe_every=3)
    gate.record([_req("a", [0.1])])
    for _ in range(40):  # one request, poor curves: the interval backs off to 12
        if gate.choose(["a"])[0]:
            gate.record([_req("a", [0.1])])
    assert gate.probe_interval == 12 and gate.load_class == 1
    # four requests with predictable text: drafting pays at this load (class 3)
    gate.record([_req(r, [0.99, 0.99, 0.99]) for r in "bcde"])
    assert any(gate.choose(list("bcde"))) and gate.probe_interval == 3 and gate.load_class == 3
    gate.record([_req("a", [0.1])])
    gate.choose(["a"])
    assert gate.load_class == 1 and gate.probe_interval == 12  # the single request's back-off holds
    assert {c: clock.interval for c, clock in gate.clocks.items()} == {1: 12, 3: 3}
    # steps are counted per class too: a rare small batch does not probe on the big batch's count
    gate = DraftGate(_split(50, 5, 40), probe_every=3, max_probe_every=3)
    gate.record([_req(r, [0.1]) for r in "abcd"])
    decisions = [any(gate.choose(["a"] if k % 4 else list("abcd"))) for k in range(16)]
    # each class probes on its own 4th step after its last probe: class 1 (one request, steps
    # 1-3, 5-7, 9-11, 13-15) at 5, 10 and 15; class 3 (four requests, steps 0, 4, 8, 12) at 12.
    # One clock for both would probe on every 4th step: 3, 7, 11, 15
    assert [k for k, d in enumerate(decisions) if d] == [5, 10, 12, 15]


def test_a_new_request_uses_the_mean_recent_curve_instead_of_forcing_a_draft():
    gate = DraftGate(_split(50, 5, 40))
    assert gate.choose(["a"]) == [True]  # nothing ever recorded: draft to learn
    gate.record([_req("a", [0.1, 0.1])])
    gate.record([_req("b", [0.3, 0.1])])  # "a" finished; both curves stay in the recent history
    # "c" is new: proxy = mean of (0.1, 0.01) and (0.3, 0.03) = (0.2, 0.02): 1.2 / 95 ms < 20 tok/s
    assert gate.choose(["c"]) == [False]
    assert gate.drafted_rate([[0.2, 0.02]]) < gate.plain_rate(1)


def test_the_gate_drafts_only_the_requests_whose_curves_pay_for_their_drafting():
    """F(B) = 50 + 5 (B - 1) ms, D(R) = 20 R ms, two requests; plain decoding: 2 / 55 ms = 36.4 tok/s.
    Survival curves a = (0.9, 0.81, 0.729), b = (0.05). Path a1, a2, a3, b1:
      a1     2.9   / (60 + 20) = 36.3      a1-a2  3.71 / (65 + 20) = 43.6
      a1-a3  4.439 / (70 + 20) = 49.3      + b1   4.489 / (75 + 40) = 39.0
    best: draft a alone. Drafting both (the all-or-nothing gate) would have paid too,
    40.4 tok/s at a1-a3, but less."""
    gate = DraftGate(_split(50, 5, 20))
    good, poor = [0.9, 0.81, 0.729], [0.05]
    assert gate.best_drafts([good, poor]) == [True, False]
    assert gate.best_drafts([poor, good]) == [False, True]
    assert gate.drafted_rate([good, poor]) == pytest.approx(4.439 / 0.110)
    assert gate.drafted_rate([good, poor]) > gate.plain_rate(2)
    # two good curves: a1 b1 a2 b2 a3 b3 -> 6.878 / (85 + 40) = 55.0 tok/s, the best prefix
    assert gate.best_drafts([good, good]) == [True, True]
    assert gate.best_drafts([poor, poor]) == [False, False]
    # through choose(): recorded curves (confidences 0.9, 0.9, 0.9 and 0.05)
    gate.record([_req("a", [0.9, 0.9, 0.9]), _req("b", [0.05])])
    assert gate.choose(["a", "b"]) == [True, False]


def test_the_gate_prices_the_pending_context_a_draft_must_process_first():
    """F(B) = 50 + 5 (B - 1) ms, D(R) = 20 R ms, two requests; a = (0.95, 0.93, 0.92) holds no
    pending rows, b = (0.9, 0.85, 0.8) a 400-row prompt not yet processed, P(n) = 0.1 ms a row
    (40 ms for b's). Path a1 a2 a3 b1 b2 b3:
      a1-a3  4.80 / (70 + 20) = 53.3 tok/s
      all    7.35 / (85 + 40) = 58.8 with b's rows processed, 7.35 / (85 + 40 + 40) = 44.5 pending
    (b1 and b1-b2 reach 36.8 and 41.0 pending) so a drafts alone while b's prompt is pending, both
    once it is processed. The engine's step timings price what they processed too, so the cost
    ratio stays 1."""
    base = _split(50, 5, 20)
    cost = SplitCost(base.forward, base.draft, CostTable({n: n * 1e-4 for n in (1, 16, 256, 1024)}))
    assert cost.project_seconds(0) == 0.0 and cost.project_seconds(400) == pytest.approx(0.04)
    assert base.project_seconds(400) == 0.0  # no P measured: nothing priced
    gate = DraftGate(cost)
    a, b = [0.95, 0.93, 0.92], [0.9, 0.85, 0.8]
    assert gate.best_drafts([a, b], [0, 400]) == [True, False]
    assert gate.best_drafts([a, b], [0, 0]) == gate.best_drafts([a, b]) == [True, True]
    gate.record([_req("a", [0.95, 0.98, 0.99]), _req("b", [0.9, 0.95, 0.95])])  # survival about a and b
    assert gate.choose(["a", "b"], [0, 400]) == [True, False]
    assert gate.choose(["a", "b"]) == [True, True]
    with pytest.raises(ValueError, match="pending_rows"):
        gate.choose(["a", "b"], [0])
    from dspark.schedule import StepTiming

    gate.observe_step(StepTiming(2, 1, 5, cost.seconds(5, 2, drafted=1) + 0.04, projected_rows=400))
    assert gate.cost_ratio("drafted") == pytest.approx(1.0)
    # the ablation (policy option pending="off"): rows ignored, as the gate before run BH
    from dspark.schedule import make_policy

    old = make_policy("dspark", cost, pending="off").gate
    old.record([_req("a", [0.95, 0.98, 0.99]), _req("b", [0.9, 0.95, 0.95])])
    assert old.choose(["a", "b"], [0, 400]) == [True, True]
    assert make_policy("dspark-async", cost, pending="off").gate.price_pending is False
    assert make_policy("dspark", cost).gate.price_pending is True
    with pytest.raises(UserError, match="pending must be"):
        make_policy("dspark", cost, pending="maybe")


def test_probes_go_to_the_cheapest_of_the_equally_stale():
    """Requests without a curve are equally stale; a probe drafts the one whose propose would
    process the fewest pending rows (prompt lookup processes none: batch order then)."""
    gate = DraftGate(_split(50, 5, 40), probe_every=1)
    assert gate.choose(list("abcd"), [500, 30, 900, 200]) == [False, True, False, False]
    gate = DraftGate(_split(50, 5, 40), probe_every=1)
    assert gate.choose(list("abcd")) == [True, False, False, False]


def test_partial_drafting_counts_towards_the_probe():
    """A step that drafts some requests leaves the others' curves stale: after probe_every
    such steps one step drafts everyone."""
    gate = DraftGate(_split(50, 5, 20), probe_every=2)
    gate.record([_req("a", [0.9, 0.9, 0.9]), _req("b", [0.05])])
    assert [gate.choose(["a", "b"]) for _ in range(6)] == [[True, False], [True, False], [True, True]] * 2


def test_probes_and_the_first_curve_draft_the_stalest_quarter():
    """Learning and probing draft a quarter of the batch (at least one request): those without
    a curve first, then the oldest curves, so probes rotate through the batch."""
    gate = DraftGate(_split(50, 5, 40), probe_every=2, max_probe_every=2)  # no back-off here
    ids = ["a", "b", "c", "d", "e"]
    assert gate.probe_size(5) == 2 and gate.probe_size(1) == 1
    assert gate.choose(ids) == [True, True, False, False, False]  # nothing recorded: learn from two
    gate.record([_req("a", [0.1]), _req("b", [0.1])] + [ScheduleRequest(i, 0, None) for i in "cde"])
    # poor curves (the proxy for c, d, e too): plain steps, then a probe of the two without a curve
    assert [gate.choose(ids) for _ in range(3)] == [[False] * 5, [False] * 5, [False, False, True, True, False]]
    gate.record([_req("c", [0.1]), _req("d", [0.1])] + [ScheduleRequest(i, 0, None) for i in "abe"])
    # e has no curve; a and b hold the oldest (tie: batch order)
    assert [gate.choose(ids) for _ in range(3)] == [[False] * 5, [False] * 5, [True, False, False, False, True]]
    gate.record([_req("a", [0.1]), _req("e", [0.1])] + [ScheduleRequest(i, 0, None) for i in "bcd"])
    gate.choose(ids), gate.choose(ids)
    assert gate.choose(ids) == [False, True, True, False, False]  # b's curve is the oldest, then c's and d's


def test_a_probe_drafts_at_most_max_probe_requests():
    """A quarter of a big batch is too dear to probe on a CPU: a probe also projects each probed
    request's unprojected context (at 64 requests, 16 probed requests' propose took 401 ms
    against a 579 ms plain step, docs/LOAD.md run AI), so probes stop at max_probe (4)."""
    gate = DraftGate(_split(50, 5, 40))
    assert [gate.probe_size(r) for r in (1, 4, 5, 16, 17, 32, 64)] == [1, 1, 2, 4, 4, 4, 4]
    ids = [f"r{i}" for i in range(64)]
    assert sum(gate.choose(ids)) == 4  # nothing recorded yet: learn from four, not sixteen
    assert DraftGate(_split(50, 5, 40), max_probe=16).probe_size(64) == 16
    with pytest.raises(ValueError, match="max_probe"):
        DraftGate(_split(50, 5, 40), max_probe=0)


def test_a_drafter_without_confidences_drafts_every_request():
    gate = DraftGate(_split(50, 5, 40))
    assert gate.choose(["a", "b", "c", "d", "e"]) == [True, True, False, False, False]
    gate.record([ScheduleRequest("a", 4, None), ScheduleRequest("b", 4, None)])
    assert gate.blind and all(gate.choose(["a", "b", "c"]) for _ in range(40))


def test_a_bigger_batch_makes_drafting_relatively_dearer():
    """D(R) grows with R while the forward of R plain tokens barely does: the same
    per-request curve is worth drafting for one request and not for sixteen."""
    gate = DraftGate(_split(50, 1, 8))
    curve = [0.6, 0.4, 0.2]
    one = [curve]
    many = [curve] * 16
    assert gate.drafted_rate(one) > gate.plain_rate(1)
    assert gate.drafted_rate(many) < gate.plain_rate(16)


def test_schedulers_walk_forward_plus_drafting_and_expose_the_gate():
    cost = _split(50, 5, 20)
    causal = PrefixScheduler(cost)
    # verify j while (1 + sum a) / (F(1 + j) + 20 ms) improves: a = 0.9, 0.81, 0.729, 0.0729
    reqs = [_req("a", [0.9, 0.9, 0.9, 0.1])]
    rates = [(1 + sum([0.9, 0.81, 0.729, 0.0729][:j])) / (50 + 5 * j + 20) for j in range(5)]
    assert causal.decide(reqs) == [max(range(5), key=lambda j: rates[j])] == [3]
    assert causal.choose_drafts(["a"]) == [True]
    for policy in (PrefixScheduler(CostTable({1: 0.01, 8: 0.02})), AsyncPrefixScheduler(CostTable({1: 0.01}))):
        assert policy.gate is None and policy.choose_drafts(["x", "y"]) == [True, True]  # one curve: always draft
    assert AsyncPrefixScheduler(cost).gate is not None
    assert build_policy("none", block_size=4).choose_drafts(["x", "y"]) == [False, False]


# ---------------------------------------------------------------- engine
class SkippingPolicy:
    """Wraps a policy; on seeded coin flips (independent of any draft) a step drafts no one,
    everyone, or each request on a coin flip of its own, a third of the steps each."""

    def __init__(self, inner, seed: int = 0) -> None:
        self.inner, self.rng = inner, random.Random(seed)
        self.name, self.skips, self.partial, self.calls = inner.name, 0, 0, 0

    def choose_drafts(self, request_ids, pending_rows=None) -> list[bool]:
        self.calls += 1
        kind = self.rng.randrange(3)
        chosen = [kind == 1 or (kind == 2 and self.rng.random() < 0.5) for _ in request_ids]
        self.skips += not any(chosen)
        self.partial += any(chosen) and not all(chosen)
        return chosen

    def decide(self, requests):
        return self.inner.decide(requests)

    def commit(self, outcomes):
        self.inner.commit(outcomes)


V = 96


@pytest.mark.parametrize("kind,cfg", [("dspark", {"block_size": 4, "num_hidden_layers": 1, "markov_rank": 8}),
                                      ("dflash", {"block_size": 4, "num_hidden_layers": 1}),
                                      ("eagle3", {"block_size": 3}), ("mtp", {})])
def test_skipped_drafts_leave_greedy_output_and_drafter_state_exact(kind, cfg):
    """Steps that skip drafting still feed the drafter its context: greedy output
    is unchanged, and a drafter tuned to copy the target keeps agreeing with it."""
    from dspark.draft.factory import build_drafter
    from dspark.draft.ngram import NoDrafter

    target = tiny_target(seed=0, vocab_size=V)
    params = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]
    plain = Engine(target, NoDrafter(), build_policy("none", block_size=1), EngineConfig())
    want = generate(plain, prompt, params).token_ids
    drafter = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, **cfg)
    policy = SkippingPolicy(build_policy("fixed", block_size=drafter.block_size), seed=1)
    engine = Engine(target, drafter, policy, EngineConfig())
    assert generate(engine, prompt, params).token_ids == want
    assert 0 < policy.skips < policy.calls and engine.num_draft_skips == policy.skips


@pytest.mark.parametrize("kind,cfg", [("dspark", {"block_size": 4, "num_hidden_layers": 1, "markov_rank": 8}),
                                      ("dflash", {"block_size": 4, "num_hidden_layers": 1}),
                                      ("eagle3", {"block_size": 3}), ("mtp", {})])
def test_drafting_part_of_the_batch_leaves_every_greedy_output_exact(kind, cfg):
    """Three requests in one batch, each step drafting no one, everyone or a random part of
    them: every request's greedy output equals its plain-decoding output, so a drafter
    proposes correctly for any subset of its requests' states."""
    from dspark.draft.factory import build_drafter
    from dspark.draft.ngram import NoDrafter

    target = tiny_target(seed=0, vocab_size=V)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    prompts = [[5, 17, 33, 5, 17, 33, 5, 17], [9, 9, 40, 2, 9, 9, 40], [60, 1, 2, 3, 60, 1, 2, 3, 60, 1]]
    plain = Engine(target, NoDrafter(), build_policy("none", block_size=1), EngineConfig())
    want = [generate(plain, p, params).token_ids for p in prompts]
    drafter = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, **cfg)
    policy = SkippingPolicy(build_policy("fixed", block_size=drafter.block_size), seed=3)
    engine = Engine(target, drafter, policy, EngineConfig())
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    assert [engine.pop_finished(i).output_ids for i in ids] == want
    assert engine.num_partial_drafts == policy.partial > 0 and engine.num_draft_skips == policy.skips
    assert engine.num_full_drafts + engine.num_partial_drafts + engine.num_draft_skips == policy.calls


def test_skipped_drafts_keep_the_engine_lossless():
    """tests/test_engine_lossless.py's chi-square test (alpha 1e-6, 16,384
    continuations, 512 cells) through a scheduler that leaves each request
    undrafted on half of the steps at random: steps that draft everyone, no one
    or part of the batch must leave the joint distribution of the first three
    tokens exact."""
    import test_engine_lossless as tel
    from drafters_for_tests import BigramDrafter
    from lossless_harness import ALPHA, chi_square

    target = tel._flat_target()
    drafter = BigramDrafter(tel.VOCAB, block_size=3, seed=4, sharpness=1.5)
    params = SamplingParams(temperature=1.0, max_new_tokens=tel.NUM_TOKENS + 1, ignore_eos=True)
    cost = CostTable({1: 0.010, 512: 0.020, 1024: 0.024, 1536: 0.040, 4096: 0.300})
    policy = SkippingPolicy(build_policy("dspark", block_size=3, cost=cost), seed=2)
    engine = Engine(target, drafter, policy, EngineConfig(max_running=tel.BATCH, max_seq_len=32,
                                                          kv_budget_tokens=tel.BATCH * 32,
                                                          max_prefill_tokens=tel.BATCH * 8))
    out = []
    for start in range(0, tel.SAMPLES, tel.BATCH):
        ids = [engine.add_request(tel.PROMPT, SamplingParams(**{**params.__dict__, "seed": start + i}))
               for i in range(tel.BATCH)]
        while engine.has_work():
            engine.step()
        out.extend(engine.pop_finished(i).output_ids[: tel.NUM_TOKENS] for i in ids)
    assert 0 < policy.skips < policy.calls and engine.num_partial_drafts == policy.partial > 0
    result = chi_square(torch.tensor(out), tel._exact_joint(target, params), tel.VOCAB)
    assert result.p_value > ALPHA, result


def test_spread_proposal_lays_a_subsets_rows_over_the_batch():
    from dspark.draft.base import spread_proposal
    from dspark.types import DraftProposal

    sub = DraftProposal(draft_tokens=torch.tensor([[4, 5], [6, 7]]), num_drafted=torch.tensor([2, 1]),
                        draft_probs=torch.rand(2, 2, 9), confidences=torch.tensor([[0.5, 0.25], [0.75, 0.5]]))
    full = spread_proposal(sub, [1, 3], 4)
    assert full.draft_tokens.tolist() == [[0, 0], [4, 5], [0, 0], [6, 7]]
    assert full.num_drafted.tolist() == [0, 2, 0, 1]
    assert torch.equal(full.draft_probs[[1, 3]], sub.draft_probs) and not full.draft_probs[[0, 2]].any()
    assert full.confidences.tolist() == [[0, 0], [0.5, 0.25], [0, 0], [0.75, 0.5]]
    point_masses = spread_proposal(DraftProposal(torch.tensor([[3]]), torch.tensor([1])), [0], 2)
    assert point_masses.draft_probs is None and point_masses.confidences is None


def test_the_engine_spreads_draft_distributions_only_up_to_the_longest_verify_length():
    """_lay_out cuts draft_probs to the step's longest verify length before spreading a partial
    proposal over the batch: the same values spreading everything then cutting gives, without the
    full [R, G, V] copy; tokens, counts and confidences keep all G positions."""
    from dspark.draft.base import spread_proposal
    from dspark.engine.engine import _lay_out
    from dspark.types import DraftProposal

    sub = DraftProposal(draft_tokens=torch.tensor([[4, 5, 6], [6, 7, 8]]), num_drafted=torch.tensor([3, 2]),
                        draft_probs=torch.rand(2, 3, 9), confidences=torch.rand(2, 3))
    whole = spread_proposal(sub, [0, 2], 3)
    for width in (0, 1, 3):
        laid = _lay_out(sub, [0, 2], 3, width)
        assert laid.draft_probs.shape == (3, width, 9)
        assert torch.equal(laid.draft_probs, whole.draft_probs[:, :width])
        assert torch.equal(laid.draft_tokens, whole.draft_tokens) and torch.equal(laid.confidences, whole.confidences)
        assert torch.equal(laid.num_drafted, whole.num_drafted)
    assert _lay_out(sub, None, 2, 3) is sub  # a proposal for everyone at full width is passed on as it is
    assert _lay_out(sub, None, 2, 1).draft_probs.data_ptr() == sub.draft_probs.data_ptr()  # a view, no copy


def test_measured_step_times_reprice_drafted_and_plain_steps_apart():
    """F(B) = 50 + 5 (B - 1) ms, D(R) = 20 R ms, one request with curve (0.6, 0.36, 0.216):
    the profile's best drafted step, verify 3, is 2.176 / (65 + 20) ms = 25.6 tok/s against
    plain 1 / 50 ms = 20: draft. Drafted steps measured at 1.5x their price (a cost the profile
    does not see) make it 17.1 tok/s: skip. Plain steps measured at 1.5x as well put both kinds
    back on the same footing: draft again."""
    from dspark.schedule import StepTiming
    from dspark.schedule.gate import COST_DECAY, PRIOR_STEPS

    gate = DraftGate(_split(50, 5, 20))
    gate.record([_req("a", [0.6, 0.6, 0.6])])
    assert gate.cost_ratio("plain") == gate.cost_ratio("drafted") == 1.0
    assert gate.best_drafts([[0.6, 0.36, 0.216]]) == [True]
    for _ in range(40):  # one drafted request verifying 3 tokens (B = 4), priced 85 ms, took 127.5
        gate.observe_step(StepTiming(requests=1, drafted=1, budget=4, seconds=0.1275))
    n = sum(COST_DECAY ** k for k in range(40))
    assert gate.cost_ratio("drafted") == pytest.approx((1.5 * n + PRIOR_STEPS) / (n + PRIOR_STEPS))
    assert gate.cost_ratio("plain") == 1.0
    assert gate.best_drafts([[0.6, 0.36, 0.216]]) == [False] and gate.choose(["a"]) == [False]
    for _ in range(40):  # plain steps priced 50 ms, took 75
        gate.observe_step(StepTiming(requests=1, drafted=0, budget=1, seconds=0.075))
    assert gate.cost_ratio("plain") == pytest.approx(gate.cost_ratio("drafted"))
    assert gate.best_drafts([[0.6, 0.36, 0.216]]) == [True]


def test_one_outlying_step_moves_a_cost_ratio_by_a_clipped_amount():
    """A step 100x its price (the process paused, say) counts as 4x, once."""
    from dspark.schedule import StepTiming
    from dspark.schedule.gate import PRIOR_STEPS, RATIO_CLIP

    gate = DraftGate(_split(50, 5, 20))
    gate.observe_step(StepTiming(requests=1, drafted=0, budget=1, seconds=5.0))
    assert gate.cost_ratio("plain") == pytest.approx((RATIO_CLIP[1] + PRIOR_STEPS) / (1 + PRIOR_STEPS))
    with pytest.raises(ValueError, match="inconsistent step timing"):
        StepTiming(requests=2, drafted=3, budget=4, seconds=0.1)
    with pytest.raises(ValueError, match="inconsistent step timing"):
        StepTiming(requests=2, drafted=1, budget=4, seconds=0.0)


def test_the_engine_reports_decode_only_steps_to_a_policy_that_prices_them():
    """Every decode-only step reaches `observe_step` with its requests, drafted requests and
    verified tokens; a step that carries a prompt chunk does not (its time is not the price of
    the decode step the gate chooses)."""
    from drafters_for_tests import BigramDrafter

    target = tiny_target(seed=0)
    policy = PrefixScheduler(_split(50, 5, 20))
    seen = []
    policy.observe_step = seen.append
    drafter = BigramDrafter(target.config.vocab_size, block_size=3, seed=1)
    engine = Engine(target, drafter, policy, EngineConfig(max_running=2, max_seq_len=64))
    engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_new_tokens=6))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert 0 < len(seen) < steps  # the first step was the prompt's
    assert all(t.requests == 1 and t.budget >= 1 and t.seconds > 0 for t in seen)
    assert all(t.budget == 1 for t in seen if t.drafted == 0)


def test_the_gate_drafts_no_one_the_scheduler_would_verify_nothing_of():
    """F(1) = 50 ms, a cliff to 110 ms at two tokens, then 1 ms a token; D(1) = 5 ms; one request
    with curve (0.9, 0.81, 0.729). Verifying all three pays (3.439 / 117 ms = 29 tok/s against
    1 / 50 ms = 20), so the gate's search of the whole path drafts. Algorithm 1 stops at the cliff
    (1.9 / 115 ms < 1 / 55 ms) and would verify nothing: under the causal scheduler the gate
    drafts no one (and counts the veto); a scheduler whose rule looks past the cliff lets it draft."""
    cost = SplitCost(CostTable({1: 0.050, 2: 0.110, 3: 0.111, 4: 0.112}), CostTable({1: 0.005, 2: 0.010}))
    curve = [0.9, 0.81, 0.729]
    gate = DraftGate(cost)
    gate.record([_req("a", [0.9, 0.9, 0.9])])
    assert gate.best_drafts([curve]) == [True] and not gate.verified_any([curve], [True])
    assert gate.choose(["a"]) == [False] and gate.vetoed == 1
    asked = []
    gate = DraftGate(cost, would_verify=lambda ids, curves, chosen: asked.append((list(ids), chosen)) or True)
    gate.record([_req("a", [0.9, 0.9, 0.9])])
    assert gate.choose(["a"]) == [True] and gate.vetoed == 0 and asked == [(["a"], [True])]
    assert PrefixScheduler(cost).gate.would_verify(["a"], [curve], [True]) is False
    # a curve that still stops at the cliff is vetoed; on a cost without the cliff it is drafted
    assert DraftGate(cost).verified_any([[0.99, 0.98, 0.97]], [True]) is False  # 1.99 / 115 < 1 / 55: still the cliff
    flat = SplitCost(CostTable({1: 0.050, 2: 0.060, 4: 0.070}), CostTable({1: 0.005, 2: 0.010}))
    gate = DraftGate(flat)
    gate.record([_req("a", [0.9, 0.9, 0.9])])
    assert gate.verified_any([curve], [True]) and gate.choose(["a"]) == [True] and gate.vetoed == 0


def test_the_async_gate_vetoes_by_the_rule_its_next_decide_will_use():
    """The cost curve of the test above, with its cliff at two tokens. The asynchronous scheduler's decide takes its capacity from a
    whole-path search over the snapshot two calls back when that snapshot has confidences (past
    the cliff: it verifies), and falls back to Algorithm 1 when it has none (stops at the cliff:
    verifies nothing). Its gate's veto follows the same rule, step by step; the decide that
    follows each choice agrees with it."""
    cost = SplitCost(CostTable({1: 0.050, 2: 0.110, 3: 0.111, 4: 0.112}), CostTable({1: 0.005, 2: 0.010}))
    sched = AsyncPrefixScheduler(cost)
    plain = ScheduleRequest("a", 0)
    assert sched.choose_drafts(["a"]) == [True]  # no curve yet: a probe learns one
    assert sum(sched.decide([_req("a", [0.9, 0.9, 0.9])])) == 0  # no snapshot yet: Algorithm 1, the cliff
    assert sched.choose_drafts(["a"]) == [False] and sched.gate.vetoed == 1  # the next snapshot is empty
    sched.decide([plain])
    # the next decide reads the drafted step's snapshot: its capacity search looks past the cliff
    assert sched.gate.would_verify(["a"], [[0.9, 0.81, 0.729]], [True])
    assert sched.choose_drafts(["a"]) == [True] and sched.gate.vetoed == 1
    assert sched.decide([_req("a", [0.9, 0.9, 0.9])]) == [3] and sched.last_capacity == 3
    # two calls back is now the plain step: Algorithm 1 again, and the veto with it
    assert sched.choose_drafts(["a"]) == [False] and sched.gate.vetoed == 2


def test_the_engine_tells_the_policy_each_requests_pending_context_rows():
    """With the DSpark drafter (context processed lazily) `choose_drafts` gets each decoding
    request's pending rows: the whole prompt before its first draft, the tokens committed since
    after it; the step timing of a drafted step carries the rows its propose processed."""
    from dspark.draft.factory import build_drafter
    from dspark.schedule import StepTiming

    target = tiny_target(seed=0)
    drafter = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, seed=1,
                            block_size=3, markov_rank=8)

    class Recorder:
        name = "recorder"

        def __init__(self) -> None:
            self.seen, self.timings, self.calls = [], [], 0

        def choose_drafts(self, request_ids, pending_rows=None):
            self.seen.append(list(pending_rows))
            self.calls += 1
            return [self.calls % 3 == 0] * len(request_ids)  # every third step drafts everyone

        def decide(self, requests):
            return [0] * len(requests)

        def commit(self, outcomes):
            pass

        def observe_step(self, timing: StepTiming):
            self.timings.append(timing)

    policy = Recorder()
    engine = Engine(target, drafter, policy, EngineConfig(max_running=2, max_seq_len=64))
    engine.add_request(list(range(5, 17)), SamplingParams(temperature=0.0, max_new_tokens=8))  # 12 tokens
    engine.add_request(list(range(20, 27)), SamplingParams(temperature=0.0, max_new_tokens=8))  # 7 tokens
    for _ in range(6):
        engine.step()
    # step 1 prefills (no decoding request, no choice); then a row a step: the hidden states of
    # the token each forward reads
    assert policy.seen[0] == [12, 7]  # the prompts, never processed
    assert policy.seen[1] == [13, 8]
    assert policy.seen[2] == [14, 9]  # this step drafts both: all of it is processed first
    assert policy.seen[3] == [1, 1]
    drafted = [t for t in policy.timings if t.drafted]
    assert drafted and drafted[0].projected_rows == 23
    assert all(t.projected_rows == 0 for t in policy.timings if not t.drafted)


@pytest.mark.parametrize("choices", [True, False])
def test_the_gate_learns_that_its_own_choices_on_stale_curves_fall_short(choices):
    """Every round that went well (an honest curve of 0.9s, 3 of 3 accepted) is followed by one
    that does not (an honest curve of 0.1s, nothing accepted): the acceptance ratio, which sets
    fresh curves beside outcomes, stays near 1, but the gate, choosing after the good rounds,
    gets nothing of what the stale curve promised. With `choices` it learns that and stops."""
    from dspark.schedule import ScheduleOutcome

    gate = DraftGate(_split(50, 5, 20), choices=choices)
    good, poor = [0.9, 0.9, 0.9], [0.1, 0.1, 0.1]
    for _ in range(8):
        gate.record([_req("a", good)])  # a round the gate did not choose (a probe, say)
        gate.observe_outcomes([ScheduleOutcome("a", 3, 3)])
        if not gate.choose(["a"])[0]:
            break
        promise = sum(min(1.0, a * gate.acceptance_ratio()) for a in (0.9, 0.81, 0.729))  # the survivals
        assert gate.promised["a"] == (pytest.approx(promise), 3)
        gate.record([_req("a", poor)])
        gate.observe_outcomes([ScheduleOutcome("a", 1, 0)])
    assert 0.95 < gate.acceptance_ratio() < 1.25
    gate.record([_req("a", good)])
    if choices:
        assert gate.choice_ratio() < 0.5 and gate.choose(["a"]) == [False]
    else:
        assert gate.choice_ratio() < 0.5 and gate.choose(["a"]) == [True]  # tracked, not applied


def test_a_choice_is_judged_only_on_the_positions_the_gate_priced():
    """The scheduler may verify more of a chosen draft than the gate priced; accepted tokens
    beyond the priced positions are not evidence about the gate's promise."""
    from dspark.schedule import ScheduleOutcome

    gate = DraftGate(_split(50, 15, 20))  # verify 1: 1.9 / 85 ms; verify 2: 2.08 / 100 ms
    gate.record([_req("a", [0.9, 0.2, 0.2])])
    assert gate.choose(["a"]) == [True]
    total, positions = gate.promised["a"]
    assert positions == 1 and total == pytest.approx(0.9)
    gate.observe_outcomes([ScheduleOutcome("a", 3, 3)])
    assert gate.chosen_realised == 1 and gate.chosen_promised == pytest.approx(0.9)
    assert gate.promised == {}
    gate.observe_outcomes([ScheduleOutcome("a", 3, 3)])  # no choice pending: the choice sums stay
    assert gate.chosen_realised == 1


def test_the_choice_correction_is_off_by_default_and_an_option_of_both_schedulers():
    from dspark.schedule import make_policy

    cost = _split(50, 5, 20)
    for name in ("dspark", "dspark-async"):
        assert make_policy(name, cost).gate.choices is False
        assert make_policy(name, cost, choices="on").gate.choices is True
        with pytest.raises(UserError, match="choices must be 'on' or 'off'"):
            make_policy(name, cost, choices="maybe")


def test_schedulers_pass_probe_max_to_their_gate():
    """`probe_max` (a policy option, `:probe_max=N` on a load-bench arm) sets how far the gate's
    probes back off while they find nothing; without it the gate's default, 4 x 32 steps."""
    from dspark.schedule import make_policy

    cost = _split(50, 5, 40)
    assert make_policy("dspark", cost).gate.max_probe_every == 128
    assert make_policy("dspark", cost, probe_max=512).gate.max_probe_every == 512
    assert make_policy("dspark-async", cost, probe_max=256).gate.max_probe_every == 256

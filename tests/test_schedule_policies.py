"""Verify-length policies: Algorithm 1 (paper numbers, brute force, ties), the
retrospective negative control, simple policies, the registry."""

import itertools
import random

import pytest

from dspark.errors import UserError
from dspark.schedule import (
    POLICY_NAMES,
    CostTable,
    FixedLength,
    NoSpeculation,
    PrefixScheduler,
    RetrospectivePrefixScheduler,
    ScheduleOutcome,
    ScheduleRequest,
    StaticThreshold,
    VerifyPolicy,
    expected_accepted,
    make_policy,
    survival,
)
from dspark.schedule.prefix import ranked_candidates

APPENDIX_A = CostTable.from_sps({1: 1.0, 2: 0.5, 3: 0.45})


def req(rid, confidences, num_drafted=None):
    n = len(confidences) if num_drafted is None else num_drafted
    return ScheduleRequest(request_id=rid, num_drafted=n, confidences=confidences)


def theta(requests, lengths, cost):
    """Expected throughput tau * SPS(B) of a verify-length choice (paper 3.2.2)."""
    tau = sum(1 + sum(survival(q)[:l]) for q, l in zip(requests, lengths))
    return tau * cost.sps(sum(1 + l for l in lengths))


def brute_force_best(requests, cost):
    ranges = [range(q.num_drafted + 1) for q in requests]
    return max(theta(requests, ls, cost) for ls in itertools.product(*ranges))


# --- paper Appendix A -------------------------------------------------------


def test_appendix_a_causal_scheduler_verifies_nothing():
    for c2 in (0.9, 0.0):
        assert PrefixScheduler(APPENDIX_A).decide([req("r", [0.8, c2])]) == [0]


def test_appendix_a_retrospective_scheduler_peeks_at_the_future():
    retro = RetrospectivePrefixScheduler(APPENDIX_A)
    assert retro.decide([req("r", [0.8, 0.9])]) == [2]  # Theta_2 = 1.134 beats Theta_0 = 1.0
    assert retro.decide([req("r", [0.8, 0.0])]) == [0]  # a_2 = 0: only Theta_0, Theta_1 = 0.9
    assert theta([req("r", [0.8, 0.9])], [2], APPENDIX_A) == pytest.approx(1.134)


# --- shape of the cost curve ------------------------------------------------


def test_flat_curve_verifies_every_token_with_positive_survival():
    flat = CostTable({1: 0.02})
    requests = [req("a", [0.9, 0.1, 0.5]), req("b", [0.3, 0.0, 0.9]), req("c", [0.05] * 4), req("d", [])]
    assert PrefixScheduler(flat).decide(requests) == [3, 1, 4, 0]


def test_steep_curve_verifies_nothing():
    steep = CostTable({b: 0.001 * b * b for b in range(1, 40)})  # time grows as B^2
    requests = [req(i, [1.0, 0.99, 0.99, 0.99]) for i in range(4)]
    assert PrefixScheduler(steep).decide(requests) == [0, 0, 0, 0]
    assert RetrospectivePrefixScheduler(steep).decide(requests) == [0, 0, 0, 0]


def test_moderate_curve_spends_budget_on_the_most_confident_request():
    linear = CostTable({1: 0.010, 64: 0.010 + 63 * 0.004})  # +4 ms per verified token
    requests = [req("low", [0.3, 0.3, 0.3]), req("high", [0.95, 0.95, 0.95])]
    assert PrefixScheduler(linear).decide(requests) == [0, 3]


# --- brute force over all (l_1..l_R) ------------------------------------------


def _random_instance(rng):
    requests = []
    for r in range(rng.randint(1, 3)):
        n = rng.randint(0, 4)
        cs = [rng.choice([rng.random(), rng.random(), 1.0, 0.0, rng.uniform(0.7, 1.0)]) for _ in range(n)]
        requests.append(req(r, cs))
    if rng.random() < 0.5:  # affine time per step: Theta is unimodal along the path
        t0, slope = rng.uniform(0.005, 0.05), rng.uniform(0.0, 0.02)
        cost = CostTable({1: t0, 20: t0 + 19 * slope})
    else:  # random non-decreasing time per step: may have several local maxima
        t, points = rng.uniform(0.005, 0.05), {}
        for b in range(1, 16):
            t += rng.choice([0.0, 0.0, rng.uniform(0, 0.02), rng.uniform(0, 0.002)])
            points[b] = t
        cost = CostTable(points)
    return requests, cost


def _path_is_unimodal(requests, cost):
    cands = ranked_candidates([survival(q) for q in requests])
    budget, tau = len(requests), float(len(requests))
    thetas = [tau * cost.sps(budget)]
    for _, _, a in cands:
        budget, tau = budget + 1, tau + a
        thetas.append(tau * cost.sps(budget))
    peak = thetas.index(max(thetas))
    rising = all(x < y for x, y in zip(thetas[:peak], thetas[1 : peak + 1]))
    falling = all(x >= y for x, y in zip(thetas[peak:], thetas[peak + 1 :]))
    return rising and falling


def test_prefix_schedulers_against_brute_force():
    rng = random.Random(1234)
    unimodal = multimodal = causal_suboptimal = 0
    for _ in range(600):
        requests, cost = _random_instance(rng)
        best = brute_force_best(requests, cost)
        causal = PrefixScheduler(cost).decide(requests)
        retro = RetrospectivePrefixScheduler(cost).decide(requests)
        # the path holds the optimum for every n, so the unconstrained search is globally optimal
        assert theta(requests, retro, cost) == pytest.approx(best, rel=1e-12)
        if _path_is_unimodal(requests, cost):
            unimodal += 1
            assert theta(requests, causal, cost) == pytest.approx(best, rel=1e-12)
        else:
            multimodal += 1
            causal_suboptimal += theta(requests, causal, cost) < best * (1 - 1e-9)
        assert theta(requests, causal, cost) <= best * (1 + 1e-12)
    assert unimodal > 200 and multimodal > 20 and causal_suboptimal > 5  # every branch exercised


def test_lengths_are_prefixes_within_drafted_range():
    rng = random.Random(7)
    for _ in range(200):
        requests, cost = _random_instance(rng)
        for policy in (PrefixScheduler(cost), RetrospectivePrefixScheduler(cost), StaticThreshold(0.4)):
            lengths = policy.decide(requests)
            assert len(lengths) == len(requests)
            for q, l in zip(requests, lengths):
                assert 0 <= l <= q.num_drafted
                assert all(a > 0 for a in survival(q)[:l]) or isinstance(policy, StaticThreshold)


# --- tie-breaking -----------------------------------------------------------


def test_ties_rank_position_then_request():
    survivals = [[0.5, 0.5, 0.25], [0.5, 0.5], [0.25]]
    order = [(r, j) for r, j, _ in ranked_candidates(survivals)]
    assert order == [(0, 1), (1, 1), (0, 2), (1, 2), (2, 1), (0, 3)]  # 0.25 tie: position 1 first


def test_tie_break_decides_who_gets_the_one_admitted_token():
    # Theta_0 = 2 * 1.0, Theta_1 = 2.5 * 0.9 = 2.25, Theta_2 = 3 * 0.7 = 2.1: admit exactly one
    cost = CostTable.from_sps({2: 1.0, 3: 0.9, 4: 0.7, 5: 0.5, 6: 0.4})
    requests = [req("x", [0.5, 1.0]), req("y", [0.5, 1.0])]
    assert PrefixScheduler(cost).decide(requests) == [1, 0]
    assert PrefixScheduler(cost).decide(requests[::-1]) == [1, 0]  # index order, not ids


def test_equal_survival_within_a_request_stays_a_prefix():
    cost = CostTable.from_sps({1: 1.0, 2: 0.9, 3: 0.8, 4: 0.3})
    # a = 0.8, 0.8, 0.8: Theta 1.0, 1.62, 1.92, then 1.02 -> stop after two
    assert PrefixScheduler(cost).decide([req("r", [0.8, 1.0, 1.0])]) == [2]


# --- confidences missing ----------------------------------------------------


def test_missing_confidences_verify_everything_drafted():
    steep = CostTable({b: 0.001 * b * b for b in range(1, 40)})
    plain = [ScheduleRequest("a", 3, None), ScheduleRequest("b", 5, None)]
    for policy in (PrefixScheduler(steep), RetrospectivePrefixScheduler(steep), StaticThreshold(0.9)):
        assert policy.decide(plain) == [3, 5]


def test_pinned_requests_count_in_the_budget():
    # alone, "c" gets its token: Theta_0 = 1 * 1.0 < Theta_1 = 1.9 * 0.9 = 1.71
    cost = CostTable.from_sps({1: 1.0, 2: 0.9, 5: 0.8, 6: 0.3})
    assert PrefixScheduler(cost).decide([req("c", [0.9])]) == [1]
    # next to a request pinned at 3 tokens, B starts at 5: 2 * 0.8 = 1.6 > 2.9 * 0.3
    mixed = [ScheduleRequest("p", 3, None), req("c", [0.9])]
    assert PrefixScheduler(cost).decide(mixed) == [3, 0]


# --- simple policies --------------------------------------------------------


def test_no_speculation_and_fixed_length():
    requests = [req("a", [0.9] * 4), req("b", [0.1] * 2), ScheduleRequest("c", 0, None)]
    assert NoSpeculation().decide(requests) == [0, 0, 0]
    assert FixedLength(1).decide(requests) == [1, 1, 0]  # MTP-1
    assert FixedLength(3).decide(requests) == [3, 2, 0]
    assert FixedLength(0).decide(requests) == [0, 0, 0]


def test_static_threshold_uses_cumulative_survival():
    # a = 0.9, 0.72, 0.36, 0.324
    q = req("a", [0.9, 0.8, 0.5, 0.9])
    assert StaticThreshold(0.7).decide([q]) == [2]
    assert StaticThreshold(0.72).decide([q]) == [2]  # >= threshold is kept
    assert StaticThreshold(0.95).decide([q]) == [0]
    assert StaticThreshold(0.0).decide([q, req("z", [0.0, 0.0])]) == [4, 2]
    assert StaticThreshold(0.3).decide([req("b", [0.9, 0.8, 0.5, 0.9], num_drafted=2)]) == [2]


def test_expected_accepted():
    assert expected_accepted([0.9, 0.8, 0.5], 0) == 0.0
    assert expected_accepted([0.9, 0.8, 0.5], 2) == pytest.approx(0.9 + 0.72)
    assert expected_accepted([0.9, 0.8, 0.5], 3) == pytest.approx(0.9 + 0.72 + 0.36)
    with pytest.raises(ValueError):
        expected_accepted([0.9], 2)


def test_records_validate():
    with pytest.raises(ValueError):
        ScheduleRequest("a", 3, [0.5, 0.5])  # fewer confidences than drafted tokens
    with pytest.raises(ValueError):
        ScheduleRequest("a", 1, [1.5])
    with pytest.raises(ValueError):
        ScheduleRequest("a", 1, [float("nan")])
    with pytest.raises(ValueError):
        ScheduleRequest("a", -1, None)
    with pytest.raises(ValueError):
        ScheduleOutcome("a", verify_len=2, num_accepted=3)
    assert survival(ScheduleRequest("a", 2, [0.5, 0.5, 0.9])) == [0.5, 0.25]  # padded row


# --- registry ---------------------------------------------------------------


def test_registry_builds_every_policy():
    cost = CostTable({1: 0.01})
    built = {
        "none": make_policy("none"),
        "fixed": make_policy("fixed", k=2),
        "threshold": make_policy("threshold", threshold=0.5),
        "dspark": make_policy("dspark", cost),
        "dspark-async": make_policy("dspark-async", cost),
        "retrospective": make_policy("retrospective", cost),
    }
    assert set(built) == set(POLICY_NAMES)
    requests = [req("a", [0.9, 0.9, 0.9])]
    for name, policy in built.items():
        assert isinstance(policy, VerifyPolicy) and policy.name == name
        assert len(policy.decide(requests)) == 1
        policy.commit([ScheduleOutcome("a", verify_len=1, num_accepted=1)])
    assert built["fixed"].decide(requests) == [2]


@pytest.mark.parametrize(
    "name, cost, options, message",
    [
        ("eagle", None, {}, "choose one of: none, fixed, threshold, dspark, dspark-async, retrospective"),
        ("fixed", None, {}, "needs option"),
        ("fixed", None, {"k": -1}, ">= 0"),
        ("fixed", None, {"k": 1.5}, "integer"),
        ("fixed", None, {"k": 2, "threshold": 0.5}, "does not take"),
        ("threshold", None, {"threshold": 1.5}, r"\[0, 1\]"),
        ("threshold", None, {}, "needs option"),
        ("dspark", None, {}, "cost table"),
        ("dspark-async", None, {}, "cost table"),
        ("dspark-async", CostTable({1: 0.01}), {"lag": 0}, "lag"),
        ("none", None, {"k": 1}, "valid options: none"),
        ("dspark", CostTable({1: 0.01}), {"probe_max": 8}, "probe_max must be an integer >= 32"),
        ("dspark-async", CostTable({1: 0.01}), {"probe_max": "often"}, "probe_max must be an integer >= 32"),
    ],
)
def test_registry_rejects_bad_names_and_options(name, cost, options, message):
    with pytest.raises(UserError, match=message):
        make_policy(name, cost, **options)

"""Asynchronous prefix scheduler (paper section 5.2): capacity K from the
confidences of two decide() calls earlier, top-K admission of the current
candidates, fallback to Algorithm 1 without history, batch changes."""

import random

from dspark.schedule import AsyncPrefixScheduler, CostTable, PrefixScheduler, RetrospectivePrefixScheduler, ScheduleRequest, survival
from dspark.schedule.prefix import greedy_walk, ranked_candidates


def req(rid, confidences, num_drafted=None):
    n = len(confidences) if num_drafted is None else num_drafted
    return ScheduleRequest(request_id=rid, num_drafted=n, confidences=confidences)


# 10 ms per step up to B = 4, then a cliff to 14 ms that stays flat to B = 16
CLIFF = CostTable({1: 0.010, 4: 0.010, 5: 0.014, 16: 0.014, 17: 0.030})


def top_k_lengths(requests, k):
    lengths = [0] * len(requests)
    for r, j, _ in ranked_candidates([survival(q) for q in requests])[:k]:
        lengths[r] = j
    return lengths


def test_first_two_calls_fall_back_to_algorithm_1():
    rng = random.Random(3)
    policy = AsyncPrefixScheduler(CLIFF)
    for _ in range(2):
        requests = [req(i, [rng.random() for _ in range(5)]) for i in range(3)]
        assert policy.decide(requests) == PrefixScheduler(CLIFF).decide(requests)
        assert policy.last_capacity is None
    policy.decide(requests)
    assert policy.last_capacity is not None


def test_global_search_on_history_crosses_the_cliff():
    history = [req("r", [0.95] * 8)]
    # Algorithm 1 stops before the cliff; the unconstrained search sees the gain beyond it
    assert PrefixScheduler(CLIFF).decide(history) == [3]
    assert RetrospectivePrefixScheduler(CLIFF).decide(history) == [8]
    policy = AsyncPrefixScheduler(CLIFF)
    policy.decide(history)
    policy.decide([req("r", [0.1] * 8)])
    # K = 8 comes from call 0; the current (low) confidences only rank the candidates
    assert policy.decide([req("r", [0.5] * 8)]) == [8]
    assert policy.last_capacity == 8


def test_capacity_ignores_current_confidences():
    capacities = []
    for current in ([0.99] * 6, [0.2] * 6, [0.7, 0.0, 0.5, 0.5, 0.5, 0.5]):
        policy = AsyncPrefixScheduler(CLIFF)
        policy.decide([req("a", [0.9] * 6), req("b", [0.6] * 6)])
        policy.decide([req("a", [0.3] * 6), req("b", [0.3] * 6)])
        policy.decide([req("a", current), req("b", [0.5] * 6)])
        capacities.append(policy.last_capacity)
    assert len(set(capacities)) == 1


def test_top_k_of_current_ranking_with_k_from_two_calls_back():
    rng = random.Random(11)
    cost = CostTable({1: 0.010, 8: 0.012, 12: 0.030, 30: 0.040})
    for _ in range(50):
        steps = [[req(i, [rng.uniform(0.2, 1.0) for _ in range(4)]) for i in range(3)] for _ in range(5)]
        policy = AsyncPrefixScheduler(cost)
        for t, requests in enumerate(steps):
            lengths = policy.decide(requests)
            if t < 2:
                continue
            k = sum(RetrospectivePrefixScheduler(cost).decide(steps[t - 2]))
            assert policy.last_capacity == k
            assert lengths == top_k_lengths(requests, k)


def test_capacity_is_clipped_to_current_candidates():
    flat = CostTable({1: 0.01})
    policy = AsyncPrefixScheduler(flat)
    policy.decide([req("a", [0.9] * 5), req("b", [0.9] * 5)])
    policy.decide([req("a", [0.9] * 5), req("b", [0.9] * 5)])
    # K = 10 from history; now "a" has 2 usable tokens and "b" has a zero confidence at 2
    assert policy.decide([req("a", [0.9] * 5, num_drafted=2), req("b", [0.9, 0.0, 0.9, 0.9, 0.9])]) == [2, 1]
    # K before clipping: "a" truncated to its current 2 drafted tokens, "b" all 5 from history
    assert policy.last_capacity == 2 + 5


def test_requests_joining_and_leaving():
    cost = CostTable({1: 0.010, 3: 0.011, 6: 0.016, 10: 0.030})
    ca, cb, cc = [0.9, 0.8, 0.7], [0.6, 0.5, 0.4], [0.99, 0.99, 0.99]
    policy = AsyncPrefixScheduler(cost)
    policy.decide([req("a", ca), req("b", cb)])
    policy.decide([req("a", ca), req("b", cb)])
    # "b" left, "c" joined: c stands in with the mean historical survival curve
    lengths = policy.decide([req("a", ca), req("c", cc)])
    sa, sb = survival(req("a", ca)), survival(req("b", cb))
    proxy = [(x + y) / 2 for x, y in zip(sa, sb)]
    expected_k = greedy_walk(ranked_candidates([sa, proxy]), cost, 2, 2, early_stop=False)
    assert policy.last_capacity == expected_k
    assert lengths == top_k_lengths([req("a", ca), req("c", cc)], expected_k)
    # only "a" stays: its own history, a lighter load (B starts at 1)
    policy.decide([req("a", ca)])
    assert policy.last_capacity == greedy_walk(ranked_candidates([sa]), cost, 1, 1, early_stop=False)


def test_no_usable_history_falls_back():
    policy = AsyncPrefixScheduler(CLIFF)
    policy.decide([])
    policy.decide([req("x", [0.9] * 4)])
    assert policy.decide([req("x", [0.9] * 4)]) == PrefixScheduler(CLIFF).decide([req("x", [0.9] * 4)])
    assert policy.last_capacity is None  # two calls back was empty
    policy.decide([req("x", [0.9] * 4)])
    assert policy.last_capacity is not None
    policy.reset()
    policy.decide([req("x", [0.9] * 4)])
    assert policy.last_capacity is None


def test_history_without_confidences_falls_back_and_pinned_requests_stay_pinned():
    policy = AsyncPrefixScheduler(CLIFF)
    plain = [ScheduleRequest("p", 4, None)]
    assert policy.decide(plain) == [4]
    assert policy.decide(plain) == [4]
    assert policy.decide(plain + [req("c", [0.9] * 4)]) == [4, PrefixScheduler(CLIFF).decide(plain + [req("c", [0.9] * 4)])[1]]
    assert policy.last_capacity is None


def test_lag_option_changes_the_history_depth():
    policy = AsyncPrefixScheduler(CostTable({1: 0.01}), lag=1)
    assert policy.decide([req("a", [0.9] * 3)]) == [3]
    assert policy.last_capacity is None
    policy.decide([req("a", [0.9] * 3)])
    assert policy.last_capacity == 3


def test_a_plain_step_verifies_nothing_and_keeps_the_snapshot_history():
    """A step nobody drafted in returns zeros at once, with no capacity searched; it still counts
    as one of the two calls the capacity lags by, so the next drafted step's K comes from the
    snapshot two calls back, as without the shortcut."""
    policy = AsyncPrefixScheduler(CLIFF)
    policy.decide([req("r", [0.95] * 8)])
    assert policy.decide([req("r", None, num_drafted=0), req("s", None, num_drafted=0)]) == [0, 0]
    assert policy.last_capacity is None
    assert PrefixScheduler(CLIFF).decide([req("r", None, num_drafted=0)]) == [0]
    # K = 8 from the first call, two calls back (Algorithm 1 alone would stop at 3)
    assert policy.decide([req("r", [0.5] * 8)]) == [8] and policy.last_capacity == 8

"""Non-anticipation, checked exhaustively on random instances.

Lossless speculative decoding needs the event "draft token j of request r is
verified" (l_r >= j) to be decided before x_{r,j} is seen. A Markov
confidence head computes c_{r,j+1} from x_{r,j}, so the event must not change
when c_{r,j+1}, c_{r,j+2}, ... change. This test rewrites those confidences
at random and checks the event, for every (r, j). It is deterministic; the
statistical test of output distributions is tests/test_schedule_lossless.py.
It must catch the retrospective scheduler (paper Appendix A).
"""

import random

from dspark.schedule import AsyncPrefixScheduler, CostTable, PrefixScheduler, RetrospectivePrefixScheduler, ScheduleRequest, StaticThreshold

GAMMA = 4


def _requests(rng, n):
    return [ScheduleRequest(i, GAMMA, [rng.choice([rng.random(), rng.uniform(0.6, 1.0), 0.0]) for _ in range(GAMMA)]) for i in range(n)]


def _cost(rng):
    t, points = rng.uniform(0.005, 0.02), {}
    for b in range(1, 4 * (GAMMA + 1) + 1):
        t += rng.choice([0.0, rng.uniform(0, 0.004), rng.uniform(-0.002, 0.01)])  # jagged
        points[b] = max(t, 0.001)
    return CostTable(points)


def _rewrite_after(requests, r, j, rng):
    """Same requests, with c_{r,j+1..} replaced (what a different x_{r,j} could do)."""
    q = requests[r]
    new = list(q.confidences[:j]) + [rng.choice([0.0, 1.0, rng.random()]) for _ in range(GAMMA - j)]
    return requests[:r] + [ScheduleRequest(q.request_id, q.num_drafted, new)] + requests[r + 1 :]


def count_violations(make_decide, trials=150, seed=0):
    """Number of (instance, r, j, rewrite) where [l_r >= j] changed."""
    rng = random.Random(seed)
    violations = 0
    for _ in range(trials):
        cost = _cost(rng)
        decide = make_decide(cost, rng)
        requests = _requests(rng, rng.randint(1, 3))
        base = decide(requests)
        for r in range(len(requests)):
            for j in range(1, GAMMA + 1):
                for _ in range(3):
                    other = decide(_rewrite_after(requests, r, j, rng))
                    violations += (base[r] >= j) != (other[r] >= j)
    return violations


def _plain(cls):
    return lambda cost, rng: cls(cost).decide


def _async(cost, rng):
    history = [_requests(rng, 3), _requests(rng, 3)]

    def decide(requests):
        policy = AsyncPrefixScheduler(cost)
        for step in history:
            policy.decide(step)
        return policy.decide(requests)

    return decide


def test_causal_scheduler_never_anticipates():
    assert count_violations(_plain(PrefixScheduler)) == 0


def test_async_scheduler_never_anticipates():
    assert count_violations(_async) == 0


def test_threshold_never_anticipates():
    assert count_violations(lambda cost, rng: StaticThreshold(rng.random()).decide) == 0


def test_retrospective_scheduler_is_caught():
    assert count_violations(_plain(RetrospectivePrefixScheduler)) > 0

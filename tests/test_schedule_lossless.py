"""Statistical losslessness of speculative decoding under each verify-length
policy, on the enumerable synthetic world of tests/lossless_harness.py, and
the power check: the same test rejects the retrospective scheduler (paper
Appendix A).

Policies see fabricated Markov confidences: c_k is a fixed function of the
token before position k (the last committed token for k = 1, draft token
k - 1 after), like the Markov confidence head, so c_{k+1} reveals x_k. One
test uses the harness's true acceptance rates instead (calibrated, also
dependent on earlier draft tokens only). The S sequences are cut into
batches of R consecutive sequences; each batch is one engine with its own
policy object (the asynchronous scheduler keeps per-batch history) driven
through decide and commit; request ids are sequence indices, stable across
rounds, and a sequence that has its n tokens leaves its batch.

Statistics: each test draws S independent continuations of n = 3 tokens
after a fixed prefix and runs Pearson's chi-square test against the exact
target distribution (computed by enumeration; cells with expected count < 5
pooled; any sample in a zero-probability cell fails). A test fails when
p < ALPHA = 1e-6, so a lossless policy fails with probability ~1e-6 per test.
Seeds are fixed, so every run is deterministic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch

from dspark.schedule import CostTable, ScheduleOutcome, ScheduleRequest, VerifyPolicy, make_policy
from dspark.types import SamplingParams, VerifyResult
from dspark.verify import SamplingTensors
from lossless_harness import ALPHA, NgramTable, RoundState, TableDrafter, World, chi_square, exact_joint, lossless_check, run_speculative

ConfidenceFn = Callable[[RoundState], torch.Tensor]  # -> [S, G] float confidences


def markov_confidences(table: list[float]) -> ConfidenceFn:
    """c_k = table[token before position k]: a Markov confidence head's shape."""
    values = torch.tensor(table, dtype=torch.float32)

    def confidences(state: RoundState) -> torch.Tensor:
        last = state.committed.gather(1, (state.num_committed - 1)[:, None])  # [S, 1]
        previous = torch.cat([last, state.draft_tokens[:, :-1]], dim=1)  # [S, G]
        return values[previous]

    return confidences


def true_confidences(state: RoundState) -> torch.Tensor:
    return state.confidences


class PolicyLengths:
    """A harness `choose_len` (plus `observe`) that drives one policy object
    per batch of R sequences through decide, then commit. Finished sequences
    leave their batch (they get length 0 and are not scheduled)."""

    def __init__(self, make: Callable[[], VerifyPolicy], batch: int, confidences: ConfidenceFn) -> None:
        self.make, self.batch, self.confidences = make, batch, confidences
        self.policies: dict[int, VerifyPolicy] = {}
        self.scheduled: dict[int, list[int]] = {}  # batch start -> sequences decided this round
        self.histogram: Counter[int] = Counter()  # verify lengths chosen for active sequences

    def __call__(self, state: RoundState) -> torch.Tensor:
        rows = self.confidences(state).tolist()
        active = state.active.tolist()
        lengths = [0] * len(rows)
        for start in range(0, len(rows), self.batch):
            policy = self.policies.get(start) or self.policies.setdefault(start, self.make())
            ids = [i for i in range(start, min(start + self.batch, len(rows))) if active[i]]
            decided = policy.decide([ScheduleRequest(i, state.block_size, rows[i]) for i in ids])
            for i, length in zip(ids, decided):
                lengths[i] = length
            self.scheduled[start] = ids
            self.histogram.update(decided)
        return torch.tensor(lengths, dtype=torch.int64)

    def observe(self, state: RoundState, lens: torch.Tensor, result: VerifyResult) -> None:
        verify_lens, accepted = lens.tolist(), result.num_accepted.tolist()
        for start, ids in self.scheduled.items():
            self.policies[start].commit([ScheduleOutcome(i, verify_lens[i], accepted[i]) for i in ids])


# ---- a random world: V = 8 trigram target, disagreeing bigram drafter, G = 4 ----

GENTLE = CostTable({1: 1.0, 4: 1.1, 6: 1.5, 10: 2.2, 16: 3.5})  # smooth: lengths spread over 0..4
JAGGED = CostTable({1: 1.0, 3: 1.05, 4: 1.6, 10: 1.9, 16: 3.5})  # a cliff at B = 4
MARKOV = markov_confidences([0.95, 0.9, 0.7, 0.5, 0.3, 0.1, 0.0, 0.98])
SAMPLES = 40_000

CASES = {
    "dspark": (lambda: make_policy("dspark", GENTLE), 2, MARKOV),
    "dspark-jagged": (lambda: make_policy("dspark", JAGGED), 2, MARKOV),
    "dspark-true-confidences": (lambda: make_policy("dspark", GENTLE), 3, true_confidences),
    "dspark-async": (lambda: make_policy("dspark-async", JAGGED), 2, MARKOV),
    "threshold": (lambda: make_policy("threshold", threshold=0.5), 2, MARKOV),
}


@pytest.mark.parametrize("case", list(CASES))
def test_policy_is_lossless_on_a_random_world(case):
    """40,000 continuations of 3 tokens (512 cells) at temperature 1, verify
    lengths from the policy under test; chi-square, fails if p < 1e-6 (false
    failure ~1e-6). The chosen lengths must be varied, or the test says
    nothing about the scheduler."""
    make, batch, confidences = CASES[case]
    choose = PolicyLengths(make, batch, confidences)
    result = lossless_check(choose, SamplingParams(temperature=1.0), num_samples=SAMPLES, seed=31, observe=choose.observe)
    assert result.p_value > ALPHA, (case, result)
    total = sum(choose.histogram.values())
    assert len(choose.histogram) >= 2 and max(choose.histogram.values()) < 0.9 * total, choose.histogram


# ---- paper Appendix A: V = {A, B}, p_target = (0.7, 0.3), p_draft = (0.5, 0.5), G = 2 ----

APPENDIX_COST = CostTable.from_sps({1: 1.0, 2: 0.5, 3: 0.45})
APPENDIX_SAMPLES = 20_000


def appendix_confidences(state: RoundState) -> torch.Tensor:
    """c_1 = 0.8 (the true acceptance rate); c_2 = 0.9 after x_1 = A, 0 after x_1 = B."""
    c2 = torch.where(state.draft_tokens[:, 0] == 0, 0.9, 0.0)
    return torch.stack([torch.full_like(c2, 0.8), c2], dim=1)


def run_appendix_a(make: Callable[[], VerifyPolicy], seed: int) -> tuple[float, torch.Tensor, PolicyLengths]:
    world = World(NgramTable.constant([0.7, 0.3]), (0,), 2)
    drafter = TableDrafter(NgramTable.constant([0.5, 0.5]))
    choose = PolicyLengths(make, 1, appendix_confidences)
    samples = run_speculative(
        world, drafter, choose, SamplingTensors.uniform(APPENDIX_SAMPLES), 3, seed, observe=choose.observe
    )
    result = chi_square(samples, exact_joint(world, SamplingParams(), 3), 2)
    return result.p_value, samples, choose


def test_retrospective_scheduler_is_rejected():
    """The retrospective scheduler verifies x1 only when x1 = A, so the first
    token comes out A with probability 0.85 instead of 0.7 (paper Appendix A).
    20,000 samples: the frequency is checked within 5 standard errors of
    0.85, and the chi-square test must reject at p < 1e-6."""
    p_value, samples, choose = run_appendix_a(lambda: make_policy("retrospective", APPENDIX_COST), seed=41)
    first_a = float((samples[:, 0] == 0).double().mean())
    assert abs(first_a - 0.85) < 5 * (0.85 * 0.15 / APPENDIX_SAMPLES) ** 0.5, first_a
    assert p_value < ALPHA
    assert set(choose.histogram) == {0, 2}


@pytest.mark.parametrize(
    "name, options, lengths",
    [
        ("dspark", {}, {0}),  # Theta_1 = 0.9 < Theta_0 = 1: stops before looking at c_2
        ("dspark-async", {}, {0, 1, 2}),  # K from two rounds back: 2 or 0
        ("threshold", {"threshold": 0.7}, {1, 2}),  # a_1 = 0.8 kept; a_2 = 0.72 or 0
    ],
)
def test_lossless_policies_pass_appendix_a(name, options, lengths):
    """The same world, confidences and cost as the retrospective rejection:
    each lossless policy passes. 20,000 samples of 3 tokens (8 cells),
    chi-square, fails if p < 1e-6 (false failure ~1e-6)."""
    p_value, _, choose = run_appendix_a(lambda: make_policy(name, APPENDIX_COST, **options), seed=42)
    assert p_value > ALPHA, (name, p_value)
    assert set(choose.histogram) == lengths

"""Aggregation math on fabricated SpecStats (tau per benchmark, domain, macro;
conditional acceptance per position and domain), the JSON round trip, and the
threshold-sweep and reliability replays on fabricated rounds."""

from __future__ import annotations

import math

import pytest

from dspark.eval.records import (
    BenchResult,
    DrafterRun,
    EvalRun,
    EvalSettings,
    RoundRecord,
    domain_means,
    domain_position_acceptance,
    macro_mean,
    run_from_dict,
    summary,
)
from dspark.eval.sweeps import reliability_samples, replay_length, threshold_sweep, uncalibrate
from dspark.types import SpecStats


def _stats(rounds: list[tuple[int, int]], block_size: int = 4) -> SpecStats:
    """SpecStats from (verify_len, num_accepted) rounds."""
    s = SpecStats(block_size=block_size)
    for verify_len, accepted in rounds:
        s.record(verify_len, accepted)
    return s


def test_tau_and_conditional_acceptance_of_one_benchmark():
    # three rounds verifying 4: accepted 4, 1, 0 -> committed 5 + 2 + 1 = 8 over 3 rounds
    s = _stats([(4, 4), (4, 1), (4, 0)])
    assert s.mean_accepted_length == pytest.approx(8 / 3)
    # position 1 reached by 3 rounds, accepted by 2; position 2 reached by 2, accepted by 1;
    # positions 3, 4 reached by the one round that accepted everything
    assert s.per_position_acceptance == [pytest.approx(2 / 3), 0.5, 1.0, 1.0]


def test_domain_and_macro_means_follow_the_paper():
    # the paper's Qwen3-4B DSpark row: math mean 5.57, code 5.12, chat 3.49
    taus = {"gsm8k": 6.11, "math500": 5.70, "aime25": 4.89, "mbpp": 5.13, "humaneval": 5.38,
            "livecodebench": 4.86, "mt-bench": 3.64, "alpaca": 3.54, "arena-hard-v2": 3.29}
    doms = domain_means(taus)
    assert doms["math"] == pytest.approx(5.5667, abs=1e-4)
    assert doms["code"] == pytest.approx(5.1233, abs=1e-4)
    assert doms["chat"] == pytest.approx(3.49, abs=1e-4)
    assert macro_mean(taus) == pytest.approx(sum(taus.values()) / 9)


def test_macro_weights_domains_equally_when_benchmarks_are_missing():
    taus = {"gsm8k": 4.0, "math500": 2.0, "alpaca": 1.0}
    assert domain_means(taus) == {"math": 3.0, "chat": 1.0}
    assert macro_mean(taus) == pytest.approx(2.0)  # not the mean of the three (7/3)
    assert macro_mean({}) is None


def test_domain_position_acceptance_averages_benchmarks_and_skips_unreached():
    per_bench = {"mbpp": [0.8, 0.5, None], "humaneval": [0.6, None, None], "alpaca": [0.1, 0.2, 0.3]}
    assert domain_position_acceptance(per_bench, "code") == [pytest.approx(0.7), 0.5, None]
    assert domain_position_acceptance(per_bench, "chat") == [0.1, 0.2, 0.3]
    assert domain_position_acceptance(per_bench, "math") == []


def _run() -> EvalRun:
    def bench(name, domain, rounds, tokens, seconds):
        return BenchResult(name, domain, 2, 2, tokens, seconds, _stats(rounds),
                           [RoundRecord(v, a, [0.9, 0.8, 0.5, 0.2][:v]) for v, a in rounds])

    fast = DrafterRun("ngram", "ngram", "ngram", 4, True, [1.0, 2.0, 1.0, 1.0], {
        "gsm8k": bench("gsm8k", "math", [(4, 3), (4, 1)], 100, 2.0),
        "alpaca": bench("alpaca", "chat", [(2, 0), (4, 4)], 60, 2.0),
    })
    base = DrafterRun("none", "none", "none", 1, False, None, {
        "gsm8k": BenchResult("gsm8k", "math", 2, 2, 100, 5.0, _stats([(0, 0)] * 100, 1)),
        "alpaca": BenchResult("alpaca", "chat", 2, 2, 60, 3.0, _stats([(0, 0)] * 60, 1)),
    })
    settings = EvalSettings(("gsm8k", "alpaca"), 2, 1.0, 4, 64, 0, "tiny", "float32")
    return EvalRun(settings, "dspark eval --drafter none,ngram", [base, fast], created="2026-01-01T00:00:00")


def test_summary_and_speedup():
    out = summary(_run())
    assert out["ngram"]["tau"] == {"gsm8k": pytest.approx(3.0), "alpaca": pytest.approx(3.0)}
    assert out["ngram"]["tau_macro"] == pytest.approx(3.0)
    assert out["none"]["tau_macro"] == 1.0
    assert out["ngram"]["tokens_per_second"] == pytest.approx(160 / 4.0)
    assert out["ngram"]["speedup_vs_none"] == pytest.approx((160 / 4.0) / (160 / 8.0))
    assert out["ngram"]["conditional_acceptance"]["math"][0] == 1.0


def test_json_round_trip():
    run = _run()
    again = run_from_dict(run.as_dict())
    assert again.as_dict() == run.as_dict()
    assert again.drafters[1].benches["gsm8k"].rounds[0] == RoundRecord(4, 3, [0.9, 0.8, 0.5, 0.2])


def test_threshold_sweep_replay():
    rounds = [RoundRecord(4, 3, [0.9, 0.8, 0.5, 0.2]),  # survival 0.9 0.72 0.36 0.072
              RoundRecord(4, 0, [0.4, 0.9, 0.9, 0.9])]  # survival 0.4 0.36 0.324 0.2916
    assert [replay_length(rounds[0], t) for t in (0.0, 0.1, 0.5, 0.8, 0.95)] == [4, 3, 2, 1, 0]
    at = {p.threshold: p for p in threshold_sweep(rounds, (0.0, 0.5, 0.95))}
    # threshold 0 is fixed-length verification: 3 + 0 accepted, 1 + 4 rejected over 2 rounds
    assert (at[0.0].accepted_per_step, at[0.0].rejected_per_step) == (1.5, 2.5)
    assert at[0.0].acceptance_rate == pytest.approx(3 / 8)
    # 0.5: round 1 verifies 2 (both accepted), round 2 verifies none
    assert (at[0.5].accepted_per_step, at[0.5].rejected_per_step, at[0.5].acceptance_rate) == (1.0, 0.0, 1.0)
    assert at[0.95].acceptance_rate is None


def test_uncalibrate_inverts_sts_and_reliability_samples():
    raw = [0.95, 0.7, 0.3]
    temps = [2.0, 0.5, 1.0]
    logit = lambda p: math.log(p / (1 - p))  # noqa: E731
    calibrated = [1 / (1 + math.exp(-logit(c) / t)) for c, t in zip(raw, temps)]
    assert uncalibrate(calibrated, temps) == pytest.approx(raw)
    rounds = [RoundRecord(3, 1, calibrated), RoundRecord(1, 1, calibrated[:1]), RoundRecord(3, 3, calibrated)]
    s2 = reliability_samples(rounds, temps, 2)
    assert s2.observed == [0.0, 1.0]  # the round that verified only 1 token is not a sample at position 2
    assert s2.after == pytest.approx([calibrated[0] * calibrated[1]] * 2)
    assert s2.before == pytest.approx([raw[0] * raw[1]] * 2)

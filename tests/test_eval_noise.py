"""Bootstrap intervals of macro tau (dspark.eval.noise) on fabricated per-prompt counts."""

from __future__ import annotations

import random

import pytest

from dspark.eval.benchmarks import BENCHMARKS
from dspark.eval.noise import macro_interval, paired_ratio_interval
from dspark.eval.records import BenchResult, DrafterRun, EvalRun, EvalSettings, macro_mean, run_from_dict
from dspark.eval.report import run_report
from dspark.types import SpecStats


def _drafter(label: str, prompt_taus: dict[str, list[float]], rounds: int = 50) -> DrafterRun:
    """Each prompt runs `rounds` rounds committing round(tau * rounds) tokens."""
    benches = {}
    for name, taus in prompt_taus.items():
        per_prompt = [(f"{name}-{i}", rounds, round(t * rounds)) for i, t in enumerate(taus)]
        stats = SpecStats(block_size=7, rounds=rounds * len(taus), committed_tokens=sum(c for *_, c in per_prompt))
        stats.accepted_tokens = stats.committed_tokens - stats.rounds
        benches[name] = BenchResult(name, BENCHMARKS[name], len(taus), len(taus), stats.committed_tokens, 1.0,
                                    stats, per_prompt=per_prompt)
    return DrafterRun(label, label, "dspark", 7, False, None, benches)


def _spread(n: int, seed: int, scale: float = 1.0) -> dict[str, list[float]]:
    rng = random.Random(seed)
    return {name: [scale * (1.0 + rng.uniform(0.0, 1.0)) for _ in range(n)] for name in BENCHMARKS}


def test_point_is_the_tables_macro_and_equal_prompts_leave_no_spread():
    d = _drafter("a", _spread(3, 0))
    iv = macro_interval(d)
    assert iv.point == pytest.approx(macro_mean(d.taus()))
    assert iv.low <= iv.point <= iv.high and iv.high - iv.low > 0.05
    flat = macro_interval(_drafter("flat", {name: [1.4] * 3 for name in BENCHMARKS}))
    assert flat.low == pytest.approx(1.4) and flat.high == pytest.approx(1.4)


def test_more_prompts_give_a_narrower_interval():
    narrow, wide = macro_interval(_drafter("n", _spread(48, 1))), macro_interval(_drafter("w", _spread(3, 1)))
    assert narrow.high - narrow.low < (wide.high - wide.low) / 2


def test_pairing_cancels_what_two_drafters_share():
    taus = _spread(3, 2)
    a = _drafter("a", taus, rounds=1000)
    b = _drafter("b", {name: [1.1 * t for t in v] for name, v in taus.items()}, rounds=1000)
    ratio = paired_ratio_interval(b, a)
    assert ratio.point == pytest.approx(1.1, abs=1e-3)
    assert ratio.high - ratio.low < 0.005  # every prompt is 1.1x: resampling cannot move the ratio
    ia, ib = macro_interval(a), macro_interval(b)
    assert ib.low < ia.high  # unpaired, the two intervals overlap: they could not tell 1.1x apart


def test_missing_or_mismatched_counts_give_none():
    old = _drafter("old", _spread(3, 3))
    for bench in old.benches.values():
        bench.per_prompt = []
    assert macro_interval(old) is None
    a, b = _drafter("a", _spread(3, 4)), _drafter("b", _spread(4, 4))
    assert paired_ratio_interval(a, b) is None  # other prompts: not paired
    assert paired_ratio_interval(a, old) is None
    with pytest.raises(ValueError, match="level"):
        macro_interval(a, level=1.5)


def test_counts_round_trip_and_the_report_lists_intervals(tmp_path):
    settings = EvalSettings(tuple(BENCHMARKS), 3, 1.0, None, 64, 0, "tiny", "float32")
    taus = _spread(3, 5)
    a = _drafter("dflash-x", taus)
    b = _drafter("dspark-x", {name: [1.05 * t for t in v] for name, v in taus.items()})
    run = EvalRun(settings, "dspark eval --drafter dflash-x,dspark-x", [a, b], created="2026-01-01T00:00:00")
    again = run_from_dict(run.as_dict())
    assert again.drafters[1].benches["gsm8k"].per_prompt == b.benches["gsm8k"].per_prompt
    run.save(tmp_path / "runs")
    text = run_report(tmp_path / "runs", tmp_path / "RESULTS.md", tmp_path / "fig").markdown.read_text()
    section = text.split("## How noisy are these numbers, temperature 1.0")[1]
    assert "dflash-x (G=7)" in section and "dspark-x (G=7) / dflash-x (G=7)" in section
    ratio = next(line for line in section.splitlines() if line.startswith("| dspark-x (G=7) / dflash-x"))
    assert "1.05" in ratio.split("|")[3]


def test_a_later_smaller_run_does_not_hide_the_comparable_pair(tmp_path):
    """Run 1 has a and b on 3 prompts each; run 2 has b again on 2 prompts (other settings). Table 1
    shows b's newest run, but the intervals keep run 1's b, so a / b is still listed."""
    big = EvalSettings(tuple(BENCHMARKS), 3, 1.0, None, 64, 0, "tiny", "float32")
    small = EvalSettings(tuple(BENCHMARKS), 2, 1.0, None, 64, 0, "tiny", "float32")
    taus = _spread(3, 6)
    a = _drafter("eagle3-x", {name: [1.1 * t for t in v] for name, v in taus.items()})
    EvalRun(big, "dspark eval --drafter dspark-x,eagle3-x", [_drafter("dspark-x", taus), a],
            created="2026-01-01T00:00:00").save(tmp_path / "runs")
    EvalRun(small, "dspark eval --drafter dspark-x --limit 2", [_drafter("dspark-x", _spread(2, 7))],
            created="2026-01-02T00:00:00").save(tmp_path / "runs")
    text = run_report(tmp_path / "runs", tmp_path / "RESULTS.md", tmp_path / "fig").markdown.read_text()
    table1 = text.split("## Table 1")[1].split("##")[0]
    assert "| dspark-x | [2] |" in table1  # the newest run of each drafter
    section = text.split("## How noisy are these numbers, temperature 1.0")[1]
    assert "| dspark-x (G=7) | [1] |" in section and "| dspark-x (G=7) | [2] |" in section
    ratio = next(line for line in section.splitlines() if line.startswith("| eagle3-x (G=7) / dspark-x (G=7)"))
    assert "[1] / [1]" in ratio and float(ratio.split("|")[3].strip().rstrip("x")) == pytest.approx(1.1, abs=0.005)

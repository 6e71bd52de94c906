"""run_report from fabricated saved runs: Table 1 and the figures are written
when their inputs exist, and a sweep without inputs is left out with a note,
never drawn from nothing."""

from __future__ import annotations

import json
import random

import pytest

from dspark.errors import UserError
from dspark.eval.benchmarks import BENCHMARKS
from dspark.eval.records import BenchResult, DrafterRun, EvalRun, EvalSettings, RoundRecord
from dspark.eval.report import run_report
from dspark.types import SpecStats


def _bench(name: str, block: int, rng: random.Random, confident: bool, skill: float) -> BenchResult:
    """Rounds whose acceptance follows the recorded confidences."""
    stats, rounds = SpecStats(block_size=block), []
    for _ in range(40):
        conf = [min(0.99, max(0.01, skill + rng.uniform(-0.3, 0.3))) for _ in range(block)]
        accepted = 0
        while accepted < block and rng.random() < conf[accepted]:
            accepted += 1
        stats.record(block, accepted)
        rounds.append(RoundRecord(block, accepted, conf if confident else []))
    return BenchResult(name, BENCHMARKS[name], 2, 2, stats.committed_tokens, 2.0, stats,
                       rounds if confident else [])


def _drafter(label: str, kind: str, block: int, seed: int, confident: bool = False, temps=None) -> DrafterRun:
    rng = random.Random(seed)
    skill = {"math": 0.8, "code": 0.7, "chat": 0.5}
    benches = {n: _bench(n, block, rng, confident, skill[d]) for n, d in BENCHMARKS.items()}
    return DrafterRun(label, label, kind, block, confident, temps, benches)


def _none() -> DrafterRun:
    benches = {}
    for n, d in BENCHMARKS.items():
        s = SpecStats(block_size=1)
        for _ in range(50):
            s.record(0, 0)
        benches[n] = BenchResult(n, d, 2, 2, 50, 4.0, s)
    return DrafterRun("none", "none", "none", 1, False, None, benches)


def _save(folder, drafters, temperature=1.0, created="2026-01-01T00:00:00", block=None) -> None:
    settings = EvalSettings(tuple(BENCHMARKS), 2, temperature, block, 64, 0, "tiny", "float32")
    specs = ",".join(d.spec for d in drafters)
    EvalRun(settings, f"dspark eval --drafter {specs} --temperature {temperature:g}", drafters,
            created=created).save(folder)


def test_report_with_every_input_draws_every_figure(tmp_path):
    runs = tmp_path / "runs"
    temps = [1.5, 1.2, 1.0, 0.9]
    _save(runs, [_none(), _drafter("dspark-g4", "dspark", 4, 1, confident=True, temps=temps)])
    _save(runs, [_drafter("dspark-g8", "dspark", 8, 2, confident=True, temps=temps * 2)],
          created="2026-01-02T00:00:00")
    _save(runs, [_drafter("ngram", "ngram", 4, 3)], temperature=0.0, created="2026-01-03T00:00:00")
    out, figs = tmp_path / "docs" / "RESULTS.md", tmp_path / "docs" / "figures"
    report = run_report(runs, out, figs)
    names = sorted(p.name for p in figs.iterdir())
    assert names == ["fig2_conditional_acceptance.png", "fig4_tau_vs_proposal_length.png",
                     "fig5_threshold_sweep_dspark-g4.png", "fig5_threshold_sweep_dspark-g8.png",
                     "fig6_reliability_dspark-g4.png", "fig6_reliability_dspark-g8.png"]
    assert all(p.stat().st_size > 10_000 for p in figs.iterdir())
    assert report.left_out == []
    text = out.read_text()
    assert "![Fig. 2](figures/fig2_conditional_acceptance.png)" in text
    assert "Made by:" in text and "dspark eval --drafter none,dspark-g4 --temperature 1" in text
    assert "python -m dspark.eval.report" in text
    assert "greedy" in text and "| ngram | [3] | 4 |" in text  # the greedy run gets its own table
    assert "Left out" not in text
    # Table 1 values are the fabricated runs' own tau, to two decimals
    saved = json.loads(next(runs.glob("*dspark-g8*")).read_text())
    assert f"{saved['summary']['dspark-g8']['tau']['gsm8k']:.2f}" in text


def test_missing_sweeps_are_noted_not_faked(tmp_path):
    runs = tmp_path / "runs"
    _save(runs, [_none(), _drafter("ngram", "ngram", 7, 4)], block=7)
    out, figs = tmp_path / "RESULTS.md", tmp_path / "figures"
    report = run_report(runs, out, figs)
    assert [p.name for p in figs.iterdir()] == ["fig2_conditional_acceptance.png"]
    assert [n.split(":")[0] for n in report.left_out] == ["fig4", "fig5", "fig6"]
    text = out.read_text()
    assert text.count("Left out:") == 3
    assert "no evaluated drafter has a confidence head" in text
    assert "two or more proposal lengths" in text and "ngram at G=[7]" in text


def test_confidence_without_calibration_leaves_out_only_fig6(tmp_path):
    runs = tmp_path / "runs"
    _save(runs, [_drafter("dspark", "dspark", 4, 5, confident=True, temps=None)])
    report = run_report(runs, tmp_path / "R.md", tmp_path / "f")
    assert [n.split(":")[0] for n in report.left_out] == ["fig4", "fig6"]
    assert "dspark calibrate" in report.left_out[1]
    assert (tmp_path / "f" / "fig5_threshold_sweep_dspark.png").is_file()


def test_bad_results_folder(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        run_report(tmp_path / "nope", tmp_path / "R.md", tmp_path / "f")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(UserError, match="not a dspark eval result"):
        run_report(tmp_path, tmp_path / "R.md", tmp_path / "f")


def _calibration_rows(text: str, drafter: str) -> dict[int, list[float]]:
    """k -> [rounds, predicted, observed, ECE %] from the report's calibration table."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] == drafter and cells[1].isdigit():
            rows[int(cells[1])] = [float(c) for c in cells[2:]]
    return rows


def test_calibration_table_scores_the_recorded_confidences(tmp_path):
    """Rounds whose acceptance follows their confidences give predicted ~ observed; the same
    rounds with confidences reported 0.3 higher give a large ECE at every position."""
    honest = _drafter("honest", "ngram", 4, 6, confident=True)
    liar = _drafter("liar", "ngram", 4, 6, confident=True)
    for bench in liar.benches.values():
        bench.rounds = [RoundRecord(r.verify_len, r.num_accepted, [min(1.0, c + 0.3) for c in r.confidences])
                        for r in bench.rounds]
    runs = tmp_path / "runs"
    _save(runs, [honest, liar], temperature=0.0)
    text = run_report(runs, tmp_path / "R.md", tmp_path / "f").markdown.read_text()
    assert "## Calibration of the confidences on the benchmarks, temperature 0" in text
    fair, biased = _calibration_rows(text, "honest (G=4)"), _calibration_rows(text, "liar (G=4)")
    assert sorted(fair) == sorted(biased) == [1, 2, 3, 4]
    assert fair[1][0] == 9 * 40  # every round verified position 1
    assert abs(fair[1][1] - fair[1][2]) < 0.05 and fair[1][3] < 8.0
    assert all(biased[k][1] > biased[k][2] + 0.1 and biased[k][3] > 10.0 for k in (1, 2))

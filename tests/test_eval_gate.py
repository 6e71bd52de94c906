"""Acceptance-length regression gate (pattern: vLLM's spec-decode acceptance
length test): the shipped default drafter's tau on a fixed subset must not
drop below the recorded value by more than the recorded tolerance.

Regenerate the table after an intended change with
`python -m dspark.eval.gate --update` (see dspark/eval/gate.py for how the
tolerance is derived and its false-failure probability).
"""

from __future__ import annotations

import pytest

from dspark.eval.gate import GATE_FILE, CaseResult, check, load_table, measure, relative_tolerance, spec_of


def _table(tau=2.0, tol=0.1, kind="ngram") -> dict:
    return {"drafter": "default", "drafter_kind": kind, "relative_tolerance": tol,
            "cases": {"temperature-1": {"temperature": 1.0, "tau": tau}}}


def _result(tau, kind="ngram") -> CaseResult:
    return CaseResult("temperature-1", 1.0, 0, kind, tau, [], 100, 7)


def test_check_passes_within_tolerance_and_fails_below_it():
    assert check(_table(), [_result(1.81)]) == []
    assert check(_table(), [_result(2.6)]) == []  # an improvement never fails
    (failure,) = check(_table(), [_result(1.79)])
    assert "tau 1.790 < 1.800" in failure and "regressed" in failure


def test_check_fails_when_the_default_drafter_changes_kind():
    (failure,) = check(_table(), [_result(5.0, kind="dspark")])
    assert "--update" in failure and "'dspark'" in failure


def test_relative_tolerance_is_three_sqrt2_sigma_with_a_floor():
    # s = 0.1 (sample sd of 1.9, 2.0, 2.1), mean 2.0 -> 3 * sqrt(2) * 0.1 / 2.0 = 0.212
    assert relative_tolerance([1.9, 2.0, 2.1]) == pytest.approx(0.212)
    assert relative_tolerance([2.0, 2.0, 2.0]) == 0.05
    assert relative_tolerance([2.0]) == 0.05


def test_the_table_is_well_formed():
    table = load_table(GATE_FILE)
    assert table["drafter"] == "default" and table["regenerate"] == "python -m dspark.eval.gate --update"
    assert set(table["cases"]) == {"temperature-1", "greedy"}
    assert 0.05 <= table["relative_tolerance"] < 0.5
    assert all(case["tau"] >= 1.0 for case in table["cases"].values())


@pytest.mark.slow
def test_default_drafter_acceptance_has_not_regressed():
    """Runs the gate subset (6 prompts, 7 answers, 48 tokens, two cases) on the
    embedded SmolLM2; about a minute of CPU."""
    table = load_table(GATE_FILE)
    results = measure(spec_of(table))
    for r in results:
        want = table["cases"][r.name]["tau"]
        print(f"{r.name}: tau {r.tau:.3f} (table {want:.3f}, tolerance {table['relative_tolerance']:.1%})")
    assert check(table, results) == []

"""Acceptance-length regression gate (pattern: vLLM's spec-decode acceptance
length test): the shipped default drafter's tau on a fixed subset must not
drop below the recorded value by more than the recorded tolerance.

Regenerate the table after an intended change with
`python -m dspark.eval.gate --update` (see dspark/eval/gate.py for how the
tolerance is derived and its false-failure probability).
"""

from __future__ import annotations

import pytest

from dspark.eval.gate import (
    GATE_FILE,
    CaseResult,
    check,
    load_table,
    measure,
    relative_tolerance,
    spec_of,
    table_from,
)


def _table(tau=2.0, tol=0.1, kind="ngram", gated=True) -> dict:
    return {"drafter": "default", "drafter_kind": kind,
            "cases": {"temperature-1": {"temperature": 1.0, "tau": tau, "relative_tolerance": tol, "gated": gated}}}


def _result(tau, kind="ngram") -> CaseResult:
    return CaseResult("temperature-1", 1.0, 0, kind, tau, [], 100, 7)


def test_check_passes_within_tolerance_and_fails_below_it():
    assert check(_table(), [_result(1.81)]) == []
    assert check(_table(), [_result(2.6)]) == []  # an improvement never fails
    (failure,) = check(_table(), [_result(1.79)])
    assert "tau 1.790 < 1.800" in failure and "regressed" in failure


def test_ungated_case_is_reported_not_checked():
    assert check(_table(gated=False), [_result(1.0)]) == []


def test_table_gates_a_case_only_when_its_floor_is_above_one():
    results = [CaseResult("temperature-1", 1.0, 0, "ngram", 1.12, [0.2], 300, 7),
               CaseResult("greedy", 0.0, 0, "ngram", 1.4, [0.3], 250, 7)]
    spec = {"drafter": "default", "block_size": 7, "max_new_tokens": 48, "seed": 0, "prompts": ["a"],
            "cases": {"temperature-1": 1.0, "greedy": 0.0}}
    table = table_from(spec, results, {"temperature-1": [1.12, 1.13, 1.10, 1.18]}, {})
    sampled, greedy = table["cases"]["temperature-1"], table["cases"]["greedy"]
    assert sampled["relative_tolerance"] > 0.1 and not sampled["gated"] and "cannot detect" in sampled["note"]
    assert greedy["relative_tolerance"] == 0.05 and greedy["gated"]
    assert check(table, [_result(1.0)] + [CaseResult("greedy", 0.0, 0, "ngram", 1.3, [], 1, 1)])[0].startswith("greedy")


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
    for case in table["cases"].values():
        assert case["tau"] >= 1.0 and 0.05 <= case["relative_tolerance"] < 0.5
        assert case["gated"] == (case["tau"] * (1 - case["relative_tolerance"]) > 1.0)
    assert any(case["gated"] for case in table["cases"].values()), "the gate must be able to fail"


@pytest.mark.slow
def test_default_drafter_acceptance_has_not_regressed():
    """Runs the gated cases of the gate subset (6 prompts, 7 answers, 48 tokens
    each) on the embedded SmolLM2: about 30 s of CPU per case. Ungated cases
    cannot fail, so CI skips them; `python -m dspark.eval.gate` reports them."""
    table = load_table(GATE_FILE)
    spec = spec_of(table)
    spec["cases"] = {name: t for name, t in spec["cases"].items() if table["cases"][name]["gated"]}
    results = measure(spec)
    for r in results:
        case = table["cases"][r.name]
        print(f"{r.name}: tau {r.tau:.3f} (table {case['tau']:.3f}, tolerance {case['relative_tolerance']:.1%})")
    assert results and check(table, results) == []

"""Benchmark loader: the shipped files are valid, and every kind of bad input
is a UserError that names the file, the line and the fix."""

from __future__ import annotations

import json

import pytest

from dspark.errors import UserError
from dspark.eval.benchmarks import BENCHMARKS, load_benchmark, load_suites, resolve_benchmarks

GOOD = {"id": "gsm8k-0000", "domain": "math", "source": "x/y:z", "turns": ["What is 2 + 2?"]}


def _write(tmp_path, name: str, lines: list[str]):
    (tmp_path / f"{name}.jsonl").write_text("".join(line + "\n" for line in lines))
    return tmp_path


def test_shipped_benchmarks_load_and_match_the_paper():
    suites = load_suites("all")
    assert list(suites) == list(BENCHMARKS)  # Table 1 order
    for name, prompts in suites.items():
        assert prompts, name
        assert all(p.domain == BENCHMARKS[name] and p.benchmark == name for p in prompts)
    assert all(len(p.turns) == 2 for p in suites["mt-bench"])
    assert all(len(p.turns) == 1 for name in BENCHMARKS if name != "mt-bench" for p in suites[name])
    assert len(suites["aime25"]) == 30 and len(suites["humaneval"]) == 164 and len(suites["mt-bench"]) == 80


def test_resolve_names_domains_and_lists():
    assert resolve_benchmarks("all") == list(BENCHMARKS)
    assert resolve_benchmarks("code") == ["mbpp", "humaneval", "livecodebench"]
    assert resolve_benchmarks("alpaca, math") == ["gsm8k", "math500", "aime25", "alpaca"]
    assert resolve_benchmarks("mt-bench,mt-bench") == ["mt-bench"]


def test_limit_cuts_each_benchmark():
    suites = load_suites("chat", limit=3)
    assert [len(v) for v in suites.values()] == [3, 3, 3]
    assert suites["alpaca"][0].id == "alpaca-0000"
    with pytest.raises(UserError, match="--limit"):
        load_suites("chat", limit=0)


@pytest.mark.parametrize("spec", ["gsm8", "all,humaneval2", "", "MATH"])
def test_unknown_benchmark_name(spec):
    with pytest.raises(UserError, match="unknown benchmark"):
        resolve_benchmarks(spec)


def test_unknown_benchmark_in_load_benchmark():
    with pytest.raises(UserError, match="choose from"):
        load_benchmark("swe-bench")


def test_malformed_json_names_file_and_line(tmp_path):
    folder = _write(tmp_path, "gsm8k", [json.dumps(GOOD), '{"id": "gsm8k-0001", "turns": ['])
    with pytest.raises(UserError, match=r"gsm8k\.jsonl:2: malformed JSON"):
        load_benchmark("gsm8k", folder)


def test_empty_file(tmp_path):
    folder = _write(tmp_path, "gsm8k", ["", "   "])
    with pytest.raises(UserError, match="is empty"):
        load_benchmark("gsm8k", folder)


@pytest.mark.parametrize(
    "record, message",
    [
        ({k: v for k, v in GOOD.items() if k != "turns"}, "missing field.*turns"),
        ({k: v for k, v in GOOD.items() if k not in ("id", "source")}, "missing field.*id, source"),
        (dict(GOOD, turns=[]), "'turns' must be a non-empty list"),
        (dict(GOOD, turns="What?"), "'turns' must be a non-empty list"),
        (dict(GOOD, turns=["ok", "  "]), "non-empty strings"),
        (dict(GOOD, domain="chat"), "does not match benchmark"),
        (dict(GOOD, id=""), "'id' must be"),
        (["not", "an", "object"], "expected a JSON object"),
    ],
)
def test_bad_records_name_the_line(tmp_path, record, message):
    folder = _write(tmp_path, "gsm8k", [json.dumps(GOOD).replace("0000", "0009"), json.dumps(record)])
    with pytest.raises(UserError, match=r"gsm8k\.jsonl:2: .*" + message):
        load_benchmark("gsm8k", folder)


def test_duplicate_id(tmp_path):
    folder = _write(tmp_path, "gsm8k", [json.dumps(GOOD), json.dumps(GOOD)])
    with pytest.raises(UserError, match="duplicate id"):
        load_benchmark("gsm8k", folder)


def test_bad_line_past_the_limit_is_still_caught(tmp_path):
    folder = _write(tmp_path, "gsm8k", [json.dumps(GOOD), "not json"])
    with pytest.raises(UserError, match=":2:"):
        load_suites("gsm8k", limit=1, data_dir=folder)


def test_missing_file(tmp_path):
    with pytest.raises(UserError, match="is missing"):
        load_benchmark("mbpp", tmp_path)

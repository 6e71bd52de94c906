"""Evaluation: the paper's benchmark sets, the acceptance-length harness
(`run_eval`), the results page and figures (`run_report`) and the acceptance
regression gate (`python -m dspark.eval.gate`)."""

from dspark.eval.benchmarks import BENCHMARKS, DOMAINS, Prompt, load_benchmark, load_suites, resolve_benchmarks
from dspark.eval.harness import run_eval
from dspark.eval.records import EvalRun, load_runs
from dspark.eval.tables import format_eval

__all__ = [
    "BENCHMARKS",
    "DOMAINS",
    "EvalRun",
    "Prompt",
    "format_eval",
    "load_benchmark",
    "load_runs",
    "load_suites",
    "resolve_benchmarks",
    "run_eval",
    "run_report",
]


def __getattr__(name: str):
    # imported lazily so that `python -m dspark.eval.report` runs without a double import
    if name == "run_report":
        from dspark.eval.report import run_report

        return run_report
    raise AttributeError(f"module 'dspark.eval' has no attribute {name!r}")

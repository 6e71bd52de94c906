"""Each arm against a baseline arm, repeat by repeat, in one or more written load reports:

    .venv/bin/python -m dspark.bench.paired docs/figures/load_cpu_v35.json [BASELINE]
    .venv/bin/python -m dspark.bench.paired docs/figures/load_cpu_v63.json docs/figures/load_cpu_v64.json

A load run interleaves its arms within every (repeat, level), so the machine's drift between
repeats (no speculation at 64 clients ran at 68.9 to 77.3 tok/s over the four repeats of
docs/LOAD.md run AJ) widens every arm's spread over repeats but hardly moves the difference
between two arms measured in the same repeat. For every level and arm this prints those
per-repeat differences to the baseline (default `nospec`), their mean ratio and its 95 %
Student-t interval over the repeats, which say whether a small gap is systematic (the interval
below 1) or noise (it straddles 1).

Three repeats give an interval of about +-4 sd of a ratio: a run alone rarely tells a 2 % gap.
Given several reports, the repeats of runs that measured the same (pattern, level, think time,
arm) are pooled into one more table, one interval over all their repeats, so that runs of the
same code can be read together. Which reports measured the same code is for the caller to say:
pass only those.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Sequence

# two-sided 95 % quantiles of Student's t, by degrees of freedom 1..30
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with `df` degrees of freedom (a table to 30, beyond it
    the Cornish-Fisher expansion around the normal's 1.960, within 0.001 there)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def mean_interval(values: Sequence[float]) -> tuple[float, float, float] | None:
    """(mean, low, high): the 95 % Student-t interval of the mean of `values`; None for fewer than two."""
    if len(values) < 2:
        return None
    mean = statistics.mean(values)
    half = t975(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def paired_differences(points: Sequence[dict], baseline: str) -> dict[tuple[str, float, str], list[tuple[float, float]]]:
    """(pattern, level, arm) -> [(throughput - baseline's, throughput / baseline's) per repeat], for
    every arm but the baseline, over the repeats in which both measured the level (a baseline
    point of zero throughput gives no ratio and is skipped)."""
    by_point = {(p["pattern"], p["level"], p["arm"], p["repeat"]): p["throughput"] for p in points}
    out: dict[tuple[str, float, str], list[tuple[float, float]]] = {}
    for (pattern, level, arm, repeat), value in sorted(by_point.items()):
        base = by_point.get((pattern, level, baseline, repeat))
        if arm == baseline or base is None or base <= 0:
            continue
        out.setdefault((pattern, level, arm), []).append((value - base, value / base))
    return out


def verdict(interval: tuple[float, float, float] | None) -> str:
    """'below' / 'above' when the ratio's interval lies wholly under / over 1, else 'level'
    ('-' without an interval)."""
    if interval is None:
        return "-"
    _, low, high = interval
    return "below" if high < 1.0 else "above" if low > 1.0 else "level"


def interval_cell(interval: tuple[float, float, float] | None) -> str:
    """'low-high' of a `mean_interval` ('-' without one)."""
    return "-" if interval is None else f"{interval[1]:.3f}-{interval[2]:.3f}"


def _read(path: str, baseline: str) -> tuple[dict, dict]:
    """(the report's pairs, its settings), refusing a report without the baseline arm."""
    with open(path) as f:
        report = json.load(f)
    points = report.get("points") or []
    if not any(p["arm"] == baseline for p in points):
        arms = sorted({p["arm"] for p in points})
        raise SystemExit(f"no points of the baseline arm {baseline!r} in {path}; its arms: {arms}")
    pairs = paired_differences(points, baseline)
    if not pairs:
        raise SystemExit(f"no arm shares a (repeat, level) with {baseline!r} in {path}")
    return pairs, report.get("settings") or {}


def main(argv: list[str]) -> None:
    paths = [a for a in argv if a.endswith(".json")]
    others = [a for a in argv if not a.endswith(".json")]
    if not paths or len(others) > 1:
        raise SystemExit("usage: python -m dspark.bench.paired REPORT.json [REPORT.json ...] "
                         "[BASELINE_ARM (default nospec)]")
    baseline = others[0] if others else "nospec"
    pooled: dict[tuple[str, float, float, str], list[tuple[float, float]]] = {}
    runs: dict[tuple[str, float, float, str], int] = {}
    for path in paths:
        pairs, settings = _read(path, baseline)
        think = float(settings.get("think_s") or 0.0)
        if len(paths) > 1:
            print(f"{path}{f' (think {think:g} s)' if think else ''}:\n")
        print(f"| arm | pattern | load | difference to {baseline} per repeat (tok/s) | mean | mean ratio "
              f"| 95 % interval | below in |")
        print("|---|---|---|---|---|---|---|---|")
        for (pattern, level, arm), rows in pairs.items():
            diffs = ", ".join(f"{d:+.1f}" for d, _ in rows)
            below = sum(d < 0 for d, _ in rows)
            interval = mean_interval([r for _, r in rows])
            print(f"| {arm} | {pattern} | {level:g} | {diffs} | {statistics.mean(d for d, _ in rows):+.2f} "
                  f"| {statistics.mean(r for _, r in rows):.3f}x | {interval_cell(interval)} "
                  f"| {below} of {len(rows)} |")
            key = (pattern, level, think, arm)
            pooled.setdefault(key, []).extend(rows)
            runs[key] = runs.get(key, 0) + 1
        print()
    if len(paths) < 2:
        return
    print(f"Pooled over the {len(paths)} reports (repeats of the same pattern, load, think time and arm):\n")
    print(f"| arm | pattern | load | think s | runs | repeats | mean ratio to {baseline} | 95 % interval "
          f"| below in | verdict |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (pattern, level, think, arm), rows in sorted(pooled.items()):
        ratios = [r for _, r in rows]
        interval = mean_interval(ratios)
        print(f"| {arm} | {pattern} | {level:g} | {think:g} | {runs[(pattern, level, think, arm)]} | {len(rows)} "
              f"| {statistics.mean(ratios):.3f}x | {interval_cell(interval)} | {sum(d < 0 for d, _ in rows)} of "
              f"{len(rows)} | {verdict(interval)} |")


if __name__ == "__main__":
    main(sys.argv[1:])

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

Pooling repeats treats them as independent, and on a shared machine they are not: runs of the
same code differ by more than their own intervals (docs/LOAD.md, runs BN, BP and BQ at four
clients: 0.973x, 0.946x and 1.011x), so the repeats of one run share an offset and an interval
over all repeats is too narrow. The pooled table therefore also gives the interval over the
runs, each run counted once by its mean ratio (`run_interval`, from two runs on), and its
verdict: the one to trust when the two disagree.

`--steady` pairs each closed-loop level's throughput until its first client ran dry
(`load_report.steady_throughput`) instead of the whole level's: the tail, when fewer requests
than clients are left, is out.

Reports that record where the engine's time went (per step kind, since session 47) also get a
table of the time a plain decode step took (nobody drafting: the same work in every arm) and of
the time per position of the steps with a prompt chunk, each against the baseline's in the same
repeat: a ratio away from 1 there is the machine or the arm's overhead, not its choices. Runs
with `--interleave` (arms stepping in turn) and runs without are pooled apart. Reports whose
engine timed its target forward apart (since session 49) split the plain step further: its
target forward against the baseline's (different batches: a drafting arm's plain steps are the
ones its gate left alone), and the rest of it in milliseconds, the arm's overhead outside the
forward.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence

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


def throughput(point: dict) -> float:
    """A point's throughput over its whole level (the default value paired)."""
    return point["throughput"]


def paired_differences(points: Sequence[dict], baseline: str, value: Callable[[dict], float | None] = throughput,
                       ) -> dict[tuple[str, float, str], list[tuple[float, float]]]:
    """(pattern, level, arm) -> [(value - baseline's, value / baseline's) per repeat], for every arm
    but the baseline, over the repeats in which both measured the level (a baseline point of zero
    value gives no ratio and is skipped, as is a point whose value is None). The value is a point's
    throughput unless `value` says otherwise (`steady`: without the closed loop's tail)."""
    by_point = {(p["pattern"], p["level"], p["arm"], p["repeat"]): value(p) for p in points}
    by_point = {key: v for key, v in by_point.items() if v is not None}
    out: dict[tuple[str, float, str], list[tuple[float, float]]] = {}
    for (pattern, level, arm, repeat), value in sorted(by_point.items()):
        base = by_point.get((pattern, level, baseline, repeat))
        if arm == baseline or base is None or base <= 0:
            continue
        out.setdefault((pattern, level, arm), []).append((value - base, value / base))
    return out


def run_interval(runs: Sequence[Sequence[float]]) -> tuple[float, float, float] | None:
    """(mean, low, high) over runs: the 95 % Student-t interval of the mean of each run's mean
    ratio (runs without a ratio are left out); None for fewer than two runs. The honest interval
    when runs differ by more than their repeats do."""
    return mean_interval([statistics.mean(run) for run in runs if run])


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


def steady(point: dict) -> float | None:
    """A closed-loop point's throughput until its first client ran dry (`steady_throughput`); None
    for other patterns."""
    from dspark.bench.load_report import steady_throughput

    return steady_throughput(point.get("samples") or []) if point["pattern"] == "closed" else None


def plain_step_ms(point: dict) -> float | None:
    """Milliseconds of a plain decode step (decode-only, nobody drafting) of a point that records
    its step kinds; None otherwise."""
    kind = (point.get("step_kinds") or {}).get("plain")
    return 1e3 * kind["seconds"] / kind["steps"] if kind and kind["steps"] else None


def prefill_position_ms(point: dict) -> float | None:
    """Milliseconds per target position of the steps with a prompt chunk; None without them."""
    kind = (point.get("step_kinds") or {}).get("prefill")
    return 1e3 * kind["seconds"] / kind["positions"] if kind and kind["positions"] else None


def plain_forward_ms(point: dict) -> float | None:
    """Milliseconds of a plain decode step's target forward (None where the engine did not time the
    forward apart: reports before session 49)."""
    kind = (point.get("step_kinds") or {}).get("plain")
    if not kind or not kind["steps"] or "forward_seconds" not in kind:
        return None
    return 1e3 * kind["forward_seconds"] / kind["steps"]


def plain_rest_ms(point: dict) -> float | None:
    """Milliseconds of a plain decode step outside its target forward: batching, the gate,
    scheduling, verification, commit, the drafter's observe (None as `plain_forward_ms`)."""
    forward = plain_forward_ms(point)
    return None if forward is None else plain_step_ms(point) - forward


def _forward_table(points: Sequence[dict], baseline: str) -> str | None:
    """Per arm and level: a plain step split into its target forward (against the baseline's, per
    repeat) and the rest (its milliseconds, and the difference to the baseline's); None when the
    points lack the forward's time."""
    forward = paired_differences(points, baseline, plain_forward_ms)
    rest = paired_differences(points, baseline, plain_rest_ms)
    if not forward:
        return None
    rests: dict[tuple[str, float, str], list[float]] = {}  # (pattern, level, arm) -> the rest per repeat
    for p in points:
        value = plain_rest_ms(p)
        if value is not None:
            rests.setdefault((p["pattern"], p["level"], p["arm"]), []).append(value)
    lines = [f"| arm | pattern | load | a plain step's target forward / {baseline}'s, per repeat "
             f"| mean (95 % interval) | the rest of a plain step (ms) | {baseline}'s "
             f"| difference (ms, 95 % interval) |",
             "|---|---|---|---|---|---|---|---|"]
    for key in sorted(forward):
        pattern, level, arm = key
        ratios = [r for _, r in forward[key]]
        diffs = [d for d, _ in rest.get(key, [])]
        mine, theirs = rests[key], rests[(pattern, level, baseline)]
        lines.append(f"| {arm} | {pattern} | {level:g} | {', '.join(f'{r:.3f}' for r in ratios)} "
                     f"| {statistics.mean(ratios):.3f}x ({interval_cell(mean_interval(ratios))}) "
                     f"| {statistics.mean(mine):.2f} | {statistics.mean(theirs):.2f} "
                     f"| {statistics.mean(diffs):+.2f} ({_cell(mean_interval(diffs))}) |")
    return "\n".join(lines)


def _cell(interval: tuple[float, float, float] | None) -> str:
    """'low to high' of an interval of differences ('-' without one)."""
    return "-" if interval is None else f"{interval[1]:+.2f} to {interval[2]:+.2f}"


def _step_table(points: Sequence[dict], baseline: str) -> str | None:
    """Per arm and level: the plain step's and the prompt chunks' time per repeat against the
    baseline's (None when the points lack step kinds)."""
    plain = paired_differences(points, baseline, plain_step_ms)
    prefill = paired_differences(points, baseline, prefill_position_ms)
    if not plain and not prefill:
        return None
    lines = [f"| arm | pattern | load | a plain step's time / {baseline}'s, per repeat | mean (95 % interval) "
             f"| prompt chunks' time a position / {baseline}'s, per repeat | mean (95 % interval) |",
             "|---|---|---|---|---|---|---|"]
    for key in sorted(set(plain) | set(prefill)):
        cells = []
        for rows in (plain.get(key, []), prefill.get(key, [])):
            ratios = [r for _, r in rows]
            cells.append(", ".join(f"{r:.3f}" for r in ratios) or "-")
            cells.append(f"{statistics.mean(ratios):.3f}x ({interval_cell(mean_interval(ratios))})" if ratios else "-")
        pattern, level, arm = key
        lines.append(f"| {arm} | {pattern} | {level:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _read(path: str, baseline: str, value: Callable[[dict], float | None] = throughput) -> tuple[dict, dict]:
    """(the report's pairs, its settings), refusing a report without the baseline arm."""
    with open(path) as f:
        report = json.load(f)
    points = report.get("points") or []
    if not any(p["arm"] == baseline for p in points):
        arms = sorted({p["arm"] for p in points})
        raise SystemExit(f"no points of the baseline arm {baseline!r} in {path}; its arms: {arms}")
    pairs = paired_differences(points, baseline, value)
    if not pairs:
        raise SystemExit(f"no arm shares a (repeat, level) with {baseline!r} in {path}")
    settings = dict(report.get("settings") or {})
    settings["step_table"] = _step_table(points, baseline)
    settings["forward_table"] = _forward_table(points, baseline)
    return pairs, settings


def main(argv: list[str]) -> None:
    window = "--steady" in argv
    argv = [a for a in argv if a != "--steady"]
    paths = [a for a in argv if a.endswith(".json")]
    others = [a for a in argv if not a.endswith(".json")]
    if not paths or len(others) > 1:
        raise SystemExit("usage: python -m dspark.bench.paired REPORT.json [REPORT.json ...] "
                         "[BASELINE_ARM (default nospec)] [--steady]")
    baseline = others[0] if others else "nospec"
    if window:
        print("Closed-loop levels until their first client ran dry (the tail left out):\n")
    pooled: dict[tuple[str, float, float, str, str], list[tuple[float, float]]] = {}
    runs: dict[tuple[str, float, float, str, str], list[list[float]]] = {}  # each run's ratios
    for path in paths:
        pairs, settings = _read(path, baseline, steady if window else throughput)
        think = float(settings.get("think_s") or 0.0)
        mode = "interleaved" if settings.get("interleave") else "one after another"
        if len(paths) > 1:
            print(f"{path}{f' (think {think:g} s)' if think else ''}, arms {mode}:\n")
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
            key = (pattern, level, think, mode, arm)
            pooled.setdefault(key, []).extend(rows)
            runs.setdefault(key, []).append([r for _, r in rows])
        print()
        for table in ("step_table", "forward_table"):
            if settings[table]:
                print(settings[table] + "\n")
    if len(paths) < 2:
        return
    print(f"Pooled over the {len(paths)} reports (repeats of the same pattern, load, think time, arm order and "
          "arm):\n")
    print(f"| arm | pattern | load | think s | arms | runs | repeats | mean ratio to {baseline} | 95 % interval "
          f"over repeats | below in | verdict | mean of run means | 95 % interval over runs | verdict over runs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (pattern, level, think, mode, arm), rows in sorted(pooled.items()):
        ratios = [r for _, r in rows]
        interval = mean_interval(ratios)
        per_run = runs[(pattern, level, think, mode, arm)]
        over_runs = run_interval(per_run)
        run_mean = statistics.mean(statistics.mean(run) for run in per_run)
        print(f"| {arm} | {pattern} | {level:g} | {think:g} | {mode} | {len(per_run)} | {len(rows)} "
              f"| {statistics.mean(ratios):.3f}x | {interval_cell(interval)} | {sum(d < 0 for d, _ in rows)} of "
              f"{len(rows)} | {verdict(interval)} | {run_mean:.3f}x | {interval_cell(over_runs)} "
              f"| {verdict(over_runs)} |")


if __name__ == "__main__":
    main(sys.argv[1:])

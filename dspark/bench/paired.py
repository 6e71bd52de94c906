"""Each arm against a baseline arm, repeat by repeat, in a written load report:

    .venv/bin/python -m dspark.bench.paired docs/figures/load_cpu_v35.json [BASELINE]

A load run interleaves its arms within every (repeat, level), so the machine's drift between
repeats (no speculation at 64 clients ran at 68.9 to 77.3 tok/s over the four repeats of
docs/LOAD.md run AJ) widens every arm's spread over repeats but hardly moves the difference
between two arms measured in the same repeat. For every level and arm this prints those
per-repeat differences to the baseline (default `nospec`) and their mean ratio, which say
whether a small gap is systematic (below the baseline in every repeat) or noise.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence


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


def main(argv: list[str]) -> None:
    if len(argv) not in (1, 2):
        raise SystemExit("usage: python -m dspark.bench.paired REPORT.json [BASELINE_ARM (default nospec)]")
    baseline = argv[1] if len(argv) > 1 else "nospec"
    with open(argv[0]) as f:
        points = json.load(f).get("points") or []
    if not any(p["arm"] == baseline for p in points):
        arms = sorted({p["arm"] for p in points})
        raise SystemExit(f"no points of the baseline arm {baseline!r} in {argv[0]}; its arms: {arms}")
    pairs = paired_differences(points, baseline)
    if not pairs:
        raise SystemExit(f"no arm shares a (repeat, level) with {baseline!r} in {argv[0]}")
    print(f"| arm | pattern | load | difference to {baseline} per repeat (tok/s) | mean | mean ratio | below in |")
    print("|---|---|---|---|---|---|---|")
    for (pattern, level, arm), rows in pairs.items():
        diffs = ", ".join(f"{d:+.1f}" for d, _ in rows)
        below = sum(d < 0 for d, _ in rows)
        print(f"| {arm} | {pattern} | {level:g} | {diffs} | {statistics.mean(d for d, _ in rows):+.2f} "
              f"| {statistics.mean(r for _, r in rows):.3f}x | {below} of {len(rows)} |")


if __name__ == "__main__":
    main(sys.argv[1:])

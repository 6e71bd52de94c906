"""Does the point a load run measures first run slow? Over written reports:

    .venv/bin/python -m dspark.bench.order_bias docs/figures/load*.json

For every report with two or more repeats, the first and second (arm, level) it measured, each
as a ratio to the mean of the same arm and level in the run's other repeats; and, as the
control, the same ratio for every later point. A process's first level pays for what it does
the first time (the allocator's heap grown for a full batch, fresh pages, first projections),
and because the arm order of a (repeat, level) is a seeded shuffle, the same arm pays in every
run with the same arms. `dspark bench serve` therefore warms every arm up once before timing
(`LoadSettings.warmup_pass`); docs/LOAD.md, run AF, has what this printed before that.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence


def ratios_to_other_repeats(points: Sequence[dict]) -> list[float | None]:
    """For each point (in measured order), its throughput over the mean throughput of the points
    of the same arm, pattern and level in other repeats (None where there are none, or they are 0)."""
    out: list[float | None] = []
    for p in points:
        others = [q["throughput"] for q in points if q is not p and (q["arm"], q["pattern"], q["level"])
                  == (p["arm"], p["pattern"], p["level"])]
        mean = statistics.mean(others) if others else 0.0
        out.append(p["throughput"] / mean if mean > 0 else None)
    return out


def main(paths: list[str]) -> None:
    if not paths:
        raise SystemExit("usage: python -m dspark.bench.order_bias REPORT.json [REPORT.json ...]")
    firsts, seconds, later = [], [], []
    for path in paths:
        with open(path) as f:
            report = json.load(f)
        points = report.get("points") or []
        if report.get("settings", {}).get("repeats", 1) < 2 or len(points) < 2:
            continue
        ratios = ratios_to_other_repeats(points)
        if ratios[0] is None:
            continue
        firsts.append(ratios[0])
        seconds.extend(r for r in ratios[1:2] if r is not None)
        later.extend(r for r in ratios[2:] if r is not None)
        print(f"{path}: first {points[0]['arm']} at {points[0]['level']:g}: {ratios[0]:.3f}x its other repeats")
    if not firsts:
        raise SystemExit("no report with two or more repeats among the given files")
    print(f"{len(firsts)} runs: first point median {statistics.median(firsts):.3f}x (mean {statistics.mean(firsts):.3f}); "
          f"second {statistics.median(seconds):.3f}x; every later point ({len(later)}) {statistics.median(later):.3f}x")


if __name__ == "__main__":
    main(sys.argv[1:])

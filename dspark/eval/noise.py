"""How far a macro acceptance length would move on other prompts: bootstrap intervals.

A `dspark eval --limit 3` run answers three prompts per benchmark, so its
macro tau carries the luck of those prompts. The interval here resamples
prompts within each benchmark (with replacement, as many as were run),
recomputes each benchmark's tau as committed tokens over rounds of the drawn
prompts, then the macro average over domains exactly as the tables do
(`records.macro_mean`), and reports the central `level` share of the
resampled values.

Two drafters that answered the same prompts with the same seeds (runs with
equal settings) are compared with the paired version: each resample draws
the same prompts for both, so what they share (an easy prompt, a long
answer) cancels in their ratio, which is what a claim such as "DSpark is
1.15x DFlash" needs.

Needs the per-prompt counts that `dspark eval` saves since session 8
(`BenchResult.per_prompt`); older runs give None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.eval.records import DrafterRun, macro_mean


@dataclass(frozen=True)
class Interval:
    point: float  # the value on the prompts that were run
    low: float
    high: float
    level: float
    resamples: int


def _counts(drafter: DrafterRun) -> dict[str, tuple[list[str], torch.Tensor, torch.Tensor]] | None:
    """benchmark -> (prompt ids, rounds [n], committed [n]) over benchmarks with rounds; None when a
    benchmark lacks per-prompt counts."""
    out = {}
    for name, bench in drafter.benches.items():
        if not bench.stats.rounds:
            continue
        if not bench.per_prompt:
            return None
        ids = [pid for pid, _, _ in bench.per_prompt]
        rounds = torch.tensor([float(n) for _, n, _ in bench.per_prompt], dtype=torch.float64)
        committed = torch.tensor([float(c) for _, _, c in bench.per_prompt], dtype=torch.float64)
        out[name] = (ids, rounds, committed)
    return out or None


def _resampled_macro(counts: dict, draws: dict[str, torch.Tensor]) -> torch.Tensor:
    """Macro tau of every resample [R] given each benchmark's drawn prompt indices [R, n]."""
    taus = {}
    for name, (_, rounds, committed) in counts.items():
        idx = draws[name]
        taus[name] = committed[idx].sum(-1) / rounds[idx].sum(-1).clamp(min=1.0)
    return macro_mean(taus)


def _draws(counts: dict, resamples: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randint(len(ids), (resamples, len(ids)), generator=gen)
            for name, (ids, _, _) in sorted(counts.items())}


def _identity(counts: dict) -> dict[str, torch.Tensor]:
    return {name: torch.arange(len(ids))[None] for name, (ids, _, _) in counts.items()}


def _interval(point: float, values: torch.Tensor, level: float) -> Interval:
    tail = (1.0 - level) / 2
    low, high = torch.quantile(values, torch.tensor([tail, 1.0 - tail], dtype=values.dtype)).tolist()
    return Interval(point, low, high, level, int(values.numel()))


def _check(level: float, resamples: int) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if resamples < 10:
        raise ValueError(f"resamples must be >= 10, got {resamples}")


def macro_interval(drafter: DrafterRun, *, resamples: int = 2000, level: float = 0.95, seed: int = 0) -> Interval | None:
    """Bootstrap interval of one drafter's macro tau (None without per-prompt counts)."""
    _check(level, resamples)
    counts = _counts(drafter)
    if counts is None:
        return None
    point = float(_resampled_macro(counts, _identity(counts))[0])
    return _interval(point, _resampled_macro(counts, _draws(counts, resamples, seed)), level)


def macro_from_counts(counts: dict[str, tuple[list[str], torch.Tensor, torch.Tensor]]) -> float:
    """Macro tau of per-prompt counts: benchmark -> (prompt ids, rounds [n], committed [n])."""
    return float(_resampled_macro(counts, _identity(counts))[0])


def paired_ratio_from_counts(
    a: dict[str, tuple[list[str], torch.Tensor, torch.Tensor]],
    b: dict[str, tuple[list[str], torch.Tensor, torch.Tensor]],
    *, resamples: int = 2000, level: float = 0.95, seed: int = 0,
) -> Interval | None:
    """Bootstrap interval of macro tau(a) / macro tau(b) from per-prompt counts, the same prompts
    drawn for both; None unless both cover the same benchmarks and prompt ids."""
    _check(level, resamples)
    if not a or not b or sorted(a) != sorted(b) or any(a[n][0] != b[n][0] for n in a):
        return None
    point = macro_from_counts(a) / macro_from_counts(b)
    draws = _draws(a, resamples, seed)
    return _interval(point, _resampled_macro(a, draws) / _resampled_macro(b, draws), level)


def paired_ratio_interval(
    numerator: DrafterRun, denominator: DrafterRun, *, resamples: int = 2000, level: float = 0.95, seed: int = 0
) -> Interval | None:
    """Bootstrap interval of macro tau(numerator) / macro tau(denominator), the same prompts drawn
    for both. None unless both have per-prompt counts for the same benchmarks and prompt ids."""
    _check(level, resamples)
    a, b = _counts(numerator), _counts(denominator)
    if a is None or b is None:
        return None
    return paired_ratio_from_counts(a, b, resamples=resamples, level=level, seed=seed)

"""Sequential Temperature Scaling (STS, paper 3.2.1) and calibration metrics.

The confidence head predicts c_k = P(draft token k accepted | tokens 1..k-1
accepted). The scheduler needs the prefix survival probability
a_k = prod_{i<=k} c_i in absolute terms, so STS calibrates that product, left
to right: at position k, a 1-D grid search picks the temperature T_k of
c_k = sigmoid(logit_k / T_k) minimising the expected calibration error of
a_k against realised prefix survival, with T_1..T_{k-1} already fixed.
Temperature scaling preserves the order of each position's scores.

Inputs (n blocks, G positions):
    conf_logits [n, G] float   pre-sigmoid confidence logits
    accepted    [n, G] float   per-position acceptance events in {0, 1}
                               (or soft probabilities in [0, 1]); the realised
                               prefix survival is their cumulative product.

Metrics are computed per position on (predicted a_k, realised survival_k):
ECE with equal-width bins, rank-based ROC-AUC (Mann-Whitney, ties averaged),
and the Brier score.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_BINS = 15
# Temperatures searched by STS: a log-spaced coarse grid (1.0 included), then
# a finer grid between the coarse neighbours of the best coarse point.
DEFAULT_GRID = torch.logspace(-1.5, 1.5, 61, dtype=torch.float64)  # step 10**0.05 (12%)
REFINE_POINTS = 21  # fine step ~1.1%


def ece(predicted: torch.Tensor, labels: torch.Tensor, bins: int = DEFAULT_BINS) -> float:
    """Expected calibration error of predicted [n] probabilities against labels [n]."""
    return float(_ece_batched(predicted.double()[None], labels.double(), bins)[0])


def _ece_batched(predicted: torch.Tensor, labels: torch.Tensor, bins: int) -> torch.Tensor:
    """ECE of each row of predicted [K, n] against labels [n]; returns [K]."""
    k, n = predicted.shape
    index = (predicted * bins).floor().clamp(0, bins - 1).long()  # [K, n]
    count = torch.zeros(k, bins, dtype=torch.float64).scatter_add_(1, index, torch.ones_like(predicted))
    pred_sum = torch.zeros(k, bins, dtype=torch.float64).scatter_add_(1, index, predicted)
    label_sum = torch.zeros(k, bins, dtype=torch.float64).scatter_add_(1, index, labels.expand(k, n))
    return (pred_sum - label_sum).abs().sum(1) / max(n, 1)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """ROC-AUC of scores [n] for binary labels [n] (labels > 0.5 are positive);
    None when one class is absent."""
    positive = labels.double() > 0.5
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return None
    ranks = _average_ranks(scores.double())
    u = float(ranks[positive].sum()) - n_pos * (n_pos + 1) / 2
    return u / (n_pos * n_neg)


def _average_ranks(values: torch.Tensor) -> torch.Tensor:
    """1-based ranks of values [n], ties given their average rank."""
    order = torch.argsort(values, stable=True)
    sorted_vals = values[order]
    n = values.numel()
    new_group = torch.ones(n, dtype=torch.bool)
    new_group[1:] = sorted_vals[1:] != sorted_vals[:-1]
    group = torch.cumsum(new_group.long(), 0) - 1  # [n] group id in sorted order
    positions = torch.arange(1, n + 1, dtype=torch.float64)
    sums = torch.zeros(int(group[-1]) + 1, dtype=torch.float64).scatter_add_(0, group, positions)
    counts = torch.zeros_like(sums).scatter_add_(0, group, torch.ones(n, dtype=torch.float64))
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[order] = (sums / counts)[group]
    return ranks


def brier(predicted: torch.Tensor, labels: torch.Tensor) -> float:
    return float(((predicted.double() - labels.double()) ** 2).mean())


def survival(accepted: torch.Tensor) -> torch.Tensor:
    """Realised prefix survival [n, G] from per-position events [n, G]."""
    return torch.cumprod(accepted.double(), dim=1)


def prefix_probs(conf_logits: torch.Tensor, temps: torch.Tensor | None = None) -> torch.Tensor:
    """a_k = prod_{i<=k} sigmoid(logit_i / T_i); [n, G] float64."""
    logits = conf_logits.double()
    if temps is not None:
        logits = logits / temps.double()
    return torch.cumprod(torch.sigmoid(logits), dim=1)


MIN_POSITIVES = 5.0  # surviving held-out blocks a position needs before its temperature is fitted


def sts_fit(
    conf_logits: torch.Tensor,  # [n, G]
    accepted: torch.Tensor,  # [n, G]
    bins: int = DEFAULT_BINS,
    grid: torch.Tensor = DEFAULT_GRID,
    min_positives: float = MIN_POSITIVES,
) -> torch.Tensor:
    """Per-position temperatures [G] (float64) by Sequential Temperature Scaling.

    A position that fewer than `min_positives` held-out blocks survive to keeps
    T = 1: with (almost) no positive outcome the ECE is smallest for T -> 0,
    which pushes every confidence to 0 or 1 - a fit to the absence of data."""
    logits = conf_logits.double()
    target = survival(accepted)
    n, g = logits.shape
    temps = torch.ones(g, dtype=torch.float64)
    prefix = torch.ones(n, dtype=torch.float64)
    grid = grid.double()
    for k in range(g):
        if float(target[:, k].sum()) < min_positives:
            prefix = prefix * torch.sigmoid(logits[:, k])
            continue
        coarse = _grid_argmin(prefix, logits[:, k], target[:, k], grid, bins)
        i = int(torch.searchsorted(grid, torch.tensor([coarse], dtype=torch.float64)).clamp(max=grid.numel() - 1))
        low, high = grid[max(i - 1, 0)], grid[min(i + 1, grid.numel() - 1)]
        fine = torch.logspace(float(low.log10()), float(high.log10()), REFINE_POINTS, dtype=torch.float64)
        temps[k] = _grid_argmin(prefix, logits[:, k], target[:, k], torch.cat([fine, grid[i : i + 1]]), bins)
        prefix = prefix * torch.sigmoid(logits[:, k] / temps[k])
    return temps


def _grid_argmin(prefix: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, grid: torch.Tensor, bins: int) -> float:
    """The temperature in grid [K] minimising ECE of prefix * sigmoid(logits / T)."""
    candidates = prefix[None] * torch.sigmoid(logits[None] / grid[:, None])  # [K, n]
    errors = _ece_batched(candidates, target, bins)
    # ties (flat ECE) resolve to the temperature closest to 1
    return float(grid[torch.argmin(errors + 1e-12 * grid.log().abs())])


@dataclass
class PositionMetrics:
    ece: float
    auc: float | None
    brier: float
    mean_predicted: float
    mean_observed: float


def position_metrics(
    conf_logits: torch.Tensor, accepted: torch.Tensor, temps: torch.Tensor | None = None, bins: int = DEFAULT_BINS
) -> list[PositionMetrics]:
    """ECE, AUC and Brier of the prefix survival at each position."""
    predicted, observed = prefix_probs(conf_logits, temps), survival(accepted)
    out = []
    for k in range(predicted.shape[1]):
        p, y = predicted[:, k], observed[:, k]
        out.append(PositionMetrics(ece(p, y, bins), auc(p, y), brier(p, y), float(p.mean()), float(y.mean())))
    return out


def reliability_curve(predicted: torch.Tensor, labels: torch.Tensor, bins: int = DEFAULT_BINS) -> dict:
    """Per bin: mean predicted, mean observed and count (empty bins dropped)."""
    index = (predicted.double() * bins).floor().clamp(0, bins - 1).long()
    count = torch.bincount(index, minlength=bins).double()
    pred = torch.bincount(index, weights=predicted.double(), minlength=bins)
    obs = torch.bincount(index, weights=labels.double(), minlength=bins)
    keep = count > 0
    return {"predicted": (pred[keep] / count[keep]).tolist(), "observed": (obs[keep] / count[keep]).tolist(),
            "count": count[keep].tolist(), "bin_left": (torch.arange(bins)[keep] / bins).tolist()}


def plot_reliability(
    conf_logits: torch.Tensor, accepted: torch.Tensor, temps: torch.Tensor, path: Path, bins: int = DEFAULT_BINS,
    positions: list[int] | None = None,
) -> Path:
    """Reliability diagram as in paper Fig. 6: one panel per block position,
    before and after calibration, with the sample histogram shaded behind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = conf_logits.shape[1]
    positions = positions or list(range(g))
    observed = survival(accepted)
    before, after = prefix_probs(conf_logits), prefix_probs(conf_logits, temps)
    fig, axes = plt.subplots(1, len(positions), figsize=(3.0 * len(positions), 3.2), squeeze=False)
    for ax, k in zip(axes[0], positions):
        hist = ax.twinx()
        hist.hist(before[:, k].numpy(), bins=bins, range=(0, 1), color="0.85", zorder=0)
        hist.set_yticks([])
        ax.set_zorder(hist.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
        for probs, name, style in ((before, "before", "o-"), (after, "after", "s-")):
            curve = reliability_curve(probs[:, k], observed[:, k], bins)
            err = ece(probs[:, k], observed[:, k], bins)
            ax.plot(curve["predicted"], curve["observed"], style, ms=3, label=f"{name} (ECE {100 * err:.1f}%)")
        score = auc(after[:, k], observed[:, k])
        ax.set_title(f"position {k + 1}" + (f", AUC {score:.3f}" if score is not None else ""), fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted acceptance")
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("observed acceptance")
    from dspark.train.plots import save_figure

    return save_figure(fig, path, dpi=120)

"""The paper's section-4 figures, drawn from saved results (matplotlib, Agg).

Every function takes plain data, writes one PNG and returns its path; the
caller passes the commands that produced the data, printed under the plot.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from dspark.eval.benchmarks import DOMAINS
from dspark.eval.sweeps import ReliabilitySamples, SweepPoint

Series = dict[str, list[float | None]]  # line label -> y values


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


FOOTER_LINE_INCHES = 0.11  # one 6-point monospace line of the commands footer


def _distinct_lines(ax, count: int) -> None:
    """Past matplotlib's 10 default colours, 20 colours and then dashed lines, so no two
    of `count` series look alike."""
    if count > 10:
        from cycler import cycler

        colors = [_plt().get_cmap("tab20")(i) for i in range(20)]
        ax.set_prop_cycle(cycler(linestyle=["-", "--"]) * cycler(color=colors))


def _legend(ax) -> None:
    """A legend inside the panel for a few lines, beside it (right) for many, so it hides no data."""
    if len(ax.get_legend_handles_labels()[0]) <= 6:
        ax.legend(fontsize=8)
    else:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)


def _save(fig, path: Path, commands: list[str]) -> Path:
    """Print the commands under the plot, in a strip the figure grows by, and write the PNG."""
    lines = [line for c in commands for line in textwrap.wrap(c, 170, subsequent_indent="    ")]
    width, height = fig.get_size_inches()
    footer = FOOTER_LINE_INCHES * len(lines) + 0.25
    fig.set_size_inches(width, height + footer)
    fig.text(0.01, 0.005, "\n".join(lines), fontsize=6, family="monospace", va="bottom", ha="left", color="0.3")
    fig.tight_layout(rect=(0, footer / (height + footer), 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return path


def conditional_acceptance(per_domain: dict[str, Series], path: Path, commands: list[str]) -> Path:
    """Fig. 2: conditional acceptance by draft position, one panel per domain."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(DOMAINS), figsize=(4.2 * len(DOMAINS), 3.6), squeeze=False)
    for ax, domain in zip(axes[0], DOMAINS):
        _distinct_lines(ax, len(per_domain.get(domain, {})))
        for label, values in per_domain.get(domain, {}).items():
            xs = [k + 1 for k, v in enumerate(values) if v is not None]
            ys = [v for v in values if v is not None]
            ax.plot(xs, ys, "o-", ms=4, label=label)
        ax.set_title(domain.capitalize())
        ax.set_xlabel("draft position k")
        ax.set_ylim(0, 1.05)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("P(accept k | 1..k-1 accepted)")
    _legend(axes[0][-1])
    return _save(fig, path, commands)


def tau_vs_block(per_domain: dict[str, dict[str, list[tuple[int, float]]]], path: Path, commands: list[str]) -> Path:
    """Fig. 4: domain tau against proposal length, one line per drafter kind."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(DOMAINS), figsize=(4.2 * len(DOMAINS), 3.6), squeeze=False)
    for ax, domain in zip(axes[0], DOMAINS):
        for kind, points in per_domain.get(domain, {}).items():
            points = sorted(points)
            ax.plot([g for g, _ in points], [t for _, t in points], "o-", ms=4, label=kind)
        ax.set_title(domain.capitalize())
        ax.set_xlabel("proposal length G (draft tokens per round)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("acceptance length tau")
    _legend(axes[0][-1])
    return _save(fig, path, commands)


def threshold_sweep(per_domain: dict[str, list[SweepPoint]], title: str, path: Path, commands: list[str]) -> Path:
    """Fig. 5: accepted / rejected draft tokens per step (bars) and acceptance
    rate (line) against a static confidence threshold, one panel per domain."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(DOMAINS), figsize=(4.2 * len(DOMAINS), 3.6), squeeze=False)
    for ax, domain in zip(axes[0], DOMAINS):
        points = per_domain.get(domain, [])
        xs = [p.threshold for p in points]
        acc = [p.accepted_per_step for p in points]
        rej = [p.rejected_per_step for p in points]
        ax.bar(xs, acc, width=0.07, label="accepted", color="tab:blue")
        ax.bar(xs, rej, width=0.07, bottom=acc, label="rejected", color="white", edgecolor="tab:red", hatch="///")
        rate = ax.twinx()
        rate.plot([p.threshold for p in points if p.acceptance_rate is not None],
                  [100 * p.acceptance_rate for p in points if p.acceptance_rate is not None], "k.-", label="rate")
        rate.set_ylim(0, 105)
        ax.set_title(f"{domain.capitalize()}")
        ax.set_xlabel("confidence threshold")
        if domain == DOMAINS[-1]:
            rate.set_ylabel("acceptance rate (%)")
    axes[0][0].set_ylabel("draft tokens per step")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path, commands)


def reliability(samples: list[ReliabilitySamples], title: str, path: Path, commands: list[str], bins: int = 10) -> Path:
    """Fig. 6: reliability diagram before/after calibration, one panel per position."""
    from dspark.train.calibrate import auc, ece, reliability_curve
    import torch

    plt = _plt()
    fig, axes = plt.subplots(1, len(samples), figsize=(3.3 * len(samples), 3.4), squeeze=False)
    for ax, s in zip(axes[0], samples):
        observed = torch.tensor(s.observed, dtype=torch.float64)
        hist = ax.twinx()
        hist.hist(s.after, bins=bins, range=(0, 1), color="0.88")
        hist.set_yticks([])
        ax.set_zorder(hist.get_zorder() + 1)
        ax.patch.set_visible(False)
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="perfect")
        for values, name, style in ((s.before, "before", "o-"), (s.after, "after", "s-")):
            pred = torch.tensor(values, dtype=torch.float64)
            curve = reliability_curve(pred, observed, bins)
            ax.plot(curve["predicted"], curve["observed"], style, ms=3,
                    label=f"{name} (ECE {100 * ece(pred, observed, bins):.1f}%)")
        score = auc(torch.tensor(s.after, dtype=torch.float64), observed)
        ax.set_title(f"position {s.position}, n={len(s.observed)}" + (f", AUC {score:.3f}" if score is not None else ""),
                     fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel("predicted acceptance")
        ax.legend(fontsize=7, loc="upper left")
    axes[0][0].set_ylabel("observed acceptance")
    fig.suptitle(title, fontsize=10)
    return _save(fig, path, commands)

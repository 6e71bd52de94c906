"""Figures of a load run, drawn from its summary rows (means over repeats).

    <name>_throughput_vs_tps.png  aggregate output tokens/s against mean
                                  tokens/s/user, one line per arm, points
                                  labelled with their concurrency (Fig. 7)
    <name>_vs_concurrency.png     aggregate throughput (top) and verification
                                  budget, 1 + mean verify length = tokens per
                                  request in one target forward (bottom),
                                  against concurrency (Fig. 8)
    <name>_poisson.png            throughput and median TTFT against the
                                  offered Poisson rate (only with rates)
"""

from __future__ import annotations

from pathlib import Path


def _curves(summary: list[dict], pattern: str) -> dict[str, list[dict]]:
    curves: dict[str, list[dict]] = {}
    for row in sorted(summary, key=lambda r: r["level"]):
        if row["pattern"] == pattern:
            curves.setdefault(row["arm"], []).append(row)
    return curves


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput_vs_tps(summary: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for arm, rows in _curves(summary, "closed").items():
        rows = [r for r in rows if r["tps_user"] is not None]
        if not rows:
            continue
        xs, ys = [r["tps_user"] for r in rows], [r["throughput"] for r in rows]
        sds = [r["throughput_sd"] or 0.0 for r in rows]
        ax.errorbar(xs, ys, yerr=sds, marker="o", capsize=3, label=arm)
        for r in rows:
            ax.annotate(f"{r['level']:g}", (r["tps_user"], r["throughput"]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7)
    ax.set_xlabel("per-user speed (tokens/s/user)")
    ax.set_ylabel("aggregate output throughput (tokens/s)")
    ax.set_title("Throughput vs per-user speed (labels: concurrency)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_vs_concurrency(summary: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.4), sharex=True)
    for arm, rows in _curves(summary, "closed").items():
        cs = [r["level"] for r in rows]
        top.errorbar(cs, [r["throughput"] for r in rows], yerr=[r["throughput_sd"] or 0.0 for r in rows],
                     marker="o", capsize=3, label=arm)
        budget = [(r["level"], r["verify_budget"]) for r in rows if r["verify_budget"] is not None]
        if budget:
            bottom.plot([c for c, _ in budget], [b for _, b in budget], marker="o", label=arm)
    top.set_ylabel("aggregate throughput (tokens/s)")
    top.set_title("Load-adaptive throughput and verification budget")
    bottom.set_ylabel("verification budget\n(tokens per request per step)")
    bottom.set_xlabel("concurrent requests")
    for ax in (top, bottom):
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_poisson(summary: list[dict], path: Path) -> None:
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.4, 6.0), sharex=True)
    for arm, rows in _curves(summary, "poisson").items():
        rates = [r["level"] for r in rows]
        top.plot(rates, [r["throughput"] for r in rows], marker="o", label=arm)
        ttft = [(r["level"], r["ttft_p50_s"]) for r in rows if r["ttft_p50_s"] is not None]
        bottom.plot([x for x, _ in ttft], [y for _, y in ttft], marker="o", label=arm)
    top.set_ylabel("aggregate throughput (tokens/s)")
    top.set_title("Open-loop Poisson arrivals")
    bottom.set_ylabel("median time to first token (s)")
    bottom.set_xlabel("offered rate (requests/s)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_load_figures(summary: list[dict], out_dir: Path, name: str) -> dict[str, Path]:
    """Draw the figures that have data -> {figure key: path}."""
    files: dict[str, Path] = {}
    if any(r["pattern"] == "closed" for r in summary):
        files["throughput_vs_tps"] = out_dir / f"{name}_throughput_vs_tps.png"
        plot_throughput_vs_tps(summary, files["throughput_vs_tps"])
        files["vs_concurrency"] = out_dir / f"{name}_vs_concurrency.png"
        plot_vs_concurrency(summary, files["vs_concurrency"])
    if any(r["pattern"] == "poisson" for r in summary):
        files["poisson"] = out_dir / f"{name}_poisson.png"
        plot_poisson(summary, files["poisson"])
    return files

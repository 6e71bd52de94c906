"""Held-out acceptance against the training budget, for recipes trained side by side:

    python -m dspark.train.budget --run DSpark=configs/dspark-960-long.toml \
        --run DFlash=configs/dflash-960-long.toml --out docs/TRAINING_BUDGET_960.md

Answers "does one recipe's edge over another grow with the steps?", which a
comparison at one budget cannot. Each `--run LABEL=RECIPE` names a recipe
(a training config); its drafters are the snapshots its run kept in
`<out_dir>/snapshots/` (`[log] snapshot_every`) and its final
`<out_dir>/drafter` at the step in `summary.json`. Every drafter is evaluated
like the end of training (`evaluate_drafter`: the recipe's held-out
sequences, its losses and anchors, the target's features computed online, or
with `--features cache` read from the recipe's feature cache, minutes faster
per drafter on a CPU), and the result is cached in
`<out_dir>/budget/step-NNNNNNN.json`, so a rerun evaluates only new drafters
(and those evaluated from the other feature source). Writes a markdown page (held-out expected tau and position-1
acceptance per step, and the first run's tau over each other run's at the
same step: list the recipe being compared first) and a PNG of the same next
to it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

from dspark.errors import UserError
from dspark.train import checkpoint as ckpt
from dspark.train.config import load_config
from dspark.train.plots import save_figure


def run_drafters(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, drafter folder) of a run: its snapshots, then its final drafter at a new step."""
    found = dict(ckpt.list_snapshots(out_dir))
    summary = out_dir / "summary.json"
    if (out_dir / "drafter" / "config.json").is_file() and summary.is_file():
        step = int(json.loads(summary.read_text())["step"])
        found.setdefault(step, out_dir / "drafter")
    return sorted(found.items())


def _stamp(folder: Path) -> float:
    return (folder / "model.safetensors").stat().st_mtime if (folder / "model.safetensors").is_file() else 0.0


def evaluate_run(recipe: str | Path, evaluate: Callable[[Path, Path], dict] | None = None,
                 log: Callable[[str], None] = print, features: str = "online") -> list[dict]:
    """One held-out evaluation per drafter of the recipe's run, cached; rows by step. A cached
    result from the other feature source (online or cache) is evaluated again, so one page never
    mixes the two."""
    if evaluate is None:
        from dspark.train.run import evaluate_drafter

        def evaluate(recipe_path: Path, folder: Path) -> dict:
            return evaluate_drafter(recipe_path, folder, features=features)
    out_dir = Path(load_config(recipe).run.out_dir)
    drafters = run_drafters(out_dir)
    if not drafters:
        raise UserError(f"{out_dir} holds no snapshots and no finished drafter; train {recipe} with "
                        "[log] snapshot_every = N first")
    cache = out_dir / "budget"
    rows = []
    for step, folder in drafters:
        path = cache / f"step-{step:07d}.json"
        cached = json.loads(path.read_text()) if path.is_file() else None
        stale = (cached is None or cached.get("stamp") != _stamp(folder) or cached.get("drafter") != str(folder)
                 or cached.get("features", "online") != features)  # entries from before the field were online
        if stale:
            log(f"budget: evaluating {folder} (step {step}) on the held-out sequences of {recipe}, features {features}")
            result = evaluate(Path(recipe), folder)
            cached = {"step": step, "drafter": str(folder), "stamp": _stamp(folder), "features": features,
                      "expected_accept_len": result["expected_accept_len"],
                      "accept_per_position": result["accept_per_position"],
                      "loss": result["loss"], "blocks_full": result.get("blocks_full")}
            cache.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(cached, indent=1) + "\n")
            os.replace(tmp, path)
        rows.append(cached)
    return rows


def budget_table(results: dict[str, list[dict]]) -> str:
    """Markdown: one row per step any run reached; tau, position-1 acceptance, and the first run's
    tau over each other run's (the first run is the one being compared)."""
    labels = list(results)
    by_step = {label: {r["step"]: r for r in rows} for label, rows in results.items()}
    steps = sorted({s for rows in by_step.values() for s in rows})
    head = ["step"] + [f"{label} tau (acc@1)" for label in labels]
    head += [f"{labels[0]} / {label}" for label in labels[1:]]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for step in steps:
        cells = [str(step)]
        for label in labels:
            r = by_step[label].get(step)
            cells.append("-" if r is None else f"{r['expected_accept_len']:.3f} ({r['accept_per_position'][0]:.3f})")
        base = by_step[labels[0]].get(step)
        for label in labels[1:]:
            r = by_step[label].get(step)
            ok = r is not None and base is not None
            cells.append(f"{base['expected_accept_len'] / r['expected_accept_len']:.3f}x" if ok else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_budget(results: dict[str, list[dict]], out_png: str | Path) -> Path:
    """Held-out expected tau and acceptance by position group against the step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_acc) = plt.subplots(1, 2, figsize=(12.5, 3.6))
    for label, rows in results.items():
        steps = [r["step"] for r in rows]
        line = ax_tau.plot(steps, [r["expected_accept_len"] for r in rows], marker="o", label=label)[0]
        ax_acc.plot(steps, [r["accept_per_position"][0] for r in rows], marker="o", color=line.get_color(),
                    label=f"{label}, position 1")
        later = [r["accept_per_position"][1:] for r in rows]
        if all(later):
            ax_acc.plot(steps, [sum(v) / len(v) for v in later], marker="s", linestyle="--", color=line.get_color(),
                        label=f"{label}, mean of positions 2+")
    ax_tau.set(xlabel="training step", ylabel="expected tau", title="held-out expected acceptance length")
    ax_acc.set(xlabel="training step", ylabel="acceptance (1 - TV)", title="held-out acceptance")
    for ax in (ax_tau, ax_acc):
        ax.grid(alpha=0.3)
    ax_tau.legend(fontsize=8)
    # beside the axes: with three or more runs a legend inside covers the lower curves
    ax_acc.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    return save_figure(fig, out_png)


def write_budget_report(runs: list[tuple[str, str]], out_md: str | Path, command: str,
                        evaluate: Callable[[Path, Path], dict] | None = None, features: str = "online") -> Path:
    """Evaluate every run's drafters (cached) and write the page and its figure."""
    results = {label: evaluate_run(recipe, evaluate, features=features) for label, recipe in runs}
    out = Path(out_md)
    png = plot_budget(results, out.parent / "figures" / f"{out.stem.lower()}.png")
    rel = Path(os.path.relpath(png, out.parent)).as_posix()
    recipes = "\n".join(f"- {label}: `{recipe}`" for label, recipe in runs)
    out.write_text(
        "# Held-out acceptance against the training budget\n\n"
        f"Generated by `{command}`; do not edit by hand.\n\n"
        f"{recipes}\n\n"
        "Each drafter (a run's snapshots and its final drafter) is evaluated on its recipe's held-out "
        f"sequences like the end of training (the target's features {'read from the recipe cache' if features == 'cache' else 'computed online'}). tau is the expected acceptance length 1 + sum over positions "
        "of the cumulative product of c* = 1 - TV(p_draft, p_target); acc@1 is c* at position 1.\n\n"
        + budget_table(results)
        + f"\n\n![held-out acceptance against the budget]({rel})\n"
    )
    return out


USAGE = ("usage: python -m dspark.train.budget --run LABEL=RECIPE [--run LABEL=RECIPE ...] [--out PAGE.md] "
         "[--features online|cache]")


def parse_args(argv: list[str]) -> tuple[list[tuple[str, str]], str, str]:
    """([(label, recipe)], markdown path, feature source) from the command line; the first run is the
    ratios' numerator."""
    runs, out, features = [], "docs/TRAINING_BUDGET.md", "online"
    args = iter(argv)
    for arg in args:
        if arg not in ("--run", "--out", "--features"):
            raise ValueError(f"unknown argument {arg}; {USAGE}")
        value = next(args, None)
        if value is None:
            raise ValueError(f"{arg} needs a value; {USAGE}")
        if arg == "--out":
            out = value
            continue
        if arg == "--features":
            if value not in ("online", "cache"):
                raise ValueError(f"--features takes online or cache, got {value!r}; {USAGE}")
            features = value
            continue
        label, sep, recipe = value.partition("=")
        if not sep or not label or not recipe:
            raise ValueError(f"--run takes LABEL=RECIPE (e.g. DSpark=configs/dspark-960-long.toml), got {value!r}")
        runs.append((label, recipe))
    if not runs:
        raise ValueError(f"no --run given; {USAGE}")
    return runs, out, features


def main(argv: list[str] | None = None) -> int:
    try:
        runs, out, features = parse_args(sys.argv[1:] if argv is None else argv)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 2
    command = " ".join(["python -m dspark.train.budget", *(f"--run {label}={recipe}" for label, recipe in runs),
                        "--out", out, *(["--features", features] if features != "online" else [])])
    try:
        print(write_budget_report(runs, out, command, features=features))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

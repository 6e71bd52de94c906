"""Write docs/RESULTS.md and its figures from saved evaluation runs.

    python -m dspark.eval.report [RESULTS_DIR [OUT_MD [FIG_DIR]]]

Table 1 and Figs. 2, 4, 5, 6 of the paper are rebuilt from the JSON files that
`dspark eval` saved; nothing is rerun. A figure whose inputs do not exist yet
(no drafter with a confidence head, no calibration, a single proposal length)
is left out with a note that says what would produce it; nothing is faked.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from dspark.eval import figures
from dspark.eval.benchmarks import BENCHMARKS, DOMAINS
from dspark.eval.records import (
    DrafterRun,
    EvalRun,
    domain_means,
    domain_position_acceptance,
    domain_reached,
    load_runs,
)
from dspark.eval.sweeps import reliability_samples, threshold_sweep
from dspark.eval.tables import fmt, render, skipped_note, speed_rows, tau_rows

DEFAULT_RESULTS = "docs/eval-runs"
PAPER_TEMPERATURE = 1.0
RELIABILITY_POSITIONS = (1, 3, 5, 7)


@dataclass
class Entry:
    """One drafter's results inside one saved run."""

    number: int  # 1-based index of the run in the report's run list
    run: EvalRun
    drafter: DrafterRun

    @property
    def name(self) -> str:
        return f"{self.drafter.label} (G={self.drafter.block_size})"


@dataclass
class Report:
    markdown: Path
    figures: list[Path] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)  # one note per figure not drawn


def latest_entries(runs: list[EvalRun], temperature: float, per_settings: bool = False) -> list[Entry]:
    """The newest result of each (drafter label, block size) among runs at
    `temperature`, in run order, then each run's drafter order. `per_settings`:
    the newest of each under every evaluation setting (prompts, length, seed),
    so that a later small run does not hide the comparable larger one."""
    chosen: dict[tuple, Entry] = {}
    order: dict[tuple, tuple[int, int]] = {}
    for number, run in enumerate(runs, start=1):
        if run.settings.temperature != temperature:
            continue
        for position, d in enumerate(run.drafters):
            key = (d.label, d.block_size) + ((repr(run.settings),) if per_settings else ())
            chosen[key] = Entry(number, run, d)
            order[key] = (number, position)
    return [chosen[key] for key in sorted(chosen, key=order.__getitem__)]


def _commands(entries: list[Entry], report_cmd: str) -> list[str]:
    seen = []
    for e in entries:
        if e.run.command not in seen:
            seen.append(e.run.command)
    return seen + [report_cmd]


def _made_by(commands: list[str]) -> str:
    return "Made by:\n\n" + "\n".join(f"    {c}" for c in commands)


def _runs_section(runs: list[EvalRun]) -> str:
    lines = ["## Runs", ""]
    for number, run in enumerate(runs, start=1):
        s, env = run.settings, run.environment
        mode = "greedy" if s.temperature == 0 else f"temperature {s.temperature:g}"
        limit = "all" if s.limit is None else f"first {s.limit}"
        lines += [
            f"**[{number}]** {run.created}: target {s.target} ({s.dtype}), {mode}, {limit} prompts per "
            f"benchmark, {s.max_new_tokens} new tokens per turn, seed {s.seed}; "
            f"torch {env.get('torch', '?')}, {env.get('threads', '?')} torch thread(s)"
            + (f", load average {env['load_average_1min']} on {env.get('cpus', '?')} CPUs at the end"
               if "load_average_1min" in env else ""),
            "", f"    {run.command}", "",
        ]
        if run.note:
            lines += [f"Note: {run.note}", ""]
        if skipped_note(run):
            lines += [skipped_note(run), ""]
    return "\n".join(lines)


def _tau_table(entries: list[Entry]) -> str:
    """Table 1 layout over entries from possibly several runs (column `run`)."""
    headers, rows = [], []
    for e in entries:
        settings = replace(e.run.settings, benchmarks=tuple(BENCHMARKS))  # all nine columns
        head, (row,) = tau_rows(EvalRun(settings=settings, command=e.run.command, drafters=[e.drafter]))
        headers = head[:1] + ["run"] + head[1:]
        rows.append(row[:1] + [f"[{e.number}]"] + row[1:])
    return render(headers, rows, markdown=True)


def _speed_section(runs: list[EvalRun]) -> str:
    parts = ["## Speed", "",
             "Batch 1 on this machine's CPU; tokens/s over all answers (prefill included), "
             "speedup over `none` in the same run.", ""]
    for number, run in enumerate(runs, start=1):
        parts += [f"Run [{number}]:", "", render(*speed_rows(run), markdown=True), ""]
    return "\n".join(parts)


def _fig2(entries: list[Entry], fig_dir: Path, report_cmd: str, report: Report) -> str:
    drafted = [e for e in entries if e.drafter.kind != "none"]
    head = "## Fig. 2: position-wise conditional acceptance\n\n"
    if not drafted:
        note = "Left out: no drafter other than `none` has a run at temperature 1.0."
        report.left_out.append("fig2: " + note)
        return head + note
    series = {dom: {e.name: domain_position_acceptance(e.drafter.position_acceptance(), dom) for e in drafted}
              for dom in DOMAINS}
    commands = _commands(drafted, report_cmd)
    path = figures.conditional_acceptance(series, fig_dir / "fig2_conditional_acceptance.png", commands)
    report.figures.append(path)
    rows = []
    for e in drafted:
        stats = {name: r.stats for name, r in e.drafter.benches.items()}
        for dom in DOMAINS:
            reached = domain_reached(stats, dom)
            rows.append([e.name, dom, *(f"{fmt(v)} ({n})" for v, n in zip(series[dom][e.name], reached))])
    width = max((len(r) - 2 for r in rows), default=0)
    table = render(["drafter", "domain", *(f"k={k + 1}" for k in range(width))],
                   [r + ["-"] * (width + 2 - len(r)) for r in rows], markdown=True)
    return (head + "Share of rounds whose draft token k was accepted, among rounds that verified position k "
            "with tokens 1..k-1 all accepted (paper 4.3.1), averaged over the domain's benchmarks; in brackets, "
            "how many rounds reached position k (few rounds: a noisy value).\n\n"
            f"![Fig. 2]({{FIG}}/{path.name})\n\n{table}\n\n{_made_by(commands)}")


def _fig4(entries: list[Entry], fig_dir: Path, report_cmd: str, report: Report) -> str:
    head = "## Fig. 4: acceptance length against proposal length\n\n"
    by_kind: dict[str, dict[int, Entry]] = {}
    for e in entries:
        if e.drafter.kind != "none":
            by_kind.setdefault(e.drafter.kind, {})[e.drafter.block_size] = e
    swept = {kind: sizes for kind, sizes in by_kind.items() if len(sizes) >= 2}
    if not swept:
        have = ", ".join(f"{k} at G={sorted(s)}" for k, s in by_kind.items()) or "none"
        note = ("Left out: needs runs of one drafter at two or more proposal lengths (e.g. "
                "`dspark eval --drafter ngram --block-size 4`, then 8, 12, 16; a learned drafter needs one trained "
                f"folder per block size; the recipes in configs/ train block size 7 only, so the learned drafters have one point each). Runs at temperature 1.0: {have}.")
        report.left_out.append("fig4: " + note)
        return head + note
    data = {dom: {kind: [(g, domain_means(e.drafter.taus()).get(dom)) for g, e in sizes.items()
                         if domain_means(e.drafter.taus()).get(dom) is not None] for kind, sizes in swept.items()}
            for dom in DOMAINS}
    used = [e for sizes in swept.values() for e in sizes.values()]
    commands = _commands(used, report_cmd)
    path = figures.tau_vs_block(data, fig_dir / "fig4_tau_vs_proposal_length.png", commands)
    report.figures.append(path)
    rows = [[kind, str(g), *(fmt(domain_means(e.drafter.taus()).get(d)) for d in DOMAINS)]
            for kind, sizes in swept.items() for g, e in sorted(sizes.items())]
    table = render(["drafter", "G", "Math", "Code", "Chat"], rows, markdown=True)
    return f"{head}![Fig. 4]({{FIG}}/{path.name})\n\n{table}\n\n{_made_by(commands)}"


def _confident(entries: list[Entry]) -> list[Entry]:
    return [e for e in entries if e.drafter.has_confidence and any(r.rounds for r in e.drafter.benches.values())]


def _no_confidence_note(entries: list[Entry]) -> str:
    names = ", ".join(sorted({e.drafter.label for e in entries})) or "none"
    return (f"no evaluated drafter has a confidence head (evaluated: {names}). The DSpark drafter has one, "
            "but none was evaluated; evaluate one with `dspark eval --drafter PATH`.")


def _fig5(entries: list[Entry], fig_dir: Path, report_cmd: str, report: Report) -> str:
    head = "## Fig. 5: static confidence-threshold sweep\n\n"
    confident = _confident(entries)
    if not confident:
        note = "Left out: " + _no_confidence_note(entries)
        report.left_out.append("fig5: " + note)
        return head + note
    parts = [head + "Replayed over the recorded rounds of the fixed-length run (see `dspark/eval/sweeps.py`)."]
    for e in confident:
        per_domain = {dom: threshold_sweep([x for r in e.drafter.benches.values() if r.domain == dom
                                            for x in r.rounds]) for dom in DOMAINS}
        commands = _commands([e], report_cmd)
        path = figures.threshold_sweep(per_domain, e.name, fig_dir / f"fig5_threshold_sweep_{e.drafter.label}.png",
                                       commands)
        report.figures.append(path)
        parts.append(f"![Fig. 5 {e.name}]({{FIG}}/{path.name})\n\n{_made_by(commands)}")
    return "\n\n".join(parts)


def _fig6(entries: list[Entry], fig_dir: Path, report_cmd: str, report: Report) -> str:
    head = "## Fig. 6: reliability of the confidence head before and after calibration\n\n"
    confident = _confident(entries)
    calibrated = [e for e in confident if e.drafter.calibration_temperatures]
    if not calibrated:
        note = "Left out: " + (_no_confidence_note(entries) if not confident else
                               "no evaluated drafter with a confidence head carries STS calibration temperatures "
                               "(run `dspark calibrate` on it, then evaluate it again).")
        report.left_out.append("fig6: " + note)
        return head + note
    parts = [head.rstrip()]
    for e in calibrated:
        benches = e.drafter.benches
        pick = [benches["alpaca"]] if "alpaca" in benches else [r for r in benches.values() if r.domain == "chat"]
        source = "alpaca" if "alpaca" in benches else ("chat benchmarks" if pick else "all benchmarks")
        rounds = [x for r in (pick or benches.values()) for x in r.rounds]
        positions = [p for p in RELIABILITY_POSITIONS if p <= e.drafter.block_size]
        samples = [reliability_samples(rounds, e.drafter.calibration_temperatures, p) for p in positions]
        samples = [s for s in samples if s.observed]
        commands = _commands([e], report_cmd)
        path = figures.reliability(samples, f"{e.name} on {source}", fig_dir / f"fig6_reliability_{e.drafter.label}.png",
                                   commands)
        report.figures.append(path)
        parts.append(f"![Fig. 6 {e.name}]({{FIG}}/{path.name})\n\n{_made_by(commands)}")
    return "\n\n".join(parts)


def _calibration(entries: list[Entry], temperature: float) -> str:
    """Per draft position k: over the rounds that verified k, the mean predicted prefix survival
    a_k against the share whose tokens 1..k were all accepted, and the ECE (10 bins), for every
    drafter with confidences (the DSpark head after STS; prompt lookup's running hit rates)."""
    import torch

    from dspark.train.calibrate import ece

    rows = []
    for e in _confident(entries):
        rounds = [x for r in e.drafter.benches.values() for x in r.rounds]
        temps = e.drafter.calibration_temperatures or [1.0] * e.drafter.block_size
        for k in range(1, e.drafter.block_size + 1):
            sample = reliability_samples(rounds, temps, k)
            if not sample.observed:
                continue
            pred, seen = torch.tensor(sample.after), torch.tensor(sample.observed)
            rows.append([e.name, str(k), str(len(sample.observed)), f"{float(pred.mean()):.3f}",
                         f"{float(seen.mean()):.3f}", f"{100 * ece(pred, seen):.1f}"])
    if not rows:
        return ""
    label = "temperature 1.0" if temperature == PAPER_TEMPERATURE else f"temperature {temperature:g}"
    head = (f"## Calibration of the confidences on the benchmarks, {label}\n\n"
            "Over the rounds that verified draft position k (all nine benchmarks): the mean predicted "
            "probability a_k that tokens 1..k are all accepted (the product of the confidences), the share "
            "that were, and the expected calibration error (10 bins).\n\n")
    return head + render(["drafter", "k", "rounds", "predicted a_k", "observed", "ECE %"], rows, markdown=True)


def _noise(entries: list[Entry], temperature: float) -> str:
    """Bootstrap intervals of each drafter's macro tau (its newest run under each evaluation
    setting) and of the ratio of every pair that answered the same prompts with the same seeds
    (dspark.eval.noise); drafters from runs saved without per-prompt counts are left out."""
    from dspark.eval.noise import macro_interval, paired_ratio_interval

    with_counts = [(e, macro_interval(e.drafter)) for e in entries]
    with_counts = [(e, iv) for e, iv in with_counts if iv is not None]
    if not with_counts:
        return ""
    label = "temperature 1.0" if temperature == PAPER_TEMPERATURE else f"temperature {temperature:g}"
    rows = [[e.name, f"[{e.number}]", f"{iv.point:.3f}", f"{iv.low:.3f} - {iv.high:.3f}"] for e, iv in with_counts]
    text = (f"## How noisy are these numbers, {label}\n\n"
            "95 % bootstrap intervals: prompts resampled within each benchmark (2000 resamples), each "
            "benchmark's tau recomputed as committed tokens over rounds, then the macro average. Each drafter's "
            "newest run under each evaluation setting is listed; runs saved before per-prompt counts were "
            "recorded are not.\n\n"
            + render(["drafter", "run", "macro tau", "95 % interval"], rows, markdown=True))
    pairs = []
    for i, (a, _) in enumerate(with_counts):
        for b, _ in with_counts[i + 1:]:
            if a.run.settings != b.run.settings:
                continue
            iv = paired_ratio_interval(b.drafter, a.drafter)
            if iv is not None:
                pairs.append([f"{b.name} / {a.name}", f"[{b.number}] / [{a.number}]", f"{iv.point:.3f}x",
                              f"{iv.low:.3f}x - {iv.high:.3f}x"])
    if pairs:
        text += ("\n\nRatios of macro tau between drafters that answered the same prompts with the same seeds, "
                 "the same prompts drawn for both in each resample:\n\n"
                 + render(["ratio", "runs", "macro tau ratio", "95 % interval"], pairs, markdown=True))
    return text


def run_report(
    results_dir: str | Path = DEFAULT_RESULTS, out_md: str | Path = "docs/RESULTS.md", fig_dir: str | Path = "docs/figures"
) -> Report:
    """Rebuild the results page and figures from every run saved in `results_dir`."""
    runs = load_runs(results_dir)
    out_md, fig_dir = Path(out_md), Path(fig_dir)
    report = Report(markdown=out_md)
    report_cmd = f"python -m dspark.eval.report {results_dir} {out_md} {fig_dir}"
    main = latest_entries(runs, PAPER_TEMPERATURE)
    greedy = latest_entries(runs, 0.0)
    sections = [
        "# Results\n\nGenerated by `" + report_cmd + "` from the saved runs in `" + str(results_dir) + "`; "
        "do not edit by hand. tau is the acceptance length per round (accepted draft tokens + the bonus token), "
        "as in the paper. Small `--limit` runs are noisy: read them as a smoke measurement, not as the paper's "
        "numbers.",
        _runs_section(runs) if runs else "## Runs\n\nNo saved runs yet.",
        "## Table 1: acceptance length tau, temperature 1.0\n\n"
        + (_tau_table(main) if main else "No run at temperature 1.0 yet."),
    ]
    if greedy:
        sections.append("## Acceptance length tau, greedy (temperature 0)\n\n" + _tau_table(greedy))
    if runs:
        sections.append(_speed_section(runs))
    for build in (_fig2, _fig4, _fig5, _fig6):
        sections.append(build(main, fig_dir, report_cmd, report))
    for entries, temperature in ((main, PAPER_TEMPERATURE), (greedy, 0.0)):
        table = _calibration(entries, temperature)
        if table:
            sections.append(table)
        table = _noise(latest_entries(runs, temperature, per_settings=True), temperature)
        if table:
            sections.append(table)
    link = Path(os.path.relpath(fig_dir, out_md.parent or Path("."))).as_posix()
    out_md.parent.mkdir(parents=True, exist_ok=True)
    out_md.write_text("\n\n".join(sections).replace("{FIG}", link) + "\n")
    return report


def main(argv: list[str]) -> int:
    if len(argv) > 3 or any(a.startswith("-") for a in argv):
        print("usage: python -m dspark.eval.report [RESULTS_DIR [OUT_MD [FIG_DIR]]]", file=sys.stderr)
        return 2
    from dspark.errors import UserError

    try:
        report = run_report(*argv)
    except UserError as err:
        print(f"dspark: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {report.markdown} and {len(report.figures)} figure(s)")
    for note in report.left_out:
        print(f"left out {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Readable tables of evaluation results: plain text for the terminal and
Markdown for docs/RESULTS.md, from the same rows."""

from __future__ import annotations

from dspark.eval.benchmarks import DISPLAY_NAMES, DOMAINS
from dspark.eval.records import EvalRun, domain_means, domain_position_acceptance, macro_mean


def fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def render(headers: list[str], rows: list[list[str]], markdown: bool) -> str:
    """A table as Markdown or as aligned plain text."""
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def tau_rows(run: EvalRun) -> tuple[list[str], list[list[str]]]:
    """Table 1 layout: drafter, tau per benchmark, per domain, macro."""
    benches = list(run.settings.benchmarks)
    headers = ["drafter", "G", *(DISPLAY_NAMES[b] for b in benches), "Math", "Code", "Chat", "Macro"]
    rows = []
    for d in run.drafters:
        taus = d.taus()
        doms = domain_means(taus)
        rows.append([d.label, str(d.block_size), *(fmt(taus.get(b)) for b in benches),
                     *(fmt(doms.get(x)) for x in DOMAINS), fmt(macro_mean(taus))])
    return headers, rows


def speed_rows(run: EvalRun) -> tuple[list[str], list[list[str]]]:
    speedups = run.speedups()
    headers = ["drafter", "answers", "tokens", "seconds", "tokens/s", "speedup vs none"]
    rows = []
    for d in run.drafters:
        answers = sum(r.generations for r in d.benches.values())
        rows.append([d.label, str(answers), str(d.generated_tokens), f"{d.seconds:.1f}",
                     f"{d.tokens_per_second:.1f}", fmt(speedups[d.label]) + ("x" if speedups[d.label] else "")])
    return headers, rows


def acceptance_rows(run: EvalRun) -> tuple[list[str], list[list[str]]]:
    """Conditional acceptance per draft position (paper 4.3.1), per domain."""
    width = max((d.block_size for d in run.drafters if d.kind != "none"), default=1)
    headers = ["drafter", "domain", *(f"k={k + 1}" for k in range(width))]
    rows = []
    for d in run.drafters:
        if d.kind == "none":
            continue
        for dom in DOMAINS:
            values = domain_position_acceptance(d.position_acceptance(), dom)
            if values:
                rows.append([d.label, dom, *(fmt(values[k] if k < len(values) else None) for k in range(width))])
    return headers, rows


def skipped_note(run: EvalRun) -> str:
    """Which prompts were left out because they do not fit the target's context."""
    first = run.drafters[0] if run.drafters else None
    lists = {n: r.skipped for n, r in (first.benches.items() if first else ()) if r.skipped}
    if not lists:
        return ""
    return "skipped (longer than the target's context): " + "; ".join(
        f"{DISPLAY_NAMES[n]} {len(ids)} ({', '.join(ids[:3])}{', ...' if len(ids) > 3 else ''})"
        for n, ids in lists.items())


def format_eval(run: EvalRun, markdown: bool = False) -> str:
    """The run as readable tables: tau (Table 1 layout), conditional acceptance
    per position, tokens/s; with the command that made it."""
    s = run.settings
    mode = "greedy" if s.temperature == 0 else f"temperature {s.temperature:g}"
    limit = "all" if s.limit is None else str(s.limit)
    parts = [
        f"target {s.target} ({s.dtype}), {mode}, {limit} prompts per benchmark, "
        f"{s.max_new_tokens} new tokens per turn, seed {s.seed}",
        "acceptance length tau (accepted + bonus per round):",
        render(*tau_rows(run), markdown),
        "conditional acceptance at draft position k, given 1..k-1 accepted:",
        render(*acceptance_rows(run), markdown),
        "speed (batch 1, wall time of all answers, prefill included):",
        render(*speed_rows(run), markdown),
        f"command: {run.command}",
    ]
    skipped = skipped_note(run)
    if skipped:
        parts.insert(-1, skipped)
    return "\n\n".join(parts)

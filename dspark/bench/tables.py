"""Markdown tables of a load report (printed at the end of a run and pasted
into docs/LOAD.md together with the command that produced them)."""

from __future__ import annotations

from dspark.bench.clients import DRAFTED_KINDS
from dspark.bench.paired import interval_cell, verdict
from dspark.engine.metrics import STEP_KINDS


def _f(value, fmt: str = ".1f") -> str:
    return "-" if value is None else format(value, fmt)


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f} %"


def _level(row: dict) -> str:
    return f"c={row['level']:g}" if row["pattern"] == "closed" else f"{row['level']:g} req/s"


def _drafted(steps: dict | None) -> str:
    """Shares of the decode steps that drafted all, some and none of their requests."""
    total = sum((steps or {}).values())
    if not total:
        return "-"
    return " / ".join(f"{100 * steps[k] / total:.0f} %" for k in DRAFTED_KINDS)


def summary_table(summary: list[dict]) -> str:
    head = ("| arm | load | repeats | throughput tok/s | tok/s/user | end-to-end tok/s/user | TTFT p50 s | "
            "started together | verify budget | tau | requests a step | ms a step | "
            "steps drafting all / some / none | done / failed / cut |")
    lines = [head, "|" + "---|" * 14]
    order = {"closed": 0, "poisson": 1}
    for r in sorted(summary, key=lambda r: (order[r["pattern"]], r["level"], r["arm"])):
        sd = "" if r["throughput_sd"] is None else f" ± {r['throughput_sd']:.1f}"
        lines.append(
            f"| {r['arm']} | {_level(r)} | {r['repeats']} | {r['throughput']:.1f}{sd} | {_f(r['tps_user'])} | "
            f"{_f(r.get('e2e_tps_user'))} | {_f(r['ttft_p50_s'], '.2f')} | {_percent(r.get('shared_starts'))} | "
            f"{_f(r['verify_budget'], '.2f')} | "
            f"{_f(r['acceptance_length'], '.2f')} | {_f(r.get('step_batch'), '.2f')} | {_f(r.get('step_ms'))} | "
            f"{_drafted(r.get('drafted_steps'))} | {r['completed']} / {r['failed']} / {r['cut']} |")
    return "\n".join(lines)


def time_table(summary: list[dict]) -> str | None:
    """Where each arm's engine time went (summed over repeats): per step kind its steps, ms a step,
    target positions a step and share of the levels' wall time; the loop's idle share; and what is
    left, the loop between steps. None when no row has the per-kind counters."""
    rows = [r for r in summary if r.get("step_time")]
    if not rows:
        return None
    head = ("| arm | load | " + " | ".join(f"{k} steps | {k} ms a step | {k} positions a step | {k} share"
                                         for k in STEP_KINDS) + " | idle share | between steps |")
    lines = [head, "|" + "---|" * (3 + 4 * len(STEP_KINDS))]
    order = {"closed": 0, "poisson": 1}
    for r in sorted(rows, key=lambda r: (order[r["pattern"]], r["level"], r["arm"])):
        t = r["step_time"]
        wall = t["wall_s"] or float("nan")
        cells, busy = [], 0.0
        for kind in STEP_KINDS:
            k = t["kinds"].get(kind, {"steps": 0, "seconds": 0.0, "positions": 0})
            n = k["steps"]
            busy += k["seconds"]
            cells.append(f"{n:.0f} | {_f(1e3 * k['seconds'] / n if n else None)} | "
                         f"{_f(k['positions'] / n if n else None)} | {_percent(k['seconds'] / wall)}")
        rest = (wall - busy - t["idle_s"]) / wall
        lines.append(f"| {r['arm']} | {_level(r)} | " + " | ".join(cells)
                     + f" | {_percent(t['idle_s'] / wall)} | {_percent(rest)} |")
    return "\n".join(lines)


def goal_lines(goals: list[dict]) -> list[str]:
    lines = []
    for g in goals:
        what = ("throughput >= max(nospec, fixed-k) within noise" if g["goal"] == "throughput"
                else "tok/s/user >= 1.6x MTP-1 at matched throughput")
        line = f"- {g['arm']}: {what}: **{g['status']}**"
        if g["status"] == "not measurable":
            line += f" ({g['why']})"
        elif g["goal"] == "throughput":
            failed = [c for c in g["checks"] if not c["met"]]
            shown = failed or [min(g["checks"], key=lambda c: c["margin"])]
            parts = []
            for c in shown:
                noise = "no noise estimate" if c["noise"] is None else f"noise {c['noise']:.1f}"
                paired = c.get("paired")
                if paired is not None:
                    noise += f"; paired {paired[0]:.3f}x, 95 % {interval_cell(paired)}, {verdict(paired)}"
                parts.append(f"{c['margin']:+.1f} tok/s at c={c['concurrency']:g} (vs {c['best_baseline']}, {noise})")
            line += ("; missed: " if failed else "; worst margin ") + ", ".join(parts)
            below = [c for c in g["checks"] if c not in shown and verdict(c.get("paired")) == "below"]
            if below:  # met within noise, but below the baseline in a paired interval
                line += "; paired below at " + ", ".join(
                    f"c={c['concurrency']:g} ({c['paired'][0]:.3f}x, 95 % {interval_cell(c['paired'])})"
                    for c in below)
            if g.get("partial"):
                line += f" ({g['partial']})"
        else:
            line += f"; smallest ratio {g['min_ratio']:.2f}x over {len(g['checks'])} matched point(s)"
            if g.get("control_min_ratio") is not None:
                line += f" (no speculation reads {g['control_min_ratio']:.2f}x by the same check)"
            if g.get("e2e_min_ratio") is not None:
                control = g.get("e2e_control_min_ratio")
                line += (f"; end to end (first-token wait included) {g['e2e_min_ratio']:.2f}x"
                         + ("" if control is None else f", no speculation {control:.2f}x"))
        lines.append(line)
    return lines


def format_load_markdown(report) -> str:
    env = report.environment
    device = f" on {env['before']['device']}" if env["before"].get("device") else ""
    parts = [f"Mode: {report.mode}{device}; wall {env.get('wall_s', 0):.0f} s; load average before "
             f"{env['before']['loadavg_1_5_15']}, after {env['after']['loadavg_1_5_15']}."]
    if report.command:
        parts.append(f"Command: `{report.command}`")
    if report.settings.get("interleave"):
        parts.append("Interleaved: the arms of each level ran at once, their engines stepping in turn; throughput "
                     "and ms a step are timed on each arm's own steps, while per-user speeds and TTFT include the "
                     "other arms' steps.")
    parts.append(summary_table(report.summary) if report.summary else "(no point measured)")
    times = time_table(report.summary or [])
    if times:
        parts.append("Where the engine's time went (summed over repeats; shares of the levels' wall time):\n\n"
                     + times)
    parts.append("Goals:\n" + "\n".join(goal_lines(report.goals)))
    pending = [f"- {a['name']}: {a['pending']}" for a in report.arms if a.get("pending")]
    if pending:
        parts.append("Pending arms (not run):\n" + "\n".join(pending))
    if report.skipped:
        parts.append(f"Skipped {len(report.skipped)} (arm, level) runs: the run's time budget was spent.")
    return "\n\n".join(parts)

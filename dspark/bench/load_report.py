"""The load benchmark's results: per-level points, their means over repeats,
the paper's serving goals checked against them, JSON, figures and a
markdown table.

Goals (paper 5.3-5.4, as the project states them):
  1. at every concurrency the DSpark scheduler's aggregate throughput is at
     least the larger of no-speculation's and fixed-k's, within measured
     noise: margin = sched - max(nospec, fixed) >= -noise, noise being the
     standard deviation of a difference of two single measurements,
     sqrt(sd_sched^2 + sd_best^2), from the repeats (1 repeat: no noise
     estimate, the margin must be >= 0). A run without one of the two
     baselines is checked against the other and says so (`partial`). Beside
     it, for information (the rule stays the one above, so that runs keep
     comparable verdicts), each check carries the paired ratio to that
     baseline, repeat by repeat, and its 95 % Student-t interval: arms are
     interleaved within every repeat, so the pair cancels the machine's drift
     that widens both arms' spreads (`dspark.bench.paired`);
  2. at matched aggregate throughput, per-user speed >= 1.6x MTP-1's. Each
     arm's closed-loop points are cut to their frontier (the points no other
     point of the same arm beats on both throughput and tokens/s/user; past
     saturation more clients only lower both, and such points are not a
     speed the arm offers at that throughput). At every MTP-1 frontier point
     whose throughput lies inside the scheduler's frontier range, the
     scheduler's tokens/s/user is interpolated linearly along its frontier
     and divided by MTP-1's. The no-speculation arm is put through the same
     check as a control (`control_min_ratio`): where MTP-1 loses throughput
     to plain decoding (a batch of one-token drafts on a CPU), a frontier
     reaches MTP-1's throughput with fewer clients, so even plain decoding
     can read well above 1x. Only the scheduler's lead over that control is
     what drafting and scheduling bought (run AX, docs/LOAD.md: 1.73x, with
     no speculation at 1.55x).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from dspark.bench.clients import DRAFTED_KINDS


def environment() -> dict:
    """Machine conditions, recorded before and after a run."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (math.nan,) * 3
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "loadavg_1_5_15": [round(x, 2) for x in load]}


@dataclass(frozen=True)
class GoalRoles:
    """Which arms play which part in the goals."""

    schedulers: tuple[str, ...] = ("dspark", "dspark-async")
    nospec: str = "nospec"
    fixed: str = "dspark-k7"
    mtp: str = "mtp1"
    speedup: float = 1.6  # goal 2: per-user speed ratio at matched throughput


def roles_for(arms: list[dict]) -> GoalRoles:
    """The roles of the arms of a run, read from their policies: the schedulers are the arms of
    the `dspark` and `dspark-async` policies, the no-speculation arm the one of policy `none`, the
    fixed-k arm the `fixed` one verifying the most tokens, MTP-1 the arm named `mtp1`. For the
    paper's arms these are its names; a run of other drafters (say prompt lookup under each
    policy) gets its goals checked the same way. HTTP arms (no policy known) keep the names."""
    known = [a for a in arms if a.get("policy")]
    if not known:
        return GoalRoles()
    default = GoalRoles()
    schedulers = tuple(a["name"] for a in known if a["policy"] in ("dspark", "dspark-async"))
    nospec = next((a["name"] for a in known if a["policy"] == "none"), default.nospec)
    fixed = [a for a in known if a["policy"] == "fixed" and a["name"] != default.mtp]
    width = lambda a: a["k"] if a.get("k") is not None else a.get("block_size") or 10**9  # noqa: E731
    return GoalRoles(schedulers=schedulers or default.schedulers, nospec=nospec,
                     fixed=max(fixed, key=width)["name"] if fixed else default.fixed)


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


SAME_START_S = 0.01  # requests released by one engine step start within a millisecond of each other


def latency_speed(samples: list[dict]) -> float | None:
    """Mean over a level's finished requests of output tokens / (end - start): each user's speed
    with the wait for the first token included. Read from the samples' times, so reports written
    before it was recorded give it too."""
    speeds = [s["output_tokens"] / (s["end_s"] - s["start_s"]) for s in samples
              if s.get("status") == "ok" and s.get("output_tokens") and s.get("end_s") is not None
              and s["end_s"] > s["start_s"]]
    return statistics.fmean(speeds) if speeds else None


def shared_starts(samples: list[dict], window_s: float = SAME_START_S) -> float | None:
    """The share of a level's requests that started within `window_s` of another one. In a closed
    loop, requests that finish in the same engine step send their successors together; those
    prefill together, so their first tokens wait longer and their later tokens are not slowed by
    each other's prefills. Greedy decoding to a length cap without drafting keeps such groups
    together (same steps, same end), drafting breaks them up (docs/LOAD.md, "Why no speculation
    reads a higher tok/s/user at four clients")."""
    starts = sorted(s["start_s"] for s in samples)
    if len(starts) < 2:
        return None
    close = [False] * len(starts)
    for k in range(1, len(starts)):
        if starts[k] - starts[k - 1] <= window_s:
            close[k] = close[k - 1] = True
    return sum(close) / len(starts)


def steady_throughput(samples: list[dict]) -> float | None:
    """Output tokens a second of a closed-loop level until its first client runs dry (the first
    request to finish after the last one was sent): the level's throughput without its tail, when
    fewer than `concurrency` requests are left. Tokens of a request inside that window are counted
    from its first-token time and mean time per output token. An arm whose requests drift apart
    has a ragged tail where one that keeps them together ends at once; this says whether that,
    and not its steps, is what it loses (docs/LOAD.md, session 46: it is not). None without
    finished requests."""
    done = [s for s in samples if s.get("status") == "ok" and s.get("end_s") is not None
            and s.get("ttft_s") is not None and s.get("output_tokens")]
    if not done:
        return None
    last_sent = max(s["start_s"] for s in samples)
    window = min((s["end_s"] for s in done if s["end_s"] > last_sent), default=None)
    if window is None:  # the last requests sent did not finish (cut at the level's deadline, failed)
        return None
    tokens = 0.0
    for s in done:
        first = s["start_s"] + s["ttft_s"]
        if window < first:
            continue
        per_token = s.get("tpot_s") or 0.0
        tokens += s["output_tokens"] if per_token <= 0 else min(s["output_tokens"], 1 + (window - first) / per_token)
    return tokens / window if window > 0 else None


def step_shape(point) -> tuple[float | None, float | None]:
    """(requests decoded per decode step, milliseconds of the level per decode step) of one level:
    arms that decode as many requests a step but take longer a step lose in the steps themselves,
    not in how the load fills them (docs/LOAD.md, run BP). None without decode steps."""
    steps = sum(point.drafted_steps.values())
    if not steps:
        return None, None
    seconds = point.duration_s if getattr(point, "busy_s", None) is None else point.busy_s
    return point.rounds / steps, 1e3 * seconds / steps


def step_time(points: list) -> dict | None:
    """Where the engine's time went over some levels (repeats of one arm and load): per step kind
    (prefill, plain, drafted) the steps, seconds, target positions and target forward's seconds
    (where the engine timed it apart) summed, the loop's idle
    seconds, and the levels' wall seconds (what is left of them is the loop between steps: handing
    tokens out, taking requests in). None when a point lacks the per-kind counters (older runs)."""
    if not points or any(not p.step_kinds or p.idle_s is None for p in points):
        return None
    kinds: dict[str, dict[str, float]] = {}
    for p in points:
        for kind, totals in p.step_kinds.items():
            into = kinds.setdefault(kind, {"steps": 0.0, "seconds": 0.0, "positions": 0.0})
            for what, value in totals.items():
                into[what] = into.get(what, 0.0) + value
    return {"kinds": kinds, "idle_s": sum(p.idle_s for p in points), "wall_s": sum(p.duration_s for p in points)}


def aggregate(points: list) -> list[dict]:
    """Means (and the throughput's standard deviation) over repeats, per (arm, pattern, level)."""
    groups: dict[tuple, list] = defaultdict(list)
    for p in points:
        groups[(p.arm, p.pattern, p.level)].append(p)
    rows = []
    for (arm, pattern, level), ps in groups.items():
        tput = [p.throughput for p in ps]
        rows.append({
            "arm": arm, "pattern": pattern, "level": level, "repeats": len(ps),
            "throughput": statistics.fmean(tput), "throughput_sd": statistics.stdev(tput) if len(tput) > 1 else None,
            "tps_user": _mean([p.tps_user_mean for p in ps]), "ttft_p50_s": _mean([p.ttft_p50_s for p in ps]),
            "e2e_tps_user": _mean([latency_speed(p.samples) for p in ps]),
            "shared_starts": _mean([shared_starts(p.samples) for p in ps]),
            "tpot_mean_s": _mean([p.tpot_mean_s for p in ps]), "verify_budget": _mean([p.verify_budget for p in ps]),
            "verify_length": _mean([p.verify_length for p in ps]),
            "acceptance_length": _mean([p.acceptance_length for p in ps]),
            "completed": sum(p.completed for p in ps), "failed": sum(p.failed for p in ps),
            "cut": sum(p.cut for p in ps),
            "drafted_steps": {k: sum(p.drafted_steps.get(k, 0) for p in ps) for k in DRAFTED_KINDS},
            "step_batch": _mean([step_shape(p)[0] for p in ps]), "step_ms": _mean([step_shape(p)[1] for p in ps]),
            "step_time": step_time(ps),
        })
    return rows


def _row(rows: list[dict], arm: str, level: float) -> dict | None:
    return next((r for r in rows if r["arm"] == arm and r["pattern"] == "closed" and r["level"] == level), None)


def _paired(points: list, arm: str, baseline: str, level: float) -> tuple[float, float, float] | None:
    """(mean, low, high) of `arm`'s throughput / `baseline`'s over the repeats in which both measured
    closed-loop `level`: the 95 % Student-t interval of the paired ratio (None under two repeats)."""
    from dspark.bench.paired import mean_interval, paired_differences

    keys = ("pattern", "level", "arm", "repeat", "throughput")
    pairs = paired_differences([{k: getattr(p, k) for k in keys} for p in points], baseline)
    return mean_interval([ratio for _, ratio in pairs.get(("closed", level, arm), [])])


def throughput_goal(rows: list[dict], scheduler: str, roles: GoalRoles, points: list = ()) -> dict:
    """Goal 1 for one scheduler arm (see the module docstring); `points`, the per-repeat
    measurements, give each check its paired ratio and interval."""
    need = [scheduler, roles.nospec, roles.fixed]
    levels = sorted({r["level"] for r in rows if r["pattern"] == "closed" and r["arm"] == scheduler})
    checks = []
    measured = [a for a in need[1:] if any(_row(rows, a, level) for level in levels)]
    for level in levels:
        sched, base = _row(rows, scheduler, level), [_row(rows, a, level) for a in measured]
        base = [b for b in base if b is not None]
        if not measured or len(base) < len(measured):
            continue
        best = max(base, key=lambda r: r["throughput"])
        sds = [sched["throughput_sd"], best["throughput_sd"]]
        noise = None if None in sds else math.hypot(*sds)
        margin = sched["throughput"] - best["throughput"]
        checks.append({"concurrency": level, "scheduler": sched["throughput"], "best_baseline": best["arm"],
                       "baseline": best["throughput"], "margin": margin, "noise": noise,
                       "met": margin >= -(noise or 0.0), "paired": _paired(points, scheduler, best["arm"], level)})
    if not checks:
        return {"goal": "throughput", "arm": scheduler, "status": "not measurable",
                "why": f"needs closed-loop points of {', '.join(need)} at the same concurrency"}
    result = {"goal": "throughput", "arm": scheduler,
              "status": "met" if all(c["met"] for c in checks) else "missed", "checks": checks}
    missing = [a for a in need[1:] if a not in measured]
    if missing:  # checked against the baselines the run measured: "met" is then only a lower bound
        result["partial"] = f"against {', '.join(measured)} only; {', '.join(missing)} not measured"
    return result


def _interp(x: float, xs: list[float], ys: list[float]) -> float:
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0] if x <= xs[0] else ys[-1]


def frontier(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (throughput, tokens/s/user) points no other point beats on both,
    sorted by throughput (so tokens/s/user falls along them)."""
    out: list[tuple[float, float]] = []
    for t, u in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not out or u > out[-1][1]:
            out.append((t, u))
    return out[::-1]


def _matched(rows: list[dict], scheduler: str, roles: GoalRoles, speed: str) -> tuple[list[dict], list]:
    """Goal 2's comparison on one per-user speed (`speed`: a summary row key) -> (the checks at
    MTP-1's frontier points inside the scheduler's frontier range, the scheduler's frontier)."""
    def curve(arm: str) -> list[tuple[float, float]]:
        return frontier([(r["throughput"], r.get(speed)) for r in rows
                         if r["arm"] == arm and r["pattern"] == "closed" and r.get(speed) is not None])

    sched, mtp = curve(scheduler), curve(roles.mtp)
    if len(sched) < 2 or not mtp:
        return [], sched
    xs, ys = [t for t, _ in sched], [u for _, u in sched]
    plain = curve(roles.nospec)  # the control
    pxs, pys = [t for t, _ in plain], [u for _, u in plain]
    checks = []
    for t, u in mtp:
        if not (xs[0] <= t <= xs[-1] and u > 0):
            continue
        ours = _interp(t, xs, ys)
        control = _interp(t, pxs, pys) / u if len(plain) >= 2 and pxs[0] <= t <= pxs[-1] else None
        checks.append({"throughput": t, "mtp_tps_user": u, "scheduler_tps_user": ours, "ratio": ours / u,
                       "nospec_ratio": control})
    return checks, sched


def matched_speed_goal(rows: list[dict], scheduler: str, roles: GoalRoles) -> dict:
    """Goal 2 for one scheduler arm (see the module docstring). Per-user speed is 1 / TPOT, the
    paper's; the same check on end-to-end speed (first-token wait included, `latency_speed`) is
    reported beside it (`e2e_min_ratio`), since where the arms' requests start together differently
    the wait for the first token moves between the two (docs/LOAD.md)."""
    checks, sched = _matched(rows, scheduler, roles, "tps_user")
    if len(sched) < 2:
        return {"goal": "matched_speed", "arm": scheduler, "status": "not measurable",
                "why": f"needs closed-loop points of {scheduler} (>= 2 on its frontier) and {roles.mtp}"}
    if not checks:
        low, high = sched[0][0], sched[-1][0]
        return {"goal": "matched_speed", "arm": scheduler, "status": "not measurable",
                "why": f"no {roles.mtp} throughput inside {scheduler}'s range {low:.1f}..{high:.1f} tok/s"}
    worst = min(c["ratio"] for c in checks)
    controls = [c["nospec_ratio"] for c in checks if c["nospec_ratio"] is not None]
    e2e, _ = _matched(rows, scheduler, roles, "e2e_tps_user")
    e2e_controls = [c["nospec_ratio"] for c in e2e if c["nospec_ratio"] is not None]
    return {"goal": "matched_speed", "arm": scheduler, "target_ratio": roles.speedup, "min_ratio": worst,
            "control_min_ratio": min(controls) if controls else None,
            "e2e_min_ratio": min(c["ratio"] for c in e2e) if e2e else None,
            "e2e_control_min_ratio": min(e2e_controls) if e2e_controls else None,
            "status": "met" if worst >= roles.speedup else "missed", "checks": checks, "e2e_checks": e2e}


INTERLEAVED_SPEED = ("interleaved arms: each request also waited for the other arms' steps, so per-user speeds "
                     "are not the arm's own; run without --interleave")


def check_goals(rows: list[dict], arms: list[dict], roles: GoalRoles = GoalRoles(), points: list = (),
                interleaved: bool = False) -> list[dict]:
    """Goals 1 and 2 of every scheduler arm; goal 2 (per-user speed) is not measurable on
    `interleaved` arms."""
    pending = {a["name"]: a["pending"] for a in arms if a.get("pending")}
    out = []
    for scheduler in roles.schedulers:
        speed = ({"goal": "matched_speed", "arm": scheduler, "status": "not measurable", "why": INTERLEAVED_SPEED}
                 if interleaved else matched_speed_goal(rows, scheduler, roles))
        for result in (throughput_goal(rows, scheduler, roles, points), speed):
            involved = ([scheduler, roles.nospec, roles.fixed] if result["goal"] == "throughput"
                        else [scheduler, roles.mtp])
            why = [f"{a}: {pending[a]}" for a in involved if a in pending]
            if result["status"] == "not measurable" and why:
                result["why"] = "; ".join(why)
            out.append(result)
    return out


@dataclass
class LoadReport:
    mode: str  # "http" | "in-process"
    settings: dict
    arms: list[dict]
    points: list  # LevelPoint
    skipped: list[dict]
    command: str | None
    environment: dict
    summary: list[dict] = field(default_factory=list)
    goals: list[dict] = field(default_factory=list)
    files: dict = field(default_factory=dict)

    @classmethod
    def build(cls, **kw) -> "LoadReport":
        report = cls(**kw)
        report.summary = aggregate(report.points)
        report.goals = check_goals(report.summary, report.arms, roles_for(report.arms), report.points,
                                   interleaved=bool(report.settings.get("interleave")))
        return report

    @classmethod
    def read(cls, path: str | Path) -> "LoadReport":
        """A report `write` wrote, its summary and goals recomputed by this code (a rescore after a
        change to the goal checks; the measured points stay as they were)."""
        from dspark.bench.loadgen import LevelPoint
        from dspark.errors import UserError

        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise UserError(f"cannot read the load report {path}: {err}; give a JSON file that "
                            "`dspark bench serve` or `python -m dspark.bench.load_docs` wrote") from None
        if not isinstance(data, dict) or data.get("kind") != "dspark-load-bench":
            raise UserError(f"{path} is not a dspark load report (no \"kind\": \"dspark-load-bench\"); give a "
                            "JSON file that `dspark bench serve` or `python -m dspark.bench.load_docs` wrote")
        fields = {f.name for f in dataclasses.fields(LevelPoint)}
        points = [LevelPoint(**{k: v for k, v in p.items() if k in fields}) for p in data["points"]]
        return cls.build(mode=data["mode"], settings=data["settings"], arms=data["arms"], points=points,
                         skipped=data["skipped"], command=data["command"], environment=data["environment"])

    def as_dict(self) -> dict:
        return {"kind": "dspark-load-bench", "version": 1, "mode": self.mode, "command": self.command,
                "settings": self.settings, "environment": self.environment, "arms": self.arms,
                "summary": self.summary, "goals": self.goals, "skipped": self.skipped,
                "points": [dataclasses.asdict(p) for p in self.points], "files": self.files}

    def write(self, out_dir: str | Path, name: str) -> None:
        from dspark.bench.plots import write_load_figures

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.files = {k: str(v) for k, v in write_load_figures(self.summary, out, name).items()}
        path = out / f"{name}.json"
        self.files["json"] = str(path)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=1, allow_nan=True) + "\n")
        tmp.replace(path)

    def markdown(self) -> str:
        from dspark.bench.tables import format_load_markdown

        return format_load_markdown(self)

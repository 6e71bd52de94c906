"""Saved evaluation results and their aggregation (paper Table 1, Fig. 2).

An `EvalRun` is what one `run_eval` call measured: its settings, the exact
command, and one `DrafterRun` per drafter, each holding a `BenchResult` per
benchmark. Runs are saved as one JSON file each so that `run_report` can
rebuild every table and figure without rerunning a model.

Aggregation follows the paper: a domain's value is the mean over its
benchmarks (Table 1: "5.57 on math" is the mean of GSM8K, MATH, AIME25), and
the macro average is the mean of the domain values (equal weight per domain;
with all nine benchmarks it equals the mean of the nine).
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark.errors import UserError
from dspark.eval.benchmarks import BENCHMARKS, DOMAINS
from dspark.types import SpecStats

FORMAT_VERSION = 1


@dataclass(frozen=True)
class EvalSettings:
    """Everything that determines an evaluation run (besides the drafters)."""

    benchmarks: tuple[str, ...]  # resolved names, Table 1 order
    limit: int | None  # first N prompts per benchmark; None = all
    temperature: float  # 0 = greedy; the paper uses 1.0
    block_size: int | None  # model-free drafters' block size; learned drafters keep theirs
    max_new_tokens: int  # per turn
    seed: int  # prompt i, turn t samples with seed + 7919 * i + t
    target: str  # target model name
    dtype: str  # target weight dtype


@dataclass
class RoundRecord:
    """One verification round of a drafter with a confidence head (for Figs. 5, 6)."""

    verify_len: int  # draft tokens verified
    num_accepted: int  # draft tokens accepted, 0..verify_len
    confidences: list[float]  # c_1..c_d for the d drafted tokens, as the scheduler saw them


@dataclass
class BenchResult:
    """One drafter on one benchmark."""

    benchmark: str
    domain: str
    prompts: int  # conversations run
    generations: int  # target answers generated (mt-bench: two per conversation)
    generated_tokens: int
    seconds: float  # wall time of all generations (prefill included)
    stats: SpecStats
    rounds: list[RoundRecord] = field(default_factory=list)  # only for drafters with confidences
    skipped: list[str] = field(default_factory=list)  # prompt ids too long for the target's context
    # (prompt id, rounds, committed tokens) of each conversation, for bootstrap intervals
    # (dspark.eval.noise); empty in runs saved before session 8
    per_prompt: list[tuple[str, int, int]] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.stats.mean_accepted_length

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class DrafterRun:
    """One drafter over the run's benchmarks."""

    label: str  # how the user named it: none, ngram, or the drafter folder's name
    spec: str  # the --drafter value
    kind: str  # drafter.name (groups runs of one method across block sizes)
    block_size: int  # G actually proposed per round
    has_confidence: bool
    calibration_temperatures: list[float] | None  # STS temperatures from the drafter config
    benches: dict[str, BenchResult]

    def taus(self) -> dict[str, float]:
        return {name: result.tau for name, result in self.benches.items() if result.stats.rounds}

    def position_acceptance(self) -> dict[str, list[float | None]]:
        return {name: result.stats.per_position_acceptance for name, result in self.benches.items()}

    @property
    def generated_tokens(self) -> int:
        return sum(r.generated_tokens for r in self.benches.values())

    @property
    def seconds(self) -> float:
        return sum(r.seconds for r in self.benches.values())

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class EvalRun:
    settings: EvalSettings
    command: str  # the exact command that reproduces this run
    drafters: list[DrafterRun]
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S"))
    environment: dict = field(default_factory=dict)
    note: str = ""  # free text shown with the run in the report (e.g. what else loaded the machine)
    saved_path: Path | None = field(default=None, compare=False)  # where save() wrote it (not serialized)

    def drafter(self, label: str) -> DrafterRun | None:
        return next((d for d in self.drafters if d.label == label), None)

    def speedups(self) -> dict[str, float | None]:
        """Tokens/s of each drafter over the `none` baseline of this run."""
        base = self.drafter("none")
        if base is None or base.tokens_per_second == 0:
            return {d.label: None for d in self.drafters}
        return {d.label: d.tokens_per_second / base.tokens_per_second for d in self.drafters}

    def as_dict(self) -> dict:
        return {
            "format": FORMAT_VERSION,
            "created": self.created,
            "command": self.command,
            "settings": asdict(self.settings),
            "environment": self.environment,
            "note": self.note,
            "drafters": [_drafter_dict(d) for d in self.drafters],
            "summary": summary(self),
        }

    def brief(self) -> dict:
        """One JSON object for `dspark eval --json`: settings, command, summary
        and where the full record was saved (without per-round records)."""
        return {"command": self.command, "settings": asdict(self.settings), "summary": summary(self),
                "saved_to": None if self.saved_path is None else str(self.saved_path)}

    def save(self, folder: str | Path) -> Path:
        """Write the run as `<folder>/<created>-<labels>-t<temperature>.json`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        labels = "+".join(d.label for d in self.drafters)[:80]
        stamp = self.created.replace(":", "").replace("-", "")
        path = folder / f"{stamp}-{labels}-t{self.settings.temperature:g}.json"
        path.write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        return path


def environment() -> dict:
    """Software and machine facts saved with a run (the load average tells whether
    other jobs shared the CPU while it ran)."""
    import os

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "machine": platform.machine(),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
            "load_average_1min": round(os.getloadavg()[0], 2)}


# ------------------------------------------------------------------ aggregation
def domain_means(values: dict[str, float]) -> dict[str, float]:
    """Benchmark -> value into domain -> mean over the domain's benchmarks present."""
    out = {}
    for domain in DOMAINS:
        own = [v for name, v in values.items() if BENCHMARKS.get(name) == domain and v is not None]
        if own:
            out[domain] = sum(own) / len(own)
    return out


def macro_mean(values: dict[str, float]) -> float | None:
    """Mean of the domain means (None when no benchmark has a value)."""
    domains = domain_means(values)
    return sum(domains.values()) / len(domains) if domains else None


def domain_reached(stats: dict[str, SpecStats], domain: str) -> list[int]:
    """Rounds that reached each draft position, summed over the domain's benchmarks."""
    rows = [s.reached for name, s in stats.items() if BENCHMARKS.get(name) == domain]
    return [sum(r[k] for r in rows if k < len(r)) for k in range(max((len(r) for r in rows), default=0))]


def domain_position_acceptance(
    per_bench: dict[str, list[float | None]], domain: str
) -> list[float | None]:
    """Conditional acceptance per position, averaged over the domain's benchmarks
    (paper Fig. 2); a position no benchmark reached is None."""
    rows = [row for name, row in per_bench.items() if BENCHMARKS.get(name) == domain]
    if not rows:
        return []
    out: list[float | None] = []
    for k in range(max(len(r) for r in rows)):
        seen = [r[k] for r in rows if k < len(r) and r[k] is not None]
        out.append(sum(seen) / len(seen) if seen else None)
    return out


def summary(run: EvalRun) -> dict:
    """The numbers a reader wants, per drafter: tau per benchmark, domain, macro;
    conditional acceptance per domain; tokens/s and speedup over `none`."""
    speedups = run.speedups()
    out = {}
    for d in run.drafters:
        taus = d.taus()
        out[d.label] = {
            "block_size": d.block_size,
            "tau": taus,
            "tau_domain": domain_means(taus),
            "tau_macro": macro_mean(taus),
            "conditional_acceptance": {
                dom: domain_position_acceptance(d.position_acceptance(), dom) for dom in DOMAINS
            },
            "tokens_per_second": d.tokens_per_second,
            "speedup_vs_none": speedups[d.label],
        }
    return out


# ------------------------------------------------------------------ JSON
def _stats_dict(stats: SpecStats) -> dict:
    return {"block_size": stats.block_size, "rounds": stats.rounds, "draft_tokens": stats.draft_tokens,
            "accepted_tokens": stats.accepted_tokens, "committed_tokens": stats.committed_tokens,
            "reached": list(stats.reached), "accepted_at": list(stats.accepted_at),
            "mean_accepted_length": stats.mean_accepted_length}


def _stats_from(d: dict) -> SpecStats:
    return SpecStats(block_size=d["block_size"], rounds=d["rounds"], draft_tokens=d["draft_tokens"],
                     accepted_tokens=d["accepted_tokens"], committed_tokens=d["committed_tokens"],
                     reached=list(d["reached"]), accepted_at=list(d["accepted_at"]))


def _drafter_dict(d: DrafterRun) -> dict:
    benches = {}
    for name, r in d.benches.items():
        benches[name] = {
            "domain": r.domain, "prompts": r.prompts, "generations": r.generations,
            "generated_tokens": r.generated_tokens, "seconds": r.seconds, "stats": _stats_dict(r.stats),
            "rounds": [[x.verify_len, x.num_accepted, [round(c, 5) for c in x.confidences]] for x in r.rounds],
            "skipped": r.skipped,
            "per_prompt": [[pid, rounds, committed] for pid, rounds, committed in r.per_prompt],
        }
    return {"label": d.label, "spec": d.spec, "kind": d.kind, "block_size": d.block_size,
            "has_confidence": d.has_confidence, "calibration_temperatures": d.calibration_temperatures,
            "benches": benches}


def _drafter_from(d: dict) -> DrafterRun:
    benches = {}
    for name, b in d["benches"].items():
        benches[name] = BenchResult(
            benchmark=name, domain=b["domain"], prompts=b["prompts"], generations=b["generations"],
            generated_tokens=b["generated_tokens"], seconds=b["seconds"], stats=_stats_from(b["stats"]),
            rounds=[RoundRecord(v, a, list(c)) for v, a, c in b["rounds"]], skipped=list(b.get("skipped", [])),
            per_prompt=[(str(pid), int(n), int(c)) for pid, n, c in b.get("per_prompt", [])],
        )
    return DrafterRun(label=d["label"], spec=d["spec"], kind=d["kind"], block_size=d["block_size"],
                      has_confidence=d["has_confidence"], calibration_temperatures=d["calibration_temperatures"],
                      benches=benches)


def run_from_dict(data: dict) -> EvalRun:
    settings = dict(data["settings"])
    settings["benchmarks"] = tuple(settings["benchmarks"])
    return EvalRun(settings=EvalSettings(**settings), command=data["command"],
                   drafters=[_drafter_from(d) for d in data["drafters"]], created=data["created"],
                   environment=data.get("environment", {}), note=data.get("note", ""))


def load_runs(folder: str | Path) -> list[EvalRun]:
    """Every saved run in `folder`, oldest first (UserError on a file that is not one)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"results folder {folder} does not exist; run `dspark eval` first or pass another folder")
    runs = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            if data.get("format") != FORMAT_VERSION:
                raise KeyError("format")
            runs.append(run_from_dict(data))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path} is not a dspark eval result ({exc!r}); move it out of {folder}") from None
    runs.sort(key=lambda r: r.created)
    return runs

"""Train several recipes side by side to the largest equal step budget a deadline allows, then
score them together offline.

Issue 4's comparison needs drafters trained on equal budgets, and this CPU stops at 2000 steps
(docs/TRAINING.md). A GPU lent for a few minutes could go further, but how many steps fit is only
known once the recipes run there. `dspark train-equal` finds out and then trains them all to that budget:

1. Each recipe is copied to OUT/configs/NAME.json with its [run] out_dir set to OUT/NAME.
2. Probe: all recipes train side by side (as they will later) for `probe_steps` steps, which
   must lie inside every recipe's warm-up. Their logs give each one's steps per second.
3. Budget: T = probe_steps + the steps the slowest recipe makes in the time left before the
   deadline (less `eval_reserve_s`), rounded down to a multiple of `round_to`, at most
   `max_steps`.
4. Every recipe resumes from its probe checkpoint with optim.total_steps = T. Warm-up does not
   depend on total_steps, so this is exactly a run of T steps from the start (tested).
5. `dspark eval offline` scores the finished drafters on the same answers, paired. Its page
   goes to OUT/offline.

OUT/equal_budget.json records the speeds, the budget, every phase's seconds and the drafters.

    dspark train-equal CONFIG [CONFIG ...] --out OUT --deadline-s 420 [--probe-steps 20]
        [--max-steps N] [--round-to 50] [--eval-reserve-s 150] [--device cuda]
        [--eval-limit 12] [--eval-max-new-tokens 128] [--no-eval]

docs/GPU.md ("Training the trio on a GPU") gives the command for the 4000-answer trio.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark.errors import UserError
from dspark.train.config import config_from_dict, load_config


@dataclass(frozen=True)
class EqualBudgetSettings:
    out: str  # folder for the runs, the derived recipes, logs and the page
    deadline_s: float  # seconds from start to the end of the evaluation
    probe_steps: int = 20
    max_steps: int | None = None
    round_to: int = 50
    eval_reserve_s: float = 150.0  # seconds kept for the offline evaluation
    eval_limit: int | None = None  # prompts per benchmark (dspark eval offline --limit)
    eval_max_new_tokens: int = 128  # answer length (128: the CPU trio's pages)
    evaluate: bool = True
    device: str = "auto"


@dataclass
class Recipe:
    name: str  # the source file's stem: OUT/NAME is its run folder
    source: str
    config: dict  # the whole recipe, out_dir already pointed into OUT

    @property
    def out_dir(self) -> Path:
        return Path(self.config["run"]["out_dir"])


def read_recipes(paths: list[str], out: Path) -> list[Recipe]:
    """The recipes, each pointed at its own folder OUT/NAME (names must differ)."""
    recipes = []
    for path in paths:
        cfg = load_config(path).to_dict()
        name = Path(path).stem
        cfg["run"]["out_dir"] = str(out / name)
        recipes.append(Recipe(name, str(path), cfg))
    names = [r.name for r in recipes]
    if len(set(names)) != len(names):
        raise UserError(f"two recipes share a file name ({names}); each trains into OUT/NAME, so rename one")
    return recipes


def check_probe(recipes: list[Recipe], probe_steps: int) -> None:
    """The probe must end inside every recipe's warm-up (so the budget chosen after it does not
    change the steps already taken) and log at least twice (its last record then times steady
    steps, not start-up)."""
    for r in recipes:
        optim, log = r.config["optim"], r.config["log"]
        if probe_steps > optim["warmup_steps"]:
            raise UserError(f"{r.source}: probe_steps {probe_steps} is past its warmup_steps {optim['warmup_steps']}; "
                            "the learning rate would then depend on the budget not yet chosen: lower --probe-steps")
        if probe_steps < 2 * log["log_every"]:
            raise UserError(f"{r.source}: probe_steps {probe_steps} gives fewer than two log records (log_every "
                            f"{log['log_every']}); raise --probe-steps or lower [log] log_every")


def write_recipe(recipe: Recipe, out: Path, total_steps: int) -> Path:
    """OUT/configs/NAME.json with this total_steps (validated as `dspark train` will read it)."""
    cfg = json.loads(json.dumps(recipe.config))
    cfg["optim"]["total_steps"] = total_steps
    config_from_dict(cfg)
    path = out / "configs" / f"{recipe.name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def train_side_by_side(configs: list[Path], logs: list[Path], device: str, stop_at_step: int | None = None) -> float:
    """`dspark train` on every config at once (one process each); the seconds until all ended.
    A failed run stops the others and raises with the end of its log."""
    procs = []
    for config, log in zip(configs, logs):
        cmd = [sys.executable, "-m", "dspark.cli", "train", str(config), "--device", device]
        if stop_at_step is not None:
            cmd += ["--stop-at-step", str(stop_at_step)]
        with open(log, "a") as f:
            procs.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT))
    start = time.perf_counter()
    failed = None
    try:
        while any(p.poll() is None for p in procs) and failed is None:
            time.sleep(1.0)
            failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
    finally:  # a failed run, or this driver interrupted: no run is left training on its own
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failed is None:
        failed = next((i for i, p in enumerate(procs) if p.returncode != 0), None)
    if failed is not None:
        tail = logs[failed].read_text()[-2000:]
        raise RuntimeError(f"dspark train {configs[failed]} exited with {procs[failed].returncode}:\n{tail}")
    return time.perf_counter() - start


def steps_per_second(recipe: Recipe) -> float:
    """The recipe's speed over its last logged window (seqs_per_s / global_batch)."""
    log = recipe.out_dir / "log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    if not records:
        raise RuntimeError(f"{log} has no records after the probe")
    return records[-1]["seqs_per_s"] / recipe.config["optim"]["global_batch"]


def choose_budget(speeds: list[float], probe_steps: int, seconds: float, round_to: int,
                  max_steps: int | None) -> int:
    """probe_steps + what the slowest recipe trains in `seconds`, rounded down to `round_to`,
    capped at max_steps."""
    if seconds <= 0:
        raise UserError("no time is left for training after the probe; raise --deadline-s or lower --eval-reserve-s")
    more = math.floor(min(speeds) * seconds)
    total = (probe_steps + more) // round_to * round_to
    if max_steps is not None:
        total = min(total, max_steps)
    if total <= probe_steps:
        raise UserError(f"the slowest recipe makes {min(speeds):.2f} steps/s: {seconds:.0f} s add no whole "
                        f"{round_to}-step round past the probe; raise --deadline-s or lower --round-to")
    return total


def run_equal_budget(paths: list[str], settings: EqualBudgetSettings) -> dict:
    """Probe, choose the budget, train to it, evaluate (module docstring); the summary it writes."""
    t0 = time.perf_counter()
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    recipes = read_recipes(paths, out)
    check_probe(recipes, settings.probe_steps)
    logs = [out / f"{r.name}.log" for r in recipes]
    warm = max(r.config["optim"]["warmup_steps"] for r in recipes)
    configs = [write_recipe(r, out, max(warm, settings.probe_steps) + 1) for r in recipes]
    print(f"equal_budget: probing {len(recipes)} recipes side by side for {settings.probe_steps} steps", flush=True)
    probe_s = train_side_by_side(configs, logs, settings.device, stop_at_step=settings.probe_steps)
    speeds = [steps_per_second(r) for r in recipes]
    left = settings.deadline_s - (time.perf_counter() - t0) - (settings.eval_reserve_s if settings.evaluate else 0)
    total = choose_budget(speeds, settings.probe_steps, left, settings.round_to, settings.max_steps)
    for r, v in zip(recipes, speeds):
        print(f"equal_budget: {r.name}: {v:.2f} steps/s side by side", flush=True)
    print(f"equal_budget: every recipe trains to {total} steps", flush=True)
    configs = [write_recipe(r, out, total) for r in recipes]
    train_s = train_side_by_side(configs, logs, settings.device)
    drafters = [str(r.out_dir / "drafter") for r in recipes]
    eval_s = None
    if settings.evaluate:
        cmd = [sys.executable, "-m", "dspark.cli", "eval", "offline", "--drafter", ",".join(drafters),
               "--results", str(out / "offline"), "--answers", str(out / "answers"), "--device", settings.device]
        cmd += ["--max-new-tokens", str(settings.eval_max_new_tokens)]
        if settings.eval_limit is not None:
            cmd += ["--limit", str(settings.eval_limit)]
        start = time.perf_counter()
        with open(out / "eval.log", "w") as f:
            rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT)
        eval_s = time.perf_counter() - start
        if rc != 0:
            raise RuntimeError(f"dspark eval offline exited with {rc}:\n{(out / 'eval.log').read_text()[-2000:]}")
    summary = {
        "recipes": [{"name": r.name, "source": r.source, "steps_per_s": round(v, 3)} for r, v in zip(recipes, speeds)],
        "total_steps": total, "probe_steps": settings.probe_steps, "device": settings.device,
        "seconds": {"probe": round(probe_s, 1), "train": round(train_s, 1),
                    "eval": None if eval_s is None else round(eval_s, 1), "all": round(time.perf_counter() - t0, 1)},
        "drafters": drafters, "settings": asdict(settings),
    }
    (out / "equal_budget.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["seconds"]), flush=True)
    return summary

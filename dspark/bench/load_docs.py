"""The load run behind docs/LOAD.md and docs/figures/load_cpu_*:

    .venv/bin/python -m dspark.bench.load_docs [DSPARK_DRAFTER_DIR [MTP_DRAFTER_DIR]] [--only ARMS] [--name STEM] [--repeats N]
    .venv/bin/python -m dspark.bench.load_docs --arm NAME=DRAFTER:POLICY[:OPTION] [--arm ...] [--name STEM] [--repeats N]
        [--temperature T]
    ... [--concurrency C,C,...] [--rates R,R,...] [--max-seconds S]

In process, on the embedded SmolLM2-135M target (float32, CPU). Without
drafter folders it measures no speculation against the model-free n-gram
drafter verifying its whole block (the stand-in speculative arm) and lists
the paper's learned-drafter arms as pending; with trained folders it runs the
paper's six arms. `--arm` (repeatable, the syntax of `dspark bench serve
--arm`) runs the given arms instead, e.g. prompt lookup under each policy;
their goal roles come from their policies (`roles_for`). `--temperature T`
samples instead of decoding greedily, request i with seed i in every arm.
`--concurrency` and `--rates` replace the docs' levels (closed loop at 1, 4
and 16 clients) with the given closed-loop client counts and open-loop Poisson
arrival rates (requests/s; either may be given alone); `--max-seconds` replaces
the run's 2700 s bound (no level starts after it). `--rescore REPORT.json`
recomputes a written report's summary, goals and figures with the current
code, without measuring anything.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from dspark.bench.arms import Arm, paper_arms, parse_arm
from dspark.bench.clients import SamplingSpec
from dspark.bench.load import LoadSettings, run_load_bench
from dspark.bench.load_report import LoadReport

DOCS_SETTINGS = LoadSettings(
    concurrency=(1, 4, 16), requests_per_client=1, level_seconds=150.0, max_seconds=2700.0, repeats=3,
    sampling=SamplingSpec(max_new_tokens=64), max_prompt_chars=300,
)
TORCH_THREADS = 1  # the shared 2-core box is oversubscribed: 2 OpenMP threads made steps ~5x slower
NGRAM = Arm("ngram-k7", "ngram", "fixed", k=7, block_size=7)


def docs_run(dspark_drafter: str | None = None, mtp_drafter: str | None = None,
             out_dir: str | Path = "docs/figures", name: str = "load_cpu",
             only: list[str] | None = None, repeats: int | None = None,
             arms: list[Arm] | None = None, temperature: float | None = None,
             concurrency: tuple[int, ...] | None = None, rates: tuple[float, ...] | None = None,
             max_seconds: float | None = None) -> LoadReport:
    """The docs' load run; `only` keeps the named arms (a rerun of some arms after a change);
    `repeats` replaces the default 3 sweeps (more repeats, a tighter noise estimate); `arms`
    replaces the arms the drafter folders give; `temperature` > 0 samples (seeded per request);
    `concurrency` and `rates` (either or both) replace the default levels; `max_seconds` the bound."""
    import dataclasses

    import torch

    from dspark.errors import UserError

    torch.set_num_threads(TORCH_THREADS)
    if arms is None:
        paper = paper_arms(dspark_drafter, mtp_drafter)
        # the n-gram stand-in runs only while no learned drafter is given (it keeps the run short otherwise)
        arms = paper if dspark_drafter or mtp_drafter else [paper[0], NGRAM] + paper[1:]
    if only:
        unknown = sorted(set(only) - {a.name for a in arms})
        if unknown:
            raise UserError(f"unknown arm(s) {', '.join(unknown)}; the arms are {', '.join(a.name for a in arms)}")
        arms = [a for a in arms if a.name in only]
    command = " ".join([".venv/bin/python -m dspark.bench.load_docs", *map(shlex.quote, sys.argv[1:])])
    settings = DOCS_SETTINGS if repeats is None else dataclasses.replace(DOCS_SETTINGS, repeats=repeats)
    if concurrency is not None or rates is not None:
        settings = dataclasses.replace(settings, concurrency=tuple(concurrency or ()), rates=tuple(rates or ()))
    if max_seconds is not None:
        settings = dataclasses.replace(settings, max_seconds=max_seconds)
    if temperature:
        settings = dataclasses.replace(settings, sampling=dataclasses.replace(
            settings.sampling, temperature=temperature, seed=0))
    return run_load_bench(arms, settings, out_dir=out_dir, name=name, command=command)


def _number_list(option: str, text: str, kind: type) -> tuple:
    """A comma-separated list of positive numbers (`kind` int or float), or SystemExit naming the option."""
    try:
        values = tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values or any(v <= 0 for v in values):
        what = "whole numbers >= 1" if kind is int else "numbers > 0"
        raise SystemExit(f"{option} takes comma-separated {what}, e.g. {'1,4,16' if kind is int else '0.5,1,2'}; "
                         f"got {text!r}")
    return values


def _keywords(options: dict[str, str]) -> dict:
    """docs_run's keyword arguments from the options given (SystemExit on a bad value)."""
    extra: dict = {}
    if options["--repeats"]:
        if not options["--repeats"].isdigit() or int(options["--repeats"]) < 1:
            raise SystemExit(f"--repeats takes a whole number >= 1, got {options['--repeats']!r}")
        extra["repeats"] = int(options["--repeats"])
    if options["--temperature"]:
        try:
            temperature = float(options["--temperature"])
        except ValueError:
            temperature = -1.0
        if not 0.0 <= temperature <= 2.0:
            raise SystemExit(f"--temperature takes a number in [0, 2], got {options['--temperature']!r}")
        extra["temperature"] = temperature
    if options["--concurrency"]:
        extra["concurrency"] = _number_list("--concurrency", options["--concurrency"], int)
    if options["--rates"]:
        extra["rates"] = _number_list("--rates", options["--rates"], float)
    if options["--max-seconds"]:
        extra["max_seconds"] = float(_number_list("--max-seconds", options["--max-seconds"], float)[0])
    return extra


def rescore(path: str) -> LoadReport:
    """Recompute a written report's summary, goals and figures with this code, in place, and print
    its table (the measured points are not touched)."""
    from dspark.errors import UserError

    try:
        report = LoadReport.read(path)
    except UserError as err:
        raise SystemExit(str(err)) from None
    report.write(Path(path).parent, Path(path).stem)
    print(report.markdown())
    return report


def main(argv: list[str]) -> None:
    """DSPARK_DIR [MTP_DIR] [--only ARM,ARM] [--name STEM] [--repeats N] [--arm NAME=DRAFTER:POLICY[:OPTION] ...] [--temperature T] [--concurrency C,C] [--rates R,R] [--max-seconds S] | --rescore REPORT.json
    (no argparse outside cli.py)."""
    positional, arm_specs = [], []
    options = dict.fromkeys(("--only", "--name", "--repeats", "--temperature", "--concurrency", "--rates",
                             "--max-seconds", "--rescore"), "")
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            print(f"usage: python -m dspark.bench.load_docs {main.__doc__.split(' (')[0]}")
            return
        if arg in options:
            options[arg] = next(args, "")
        elif arg == "--arm":
            arm_specs.append(next(args, ""))
        elif arg.startswith("-"):
            raise SystemExit(f"unknown option {arg}; the options are --only ARM,ARM, --name STEM, --repeats N, "
                             "--arm NAME=DRAFTER:POLICY[:OPTION], --temperature T, --concurrency C,C, --rates R,R, "
                             "--max-seconds S and --rescore REPORT.json")
        else:
            positional.append(arg)
    if options["--rescore"]:
        rescore(options["--rescore"])
        return
    if arm_specs and positional:
        raise SystemExit("give drafter folders or --arm, not both: --arm lists every arm of the run")
    only = [a for a in options["--only"].split(",") if a] or None
    extra = _keywords(options)
    from dspark.errors import UserError

    try:
        arms = [parse_arm(spec) for spec in arm_specs] or None
    except UserError as err:
        raise SystemExit(str(err)) from None
    if arms:
        extra["arms"] = arms
    extra.setdefault("repeats", None)
    docs_run(*positional[:2], name=options["--name"] or "load_cpu", only=only, **extra)


if __name__ == "__main__":
    main(sys.argv[1:])

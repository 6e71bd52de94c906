"""The soak behind docs/LOAD.md: a real server for the embedded SmolLM2-135M
target (by default the n-gram drafter at fixed k = 7; docs/LOAD.md runs it with `default dspark`: the shipped DSpark drafter under the DSpark scheduler) on
127.0.0.1, soaked by `run_soak`:

    .venv/bin/python -m dspark.bench.soak_docs [DRAFTER [POLICY]] [--clients N] [--requests N] [--slots N] [--out PATH]

Writes docs/figures/load_soak.json and exits 1 if the soak did not pass. The
options replace the docs' 12 clients, 72 requests and 8 KV slots (the engine's
`max_running`): `--clients 64 --requests 256 --slots 32` soaks a server holding
more requests than the scheduler's profile measured (16), where its cost grid
is extrapolated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.bench.local_server import local_server
from dspark.bench.soak import SoakSettings, run_soak

DOCS_SOAK = SoakSettings(clients=12, requests=72, max_seconds=300.0, max_new_tokens=24, greedy_prompts=4,
                         max_prompt_chars=400, settle_seconds=60.0)


def soak_docs(drafter: str = "ngram", policy: str = "fixed", out: str | Path = "docs/figures/load_soak.json",
              clients: int | None = None, requests: int | None = None, slots: int = 8) -> bool:
    import dataclasses

    from dspark.engine.engine import EngineConfig
    from dspark.server import build_stack

    settings = dataclasses.replace(DOCS_SOAK, clients=clients or DOCS_SOAK.clients,
                                   requests=requests or DOCS_SOAK.requests)
    stack = build_stack(None, drafter, policy, engine_config=EngineConfig(max_running=slots, max_seq_len=1024,
                                                                          kv_budget_tokens=1024 * slots))
    with local_server(stack) as url:
        report = run_soak(url, settings)
    record = {"command": " ".join([".venv/bin/python -m dspark.bench.soak_docs", *sys.argv[1:]]),
              "drafter": drafter, "policy": policy, "slots": slots, "settings": settings.__dict__,
              **report.as_dict()}
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    return report.passed


def main(argv: list[str]) -> bool:
    """[DRAFTER [POLICY]] [--clients N] [--requests N] [--slots N] [--out PATH] (no argparse outside cli.py)."""
    positional = []
    options: dict[str, str | None] = {"--clients": None, "--requests": None, "--slots": None, "--out": None}
    args = iter(argv)
    for arg in args:
        if arg in options:
            options[arg] = next(args, None)
            if options[arg] is None:
                raise SystemExit(f"{arg} needs a value")
        elif arg.startswith("-"):
            raise SystemExit(f"unknown option {arg}; the options are --clients N, --requests N, --slots N and --out PATH")
        else:
            positional.append(arg)
    counts = {}
    for name in ("--clients", "--requests", "--slots"):
        if options[name] is not None:
            if not options[name].isdigit() or int(options[name]) < 1:
                raise SystemExit(f"{name} takes a whole number >= 1, got {options[name]!r}")
            counts[name[2:]] = int(options[name])
    if len(positional) > 2:
        raise SystemExit("give at most a drafter and a policy, e.g. `default dspark`")
    return soak_docs(*positional, out=options["--out"] or "docs/figures/load_soak.json", **counts)


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:]) else 1)

"""The soak behind docs/LOAD.md: a real server for the embedded SmolLM2-135M
target (by default the n-gram drafter at fixed k = 7; docs/LOAD.md runs it with `default dspark`: the shipped DSpark drafter under the DSpark scheduler) on
127.0.0.1, soaked by `run_soak`:

    .venv/bin/python -m dspark.bench.soak_docs [DRAFTER [POLICY]]

Writes docs/figures/load_soak.json and exits 1 if the soak did not pass.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.bench.local_server import local_server
from dspark.bench.soak import SoakSettings, run_soak

DOCS_SOAK = SoakSettings(clients=12, requests=72, max_seconds=300.0, max_new_tokens=24, greedy_prompts=4,
                         max_prompt_chars=400, settle_seconds=60.0)


def soak_docs(drafter: str = "ngram", policy: str = "fixed", out: str | Path = "docs/figures/load_soak.json") -> bool:
    from dspark.engine.engine import EngineConfig
    from dspark.server import build_stack

    stack = build_stack(None, drafter, policy, engine_config=EngineConfig(max_running=8, max_seq_len=1024,
                                                                          kv_budget_tokens=8192))
    with local_server(stack) as url:
        report = run_soak(url, DOCS_SOAK)
    record = {"command": " ".join([".venv/bin/python -m dspark.bench.soak_docs", *sys.argv[1:]]),
              "drafter": drafter, "policy": policy, "settings": DOCS_SOAK.__dict__, **report.as_dict()}
    Path(out).write_text(json.dumps(record, indent=1) + "\n")
    return report.passed


if __name__ == "__main__":
    sys.exit(0 if soak_docs(*sys.argv[1:3]) else 1)

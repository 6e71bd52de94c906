"""Wall clock of `dspark generate --drafter default` against `--drafter none`
(docs/TRAINING.md, "The shipped DSpark drafter since session 20"):

    .venv/bin/python -m dspark.bench.generate_ab [ROUNDS] [DRAFTER]

runs the three prompts of the docs ROUNDS times (default 3), each prompt once
with no drafter and once with DRAFTER (default `default`), the two alternating,
each in a fresh `dspark generate` process (greedy, 96 new tokens), and prints
each run, the tokens per second over all runs of each arm, their ratio and
whether every pair generated the same tokens. One untimed run of each arm
comes first, so that what a first start does once (building the kernel,
timing its block shapes, measuring the cost profile) is not counted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

PROMPTS = (
    "Write a short Python function that reverses a string, then explain it.",
    "What is 17 times 23? Show your steps.",
    "Give three tips for staying focused while studying.",
)


def generate(prompt: str, drafter: str) -> dict:
    """One `dspark generate --json` run, in its own process, as a user would start it."""
    exe = shutil.which("dspark") or str(Path(sys.executable).with_name("dspark"))
    cmd = [exe, "generate", "--chat", "--prompt", prompt, "--drafter", drafter,
           "--temperature", "0", "--max-new-tokens", "96", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    """[ROUNDS] [DRAFTER] (no argparse outside cli.py)."""
    if len(argv) > 2 or (argv and not argv[0].isdigit()) or (argv and int(argv[0]) < 1):
        raise SystemExit("usage: python -m dspark.bench.generate_ab [ROUNDS >= 1] [DRAFTER (default: default)]")
    rounds = int(argv[0]) if argv else 3
    drafter = argv[1] if len(argv) > 1 else "default"
    if drafter == "none":
        raise SystemExit("DRAFTER is compared with `--drafter none`; give another one (default, mtp1, ngram or a folder)")
    totals = {"none": [0, 0.0], drafter: [0, 0.0]}
    same = True
    for arm in ("none", drafter):  # untimed: first-start work is done once, then cached
        generate(PROMPTS[0], arm)
    for round_ in range(1, rounds + 1):
        for k, prompt in enumerate(PROMPTS, start=1):
            runs = {}
            for arm in ("none", drafter):
                out = generate(prompt, arm)
                runs[arm] = out
                totals[arm][0] += out["num_generated"]
                totals[arm][1] += out["seconds"]
                stats = out["stats"]
                print(f"round {round_} prompt {k} {arm:>8}: {out['num_generated']} tokens, "
                      f"{out['tokens_per_second']:.2f} tok/s, {stats['rounds']} rounds, "
                      f"{stats['draft_tokens']} draft tokens, tau {stats['mean_accepted_length']:.3f}", flush=True)
            same &= runs["none"]["token_ids"] == runs[drafter]["token_ids"]
    rate = {arm: n / s for arm, (n, s) in totals.items()}
    print(f"none {rate['none']:.1f} tok/s, {drafter} {rate[drafter]:.1f} tok/s over {totals['none'][0]} tokens each: "
          f"{rate[drafter] / rate['none']:.3f}x; same tokens in every pair: {same}")


if __name__ == "__main__":
    main(sys.argv[1:])

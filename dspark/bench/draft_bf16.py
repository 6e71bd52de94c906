"""A learned drafter's rounds with its many-row products on the exact float32 kernel against
bfloat16 matmuls (`DSPARK_DRAFTER_BF16`, dspark.models.cpu_kernels), on this machine.

    python -m dspark.bench.draft_bf16 [REPEATS] [DRAFTER] [OUT.json]

Loads the embedded target and the drafter (default: the shipped DSpark drafter) twice, once with
the bfloat16 path off and once on, gives every request 256 random tapped context positions, and
times in alternation, for 1 to 16 requests:
- `propose`: one drafting round;
- `project`: taking 64 newly committed positions per request into the context keys/values (the
  batched projection every drafter carries, drafting or not), rolled back after each repeat.
Medians in ms; `x` is off / on. The weights and the target are the real ones; the context is random,
which does not change the time.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from dspark.types import SamplingParams

REQUESTS = (1, 2, 4, 8, 16)
CONTEXT = 256
COMMITTED = 64


def _drafter(spec: str, target, mode: str):
    from dspark.draft.registry import load_drafter

    return load_drafter(spec, target, bf16=mode)


def time_modes(target, spec: str = "default", repeats: int = 30, requests: tuple[int, ...] = REQUESTS) -> dict:
    """{"rows": [{"requests", "propose_off_ms", "propose_on_ms", "project_off_ms", "project_on_ms"}, ...]}."""
    drafters = {mode: _drafter(spec, target, mode) for mode in ("off", "on")}
    first = drafters["off"]
    if not hasattr(first, "project_pending"):
        raise SystemExit(f"{spec}: a DSpark or DFlash drafter folder is needed (it has no context projection)")
    gen = torch.Generator().manual_seed(0)
    taps, width = len(first.tap_layers), first.target_config.hidden_size
    rows = []
    for count in requests:
        context = [torch.randn(CONTEXT, taps, width, generator=gen) for _ in range(count)]
        committed = [torch.randn(COMMITTED, taps, width, generator=gen) for _ in range(count)]
        setups = {}
        for mode, drafter in drafters.items():
            states = [drafter.new_state() for _ in range(count)]
            drafter.observe(states, [torch.zeros(CONTEXT, dtype=torch.int64)] * count, context)
            drafter.project_pending(states)
            setups[mode] = (drafter, states)
        anchors = torch.arange(count) + 20
        params = [SamplingParams(temperature=1.0)] * count
        times = {(mode, part): [] for mode in setups for part in ("propose", "project")}
        for rep in range(repeats + 3):
            order = list(setups.items())
            for mode, (drafter, states) in (order if rep % 2 else order[::-1]):
                gens = [torch.Generator().manual_seed(i) for i in range(count)]
                t0 = time.perf_counter()
                drafter.propose(states, anchors, params, gens)
                t1 = time.perf_counter()
                drafter.observe(states, [torch.zeros(COMMITTED, dtype=torch.int64)] * count, committed)
                t2 = time.perf_counter()
                drafter.project_pending(states)
                t3 = time.perf_counter()
                for state in states:
                    drafter.truncate(state, CONTEXT)
                if rep >= 3:  # warm-up
                    times[mode, "propose"].append(t1 - t0)
                    times[mode, "project"].append(t3 - t2)
        row = {"requests": count}
        for (mode, part), values in times.items():
            row[f"{part}_{mode}_ms"] = 1e3 * statistics.median(values)
        rows.append(row)
    return {"drafter": spec, "threads": torch.get_num_threads(), "context": CONTEXT, "committed": COMMITTED,
            "repeats": repeats, "rows": rows}


def format_table(result: dict) -> str:
    lines = [f"{result['drafter']}: {result['threads']} thread(s), {result['context']} context positions per request, "
             f"median of {result['repeats']}, bfloat16 path off / on",
             "| requests | propose off | propose on | x | project 64 off | project 64 on | x |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['requests']} | {r['propose_off_ms']:.2f} | {r['propose_on_ms']:.2f} | "
                     f"{r['propose_off_ms'] / r['propose_on_ms']:.2f}x | {r['project_off_ms']:.2f} | "
                     f"{r['project_on_ms']:.2f} | {r['project_off_ms'] / r['project_on_ms']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """[REPEATS] [DRAFTER] [OUT.json] (no argparse outside cli.py)."""
    if len(argv) > 3 or (argv and (not argv[0].isdigit() or int(argv[0]) < 1)):
        raise SystemExit("usage: python -m dspark.bench.draft_bf16 [REPEATS >= 1] [DRAFTER (default: default)] [OUT.json]")
    from dspark.models.device import cpu_has_amx_bf16
    from dspark.models.loading import load_target

    repeats = int(argv[0]) if argv else 30
    spec = argv[1] if len(argv) > 1 else "default"
    target = load_target(None).model
    result = time_modes(target, spec, repeats)
    result["cpu_has_amx_bf16"] = cpu_has_amx_bf16()
    print(format_table(result))
    if not result["cpu_has_amx_bf16"]:
        print("(this CPU has no AMX tiles for bfloat16: `auto` keeps the bfloat16 path off here)")
    if len(argv) > 2:
        Path(argv[2]).parent.mkdir(parents=True, exist_ok=True)
        Path(argv[2]).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])

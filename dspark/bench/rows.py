"""The target forward by the rows it computes: what verifying a few draft tokens, or decoding a
few requests, costs against a decode step.

    .venv/bin/python -m dspark.bench.rows [--threads N] [--repeats N] [--blocks ROUNDS]

times the embedded target's float32 forward (context 256, median of `--repeats`) for one
request computing 1-8 tokens (a decode step, then verifying 1-7 draft tokens) and for 2-8
requests decoding one token each, with dspark's small-row CPU kernel and without it, and prints
each as ms and as a multiple of the one-token step. On a CPU these are the numbers that decide
whether a draft can pay for itself (docs/BENCHMARKS.md, session 22): the drafter's tokens are
worth their verification only while a few more rows cost little more than one.

With `--blocks ROUNDS` it compares instead, in one process, the kernel's compiled block shapes
with those tuned for this machine and model (dspark.models.cpu_kernels, `tuned_blocks`): the
same forwards (`--repeats` each, median) under each, alternating in ROUNDS rounds, and prints
both medians over the rounds and their ratio.
"""

from __future__ import annotations

import statistics
import sys

import torch

from dspark.bench.decode import _by_batch, run_decode_bench, time_lean
from dspark.bench.options import parse_options

CASES = tuple((1, q) for q in range(1, 9)) + tuple((r, 1) for r in (2, 3, 4, 6, 8))  # (requests, tokens each)


def rows_table(result: dict) -> str:
    """Markdown: one line per runtime (with the kernel, without it), each case in ms and as a
    multiple of the one-request, one-token step."""
    ms = {(t["runtime"], t["batch"], t["new_tokens"]): t["ms"] for t in result["timings"]}
    lines = [f"ms per target forward (requests x tokens each; in brackets: x the 1x1 step), context "
             f"{result['context']}, median of {result['repeats']}, {result['threads']} thread(s)", "",
             "| runtime | " + " | ".join(f"{b}x{q}" for b, q in CASES) + " |", "|---|" + "---|" * len(CASES)]
    for runtime in dict.fromkeys(t["runtime"] for t in result["timings"]):
        base = ms[(runtime, 1, 1)]
        cells = [f"{ms[(runtime, b, q)]:.1f} ({ms[(runtime, b, q)] / base:.2f}x)" for b, q in CASES]
        lines.append(f"| {runtime} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def blocks_table(ms: dict, blocks: str, threads: int, repeats: int, rounds: int) -> str:
    """Markdown: the median ms of each case under each arm ({"compiled": {case: [ms per round]},
    "tuned": ...}) and tuned / compiled."""
    med = {arm: {case: statistics.median(v) for case, v in cases.items()} for arm, cases in ms.items()}
    lines = [f"ms per target forward, compiled block shapes against tuned ({blocks}), context 256, median of "
             f"{rounds} alternating rounds of {repeats} repeats, {threads} thread(s)", "",
             "| shapes | " + " | ".join(f"{b}x{q}" for b, q in CASES) + " |", "|---|" + "---|" * len(CASES)]
    for arm in med:
        lines.append(f"| {arm} | " + " | ".join(f"{med[arm][c]:.1f}" for c in CASES) + " |")
    lines.append("| tuned / compiled | " + " | ".join(f"{med['tuned'][c] / med['compiled'][c]:.2f}" for c in CASES) + " |")
    return "\n".join(lines)


def compare_blocks(threads: int, repeats: int, rounds: int) -> str:
    """The embedded target's forwards under the compiled and the tuned block shapes, alternating."""
    from dspark.models import cpu_kernels
    from dspark.models.loading import load_target

    torch.set_num_threads(threads)
    loaded = load_target(None, dtype=torch.float32, cpu_kernels=True)  # tunes (or reads the cache)
    kernels = cpu_kernels.rowgemm()[0]
    if kernels is None:
        raise SystemExit(f"no CPU kernel here: {cpu_kernels.cpu_kernels_status()}")
    arms = {"compiled": cpu_kernels.DEFAULT_BLOCKS, "tuned": cpu_kernels.blocks_in_use()[0]}
    described = cpu_kernels.kernel_blocks()
    ms = {arm: {case: [] for case in CASES} for arm in arms}
    try:
        for round_ in range(rounds):
            for arm in (list(arms) if round_ % 2 == 0 else list(arms)[::-1]):
                cpu_kernels.apply_blocks(kernels, arms[arm])
                for batch, qs in _by_batch(CASES).items():
                    for q, t in time_lean(loaded, batch, qs, 256, repeats, 1, "wall").items():
                        ms[arm][(batch, q)].append(t)
    finally:
        cpu_kernels.apply_blocks(kernels, arms["tuned"])
    return blocks_table(ms, described, threads, repeats, rounds)


def main(argv: list[str]) -> None:
    """[--threads N] [--repeats N] [--blocks ROUNDS] (no argparse outside cli.py)."""
    options = parse_options(argv, {"--threads": "1", "--repeats": "15", "--blocks": ""},
                            whole=("--threads", "--repeats", "--blocks"))
    if options["--blocks"]:
        print(compare_blocks(int(options["--threads"]), int(options["--repeats"]), int(options["--blocks"])))
        return
    result = run_decode_bench(None, int(options["--repeats"]), cases=CASES, dtypes=(torch.float32,),
                              include_transformers=False, threads=int(options["--threads"]), print_fn=None)
    print(rows_table(result))


if __name__ == "__main__":
    main(sys.argv[1:])

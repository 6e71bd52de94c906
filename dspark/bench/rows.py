"""The target forward by the rows it computes: what verifying a few draft tokens, or decoding a
few requests, costs against a decode step.

    .venv/bin/python -m dspark.bench.rows [--threads N] [--repeats N]

times the embedded target's float32 forward (context 256, median of `--repeats`) for one
request computing 1-8 tokens (a decode step, then verifying 1-7 draft tokens) and for 2-8
requests decoding one token each, with dspark's small-row CPU kernel and without it, and prints
each as ms and as a multiple of the one-token step. On a CPU these are the numbers that decide
whether a draft can pay for itself (docs/BENCHMARKS.md, session 22): the drafter's tokens are
worth their verification only while a few more rows cost little more than one.
"""

from __future__ import annotations

import sys

import torch

from dspark.bench.decode import run_decode_bench

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


def main(argv: list[str]) -> None:
    """[--threads N] [--repeats N] (no argparse outside cli.py)."""
    options = {"--threads": "1", "--repeats": "15"}
    args = iter(argv)
    for arg in args:
        if arg not in options:
            raise SystemExit(f"unknown option {arg}; the options are --threads N and --repeats N")
        value = next(args, "")
        if not value.isdigit() or int(value) < 1:
            raise SystemExit(f"{arg} takes a whole number >= 1, got {value!r}")
        options[arg] = value
    result = run_decode_bench(None, int(options["--repeats"]), cases=CASES, dtypes=(torch.float32,),
                              include_transformers=False, threads=int(options["--threads"]), print_fn=None)
    print(rows_table(result))


if __name__ == "__main__":
    main(sys.argv[1:])

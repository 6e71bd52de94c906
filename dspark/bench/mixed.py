"""Mixed batches: what one target forward costs when a few requests of a decoding batch
verify drafts or prefill a prompt chunk, with attention in parts by query length (the
runtime: `dspark.models.llama.query_parts`) against one padded attention call over the
whole batch (how the runtime attended before: every request padded to the longest query).

    .venv/bin/python -m dspark.bench.mixed [--repeats N] [--threads T] [--context L]

Each layout's requests have `context` cached tokens (copies of one prefilled request);
a step runs the layout's new tokens and rolls the cache back. The two attention layouts
of a case are timed step by step in alternation (`paired_ms`), so drift of a shared
machine hits both alike. Prints a markdown table.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from dspark.bench.decode import _prompts, paired_ms, prefilled_cache
from dspark.types import RaggedBatch

# (label, query lengths): 16 requests; 1 = a decode step, 2..8 = verifying 1..7 draft tokens
LAYOUTS = (
    ("16 decoding", [1] * 16),
    ("14 decoding, 2 verifying 1", [1] * 14 + [2] * 2),
    ("15 decoding, 1 verifying 7", [1] * 15 + [8]),
    ("12 decoding, 4 verifying 7", [1] * 12 + [8] * 4),
    ("15 decoding, 1 prefilling 64", [1] * 15 + [64]),
    ("16 verifying 7", [8] * 16),
)


@contextlib.contextmanager
def one_padded_call():
    """Attention over the whole batch in one call, as before the runtime grouped it."""
    from dspark.models import llama

    grouped = llama.query_parts
    llama.query_parts = lambda qlens: [list(range(len(qlens)))]
    try:
        yield
    finally:
        llama.query_parts = grouped


def mixed_steps(loaded, context: int = 256) -> dict[str, object]:
    """Per layout, a callable running one forward of it and rolling the cache back."""
    model = loaded.model
    cache, slots = prefilled_cache(loaded, 16, context, max(max(q) for _, q in LAYOUTS))
    steps = {}
    for label, qlens in LAYOUTS:
        tokens = _prompts(loaded.config.vocab_size, 1, sum(qlens))[0]
        batch = RaggedBatch(tokens, slots, qlens)
        # logits of the rows the engine reads: every token of a verifying request, the last of the others
        rows, offset = [], 0
        for q in qlens:
            rows += list(range(offset, offset + q)) if 1 < q <= 8 else [offset + q - 1]
            offset += q

        def step(batch: RaggedBatch = batch, rows: torch.Tensor = torch.tensor(rows)) -> None:
            with torch.inference_mode():
                model(batch, cache, logits_rows=rows)
            for slot in slots:
                cache.truncate(slot, context)

        steps[label] = step
    return steps


def run_mixed_bench(repeats: int = 20, warmup: int = 2, context: int = 256, threads: int | None = None,
                    target: str | None = None) -> list[dict]:
    from dspark.models import load_target

    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load_target(target)
    steps = mixed_steps(loaded, context)
    rows = []
    for label, qlens in LAYOUTS:
        def padded(step=steps[label]) -> None:
            with one_padded_call():
                step()

        parts_ms, padded_ms = paired_ms([steps[label], padded], repeats, warmup)
        rows.append({"layout": label, "tokens": sum(qlens), "parts_ms": parts_ms, "padded_ms": padded_ms})
    return rows


def format_rows(rows: list[dict], repeats: int, context: int) -> str:
    lines = [f"ms per target forward, 16 requests with {context} cached tokens each, median of {repeats}, "
             f"{torch.get_num_threads()} torch thread(s), the two layouts in alternation",
             "| batch | tokens | attention in parts (runtime) | one padded call | parts / padded |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['tokens']} | {r['parts_ms']:.1f} | {r['padded_ms']:.1f} | "
                     f"{r['parts_ms'] / r['padded_ms']:.2f}x |")
    base = rows[0]["parts_ms"]
    lines += ["", "Cost of the mixed batches over a plain decode step of the 16 (runtime): " + ", ".join(
        f"{r['layout']} +{r['parts_ms'] - base:.1f} ms" for r in rows[1:])]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """[--repeats N] [--threads T] [--context L] (no argparse outside cli.py)."""
    options = {"--repeats": "20", "--threads": "", "--context": "256"}
    args = iter(argv)
    for arg in args:
        if arg in ("-h", "--help"):
            print(f"usage: python -m dspark.bench.mixed {main.__doc__.split(' (')[0]}")
            return
        if arg not in options:
            raise SystemExit(f"unknown option {arg}; the options are --repeats N, --threads T and --context L")
        options[arg] = next(args, "")
    for name in options:
        if options[name] and (not options[name].isdigit() or int(options[name]) < 1):
            raise SystemExit(f"{name} takes a whole number >= 1, got {options[name]!r}")
    repeats, context = int(options["--repeats"]), int(options["--context"])
    rows = run_mixed_bench(repeats, context=context, threads=int(options["--threads"]) if options["--threads"] else None)
    print("Command: `" + " ".join([".venv/bin/python -m dspark.bench.mixed", *argv]) + "`")
    print(format_rows(rows, repeats, context))


if __name__ == "__main__":
    main(sys.argv[1:])

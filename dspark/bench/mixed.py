"""Mixed batches: what one target forward costs when a few requests of a decoding batch
verify drafts or prefill a prompt chunk, with attention in parts by query length
(`dspark.models.llama.query_parts`: the runtime's choice on the CPU) against one padded
attention call over the whole batch (every request padded to the longest query: the
runtime's choice on a GPU while the padding stays small, `attention_groups`).

    .venv/bin/python -m dspark.bench.mixed [--repeats N] [--threads T] [--context L] [--device D] [--target DIR]

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
from dspark.bench.options import parse_options
from dspark.models.device import hardware_id, resolve_device, synchronize
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
def attention_layout(one_call: bool):
    """Attention over the whole batch in one padded call (one_call), or in parts by query
    length (`query_parts`), regardless of what the runtime would choose on this device."""
    from dspark.models import llama

    chosen = llama.attention_groups
    if one_call:
        llama.attention_groups = lambda qlens, *_: [list(range(len(qlens)))]
    else:
        llama.attention_groups = lambda qlens, *_: llama.query_parts(qlens)
    try:
        yield
    finally:
        llama.attention_groups = chosen


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
            synchronize(model.device)  # a GPU step is timed to its end
            for slot in slots:
                cache.truncate(slot, context)

        steps[label] = step
    return steps


def run_mixed_bench(repeats: int = 20, warmup: int = 2, context: int = 256, threads: int | None = None,
                    target: str | None = None, device: str = "cpu", loaded=None) -> list[dict]:
    """Both layouts of every case timed in alternation, on `loaded` (a LoadedTarget) or on
    `target` (None: the embedded model) loaded on `device`."""
    from dspark.models import load_target

    if threads is not None:
        torch.set_num_threads(threads)
    loaded = loaded or load_target(target, device=device)
    steps = mixed_steps(loaded, context)
    rows = []
    for label, qlens in LAYOUTS:
        def in_parts(step=steps[label]) -> None:
            with attention_layout(one_call=False):
                step()

        def padded(step=steps[label]) -> None:
            with attention_layout(one_call=True):
                step()

        parts_ms, padded_ms = paired_ms([in_parts, padded], repeats, warmup)
        rows.append({"layout": label, "tokens": sum(qlens), "parts_ms": parts_ms, "padded_ms": padded_ms})
    return rows


def format_rows(rows: list[dict], repeats: int, context: int, device: str = "cpu") -> str:
    where = f"{torch.get_num_threads()} torch thread(s)" if device == "cpu" else device
    lines = [f"ms per target forward, 16 requests with {context} cached tokens each, median of {repeats}, "
             f"{where}, the two layouts in alternation",
             "| batch | tokens | attention in parts (CPU runtime) | one padded call (GPU runtime) | parts / padded |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layout']} | {r['tokens']} | {r['parts_ms']:.1f} | {r['padded_ms']:.1f} | "
                     f"{r['parts_ms'] / r['padded_ms']:.2f}x |")
    base = rows[0]["parts_ms"]
    lines += ["", "Cost of the mixed batches over a plain decode step of the 16 (in parts): " + ", ".join(
        f"{r['layout']} +{r['parts_ms'] - base:.1f} ms" for r in rows[1:])]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """[--repeats N] [--threads T] [--context L] [--device D] [--target DIR] (no argparse outside cli.py)."""
    if "-h" in argv or "--help" in argv:
        print(f"usage: python -m dspark.bench.mixed {main.__doc__.split(' (')[0]}")
        return
    options = parse_options(argv, {"--repeats": "20", "--threads": "", "--context": "256", "--device": "cpu",
                                   "--target": ""}, whole=("--repeats", "--threads", "--context"))
    repeats, context = int(options["--repeats"]), int(options["--context"])
    device = str(resolve_device(options["--device"]))
    rows = run_mixed_bench(repeats, context=context, threads=int(options["--threads"]) if options["--threads"] else None,
                           target=options["--target"] or None, device=device)
    print("Command: `" + " ".join([".venv/bin/python -m dspark.bench.mixed", *argv]) + "`")
    print(format_rows(rows, repeats, context, hardware_id(device) if device != "cpu" else "cpu"))


if __name__ == "__main__":
    main(sys.argv[1:])

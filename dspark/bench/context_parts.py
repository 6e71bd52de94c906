"""Attention parts split by context length against parts by query length alone, on the engine.

On the CPU the target runs one attention call per part of a ragged batch, and a part reads every
slot of its span up to its longest request's context (`dspark.models.llama`). Since session 7 the
parts are the requests of one query length; since session 46 each of those is also split by
context length (`split_by_context`), since decoding four requests of the evaluation prompts read
1.75-1.94x the cached positions they attend to. This runs no speculation in a closed loop
(`dspark.bench.steps.trace_steps`: every finished request replaced at once, greedy, 64 new
tokens, one torch thread) once with each grouping per round, in alternation, on the same prompts,
and prints per round the throughput, the decode-only steps' forward time and the positions the
decode parts read per position attended, then the mean ratios:

    .venv/bin/python -m dspark.bench.context_parts CONCURRENCY STEPS ROUNDS [PROMPT_CHARS]

(PROMPT_CHARS defaults to 2000, as `dspark bench serve` replays.) Both groupings compute the same
attention; they differ by float32 rounding (`tests/test_models_parity.py`).
"""

from __future__ import annotations

import statistics
import sys


def main(argv: list[str]) -> None:
    """CONCURRENCY STEPS ROUNDS [PROMPT_CHARS] (no argparse outside cli.py)."""
    if len(argv) not in (3, 4) or not all(a.isdigit() and int(a) > 0 for a in argv):
        raise SystemExit("usage: python -m dspark.bench.context_parts CONCURRENCY STEPS ROUNDS [PROMPT_CHARS] "
                         "(integers > 0; e.g. 4 300 4)")
    concurrency, steps, rounds = int(argv[0]), int(argv[1]), int(argv[2])
    from dspark.bench.arms import Arm
    from dspark.bench.steps import EmbeddedBench, trace_steps
    from dspark.models import llama
    from dspark.schedule import make_policy

    split = llama.attention_groups
    make_part = llama._make_part

    def by_query(qlens, starts, slots, heads_per_kv, device_type):
        return llama.query_parts(qlens) if device_type == "cpu" else split(qlens, starts, slots, heads_per_kv,
                                                                           device_type)

    read = {"positions": 0, "attended": 0}

    def counted(rows, slots, starts, qlens, cache, group, dtype):
        part = make_part(rows, slots, starts, qlens, cache, group, dtype)
        if part.max_query == 1:
            read["positions"] += part.span * part.attended
            read["attended"] += sum(s + q for s, q in zip(starts, qlens))
        return part

    bench = EmbeddedBench.open(concurrency, int(argv[3]) if len(argv) > 3 else 2000)
    drafter, cost = bench.backend._arm_parts(Arm("nospec", "none", "none"))
    results: dict[str, list[tuple[float, float, float]]] = {"query length": [], "query length and context": []}
    llama._make_part = counted
    try:
        for r in range(rounds):
            for name in (list(results) if r % 2 == 0 else list(results)[::-1]):
                llama.attention_groups = by_query if name == "query length" else split
                read.update(positions=0, attended=0)
                records = trace_steps(bench.engine(drafter, make_policy("none", cost)), bench.prompt_ids[r * 40:],
                                      bench.params, concurrency, steps, progress=False)
                decode = [x for x in records if x.prefill == 0]
                seconds, tokens = sum(x.seconds for x in records), sum(x.tokens for x in records)
                forward = statistics.fmean(x.forward for x in decode) if decode else float("nan")
                padding = read["positions"] / max(read["attended"], 1)
                results[name].append((tokens / seconds, forward, padding))
                print(f"round {r}, parts by {name}: {tokens} tokens in {seconds:.1f} s, {tokens / seconds:.2f} tok/s; "
                      f"decode-only forward {1e3 * forward:.1f} ms over {len(decode)} steps; decode parts read "
                      f"{padding:.2f} positions a position attended", flush=True)
    finally:
        llama.attention_groups, llama._make_part = split, make_part
    old, new = results["query length"], results["query length and context"]
    for k, what in ((0, "throughput"), (1, "decode-only forward")):
        ratios = [b[k] / a[k] for a, b in zip(old, new)]
        print(f"{what}, split by context / by query length alone: {', '.join(f'{x:.3f}' for x in ratios)}; "
              f"mean {statistics.fmean(ratios):.3f}x")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Arms against each other on the bare engine: the same requests, no clients, no threads.

`dspark bench serve` measures an arm through an `AsyncEngine` thread and asyncio clients in the
same process; a step trace (`dspark.bench.steps`) runs one engine for a fixed number of steps.
This runs each arm's synchronous `Engine` over the same fixed work, REQUESTS requests from the
evaluation prompts at CONCURRENCY (every finished request replaced at once, greedy, 64 new tokens,
one torch thread), the arms in a seeded shuffled order in every round, a fresh engine each time,
after one unmeasured round. Per round and arm it prints the tokens, seconds, decode steps,
milliseconds a step, the time spent in steps with a prompt chunk and in decode-only steps, the
plain steps (decode-only, nobody drafting: the same work in every arm) and their milliseconds,
the steps that drafted, and how many requests finished in the same step as another (the
lockstep of docs/LOAD.md run BG); then each arm's ratio of throughput, and of a plain step's
time, to the first arm's, round by round, with 95 % Student-t intervals
(`dspark.bench.paired.mean_interval`). Arms are written as `dspark bench serve --arm` takes
them, policy options included (`dspark.bench.arms.parse_arm`):

    .venv/bin/python -m dspark.bench.engine_ab CONCURRENCY ROUNDS REQUESTS NAME=DRAFTER:POLICY ... [--prompt-chars N] [--interleave]

e.g. `4 4 32 nospec=none:none dspark=default:dspark dspark-async=default:dspark-async`. The same
greedy requests give every arm the same tokens, so the ratio is one of time alone.

The machine's speed drifts by more than the effects in question: one after another, the same
prompt-chunk work took up to 12 % more or less time in one arm than another of the same round
(docs/LOAD.md, session 46). `--interleave` runs every arm's engine in the same round at once,
taking one step each in turn, and counts each arm's own steps' time only: a drift then slows
every arm alike, to within a step. (The engines share the target's weights; interleaved, each
arm's step follows another arm's, so a step may find less of its own data in the caches than
alone, and every arm alike.)
"""

from __future__ import annotations

import random
import statistics
import sys
import time


def closed_loop(engine, prompt_ids, params, concurrency: int, requests: int, offset: int):
    """`requests` requests from `prompt_ids` (from `offset` on, cyclically) through `engine`,
    `concurrency` at a time, every finished one replaced at once; one engine step per `next()`,
    yielding the running totals (tokens, seconds of its own steps, steps, seconds in steps with a
    prompt chunk and in decode-only steps, requests finished in the same step as another, steps
    that drafted, and the seconds and count of plain steps: decode-only, nobody drafting), complete
    once the generator is exhausted."""
    sent = 0

    def add() -> None:
        nonlocal sent
        engine.add_request(list(prompt_ids[(offset + sent) % len(prompt_ids)]), params)
        sent += 1

    for _ in range(min(concurrency, requests)):
        add()
    row = {"tokens": 0, "seconds": 0.0, "steps": 0, "prefill_s": 0.0, "decode_s": 0.0, "together": 0, "drafted": 0,
           "plain_s": 0.0, "plain_steps": 0}
    while engine.has_work():
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        row["seconds"] += seconds
        row["prefill_s" if engine.last_step_kind == "prefill" else "decode_s"] += seconds
        if engine.last_step_kind == "plain":  # decode-only, nobody drafted: the same work in every arm
            row["plain_s"] += seconds
            row["plain_steps"] += 1
        row["steps"] += 1
        row["tokens"] += sum(len(o.new_token_ids) for o in outputs)
        finished = [o for o in outputs if o.finished]
        row["together"] += len(finished) if len(finished) > 1 else 0
        for out in finished:
            engine.pop_finished(out.request_id)
            if sent < requests:
                add()
        row["drafted"] = engine.num_full_drafts + engine.num_partial_drafts
        yield row


def run_round(loops: dict, interleave: bool) -> dict[str, dict]:
    """Each arm's totals of one round from its `closed_loop` (name -> generator, in the round's
    order): one arm after another, or with `interleave` every arm at once, one step each in turn,
    so that each arm's seconds (its own steps only) are measured at the same moments as the
    others'."""
    rows: dict[str, dict] = {}
    if not interleave:
        for name, loop in loops.items():
            for rows[name] in loop:
                pass
        return rows
    live = dict(loops)
    while live:
        for name in list(live):
            row = next(live[name], None)
            if row is None:
                del live[name]
            else:
                rows[name] = row
    return rows


def main(argv: list[str]) -> None:
    """CONCURRENCY ROUNDS REQUESTS NAME=DRAFTER:POLICY ... [--prompt-chars N] [--interleave] (no argparse outside
    cli.py)."""
    chars, interleave = 2000, "--interleave" in argv
    argv = [a for a in argv if a != "--interleave"]
    if "--prompt-chars" in argv:
        at = argv.index("--prompt-chars")
        value = argv[at + 1] if at + 1 < len(argv) else ""
        if not value.isdigit() or int(value) < 1:
            raise SystemExit("--prompt-chars takes the longest prompt to replay in characters, an integer > 0")
        chars, argv = int(value), argv[:at] + argv[at + 2:]
    numbers, specs = argv[:3], argv[3:]
    if (len(numbers) != 3 or not all(a.isdigit() and int(a) > 0 for a in numbers) or len(specs) < 2
            or any(spec.count("=") < 1 or ":" not in spec.partition("=")[2] for spec in specs)):
        raise SystemExit("usage: python -m dspark.bench.engine_ab CONCURRENCY ROUNDS REQUESTS NAME=DRAFTER:POLICY "
                         "NAME=DRAFTER:POLICY ... [--prompt-chars N] [--interleave] (integers > 0, two arms or more, "
                         "each as `dspark bench serve --arm` takes it; e.g. 4 4 32 nospec=none:none dspark=default:dspark)")
    from dspark.bench.arms import parse_arm
    from dspark.errors import UserError

    try:
        arms = [parse_arm(spec) for spec in specs]
    except UserError as err:
        raise SystemExit(f"usage: {err}") from None
    if len({arm.name for arm in arms}) != len(arms):
        raise SystemExit(f"arm names must differ: {[arm.name for arm in arms]}")
    concurrency, rounds, requests = (int(a) for a in numbers)
    from dspark.bench.paired import interval_cell, mean_interval
    from dspark.bench.steps import EmbeddedBench
    from dspark.schedule import make_policy

    bench = EmbeddedBench.open(concurrency, chars)
    ids, params = bench.prompt_ids, bench.params
    parts = {arm.name: (arm, *bench.backend._arm_parts(arm)) for arm in arms}

    def loops(order: list[str], offset: int) -> dict:
        out = {}
        for name in order:
            arm, drafter, cost = parts[name]
            options = arm.policy_options
            if arm.policy == "fixed" and options["k"] is None:
                options = {"k": drafter.block_size}
            engine = bench.engine(drafter, make_policy(arm.policy, cost, **options))  # fresh: a policy keeps state
            out[name] = closed_loop(engine, ids, params, concurrency, requests, offset)
        return out

    names = [arm.name for arm in arms]
    run_round(loops(names, len(ids) // 2), interleave)  # one unmeasured round: every arm's first run pays for warming up
    results: dict[str, list[dict]] = {name: [] for name in names}
    rng = random.Random(0)
    for r in range(rounds):
        order = names[:]
        rng.shuffle(order)
        rows = run_round(loops(order, r * requests), interleave)
        for name in order:
            row = rows[name]
            results[name].append(row)
            print(f"round {r} {name}: {row['tokens']} tokens in {row['seconds']:.1f} s, "
                  f"{row['tokens'] / row['seconds']:.2f} tok/s, {row['steps']} steps "
                  f"({1e3 * row['seconds'] / row['steps']:.1f} ms), prompt-chunk steps {row['prefill_s']:.1f} s, "
                  f"decode-only steps {row['decode_s']:.1f} s, plain steps {row['plain_steps']} at "
                  f"{1e3 * row['plain_s'] / max(row['plain_steps'], 1):.1f} ms, {row['drafted']} drafted, "
                  f"{row['together']}/{requests} finished together", flush=True)
    base = names[0]
    for name in names[1:]:
        ratios = [(a["tokens"] / a["seconds"]) / (b["tokens"] / b["seconds"])
                  for a, b in zip(results[name], results[base])]
        decode = [a["decode_s"] / b["decode_s"] for a, b in zip(results[name], results[base]) if b["decode_s"]]
        plain = [(a["plain_s"] / a["plain_steps"]) / (b["plain_s"] / b["plain_steps"])
                 for a, b in zip(results[name], results[base]) if a["plain_steps"] and b["plain_steps"]]
        print(f"{name} / {base}: throughput {', '.join(f'{x:.3f}' for x in ratios)}, mean "
              f"{statistics.fmean(ratios):.3f}x ({interval_cell(mean_interval(ratios))})"
              + (f"; decode-only steps' time {statistics.fmean(decode):.3f}x" if decode else "")
              + (f"; a plain step's time {statistics.fmean(plain):.3f}x ({interval_cell(mean_interval(plain))})"
                 if plain else ""))


if __name__ == "__main__":
    main(sys.argv[1:])

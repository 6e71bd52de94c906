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
(`dspark.bench.paired.mean_interval`). A drafting arm's plain steps are the steps its gate
left alone, not the same batches as the first arm's, so last it compares the plain steps'
target forwards at the same batch shape (the first arm's forward time fitted on requests, rows
and contexts: `fit_forward`, `matched_forward`, paired by round) and prints the rest of a plain
step (its time outside the target forward: batching, scheduling, verification, the drafter's
observe). Arms are written as `dspark bench serve --arm` takes them, policy options included
(`dspark.bench.arms.parse_arm`):

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


class TimedTarget:
    """One engine's view of the target: the same model (arms may share it), its forward timed and
    the shape of each forward's batch noted in `last`: the forward's seconds, its requests, its
    rows (tokens), the longest context after it (attention reads every request's slot up to the
    longest) and the contexts' sum."""

    def __init__(self, model) -> None:
        self.model = model
        self.last: dict[str, float] = {}

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def forward(self, batch, cache, **kwargs):
        contexts = [cache.length(slot) + q for slot, q in zip(batch.slots, batch.query_lens)]
        start = time.perf_counter()
        out = self.model.forward(batch, cache, **kwargs)
        self.last = {"forward": time.perf_counter() - start, "requests": len(contexts),
                     "rows": sum(batch.query_lens), "longest": max(contexts, default=0), "context": sum(contexts)}
        return out


def closed_loop(engine, prompt_ids, params, concurrency: int, requests: int, offset: int):
    """`requests` requests from `prompt_ids` (from `offset` on, cyclically) through `engine`,
    `concurrency` at a time, every finished one replaced at once; one engine step per `next()`,
    yielding the running totals (tokens, seconds of its own steps, steps, seconds in steps with a
    prompt chunk and in decode-only steps, requests finished in the same step as another, steps
    that drafted, and the seconds and count of plain steps: decode-only, nobody drafting), complete
    once the generator is exhausted. With the engine's target a `TimedTarget`, the totals also
    list every plain step as (step seconds, `TimedTarget.last`) under "plain"."""
    sent = 0
    timed = isinstance(engine.target, TimedTarget)

    def add() -> None:
        nonlocal sent
        engine.add_request(list(prompt_ids[(offset + sent) % len(prompt_ids)]), params)
        sent += 1

    for _ in range(min(concurrency, requests)):
        add()
    row = {"tokens": 0, "seconds": 0.0, "steps": 0, "prefill_s": 0.0, "decode_s": 0.0, "together": 0, "drafted": 0,
           "plain_s": 0.0, "plain_steps": 0, "plain": [], "prefill_steps": 0, "prefill_positions": 0}
    while engine.has_work():
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        row["seconds"] += seconds
        row["prefill_s" if engine.last_step_kind == "prefill" else "decode_s"] += seconds
        if engine.last_step_kind == "prefill":
            row["prefill_steps"] += 1
            row["prefill_positions"] += engine.last_step_positions
        if engine.last_step_kind == "plain":  # decode-only, nobody drafted: the same work in every arm
            row["plain_s"] += seconds
            row["plain_steps"] += 1
            if timed:
                row["plain"].append((seconds, engine.target.last))
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


def _shape(last: dict[str, float]) -> list[float]:
    """A forward's batch shape as the terms its time is fitted on (`fit_forward`)."""
    return [1.0, last["requests"], last["rows"], last["requests"] * last["longest"], last["context"]]


def fit_forward(plain: list[tuple[float, dict]]):
    """Least-squares coefficients of a plain step's forward seconds on its batch shape (a constant,
    the requests, the rows, requests x the longest context, the contexts' sum), from one arm's
    plain steps (`closed_loop`'s "plain"): what that arm's forward costs for a batch of any shape."""
    import numpy as np

    shapes = np.array([_shape(last) for _, last in plain])
    seconds = np.array([last["forward"] for _, last in plain])
    return np.linalg.lstsq(shapes, seconds, rcond=None)[0]


def matched_forward(coef, plain: list[tuple[float, dict]]) -> float:
    """These plain steps' forward seconds over what `coef` (`fit_forward` on another arm) predicts
    for the same batch shapes: the arms' forwards compared step for step, free of which batches
    each arm's plain steps happened to hold (a drafting arm's plain steps are a subset of its
    steps, so their mean time alone compares different batches)."""
    import numpy as np

    predicted = np.array([_shape(last) for _, last in plain]) @ coef
    return float(sum(last["forward"] for _, last in plain) / predicted.sum())


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
            engine.target = TimedTarget(engine.target)
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
                  f"({1e3 * row['seconds'] / row['steps']:.1f} ms), {row['prefill_steps']} prompt-chunk steps "
                  f"{row['prefill_s']:.1f} s ({1e3 * row['prefill_s'] / max(row['prefill_positions'], 1):.2f} ms a "
                  f"position), "
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
    base_plain = [step for row in results[base] for step in row["plain"]]
    if len(base_plain) < 10:
        print(f"too few plain steps of {base} ({len(base_plain)}) to fit its forward on the batch shape")
        return
    coef = fit_forward(base_plain)  # over every round: each round's own speed is divided out below
    for name in names:
        # per round, against the first arm's steps of the same round (the machine's speed of that round)
        ratios = [matched_forward(coef, a["plain"]) / matched_forward(coef, b["plain"])
                  for a, b in zip(results[name], results[base]) if a["plain"] and b["plain"]]
        rest = [seconds - last["forward"] for row in results[name] for seconds, last in row["plain"]]
        if not rest:
            continue
        matched = ("" if name == base or not ratios else  # the first arm against itself reads 1 by construction
                   f"plain steps' target forward {statistics.fmean(ratios):.4f}x {base}'s at the same batch shape "
                   f"({interval_cell(mean_interval(ratios))}, paired by round); ")
        print(f"{name}: {matched}the rest of a plain step {1e3 * statistics.fmean(rest):.3f} ms over {len(rest)} steps")


if __name__ == "__main__":
    main(sys.argv[1:])

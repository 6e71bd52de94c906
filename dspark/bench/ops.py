"""aten ops per engine step, by phase: the price of a step where ops, not arithmetic, set
it. A small model run eagerly on a GPU pays a dispatch for every op and a kernel launch for
most, whatever their size: docs/LOAD.md run AL found the embedded target's plain step on an
H200 no faster than on this 2-core CPU. These counts are the same on every device, so they
can be read, and lowered, on a CPU.

    .venv/bin/python -m dspark.bench.ops DRAFTER POLICY CONCURRENCY STEPS [gpu]

runs the embedded target on the CPU with torch's own matmuls (dspark's C kernel would hide
them) like `dspark.bench.steps`: greedy, a closed loop of CONCURRENCY requests over the
evaluation prompts, and counts each of STEPS steps' ops in the target forward, the drafter's
`propose` and `observe`, and the rest of the step. `gpu` lays attention out as a GPU does
(`dspark.bench.layouts.runtime_layouts`). Prints, for plain and drafting steps apart,
the median counts and the most frequent ops, and the scalars a step reads back to Python
(host reads): on a GPU each waits for the work queued before it, so a step with one per
request stalls once per request instead of once.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch.utils._python_dispatch import TorchDispatchMode

PHASES = ("forward", "propose", "observe")
HOST_READ = "aten._local_scalar_dense"  # what int(), float(), bool() and .item() of a tensor dispatch


class _PhaseCounter(TorchDispatchMode):
    """Counts every aten op dispatched while active, under the phase set at the time."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "rest"
        self.counts: dict[str, Counter] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.setdefault(self.phase, Counter())[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class StepOps:
    """One engine step's ops by phase (`rest`: scheduling, sampling, verification)."""

    drafted: bool
    ops: dict[str, Counter] = field(default_factory=dict)

    def count(self, phase: str | None = None) -> int:
        phases = self.ops.values() if phase is None else [self.ops.get(phase, Counter())]
        return sum(sum(c.values()) for c in phases)

    def host_reads(self) -> int:
        """Scalars read back to Python (`int(t)`, `float(t)`, `bool(t)`, `t.item()`), every phase:
        each is a sync on a GPU when `t` lives there. (`t.tolist()` of a CPU tensor is no op, so
        a copy read as one list is not counted.)"""
        return sum(c.get(HOST_READ, 0) for c in self.ops.values())


@contextlib.contextmanager
def _in_phases(engine, counter: _PhaseCounter):
    """The engine's target forward and drafter calls, each counted under its own phase."""
    wrapped = [(engine.target, "forward"), (engine.drafter, "propose"), (engine.drafter, "observe")]

    def phased(name, fn):
        def wrapper(*args, **kwargs):
            before, counter.phase = counter.phase, name
            try:
                return fn(*args, **kwargs)
            finally:
                counter.phase = before
        return wrapper

    missing = object()
    saved = [vars(obj).get(name, missing) for obj, name in wrapped]
    for obj, name in wrapped:
        setattr(obj, name, phased(name, getattr(obj, name)))
    try:
        yield
    finally:
        for (obj, name), old in zip(wrapped, saved):
            if old is missing:
                delattr(obj, name)  # the class's method shows through again
            else:
                setattr(obj, name, old)


def count_step_ops(engine, prompts: Sequence[list[int]], params, concurrency: int, steps: int,
                   warmup: int = 4) -> list[StepOps]:
    """Run `warmup` then `steps` steps of `engine` in a closed loop of `concurrency` requests
    (a finished one replaced by the next of `prompts`, cycled) and count each counted step's ops."""
    if concurrency < 1 or steps < 1 or not prompts:
        raise ValueError(f"need concurrency >= 1, steps >= 1 and prompts; got {concurrency}, {steps}, {len(prompts)}")
    next_prompt = 0

    def refill(outputs) -> None:
        nonlocal next_prompt
        for out in outputs:
            if out.finished:
                engine.pop_finished(out.request_id)
                engine.add_request(list(prompts[next_prompt % len(prompts)]), params)
                next_prompt += 1

    for _ in range(concurrency):
        engine.add_request(list(prompts[next_prompt % len(prompts)]), params)
        next_prompt += 1
    for _ in range(warmup):  # the prompts' prefill is not a step worth counting
        refill(engine.step())
    records = []
    for _ in range(steps):
        drafted_before = engine.num_full_drafts + engine.num_partial_drafts
        counter = _PhaseCounter()
        with _in_phases(engine, counter), counter:
            outputs = engine.step()
        records.append(StepOps(drafted=engine.num_full_drafts + engine.num_partial_drafts > drafted_before,
                               ops=counter.counts))
        refill(outputs)
    return records


def summarise_ops(records: Sequence[StepOps], top: int = 8) -> str:
    """Median ops per step, plain and drafting steps apart, with the most frequent ops."""
    lines = ["| steps | n | ops per step | forward | propose | observe | rest | host reads |",
             "|---|---|---|---|---|---|---|---|"]
    details = []
    for label, group in (("plain", [r for r in records if not r.drafted]), ("drafting", [r for r in records if r.drafted])):
        if not group:
            continue
        cells = [statistics.median(r.count(p) for r in group) for p in (None, *PHASES, "rest")]
        cells.append(statistics.median(r.host_reads() for r in group))
        lines.append(f"| {label} | {len(group)} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
        for phase in (*PHASES, "rest"):
            total = Counter()
            for r in group:
                total.update(r.ops.get(phase, Counter()))
            if total:
                common = ", ".join(f"{op.removeprefix('aten.')} {n / len(group):.0f}" for op, n in total.most_common(top))
                details.append(f"- {label}, {phase}: {common}")
    return "\n".join(lines + ["", "Most frequent ops per step:"] + details)


def main(argv: list[str]) -> None:
    """DRAFTER POLICY CONCURRENCY STEPS [gpu] (no argparse outside cli.py)."""
    layout = argv[4] if len(argv) == 5 else "cpu"
    if len(argv) not in (4, 5) or not all(a.isdigit() and int(a) > 0 for a in argv[2:4]) or layout not in ("cpu", "gpu"):
        raise SystemExit("usage: python -m dspark.bench.ops DRAFTER POLICY CONCURRENCY STEPS [gpu] (integers > 0; "
                         "e.g. dspark/assets/drafters/smollm2-135m-dspark fixed 1 20)")
    import torch

    from dspark.bench.arms import Arm
    from dspark.bench.clients import ChatEncoder, SamplingSpec
    from dspark.bench.layouts import runtime_layouts
    from dspark.bench.load import InProcessBackend, load_prompts
    from dspark.engine.engine import Engine
    from dspark.models import load_target
    from dspark.schedule import make_policy
    from dspark.types import SamplingParams

    drafter_spec, policy_name, concurrency, steps = argv[0], argv[1], int(argv[2]), int(argv[3])
    torch.set_num_threads(1)
    loaded = load_target(None, cpu_kernels=False)
    prompts = load_prompts("all", max_chars=300)
    backend = InProcessBackend(loaded, prompts, SamplingSpec(max_new_tokens=64), concurrency, embedded=True)
    drafter, cost = backend._arm_parts(Arm("counted", drafter_spec, policy_name))
    options = {"k": drafter.block_size} if policy_name == "fixed" else {}
    engine = Engine(loaded.model, drafter, make_policy(policy_name, cost, **options), backend.engine_config,
                    tokenizer=loaded.tokenizer)
    encoder = ChatEncoder(loaded.tokenizer)
    with runtime_layouts("cuda" if layout == "gpu" else "cpu"):
        records = count_step_ops(engine, [encoder(p) for p in prompts], SamplingParams(temperature=0.0, max_new_tokens=64),
                                 concurrency, steps)
    print(f"Command: `.venv/bin/python -m dspark.bench.ops {' '.join(argv)}`")
    print(f"{drafter_spec} / {policy_name}, {concurrency} requests, attention laid out as on a {layout.upper()}")
    print(summarise_ops(records))


if __name__ == "__main__":
    main(sys.argv[1:])

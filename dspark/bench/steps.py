"""Where a step's time goes, step by step, next to what the cost profile predicted.

The load benchmark reports what an arm achieves; this trace says why. It runs a
synchronous `Engine` in a closed loop (every finished request is replaced at once,
so `concurrency` requests decode in every step) and records, per step: how many
requests decoded and drafted, the tokens B the target verified, the measured
seconds of the target forward, of the drafter's `propose` and `observe`, of the
whole step, and the tokens it committed. Decode-only steps (no prompt chunk in
them) are then grouped by B and their median forward time is set beside the
profile's F(R, B), which is the number the draft gate priced the step with.
With a draft gate (the prefix schedulers) it also records whether a drafted
step was the gate's probe and how many draft tokens the scheduler then sent
to verification, so the summary counts the gate's own choices that verified
nothing, and its vetoes: session 27 found the asynchronous scheduler's gate
drafting 31 of 32 requests for nothing this way (docs/LOAD.md, run AF). Under the
asynchronous scheduler, every step whose capacity K came from the snapshot two steps
back is also set beside what Algorithm 1 would have verified on the same, current
confidences (a shadow scheduler that only decides): the summary adds up the tokens
verified beyond or short of it, the expected accepted tokens gained or lost, and what
the difference cost at the profile's prices. That is the staleness's price, measured
on the choices themselves rather than through the machine's noise (docs/LOAD.md,
session 45).

Session 21 found run Q's regression this way (docs/LOAD.md, runs R and S): the
gate drafted two requests in nearly every step at 16 clients because the cached
profile said a step verifying 18 tokens (125 ms) was cheaper than a plain one of
16 (153 ms); the trace measured 131 and 136 ms.

    .venv/bin/python -m dspark.bench.steps DRAFTER POLICY[:OPTION=VALUE...] CONCURRENCY STEPS [PROBE_EVERY [PROMPT_CHARS]] [--device D]
        [--think-steps N]

runs the embedded target on the evaluation prompts (greedy, 64 new tokens, one
torch thread as the load benchmark) and prints the summary. With PROBE_EVERY
the policy's own choice of whom to draft is replaced by `EveryKthQuarter`: the
first quarter of the requests draft on every PROBE_EVERY-th step (the size of
the draft gate's probes), no one on the others (verify lengths are still the
policy's), so the summary sets a probe step's cost beside a plain step's
(0: the policy chooses). PROMPT_CHARS (default 300, as the load runs of
`load_docs`) caps the prompts' length; `dspark bench serve` replays up to 2000.
`--think-steps N` makes a finished request's successor wait about N steps (seeded), as the
load bench's `--think-seconds` clients do (docs/LOAD.md, run BH). `--device cuda` traces the
engine on a GPU: each phase and step is then timed to the end of its GPU work (synchronized),
which says where the ~7 ms of a GPU step outside the forward go (docs/GPU.md, run AL).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from dspark.models.device import synchronize


@dataclass
class StepRecord:
    """One engine step."""

    seconds: float  # the whole step
    forward: float  # the target forward(s) in it
    propose: float  # the drafter's propose (0 when nobody drafted)
    observe: float  # the drafter's observe
    budget: int  # tokens the target computed (verification plus any prompt chunk)
    requests: int  # requests in the target forward
    decoding: int  # requests that got a StepOutput (decoded, or finished their prompt)
    prefill: int  # prompt tokens computed in the step
    drafted: bool  # the policy drafted for at least one request
    tokens: int  # tokens committed
    verified: int = 0  # draft tokens the policy sent to verification
    probe: bool = False  # the draft gate's probe chose (some of) the drafts
    # the asynchronous scheduler, in a step where its capacity came from the snapshot: what
    # Algorithm 1 would verify on the same confidences, and both choices' expected accepted tokens
    snapshot: bool = False
    causal_verified: int = 0
    expected: float = 0.0
    causal_expected: float = 0.0


def trace_steps(engine, prompts: Sequence[list[int]], params, concurrency: int, steps: int,
                progress: bool = True, think_steps: float = 0.0, seed: int = 0) -> list[StepRecord]:
    """Run `steps` steps of `engine` with `concurrency` requests, replacing each finished one
    with the next prompt of `prompts` (cycled), and record each step. With `think_steps` > 0 a
    replacement joins after a pause of about that many steps (geometric, seeded: the same for
    every drafter and policy), as the load bench's `--think-seconds` clients do, so the batch
    size varies. The engine's target and drafter are wrapped for the run and restored after it."""
    import random

    from tqdm.auto import tqdm

    if concurrency < 1 or steps < 1 or not prompts or think_steps < 0:
        raise ValueError(f"need concurrency >= 1, steps >= 1, prompts and think_steps >= 0; got {concurrency}, "
                         f"{steps}, {len(prompts)}, {think_steps}")
    rng = random.Random(f"think steps {seed}")  # the k-th finished request's successor waits the k-th draw
    target, drafter = engine.target, engine.drafter
    device = next(target.parameters()).device
    cur: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            synchronize(device)  # on a GPU a phase is timed from the end of the last one to its own end
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            synchronize(device)
            cur[name] = cur.get(name, 0.0) + time.perf_counter() - start
            return out
        return wrapper

    def forward(ragged, *args, **kwargs):
        cur["budget"] = cur.get("budget", 0) + len(ragged.token_ids)
        cur["requests"] = cur.get("requests", 0) + len(ragged.query_lens)
        return timed_forward(ragged, *args, **kwargs)

    timed_forward = timed("forward", target.forward)
    plan_steps = engine.batcher.plan

    def plan(*args, **kwargs):
        out = plan_steps(*args, **kwargs)
        cur["prefill"] = sum(length for _, length in out.prefill)
        return out

    policy, gate = engine.policy, getattr(engine.policy, "gate", None)
    policy_decide, policy_choose = policy.decide, getattr(policy, "choose_drafts", None)

    shadow = _shadow_causal(policy)

    def decide(requests, *args, **kwargs):
        lengths = policy_decide(requests, *args, **kwargs)
        cur["verified"] = cur.get("verified", 0) + sum(lengths)
        if shadow is not None and policy.last_capacity is not None:
            causal = shadow.decide(requests)
            cur["snapshot"] = True
            cur["causal_verified"] = cur.get("causal_verified", 0) + sum(causal)
            cur["expected"] = cur.get("expected", 0.0) + _expected_accepts(requests, lengths)
            cur["causal_expected"] = cur.get("causal_expected", 0.0) + _expected_accepts(requests, causal)
        return lengths

    def choose(*args, **kwargs):
        chosen = policy_choose(*args, **kwargs)
        cur["probe"] = bool(gate is not None and gate.probed)
        return chosen

    wrapped = {(target, "forward"): forward, (drafter, "propose"): timed("propose", drafter.propose),
               (drafter, "observe"): timed("observe", drafter.observe),
               (engine.batcher, "plan"): plan, (policy, "decide"): decide}
    if policy_choose is not None:
        wrapped[(policy, "choose_drafts")] = choose
    missing = object()
    saved = {key: vars(key[0]).get(key[1], missing) for key in wrapped}
    for (obj, name), fn in wrapped.items():
        setattr(obj, name, fn)
    records: list[StepRecord] = []
    next_prompt = 0
    joining: list[int] = []  # steps left before each pausing replacement joins

    def add() -> None:
        nonlocal next_prompt
        engine.add_request(list(prompts[next_prompt % len(prompts)]), params)
        next_prompt += 1

    try:
        for _ in range(concurrency):
            add()
        for _ in tqdm(range(steps), desc=f"tracing {concurrency} requests", unit="step", disable=not progress):
            joining = [left - 1 for left in joining]
            if joining and not engine.has_work():  # everyone is pausing: skip to the first to join
                joining = [left - min(joining) for left in joining]
            for _ in range(sum(left <= 0 for left in joining)):
                add()
            joining = [left for left in joining if left > 0]
            cur.clear()
            drafted_before = engine.num_full_drafts + engine.num_partial_drafts
            synchronize(device)
            start = time.perf_counter()
            outputs = engine.step()
            synchronize(device)
            seconds = time.perf_counter() - start
            records.append(StepRecord(
                seconds=seconds, forward=cur.get("forward", 0.0), propose=cur.get("propose", 0.0),
                observe=cur.get("observe", 0.0), budget=int(cur.get("budget", 0)),
                requests=int(cur.get("requests", 0)), decoding=len(outputs), prefill=int(cur.get("prefill", 0)),
                drafted=engine.num_full_drafts + engine.num_partial_drafts > drafted_before,
                tokens=sum(len(o.new_token_ids) for o in outputs), verified=int(cur.get("verified", 0)),
                probe=bool(cur.get("probe", False)), snapshot=bool(cur.get("snapshot", False)),
                causal_verified=int(cur.get("causal_verified", 0)), expected=cur.get("expected", 0.0),
                causal_expected=cur.get("causal_expected", 0.0)))
            for out in outputs:
                if out.finished:
                    engine.pop_finished(out.request_id)
                    pause = int(rng.expovariate(1.0 / think_steps)) if think_steps else 0
                    if pause:
                        joining.append(pause)
                    else:
                        add()
    finally:
        for (obj, name), before in saved.items():  # back to what they were
            if before is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, before)
    return records


def _shadow_causal(policy):
    """For the asynchronous scheduler (a policy with `last_capacity`), a gate-less Algorithm 1 on
    its cost profile, asked in every step the scheduler read its capacity off the snapshot what it
    would have verified instead; None for other policies."""
    from dspark.schedule.prefix import PrefixScheduler

    inner = getattr(policy, "policy", policy)
    if not hasattr(inner, "last_capacity"):
        return None
    shadow = PrefixScheduler(inner.cost)
    shadow.gate = None  # it only decides; the traced scheduler's gate chooses the drafts
    return shadow


def _expected_accepts(requests, lengths: Sequence[int]) -> float:
    """Expected accepted draft tokens of verifying `lengths` of these requests: the sum of the
    survivals a_{r,1..l_r} (requests without confidences count 0)."""
    from dspark.schedule.base import survival

    return sum(sum(survival(q)[:n]) for q, n in zip(requests, lengths) if q.confidences is not None)


class EveryKthQuarter:
    """A policy that drafts the first quarter of its requests (at least one) on every k-th
    step and no one on the others; everything else is the wrapped policy's."""

    def __init__(self, policy, k: int) -> None:
        if k < 1:
            raise ValueError(f"probe interval must be >= 1, got {k}")
        self.policy, self.k, self.calls = policy, k, 0

    def choose_drafts(self, request_ids, pending_rows=None) -> list[bool]:
        self.calls += 1
        quarter = max(1, len(request_ids) // 4) if self.calls % self.k == 0 else 0
        return [i < quarter for i in range(len(request_ids))]

    def __getattr__(self, name):
        return getattr(self.policy, name)


def summarise(records: Sequence[StepRecord], cost=None, vetoes: int | None = None) -> str:
    """Plain and drafted decode-only steps (every request decoding, no prompt chunk) side by
    side, then each B's median forward against the profile's F(R, B) when `cost` is given;
    with `vetoes` (a draft gate's count), the drafted steps split into probes and the gate's
    own choices, and how many of each verified no draft token."""
    if not records:
        return "no steps"
    full = max(r.decoding for r in records)
    decode = [r for r in records if r.decoding == full and r.requests == full and r.prefill == 0]
    lines = [f"{len(records)} steps, {sum(r.tokens for r in records)} tokens in "
             f"{sum(r.seconds for r in records):.1f} s; {len(decode)} decode-only steps of {full} requests"]
    totals = {k: sum(getattr(r, k) for r in records) for k in ("seconds", "forward", "propose", "observe")}
    lines.append(f"     all: forward {totals['forward']:.2f} s, propose {totals['propose']:.2f} s, observe "
                 f"{totals['observe']:.2f} s, the rest {totals['seconds'] - totals['forward'] - totals['propose'] - totals['observe']:.2f} s")
    for label, rows in (("plain", [r for r in decode if not r.drafted]), ("drafted", [r for r in decode if r.drafted])):
        if rows:
            mean = {k: statistics.mean(getattr(r, k) for r in rows) for k in ("seconds", "forward", "propose", "observe",
                                                                              "budget", "tokens")}
            lines.append(f"{label:>8}: {len(rows)} steps, {1e3 * mean['seconds']:.1f} ms a step (forward "
                         f"{1e3 * mean['forward']:.1f}, propose {1e3 * mean['propose']:.1f}, observe "
                         f"{1e3 * mean['observe']:.1f}), B {mean['budget']:.2f}, {mean['tokens']:.2f} tokens, "
                         f"{mean['tokens'] / mean['seconds']:.1f} tok/s")
    if vetoes is not None:
        drafted = [r for r in records if r.drafted]
        probes = [r for r in drafted if r.probe]
        chosen = [r for r in drafted if not r.probe]
        lines.append(f"    gate: {len(drafted)} drafted steps: {len(probes)} probes ({sum(r.verified == 0 for r in probes)} "
                     f"verified nothing, propose {sum(r.propose for r in probes):.2f} s), {len(chosen)} chosen "
                     f"({sum(r.verified == 0 for r in chosen)} verified nothing, propose "
                     f"{sum(r.propose for r in chosen):.2f} s, {sum(r.tokens - r.decoding for r in chosen)} tokens "
                     f"past one a request); {vetoes} vetoes")
    snap = [r for r in records if r.snapshot]
    if snap:
        over = [r for r in snap if r.verified > r.causal_verified]
        under = [r for r in snap if r.verified < r.causal_verified]
        extra = sum(r.verified - r.causal_verified for r in snap)
        gained = sum(r.expected - r.causal_expected for r in snap)
        priced = ""
        if cost is not None:
            delta = sum(cost.forward_seconds(r.requests + r.verified, r.requests)
                        - cost.forward_seconds(r.requests + r.causal_verified, r.requests) for r in snap)
            priced = f", {1e3 * delta:+.1f} ms of target forward at the profile's prices"
        lines.append(f"   async: {len(snap)} decides read the snapshot; against Algorithm 1 on the same confidences "
                     f"they verified {extra:+d} tokens ({len(over)} steps more, {len(under)} fewer), "
                     f"{gained:+.2f} expected accepted tokens{priced}")
    by_budget: dict[int, list[float]] = defaultdict(list)
    for r in decode:
        by_budget[r.budget].append(r.forward)
    for budget in sorted(by_budget):
        measured = 1e3 * statistics.median(by_budget[budget])
        predicted = "" if cost is None else f", profile F({full}, {budget}) {1e3 * cost.forward_seconds(budget, full):.1f} ms"
        lines.append(f"  B={budget}: {len(by_budget[budget])} steps, forward median {measured:.1f} ms{predicted}")
    return "\n".join(lines)


@dataclass
class EmbeddedBench:
    """The embedded target set up as the load benchmark runs it, for the engine-level tools
    (this module, `engine_ab`, `context_parts`): one torch thread, the evaluation prompts encoded
    with the chat template, greedy requests of 64 new tokens."""

    loaded: object  # dspark.models.LoadedTarget
    backend: object  # dspark.bench.load.InProcessBackend: the arms' drafters, profiles and engine config
    prompt_ids: list[list[int]]
    params: object  # dspark.types.SamplingParams

    @classmethod
    def open(cls, concurrency: int, prompt_chars: int, device: str = "cpu") -> "EmbeddedBench":
        import torch

        from dspark.bench.clients import ChatEncoder, SamplingSpec
        from dspark.bench.load import InProcessBackend, load_prompts
        from dspark.models import load_target
        from dspark.types import SamplingParams

        torch.set_num_threads(1)  # as the load benchmark (dspark.bench.load_docs)
        loaded = load_target(None, device=device)
        prompts = load_prompts("all", max_chars=prompt_chars)
        backend = InProcessBackend(loaded, prompts, SamplingSpec(max_new_tokens=64), concurrency, embedded=True)
        encoder = ChatEncoder(loaded.tokenizer)
        return cls(loaded, backend, [encoder(p) for p in prompts], SamplingParams(temperature=0.0, max_new_tokens=64))

    def engine(self, drafter, policy):
        from dspark.engine.engine import Engine

        return Engine(self.loaded.model, drafter, policy, self.backend.engine_config, tokenizer=self.loaded.tokenizer)


def main(argv: list[str]) -> None:
    """DRAFTER POLICY[:OPTION=VALUE...] CONCURRENCY STEPS [PROBE_EVERY [PROMPT_CHARS]] [--device D] (no argparse
    outside cli.py)."""
    from dspark.models.device import resolve_device

    device, think_steps = "cpu", 0.0
    if "--device" in argv:
        at = argv.index("--device")
        device = str(resolve_device(argv[at + 1] if at + 1 < len(argv) else ""))
        argv = argv[:at] + argv[at + 2:]
    if "--think-steps" in argv:
        at = argv.index("--think-steps")
        try:
            think_steps = float(argv[at + 1])
        except (IndexError, ValueError):
            raise SystemExit("--think-steps takes the mean steps a finished request's successor waits, "
                             "a number >= 0") from None
        argv = argv[:at] + argv[at + 2:]
    numbers = argv[2:]
    if (len(argv) not in (4, 5, 6) or not all(a.isdigit() for a in numbers)
            or not all(int(a) > 0 for k, a in enumerate(numbers) if k != 2)):
        raise SystemExit("usage: python -m dspark.bench.steps DRAFTER POLICY CONCURRENCY STEPS [PROBE_EVERY "
                         "[PROMPT_CHARS]] [--device D] [--think-steps N] (integers > 0, PROBE_EVERY >= 0; e.g. "
                         "dspark/assets/drafters/smollm2-135m-dspark dspark 16 300)")
    from dspark.bench.arms import Arm
    from dspark.schedule import make_policy

    drafter_spec, policy_spec, concurrency, steps = argv[0], argv[1], int(argv[2]), int(argv[3])
    bench = EmbeddedBench.open(concurrency, int(argv[5]) if len(argv) > 5 else 300, device)
    probe_every = int(argv[4]) if len(argv) > 4 else 0
    policy_name, *extra = policy_spec.split(":")  # e.g. dspark:choices=on (the policy's on/off options)
    drafter, cost = bench.backend._arm_parts(Arm("traced", drafter_spec, policy_name))
    options = {"k": drafter.block_size} if policy_name == "fixed" else {}
    options.update(option.partition("=")[::2] for option in extra)
    policy = make_policy(policy_name, cost, **options)
    if probe_every:
        policy = EveryKthQuarter(policy, probe_every)
    records = trace_steps(bench.engine(drafter, policy), bench.prompt_ids, bench.params, concurrency, steps,
                          think_steps=think_steps)
    forced = f", a quarter drafted every {probe_every} steps" if probe_every else ""
    forced += f", successors waiting {think_steps:g} steps on average" if think_steps else ""
    print(f"{drafter_spec} / {policy_spec}, {concurrency} requests{forced}")
    gate = getattr(getattr(policy, "policy", policy), "gate", None)
    print(summarise(records, cost, None if gate is None else gate.vetoed))
    if gate is not None:
        print(f"   gate at the end: acceptance ratio {gate.acceptance_ratio():.3f}; its own choices accepted "
              f"{gate.chosen_realised:.2f} of {gate.chosen_promised:.2f} promised tokens (decayed sums), choice "
              f"ratio {gate.choice_ratio():.3f}{'' if gate.choices else ' (not applied)'}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""The offline acceptance-length harness (paper section 4.1).

Each prompt runs alone (batch 1) through the engine's draft -> schedule ->
verify -> commit loop, with the lossless verifier and a fixed verify length
equal to the drafter's block (the paper's offline protocol: no confidence
scheduling, the whole block is verified). Multi-turn prompts (mt-bench) feed
turn t+1 after the model's own answer to turn t, through the chat template.

Order of work: benchmark files are validated first, then the target loads,
then every drafter loads (a drafter trained for another target fails here),
and only then does generation start.
"""

from __future__ import annotations

import math
import os
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from dspark.draft.base import Drafter
from dspark.engine.engine import Engine, EngineConfig
from dspark.engine.generate import GenerationResult, generate
from dspark.errors import UserError
from dspark.eval.benchmarks import BENCHMARKS, Prompt, load_suites
from dspark.eval.records import BenchResult, DrafterRun, EvalRun, EvalSettings, RoundRecord, environment
from dspark.models.chat import encode_chat
from dspark.schedule import FixedLength, ScheduleOutcome, ScheduleRequest
from dspark.types import SamplingParams, SpecStats

DTYPES = ("float32", "bfloat16")
SEED_STRIDE = 7919  # prompt i, turn t samples with seed + SEED_STRIDE * i + t
CONTEXT_MARGIN = 64  # tokens of chat-template overhead allowed per turn


class RecordingPolicy:
    """Verify the whole drafted block (FixedLength(G)) and, when asked, keep each
    round's confidences and outcome for the threshold sweep and the
    reliability diagrams."""

    name = "fixed"

    def __init__(self, block_size: int, keep_rounds: bool) -> None:
        self.inner = FixedLength(block_size)
        self.keep_rounds = keep_rounds
        self.rounds: list[RoundRecord] = []
        self._pending: dict[object, list[float]] = {}

    def decide(self, requests: list[ScheduleRequest]) -> list[int]:
        if self.keep_rounds:
            for q in requests:
                conf = q.confidences
                self._pending[q.request_id] = [] if conf is None else [float(c) for c in conf[: q.num_drafted]]
        return self.inner.decide(requests)

    def commit(self, outcomes: list[ScheduleOutcome]) -> None:
        for o in outcomes:
            conf = self._pending.pop(o.request_id, None)
            if self.keep_rounds:
                self.rounds.append(RoundRecord(o.verify_len, o.num_accepted, conf or []))

    def take_rounds(self) -> list[RoundRecord]:
        rounds, self.rounds = self.rounds, []
        return rounds


def run_conversation(
    engine: Engine, prompt: Prompt, params: SamplingParams, index: int
) -> list[GenerationResult]:
    """Generate an answer to every user turn of `prompt`, each turn seeing the
    model's own earlier answers."""
    messages: list[dict] = []
    results = []
    for turn, text in enumerate(prompt.turns):
        messages.append({"role": "user", "content": text})
        ids = encode_chat(engine.tokenizer, messages)
        seed = params.seed + SEED_STRIDE * index + turn
        result = generate(engine, ids, replace(params, seed=seed))
        messages.append({"role": "assistant", "content": result.text})
        results.append(result)
    return results


def conversation_length(tokenizer, prompt: Prompt, max_new_tokens: int) -> int:
    """Most tokens a conversation can need: its turns, every answer and the chat
    template's overhead per turn."""
    turns = sum(len(encode_chat(tokenizer, [{"role": "user", "content": t}])) for t in prompt.turns)
    return turns + len(prompt.turns) * (max_new_tokens + CONTEXT_MARGIN)


def fit_context(
    tokenizer, suites: dict[str, list[Prompt]], max_new_tokens: int, context: int
) -> tuple[dict[str, list[Prompt]], dict[str, list[str]], int]:
    """Drop conversations that cannot fit the target's context.

    Returns the kept prompts per benchmark, the ids skipped per benchmark, and
    the KV-cache length the kept ones need."""
    kept, skipped, need = {}, {}, 1
    for name, prompts in suites.items():
        lengths = [conversation_length(tokenizer, p, max_new_tokens) for p in prompts]
        kept[name] = [p for p, n in zip(prompts, lengths) if n <= context]
        skipped[name] = [p.id for p, n in zip(prompts, lengths) if n > context]
        need = max([need, *(n for n in lengths if n <= context)])
    return kept, skipped, need


@dataclass
class _Lane:
    """One drafter with its own engine, and what it has measured so far."""

    label: str
    spec: str
    drafter: Drafter
    engine: Engine
    policy: RecordingPolicy
    benches: dict[str, BenchResult] = field(default_factory=dict)

    def start(self, name: str, prompts: int, skipped: list[str]) -> BenchResult:
        stats = SpecStats(block_size=self.drafter.block_size)
        self.benches[name] = BenchResult(name, BENCHMARKS[name], prompts, 0, 0, 0.0, stats, skipped=skipped)
        return self.benches[name]

    def run(self, bench: BenchResult, prompt: Prompt, params: SamplingParams, index: int) -> int:
        results = run_conversation(self.engine, prompt, params, index)
        for result in results:
            bench.stats.merge(result.stats)
            bench.generated_tokens += result.num_generated
            bench.seconds += result.seconds
            bench.generations += 1
        bench.per_prompt.append((prompt.id, sum(r.stats.rounds for r in results),
                                 sum(r.stats.committed_tokens for r in results)))
        return len(results)

    def finish(self, bench: BenchResult) -> None:
        bench.rounds = self.policy.take_rounds()

    def record(self) -> DrafterRun:
        temps = getattr(getattr(self.drafter, "config", None), "calibration_temperatures", None)
        return DrafterRun(
            label=self.label, spec=self.spec, kind=self.drafter.name, block_size=self.drafter.block_size,
            has_confidence=bool(self.drafter.has_confidence),
            calibration_temperatures=None if temps is None else [float(t) for t in temps], benches=self.benches,
        )


def _lane(target, tokenizer, label: str, spec: str, drafter: Drafter, max_seq_len: int) -> _Lane:
    policy = RecordingPolicy(drafter.block_size, keep_rounds=drafter.has_confidence)
    engine = Engine(target, drafter, policy, EngineConfig(max_running=1, max_seq_len=max_seq_len),
                    tokenizer=tokenizer)
    # one short untimed generation, so lazy initialisation is not billed to the first benchmark
    generate(engine, encode_chat(tokenizer, [{"role": "user", "content": "Hello"}]),
             SamplingParams(temperature=0.0, max_new_tokens=4, seed=0))
    policy.take_rounds()
    return _Lane(label, spec, drafter, engine, policy)


def evaluate(
    target, tokenizer, drafters: list[tuple[str, str, Drafter]], suites: dict[str, list[Prompt]],
    settings: EvalSettings, progress: bool = True,
) -> list[DrafterRun]:
    """Every (label, spec, drafter) over every benchmark with the same prompts and
    seeds. Drafters take turns prompt by prompt, so that a load change on a
    shared machine slows all of them alike and tokens/s stay comparable."""
    params = SamplingParams(temperature=settings.temperature, max_new_tokens=settings.max_new_tokens,
                            seed=settings.seed)
    limit = target.config.max_position_embeddings
    suites, skipped, need = fit_context(tokenizer, suites, settings.max_new_tokens, limit - 64)
    lanes = [_lane(target, tokenizer, label, spec, d, min(limit, need + d.block_size + 1))
             for label, spec, d in drafters]
    total = len(lanes) * sum(len(p.turns) for prompts in suites.values() for p in prompts)
    bar = tqdm(total=total, desc="eval", unit="answer", disable=not progress)
    for name, prompts in suites.items():
        bar.set_postfix_str(name)
        benches = [lane.start(name, len(prompts), skipped[name]) for lane in lanes]
        for index, prompt in enumerate(prompts):
            for lane, bench in zip(lanes, benches):
                bar.update(lane.run(bench, prompt, params, index))
        for lane, bench in zip(lanes, benches):
            lane.finish(bench)
    bar.close()
    return [lane.record() for lane in lanes]


def drafter_label(spec: str) -> str:
    return spec if spec in ("none", "ngram", "default") else Path(spec).expanduser().name


def parse_drafters(drafters: str | Sequence[str], baseline: bool) -> list[str]:
    """Drafter specs in order; `none` first when the baseline is asked for and absent."""
    specs = [s.strip() for s in (drafters.split(",") if isinstance(drafters, str) else drafters)]
    specs = [s for s in specs if s]
    if not specs:
        raise UserError("no drafter given: pass --drafter none, ngram, default, mtp1 or PATH[,PATH...]")
    labels = [drafter_label(s) for s in specs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise UserError(f"drafter name(s) {', '.join(dupes)} given twice; give each drafter once")
    if baseline and "none" not in specs:
        specs.insert(0, "none")
    return specs


def eval_command(specs: list[str], settings: EvalSettings, target: str | None) -> str:
    """The `dspark eval` command line that reproduces a run (specs after
    `parse_drafters`, so `none` is listed when it ran)."""
    bench = "all" if list(settings.benchmarks) == list(BENCHMARKS) else ",".join(settings.benchmarks)
    parts = ["dspark", "eval", "--drafter", ",".join(specs), "--bench", bench]
    if "none" not in specs:
        parts.append("--no-baseline")
    if settings.limit is not None:
        parts += ["--limit", str(settings.limit)]
    parts += ["--temperature", f"{settings.temperature:g}"]
    if settings.block_size is not None:
        parts += ["--block-size", str(settings.block_size)]
    parts += ["--max-new-tokens", str(settings.max_new_tokens), "--seed", str(settings.seed)]
    if target is not None:
        parts += ["--target", target]
    if settings.dtype != "float32":
        parts += ["--dtype", settings.dtype]
    threads = os.environ.get("OMP_NUM_THREADS")  # changes tokens/s, so it belongs to the command
    return (f"OMP_NUM_THREADS={shlex.quote(threads)} " if threads else "") + shlex.join(parts)


def _check_args(temperature: float, block_size: int | None, max_new_tokens: int, dtype: str) -> None:
    SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)  # validates both
    if not math.isfinite(temperature):
        raise UserError("--temperature must be finite")
    if block_size is not None and not (1 <= block_size <= 64):
        raise UserError(f"--block-size must be in 1..64, got {block_size}")
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def run_eval(
    drafters: str | Sequence[str],
    bench: str = "all",
    *,
    limit: int | None = None,
    temperature: float = 1.0,
    block_size: int | None = None,
    max_new_tokens: int = 256,
    seed: int = 0,
    target: str | None = None,
    home: str | None = None,
    dtype: str = "float32",
    cpu_kernels: bool = True,
    device: str = "cpu",
    baseline: bool = True,
    results_dir: str | Path | None = "runs/eval",
    progress: bool = True,
) -> EvalRun:
    """`dspark eval`: acceptance length (tau) of each drafter per benchmark,
    domain and macro average, conditional acceptance per position, and tokens/s
    against `none`. Saves the run as JSON under `results_dir` (None: not saved;
    the path is in `run.saved_path`)."""
    import torch

    from dspark.draft.registry import load_drafter
    from dspark.models import load_target

    _check_args(temperature, block_size, max_new_tokens, dtype)
    specs = parse_drafters(drafters, baseline)
    suites = load_suites(bench, limit)  # every file validated before any model work
    loaded = load_target(target, home=home, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype],
                         cpu_kernels=cpu_kernels, device=device)
    built = [(drafter_label(s), s, load_drafter(s, loaded.model, block_size=block_size, embedded=target is None))
             for s in specs]  # a drafter for another target fails here, before generation
    settings = EvalSettings(benchmarks=tuple(suites), limit=limit, temperature=temperature, block_size=block_size,
                            max_new_tokens=max_new_tokens, seed=seed, target=loaded.name, dtype=dtype)
    runs = evaluate(loaded.model, loaded.tokenizer, built, suites, settings, progress)
    run = EvalRun(settings=settings, command=eval_command(specs, settings, target), drafters=runs,
                  environment={**environment(), "device": str(loaded.model.device)})
    if results_dir is not None:
        run.saved_path = run.save(results_dir)
    return run

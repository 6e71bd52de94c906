"""Run the engine to completion: one request (`dspark generate`, the eval
harness) or many (`dspark prepare` regenerating training answers)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tqdm import tqdm

from dspark.engine.engine import Engine, EngineConfig
from dspark.types import SamplingParams, SpecStats


@dataclass
class GenerationResult:
    token_ids: list[int]  # generated tokens (no prompt, no end-of-sequence token)
    text: str
    num_generated: int
    seconds: float
    tokens_per_second: float
    stats: SpecStats
    finish_reason: str | None

    def as_dict(self) -> dict:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "num_generated": self.num_generated,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "finish_reason": self.finish_reason,
            "stats": self.stats.as_dict(),
        }


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """Text up to the first occurrence of any stop string."""
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def generate(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
    """Generate one request alone on the engine (batch 1)."""
    start = time.perf_counter()
    rid = engine.add_request(prompt_ids, params)
    while not engine.requests[rid].finished:
        engine.step()
    seconds = time.perf_counter() - start
    req = engine.pop_finished(rid)
    text = ""
    if engine.tokenizer is not None:
        text = cut_at_stop(engine.tokenizer.decode(req.output_ids, skip_special_tokens=True), params.stop)
    n = len(req.output_ids)
    return GenerationResult(
        token_ids=list(req.output_ids),
        text=text,
        num_generated=n,
        seconds=seconds,
        tokens_per_second=n / seconds if seconds > 0 else 0.0,
        stats=req.stats,
        finish_reason=req.finish_reason,
    )


def generate_many(
    target,
    prompt_ids: list[list[int]],
    params: SamplingParams,
    *,
    drafter=None,
    max_batch: int = 16,
    max_seq_len: int = 2048,
    progress: bool = True,
) -> list[list[int]]:
    """Generate a continuation for every prompt with continuous batching.

    Request i uses seed `params.seed + i` when params.seed is set, so results
    do not depend on batch composition.
    """
    from dspark.draft.ngram import NoDrafter
    from dspark.engine.policy import build_policy

    drafter = drafter or NoDrafter()
    policy = build_policy("fixed", block_size=drafter.block_size)
    config = EngineConfig(max_running=max_batch, max_seq_len=max_seq_len)
    engine = Engine(target, drafter, policy, config)
    ids = []
    for i, prompt in enumerate(prompt_ids):
        seed = None if params.seed is None else params.seed + i
        ids.append(engine.add_request(prompt, _with_seed(params, seed)))
    bar = tqdm(total=len(ids), desc="generate", disable=not progress)
    done = 0
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                done += 1
                bar.update(1)
    bar.close()
    return [list(engine.pop_finished(rid).output_ids) for rid in ids]


def _with_seed(params: SamplingParams, seed: int | None) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)

"""Offline speed of one DSpark drafting round, split into the parallel stage
(backbone + LM head) and the sequential stage (left-to-right sampling loop
+ confidence head), for several block sizes and batch sizes, next to the
target's verification forward of the same block.

Each case observes `context` random target features per request once, then
times `propose` (median of `repeats` after `warmup`), its two stages
separately, the sequential stage with the top-K transition restriction, the
per-round `observe` of a typical accepted prefix, `propose` again with a
draft vocabulary of K tokens (`vocabK`), and (when the target can
run) one target forward of batch x (G + 1) tokens with the drafter's tapped
layers, rolled back after each repeat. Weights are random, rounded to
float16 as in a shipped checkpoint (the CPU kernel then reads them as float16):
speed does not depend on their values.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch

from dspark.draft.dspark import DSparkDrafter
from dspark.draft.factory import build_drafter, drafter_size
from dspark.models.cpu_kernels import enable_drafter_cpu_kernels, has_cpu_kernels
from dspark.models.device import synchronize
from dspark.types import RaggedBatch, SamplingParams


def _median_ms(step: Callable[[], object], repeats: int, warmup: int, device: torch.device | None = None) -> float:
    """Median wall-clock ms of `step` (synchronising a GPU before each reading of the clock)."""
    device = device or torch.device("cpu")
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _observed_states(drafter: DSparkDrafter, batch: int, context: int) -> list:
    gen = torch.Generator().manual_seed(0)
    t, d = len(drafter.tap_layers), drafter.target_config.hidden_size
    states = [drafter.new_state() for _ in range(batch)]
    hidden = [torch.randn(context, t, d, generator=gen).to(drafter.device) for _ in range(batch)]
    tokens = [torch.zeros(context, dtype=torch.int64) for _ in range(batch)]
    drafter.observe(states, tokens, hidden)
    return states


def _time_drafter(
    drafter: DSparkDrafter, batch: int, context: int, repeats: int, warmup: int, top_ks, vocab_sizes=()
) -> dict:
    g, dev = drafter.block_size, drafter.device
    states = _observed_states(drafter, batch, context)
    anchors = torch.arange(batch, dtype=torch.int64, device=dev) + 20
    params = [SamplingParams(temperature=1.0)] * batch
    gens = [torch.Generator().manual_seed(i) for i in range(batch)]
    temps = torch.ones(batch, device=dev)
    uniforms = torch.rand(batch, g).to(dev)
    block = drafter.draft_block(states, anchors)

    def median_ms(step: Callable[[], object]) -> float:
        return _median_ms(step, repeats, warmup, dev)

    def sequential():
        tokens, _ = drafter.sample(block, anchors, temps, uniforms)
        drafter.confidences(block.hidden, anchors, tokens)

    row = {
        "propose_ms": median_ms(lambda: drafter.propose(states, anchors, params, gens)),
        "backbone_ms": median_ms(lambda: drafter.draft_block(states, anchors)),
        "sequential_ms": median_ms(sequential),
    }
    base_config = drafter.config
    for k in top_ks:
        drafter.config = dataclasses.replace(base_config, transition_top_k=k)
        row[f"sequential_top{k}_ms"] = median_ms(sequential)
    drafter.config = base_config
    ranking = torch.arange(drafter.target_config.vocab_size)  # which K tokens does not change the cost
    for k in vocab_sizes:
        drafter.set_draft_vocab(ranking, k)
        row[f"propose_vocab{k}_ms"] = median_ms(lambda: drafter.propose(states, anchors, params, gens))
    drafter.set_draft_vocab(None, 0)
    accepted = g // 2 + 1
    new_hidden = [torch.randn(accepted, len(drafter.tap_layers), drafter.target_config.hidden_size).to(dev)] * batch
    new_tokens = [torch.zeros(accepted, dtype=torch.int64)] * batch

    def observe():  # buffer, then one batched projection (as the next propose does), then roll back
        drafter.observe(states, new_tokens, new_hidden)
        drafter.project_pending(states)
        for s in states:
            drafter.truncate(s, context)

    row["observe_ms"] = median_ms(observe)
    row["sequential_share"] = row["sequential_ms"] / row["propose_ms"]
    return row


def _time_verify(target, batch: int, new_tokens: int, context: int, taps, repeats: int, warmup: int) -> float:
    """Median ms of the target forward that verifies `new_tokens` per request."""
    cache = target.new_cache(batch, context + new_tokens)
    slots = [cache.allocate() for _ in range(batch)]
    gen = torch.Generator().manual_seed(1)
    vocab = target.config.vocab_size
    with torch.inference_mode():
        for slot in slots:
            prompt = torch.randint(3, vocab, (context,), generator=gen)
            target(RaggedBatch(prompt, [slot], [context]), cache, logits_rows=torch.tensor([context - 1]))
    step_batch = RaggedBatch(torch.randint(3, vocab, (batch * new_tokens,), generator=gen), slots, [new_tokens] * batch)

    def step() -> None:
        with torch.inference_mode():
            target(step_batch, cache, tap_layers=taps)
        for slot in slots:
            cache.truncate(slot, context)

    return _median_ms(step, repeats, warmup, target.device)


def run_draft_bench(
    target,
    *,
    gammas: tuple[int, ...] = (4, 8, 16),
    batches: tuple[int, ...] = (1, 16),
    context: int = 256,
    repeats: int = 5,
    warmup: int = 1,
    top_ks: tuple[int, ...] = (256,),
    vocab_sizes: tuple[int, ...] = (8192,),
    verify: bool = True,
    drafter_config: dict | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Time DSpark drafting rounds on `target` (a TargetModel; its forward is
    used only when verify=True) -> {"drafter": ..., "cases": [...]}."""
    cases = []
    sizes = None
    log(f"{'G':>3} {'R':>3} | {'propose':>8} {'backbone':>8} {'seq':>7} {'seq%':>5} "
        + " ".join(f"{'seqK' + str(k):>8}" for k in top_ks)
        + "".join(f" {'vocab' + str(k):>9}" for k in vocab_sizes) + f" {'observe':>8} | {'verify':>8}  (ms)")
    for gamma in gammas:
        drafter = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight,
                                **{**(drafter_config or {}), "block_size": gamma})
        with torch.no_grad():  # float16-rounded, as a drafter loaded from a float16 checkpoint is
            for p in drafter.parameters():
                p.copy_(p.half().float())
        if has_cpu_kernels(target):  # served as `dspark generate` serves it: with the CPU kernel
            enable_drafter_cpu_kernels(drafter, target)
        sizes = sizes or drafter_size(drafter)
        for batch in batches:
            timed = _time_drafter(drafter, batch, context, repeats, warmup, top_ks, vocab_sizes)
            row = {"block_size": gamma, "batch": batch, **timed}
            if verify:
                row["verify_ms"] = _time_verify(target, batch, gamma + 1, context, drafter.tap_layers, repeats, warmup)
            cases.append(row)
            log(f"{gamma:>3} {batch:>3} | {row['propose_ms']:8.2f} {row['backbone_ms']:8.2f} "
                f"{row['sequential_ms']:7.2f} {100 * row['sequential_share']:4.0f}% "
                + " ".join(f"{row[f'sequential_top{k}_ms']:8.2f}" for k in top_ks)
                + "".join(f" {row[f'propose_vocab{k}_ms']:9.2f}" for k in vocab_sizes)
                + f" {row['observe_ms']:8.2f} | {row.get('verify_ms', float('nan')):8.2f}")
    params, fp16_bytes = sizes
    return {
        "drafter": {"params": params, "fp16_mb": fp16_bytes / 1e6, "config": drafter_config or {}},
        "context": context,
        "threads": torch.get_num_threads(),
        "cases": cases,
    }


def main() -> None:
    """Run on the embedded SmolLM2-135M target (no argument parsing: the CLI wraps run_draft_bench)."""
    from dspark.models.loading import load_target

    run_draft_bench(load_target(None).model)


if __name__ == "__main__":
    main()

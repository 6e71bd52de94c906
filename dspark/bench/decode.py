"""Offline speed of one target forward: the lean runtime (float32 and bfloat16)
against Hugging Face transformers, for decode steps and verification steps.

For each batch size, one request's `context` tokens are prefilled and its cache
copied to the other requests; then a forward of q new tokens per request is
timed, rolling the cache back after each so the context stays the same. The
reported time is the median over `repeats` steps after `warmup` untimed ones.

    from dspark.bench.decode import run_decode_bench
    run_decode_bench()  # embedded SmolLM2, context 256, batch 1 and 16, q = 1 and 8
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from dspark.models.cpu_kernels import cpu_kernels_available, cpu_kernels_status, target_linears
from dspark.models.loading import LoadedTarget, load_target, read_target_config
from dspark.types import RaggedBatch

DEFAULT_CASES = ((1, 1), (1, 8), (16, 1), (16, 8))  # (batch, new tokens per request)


@dataclass
class DecodeTiming:
    runtime: str  # "dspark" (lean) or "transformers"
    dtype: str  # weight dtype
    batch: int  # requests in the forward
    new_tokens: int  # tokens per request in the forward (1 = decode step)
    ms: float  # median milliseconds per forward


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU time


def _median_ms(step: Callable[[], None], repeats: int, warmup: int, clock: str = "wall") -> float:
    now = CLOCKS[clock]
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t0 = now()
        step()
        times.append((now() - t0) * 1e3)
    return statistics.median(times)


def _prompts(vocab: int, batch: int, context: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, vocab, (batch, context), generator=gen)  # [batch, context]


def prefilled_cache(target: LoadedTarget, batch: int, context: int, room: int):
    """A KV cache of `batch` slots each holding the same `context` pseudo-random tokens (one
    prefilled, copied to the others), with `room` more positions -> (cache, slots)."""
    model = target.model
    cache = model.new_cache(batch, context + room)
    slots = [cache.allocate() for _ in range(batch)]
    prompt = _prompts(target.config.vocab_size, 1, context)[0]
    with torch.inference_mode():
        model(RaggedBatch(prompt, slots[:1], [context]), cache, logits_rows=torch.tensor([context - 1]))
    for slot in slots[1:]:
        cache.copy_slot(slots[0], slot)
    return cache, slots


def lean_steps(target: LoadedTarget, batch: int, new_tokens: list[int], context: int) -> dict[int, Callable[[], None]]:
    """Per q, a callable running one ragged forward of `batch` requests x q new tokens at
    `context` and rolling the cache back. One request is prefilled; the others get a copy of
    its cache (the content does not change the cost)."""
    model = target.model
    cache, slots = prefilled_cache(target, batch, context, max(new_tokens))
    steps = {}
    for q in new_tokens:
        tokens = _prompts(target.config.vocab_size, batch, q).reshape(-1)
        step_batch = RaggedBatch(tokens, slots, [q] * batch)

        def step(step_batch: RaggedBatch = step_batch) -> None:
            with torch.inference_mode():
                model(step_batch, cache)
            for slot in slots:
                cache.truncate(slot, context)

        steps[q] = step
    return steps


def time_lean(
    target: LoadedTarget, batch: int, new_tokens: list[int], context: int, repeats: int, warmup: int, clock: str
) -> dict[int, float]:
    """Median ms of one ragged forward of `batch` requests x q new tokens at `context`, per q."""
    return {q: _median_ms(step, repeats, warmup, clock) for q, step in lean_steps(target, batch, new_tokens, context).items()}


def _projections(model) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """(x -> x @ W.T, in_features) for every weight matrix of a forward, as the forward computes
    it: through the module's CPU kernel when it has one, else through `linear`."""
    from dspark.models.layers import linear

    def product(module: object, weight: torch.Tensor, kernel_name: str):
        kernel = module.__dict__.get(kernel_name)
        return (kernel if kernel is not None else lambda x: linear(x, weight)), weight.shape[1]

    out = [product(m, m.weight, "cpu_kernel") for m in target_linears(model)]
    out.append(product(model, model.lm_head_weight, "head_kernel"))
    return out


def time_matmuls_only(
    target: LoadedTarget, batch: int, new_tokens: list[int], repeats: int, warmup: int, clock: str
) -> dict[int, float]:
    """Median ms of just the weight matmuls of one forward (every projection of every layer and
    the LM head, over batch x q rows, computed as the runtime computes them): the floor a
    forward cannot go below with these kernels, whatever the rest of the runtime does."""
    products = _projections(target.model)
    dtype = target.model.dtype
    timings = {}
    for q in new_tokens:
        rows = {n: torch.randn(batch * q, n, dtype=dtype) for n in {n for _, n in products}}

        def step() -> None:
            with torch.inference_mode():
                for product, n in products:
                    product(rows[n])

        timings[q] = _median_ms(step, repeats, warmup, clock)
    return timings


def transformers_steps(hf_model, vocab: int, batch: int, new_tokens: list[int], context: int) -> dict[int, Callable[[], None]]:
    """The same steps with transformers' own forward and DynamicCache (equal-length batch)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        hf_model(_prompts(vocab, 1, context), cache=cache, use_cache=True)
        cache.batch_repeat_interleave(batch)
    if cache.get_seq_length() != context:  # a transformers version that ignores `cache=`
        raise RuntimeError("transformers did not fill the DynamicCache; the comparison would be invalid")
    steps = {}
    for q in new_tokens:
        tokens = _prompts(vocab, batch, q)

        def step(tokens: torch.Tensor = tokens, q: int = q) -> None:
            with torch.inference_mode():
                hf_model(tokens, cache=cache, use_cache=True)
            cache.crop(-q)  # transformers 5: a negative count of tokens to drop

        steps[q] = step
    return steps


def time_transformers(
    hf_model, vocab: int, batch: int, new_tokens: list[int], context: int, repeats: int, warmup: int, clock: str
) -> dict[int, float]:
    """Median ms per q of transformers' forward (see `transformers_steps`)."""
    steps = transformers_steps(hf_model, vocab, batch, new_tokens, context)
    return {q: _median_ms(step, repeats, warmup, clock) for q, step in steps.items()}


def paired_ms(steps: list[Callable[[], None]], repeats: int, warmup: int, clock: str = "wall") -> list[float]:
    """Median ms of each step, timed in alternation (A, B, A, B, ...): drift of a shared machine
    then hits every step alike, so their ratio is steadier than that of separate runs."""
    now = CLOCKS[clock]
    for _ in range(warmup):
        for step in steps:
            step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for step, out in zip(steps, times):
            t0 = now()
            step()
            out.append((now() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def _by_batch(cases: tuple[tuple[int, int], ...]) -> dict[int, list[int]]:
    grouped: dict[int, list[int]] = {}
    for batch, q in cases:
        grouped.setdefault(batch, []).append(q)
    return grouped


def run_decode_bench(
    target: str | None = None,
    repeats: int = 10,
    *,
    context: int = 256,
    cases: tuple[tuple[int, int], ...] = DEFAULT_CASES,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    include_transformers: bool = True,
    warmup: int = 2,
    clock: str = "wall",
    threads: int | None = None,
    home: str | None = None,
    print_fn: Callable[[str], None] | None = print,
    cpu_kernels: bool = True,
) -> dict:
    """Time the target forward in each (batch, new tokens) case; print a table and return
    {"target", "context", "repeats", "threads", "clock", "timings": [DecodeTiming as dict, ...]}.

    clock: "wall" (elapsed time) or "cpu" (this process's CPU time: steadier on a busy
    machine, meaningful with threads=1). threads: torch intra-op threads for the run
    (None keeps the current setting; it is restored afterwards). cpu_kernels: time the
    runtime with its small-row CPU kernel and again without it (False: without only).
    """
    if clock not in CLOCKS:
        raise ValueError(f"clock must be one of {sorted(CLOCKS)}, got {clock!r}")
    previous_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        result = _run_cases(target, repeats, context, cases, dtypes, include_transformers, warmup, clock, home,
                            cpu_kernels)
    finally:
        torch.set_num_threads(previous_threads)
    if print_fn is not None:
        print_fn(format_table(result))
    return result


def _run_cases(
    target: str | None, repeats: int, context: int, cases: tuple[tuple[int, int], ...],
    dtypes: tuple[torch.dtype, ...], include_transformers: bool, warmup: int, clock: str, home: str | None,
    cpu_kernels: bool = True,
) -> dict:
    timings: list[DecodeTiming] = []
    paired: list[dict] = []
    folder = None
    variants = [(dtype, cpu_kernels) for dtype in dtypes]
    if cpu_kernels and torch.float32 in dtypes and cpu_kernels_available():  # the runtime without its CPU kernel
        variants.insert(dtypes.index(torch.float32) + 1, (torch.float32, False))
    for dtype, kernels in variants:
        loaded = load_target(target, home=home, dtype=dtype, cpu_kernels=kernels)
        folder = loaded.path
        name = str(dtype).removeprefix("torch.")
        suffix = "" if kernels or dtype != torch.float32 else ", CPU kernels off"
        for batch, qs in _by_batch(cases).items():
            for q, ms in time_lean(loaded, batch, qs, context, repeats, warmup, clock).items():
                timings.append(DecodeTiming("dspark" + suffix, name, batch, q, ms))
            for q, ms in time_matmuls_only(loaded, batch, qs, repeats, warmup, clock).items():
                timings.append(DecodeTiming("matmuls only" + suffix, name, batch, q, ms))
        del loaded
    if include_transformers:
        from transformers import AutoModelForCausalLM

        if folder is None:
            folder = load_target(target, home=home).path
        hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        vocab = read_target_config(folder).vocab_size
        for batch, qs in _by_batch(cases).items():
            for q, ms in time_transformers(hf_model, vocab, batch, qs, context, repeats, warmup, clock).items():
                timings.append(DecodeTiming("transformers", "float32", batch, q, ms))
        if torch.float32 in dtypes:
            paired = _head_to_head(target, home, hf_model, vocab, cases, context, repeats, warmup, clock, cpu_kernels)
    return {
        "target": str(folder),
        "context": context,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "clock": clock,
        "cpu_kernels": cpu_kernels_status() if cpu_kernels else "off (--no-cpu-kernel)",
        "timings": [asdict(t) for t in timings],
        "paired": paired,
    }


def _head_to_head(target, home, hf_model, vocab: int, cases, context: int, repeats: int, warmup: int, clock: str,
                  cpu_kernels: bool) -> list[dict]:
    """The float32 lean runtime and transformers on the batch-1 cases, step by step in
    alternation (`paired_ms`): the comparison the foundation issue's goal is about."""
    qs = [q for b, q in cases if b == 1]
    if not qs:
        return []
    loaded = load_target(target, home=home, cpu_kernels=cpu_kernels)
    lean, hf = lean_steps(loaded, 1, qs, context), transformers_steps(hf_model, vocab, 1, qs, context)
    out = []
    for q in qs:
        ours, theirs = paired_ms([lean[q], hf[q]], repeats, warmup, clock)
        out.append({"batch": 1, "new_tokens": q, "dspark_ms": ours, "transformers_ms": theirs, "ratio": ours / theirs})
    return out


def format_table(result: dict) -> str:
    """Markdown table: one row per runtime/dtype, one column per (batch, new tokens) case."""
    timings = result["timings"]
    cases = list(dict.fromkeys((t["batch"], t["new_tokens"]) for t in timings))
    runtimes = list(dict.fromkeys((t["runtime"], t["dtype"]) for t in timings))
    ms = {(t["runtime"], t["dtype"], t["batch"], t["new_tokens"]): t["ms"] for t in timings}
    header = "| runtime | dtype | " + " | ".join(f"batch {b}, q={q}" for b, q in cases) + " |"
    lines = [
        f"ms per target forward ({result['clock']} clock), context {result['context']}, "
        f"median of {result['repeats']}, {result['threads']} threads; CPU kernel {result.get('cpu_kernels', 'n/a')}",
        header,
        "|" + "---|" * (2 + len(cases)),
    ]
    for runtime, dtype in runtimes:
        cells = [f"{ms[(runtime, dtype, b, q)]:.1f}" if (runtime, dtype, b, q) in ms else "-" for b, q in cases]
        lines.append(f"| {runtime} | {dtype} | " + " | ".join(cells) + " |")
    if result.get("paired"):
        lines += ["", f"Head to head, float32, the two runtimes' steps in alternation (median of {result['repeats']} each):",
                  "| batch 1, new tokens q | dspark ms | transformers ms | dspark / transformers |", "|---|---|---|---|"]
        lines += [f"| {p['new_tokens']} | {p['dspark_ms']:.1f} | {p['transformers_ms']:.1f} | {p['ratio']:.2f}x |"
                  for p in result["paired"]]
    return "\n".join(lines)

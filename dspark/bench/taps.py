"""What the drafter's taps cost the target forward, measured inside one process.

A learned drafter reads the target's hidden states at a few layers (`tap_layers`), so every
step of a speculative engine runs the target with taps, and no speculation without. Between
two processes the same forward's time drifts by 5-10 % on a small CPU (session 42: the
median decode forward of 16 requests read 128.5 and 140.2 ms in two no-speculation traces),
which hides a cost of one or two percent. This bench removes that drift: one model, one
KV cache, R requests with a prompt each, then decode forwards with and without taps
interleaved (the order flips every iteration), and the median of each.

    .venv/bin/python -m dspark.bench.taps REQUESTS ITERATIONS [PROMPT_TOKENS]

runs the embedded target with the default drafter's tap layers on one torch thread.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from dspark.types import RaggedBatch


def time_taps(model, requests: int, iterations: int, prompt_tokens: int, tap_layers: tuple[int, ...],
              seed: int = 0) -> dict[str, list[float]]:
    """Seconds of each decode forward of `requests` requests, with ("taps") and without
    ("none") `tap_layers`, `iterations` of each, interleaved, after random prompts of
    `prompt_tokens` tokens."""
    if requests < 1 or iterations < 1 or prompt_tokens < 1 or not tap_layers:
        raise ValueError("need requests, iterations and prompt_tokens >= 1 and at least one tap layer")
    vocab = model.config.vocab_size
    cache = model.new_cache(requests, prompt_tokens + 2 * iterations + 1)
    gen = torch.Generator().manual_seed(seed)
    slots = [cache.allocate() for _ in range(requests)]
    times: dict[str, list[float]] = {"none": [], "taps": []}
    with torch.inference_mode():
        for slot in slots:
            ids = torch.randint(0, vocab, (prompt_tokens,), generator=gen)
            model.forward(RaggedBatch(token_ids=ids, slots=[slot], query_lens=[prompt_tokens]), cache,
                          logits_rows=torch.tensor([prompt_tokens - 1]))
        for it in range(iterations):
            for mode in ("none", "taps") if it % 2 == 0 else ("taps", "none"):
                ids = torch.randint(0, vocab, (requests,), generator=gen)
                batch = RaggedBatch(token_ids=ids, slots=slots, query_lens=[1] * requests)
                start = time.perf_counter()
                model.forward(batch, cache, tap_layers=tap_layers if mode == "taps" else ())
                times[mode].append(time.perf_counter() - start)
    return times


def main(argv: list[str]) -> None:
    """REQUESTS ITERATIONS [PROMPT_TOKENS] (no argparse outside cli.py)."""
    if len(argv) not in (2, 3) or not all(a.isdigit() and int(a) > 0 for a in argv):
        raise SystemExit("usage: python -m dspark.bench.taps REQUESTS ITERATIONS [PROMPT_TOKENS] "
                         "(integers > 0; e.g. 32 60 400)")
    from dspark.draft.checkpoint import read_config
    from dspark.draft.registry import shipped_default
    from dspark.models import load_target

    torch.set_num_threads(1)  # as the load benchmark
    loaded = load_target(None)
    folder = shipped_default("default")
    if folder is None:
        raise SystemExit("the default drafter is not installed: reinstall dspark (it ships in dspark/assets/drafters)")
    taps = tuple(read_config(folder)["target_layer_ids"])
    requests, iterations = int(argv[0]), int(argv[1])
    prompt = int(argv[2]) if len(argv) > 2 else 400
    times = time_taps(loaded.model, requests, iterations, prompt, taps)
    print(f"{requests} requests, {prompt}-token prompts, taps at layers {list(taps)}")
    for mode, seconds in times.items():
        print(f"  {mode}: median {1e3 * statistics.median(seconds):.1f} ms, mean {1e3 * statistics.mean(seconds):.1f} ms"
              f" over {len(seconds)} forwards")


if __name__ == "__main__":
    main(sys.argv[1:])

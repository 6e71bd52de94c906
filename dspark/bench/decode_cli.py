"""`dspark bench decode`: one run that measures, on the same machine and model,

1. the per-step time of the lean runtime against transformers (decode step and
   verifying 8 tokens, batch 1 and 16; see `dspark.bench.decode`);
2. plain greedy tokens/s of the engine (`--drafter none`) against
   transformers' `model.generate`, and whether their tokens agree;
3. the ngram drafter's speedup over plain decoding on a prompt that asks the
   model to repeat its input.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import torch

from dspark.bench.decode import format_table, run_decode_bench

CHAT_PROMPT = "Write a short story about a robot who learns to paint."
COPY_PROMPT = (
    "Repeat the following paragraph exactly, word for word:\n\n"
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts several tokens "
    "cheaply and lets the large model check them all in one forward pass, so the output is "
    "exactly what the large model would have written, only sooner."
)


def _engine_generate(loaded, drafter_name: str, prompt: str, max_new_tokens: int):
    from dspark.draft.registry import load_drafter
    from dspark.engine.engine import Engine, EngineConfig
    from dspark.engine.generate import generate
    from dspark.engine.policy import build_policy
    from dspark.models.chat import encode_prompt
    from dspark.types import SamplingParams

    drafter = load_drafter(drafter_name, loaded.model)
    policy = build_policy("fixed", block_size=drafter.block_size)
    engine = Engine(loaded.model, drafter, policy, EngineConfig(max_running=1), tokenizer=loaded.tokenizer)
    ids = encode_prompt(loaded.tokenizer, prompt, chat=True)
    return generate(engine, ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)), ids


def _hf_generate(folder, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    inputs = torch.tensor([prompt_ids])
    with torch.no_grad():
        model.generate(inputs, max_new_tokens=4, do_sample=False)  # warm-up
        start = time.perf_counter()
        out = model.generate(
            inputs, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False
        )
        seconds = time.perf_counter() - start
    return out[0, len(prompt_ids) :].tolist(), seconds


def measure_generation(target: str | None, home: str | None, max_new_tokens: int, cpu_kernels: bool = True) -> dict:
    from dspark.models import load_target

    loaded = load_target(target, home=home, cpu_kernels=cpu_kernels)
    _engine_generate(loaded, "none", CHAT_PROMPT, 8)  # warm-up
    plain, prompt_ids = _engine_generate(loaded, "none", CHAT_PROMPT, max_new_tokens)
    hf_tokens, hf_seconds = _hf_generate(loaded.path, prompt_ids, max_new_tokens)
    copy_none, _ = _engine_generate(loaded, "none", COPY_PROMPT, max_new_tokens)
    copy_ngram, _ = _engine_generate(loaded, "ngram", COPY_PROMPT, max_new_tokens)
    return {
        "greedy_tokens_per_second": {
            "dspark_none": plain.tokens_per_second,
            "transformers_generate": len(hf_tokens) / hf_seconds,
            "same_tokens": plain.token_ids == hf_tokens,
        },
        "ngram_on_copy_prompt": {
            "none_tokens_per_second": copy_none.tokens_per_second,
            "ngram_tokens_per_second": copy_ngram.tokens_per_second,
            "speedup": copy_ngram.tokens_per_second / copy_none.tokens_per_second,
            "mean_accepted_length": copy_ngram.stats.mean_accepted_length,
            "same_tokens": copy_ngram.token_ids == copy_none.token_ids,
        },
    }


def report(steps: dict, gen: dict, command: str) -> str:
    g, c = gen["greedy_tokens_per_second"], gen["ngram_on_copy_prompt"]
    lines = [
        f"Command: `{command}`",
        f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, context {steps['context']} tokens, median of {steps['repeats']}.",
        "",
        "Per-step time of one target forward, ms (batch x new tokens per request):",
        "",
        format_table(steps),
        "",
        "| greedy generation, batch 1 | tokens/s |",
        "|---|---|",
        f"| dspark engine, `--drafter none` | {g['dspark_none']:.1f} |",
        f"| transformers `model.generate` | {g['transformers_generate']:.1f} |",
        f"| same tokens | {g['same_tokens']} |",
        "",
        "| prompt lookup on a prompt that repeats its input | value |",
        "|---|---|",
        f"| `--drafter none` tokens/s | {c['none_tokens_per_second']:.1f} |",
        f"| `--drafter ngram` tokens/s | {c['ngram_tokens_per_second']:.1f} |",
        f"| speedup | {c['speedup']:.2f}x |",
        f"| mean acceptance length tau | {c['mean_accepted_length']:.2f} |",
        f"| same tokens as `none` | {c['same_tokens']} |",
    ]
    return "\n".join(lines)


def run(args) -> dict:
    kernels = getattr(args, "cpu_kernels", True)
    steps = run_decode_bench(args.target, args.repeats, home=args.home, print_fn=None, cpu_kernels=kernels)
    gen = measure_generation(args.target, args.home, args.max_new_tokens, cpu_kernels=kernels)
    command = f"dspark bench decode --repeats {args.repeats} --max-new-tokens {args.max_new_tokens}"
    command += "" if kernels else " --no-cpu-kernel"
    text = report(steps, gen, command)
    print(text)
    if getattr(args, "out", None):
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        Path(args.out).with_suffix(".json").write_text(json.dumps({"steps": steps, "generation": gen}, indent=2))
    return {"steps": steps, "generation": gen}

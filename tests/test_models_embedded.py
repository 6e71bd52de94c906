"""The embedded SmolLM2-135M-Instruct through the lean runtime against transformers.

Slow: converts the GGUF once (15-60 s) if the dspark home has no cache yet; a
few seconds afterwards.
"""

from __future__ import annotations

import pytest
import torch

from dspark.models.loading import load_target
from dspark.types import RaggedBatch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm():
    return load_target(None)


@torch.no_grad()
def test_embedded_target_matches_transformers(smollm) -> None:
    from transformers import AutoModelForCausalLM

    assert smollm.config.num_hidden_layers == 30 and smollm.config.eos_token_ids == (2,)
    assert smollm.tokenizer.chat_template and "<|im_start|>" in smollm.tokenizer.chat_template
    hf = AutoModelForCausalLM.from_pretrained(str(smollm.path), dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "Write three sentences about the sea and why sailors love it."}]
    prompt = smollm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = smollm.tokenizer(prompt)["input_ids"]
    ids = (ids * 4)[:100]
    other = ids[:37]
    continuation = [279, 5125, 314, 260, 1235]
    full = ids + continuation
    ref = hf(torch.tensor([full])).logits[0]
    ref_other = hf(torch.tensor([other + continuation[:3]])).logits[0]

    model = smollm.model
    cache = model.new_cache(2, 160)
    a, b = cache.allocate(), cache.allocate()
    prefill = model(RaggedBatch(torch.tensor(ids), [a], [100]), cache)
    torch.testing.assert_close(prefill.logits, ref[:100], atol=2e-3, rtol=0)
    decode = model(RaggedBatch(torch.tensor(continuation[:1]), [a], [1]), cache)
    torch.testing.assert_close(decode.logits[0], ref[100], atol=2e-3, rtol=0)
    model(RaggedBatch(torch.tensor(other), [b], [len(other)]), cache)
    # a ragged verify-like step: request a checks 4 tokens, request b 3 tokens, one forward
    step = model(RaggedBatch(torch.tensor(continuation[1:] + continuation[:3]), [a, b], [4, 3]), cache)
    torch.testing.assert_close(step.logits[:4], ref[101:105], atol=2e-3, rtol=0)
    torch.testing.assert_close(step.logits[4:], ref_other[len(other) :], atol=2e-3, rtol=0)
    assert torch.equal(step.logits[:4].argmax(-1), ref[101:105].argmax(-1))


def test_embedded_target_is_served_from_its_gguf_blocks(smollm) -> None:
    """The GGUF stores Q4_1 layers and a Q8_0 embedding (the tied LM head): the float32 copy
    holds exactly those values, so the CPU kernel serves them from 4- and 8-bit records (the
    parity test above then runs on them for its decode and verification steps)."""
    from dspark.models.cpu_kernels import cpu_kernels_available, has_cpu_kernels, target_linears

    if not cpu_kernels_available():
        pytest.skip("the CPU kernel is unavailable here")
    assert has_cpu_kernels(smollm.model)
    assert {m.cpu_kernel.format for m in target_linears(smollm.model)} == {"q4"}
    assert smollm.model.head_kernel.format == "q8"

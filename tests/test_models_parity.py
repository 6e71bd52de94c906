"""The lean target runtime against Hugging Face transformers on tiny random models:
prefill, decode, mixed ragged batches, rollback and hidden-state taps."""

from __future__ import annotations

import pytest
import torch
import transformers

from dspark.models.tiny import tiny_config, tiny_state_dict, tiny_target
from dspark.types import RaggedBatch

ATOL = 2e-4  # float32, logits of std ~4


def hf_reference(family: str, seed: int = 0, **kw) -> torch.nn.Module:
    config = tiny_config(family=family, **kw)
    hf_cls = transformers.LlamaConfig if family == "llama" else transformers.Qwen3Config
    hf = transformers.AutoModelForCausalLM.from_config(hf_cls(**config.to_hf()), attn_implementation="eager")
    hf.load_state_dict(tiny_state_dict(config, seed), strict=not config.tie_word_embeddings)
    return hf.eval()


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0]  # [len, V]


def random_tokens(n: int, seed: int, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def forward(model, cache, requests: list[tuple[int, list[int]]], **kw):
    """One ragged forward over (slot, new tokens) pairs."""
    tokens = torch.tensor([t for _, new in requests for t in new])
    batch = RaggedBatch(tokens, [s for s, _ in requests], [len(new) for _, new in requests])
    return model(batch, cache, **kw)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("tied", [True, False])
def test_prefill_and_decode_match_hf(family: str, tied: bool) -> None:
    model = tiny_target(3, family=family, tie_word_embeddings=tied)
    hf = hf_reference(family, 3, tie_word_embeddings=tied)
    tokens = random_tokens(24, seed=1)
    cache = model.new_cache(2, 64)
    slot = cache.allocate()
    out = forward(model, cache, [(slot, tokens[:20])])
    ref = hf_logits(hf, tokens)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (20, 96)
    torch.testing.assert_close(out.logits, ref[:20], atol=ATOL, rtol=0)
    for i in range(20, 24):  # decode one token at a time
        step = forward(model, cache, [(slot, [tokens[i]])])
        torch.testing.assert_close(step.logits[0], ref[i], atol=ATOL, rtol=0)
    assert cache.length(slot) == 24


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_mixed_ragged_batch_matches_hf(family: str) -> None:
    """Four requests with different cached lengths and query lengths (1, 5, 9, 2) in one forward."""
    model, hf = tiny_target(0, family=family), hf_reference(family, 0)
    cache = model.new_cache(6, 80)
    prefixes = [random_tokens(n, seed=10 + n) for n in (7, 30, 1, 15)]
    news = [random_tokens(q, seed=50 + q) for q in (1, 5, 9, 2)]
    slots = [cache.allocate() for _ in prefixes]
    for slot, prefix in zip(slots, prefixes):
        forward(model, cache, [(slot, prefix)])
    out = forward(model, cache, list(zip(slots, news)))
    offset = 0
    for prefix, new in zip(prefixes, news):
        ref = hf_logits(hf, prefix + new)[len(prefix) :]
        torch.testing.assert_close(out.logits[offset : offset + len(new)], ref, atol=ATOL, rtol=0)
        offset += len(new)
    assert [cache.length(s) for s in slots] == [len(p) + len(n) for p, n in zip(prefixes, news)]


def _ragged_vs_sequential(slot_choice: list[int], qlens=(3, 1, 8, 2), prefix_lens=(12, 4, 25, 9)) -> None:
    model = tiny_target(1)
    batched, single = model.new_cache(40, 64), model.new_cache(40, 64)
    for cache in (batched, single):
        for _ in range(40):
            cache.allocate()
    requests = [(s, random_tokens(p, seed=s)) for s, p in zip(slot_choice, prefix_lens)]
    new = [(s, random_tokens(q, seed=100 + s)) for s, q in zip(slot_choice, qlens)]
    forward(model, batched, requests)  # prefill together
    together = forward(model, batched, new, tap_layers=(0, 1), want_last_hidden=True)
    alone_logits, alone_taps, alone_last = [], [], []
    for req, nxt in zip(requests, new):
        forward(model, single, [req])
        out = forward(model, single, [nxt], tap_layers=(0, 1), want_last_hidden=True)
        alone_logits.append(out.logits), alone_taps.append(out.tapped_hidden), alone_last.append(out.last_hidden)
    torch.testing.assert_close(together.logits, torch.cat(alone_logits), atol=1e-5, rtol=0)
    torch.testing.assert_close(together.tapped_hidden, torch.cat(alone_taps), atol=1e-5, rtol=0)
    torch.testing.assert_close(together.last_hidden, torch.cat(alone_last), atol=1e-5, rtol=0)


def test_ragged_batch_equals_one_request_at_a_time_compact_slots() -> None:
    _ragged_vs_sequential([5, 3, 4, 7])  # a compact span read as a cache view (slot 6 is idle in it)


def test_ragged_batch_equals_one_request_at_a_time_scattered_slots() -> None:
    _ragged_vs_sequential([38, 0, 21, 9])  # a wide span: the slots are gathered instead


def test_attention_parts_group_requests_by_query_length() -> None:
    from dspark.models.llama import query_parts

    assert query_parts([1, 1, 1]) == [[0, 1, 2]]
    assert query_parts([1, 3, 1, 4, 1, 8, 9, 2, 100]) == [[0, 2, 4], [1, 3], [5], [6], [7], [8]]


def test_cpu_attention_parts_split_requests_of_unequal_context() -> None:
    from dspark.models.llama import PART_OVERHEAD_POSITIONS, attention_groups, split_by_context

    # eight decoding requests: four long ones in slots 0-3, four short ones in slots 4-7
    starts, qlens, slots = [700, 710, 690, 705, 100, 90, 110, 95], [1] * 8, list(range(8))
    assert split_by_context(list(range(8)), starts, qlens, slots) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # the same contexts interleaved over the slots: each half's span would cover the whole cache
    # (read as a view, 8 slots) or be gathered (copied), so the short ones pay for a call each
    # only if that is cheaper; either way no part reads the short ones up to 711 positions
    mixed = [700, 100, 710, 90, 690, 110, 705, 95]
    parts = split_by_context(list(range(8)), mixed, qlens, slots)
    assert sorted(i for part in parts for i in part) == list(range(8))
    assert not any({0, 1} <= set(part) for part in parts)
    # close contexts in adjacent slots stay one call; a lone request is its own part
    assert split_by_context([0, 1, 2], [500, 505, 498], [1, 1, 1], [3, 4, 5]) == [[0, 1, 2]]
    assert split_by_context([4], starts, qlens, slots) == [[4]]
    # the cost it minimises: positions read plus an overhead a call, against one padded call
    one_call = 8 * 711
    two_calls = 4 * 711 + 4 * 111 + 2 * PART_OVERHEAD_POSITIONS
    assert two_calls + PART_OVERHEAD_POSITIONS < one_call + PART_OVERHEAD_POSITIONS
    assert attention_groups(qlens, starts, slots, 3, "cpu") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert attention_groups(qlens, starts, slots, 3, "cuda") == [list(range(8))]


def test_parts_split_by_context_equal_one_request_at_a_time(monkeypatch) -> None:
    """With calls priced at nothing the CPU splits decoding requests of unequal context into parts
    of their own, whose rows interleave with the verifications' and a prefill chunk's."""
    from dspark.models import llama

    monkeypatch.setattr(llama, "PART_OVERHEAD_POSITIONS", 0)
    qlens, prefix_lens = (1, 3, 1, 1, 4, 1, 12), (40, 4, 3, 25, 9, 30, 2)
    starts = list(prefix_lens)
    assert len(llama.attention_groups(list(qlens), starts, [5, 3, 4, 7, 8, 6, 9], 3, "cpu")) >= 5
    _ragged_vs_sequential([5, 3, 4, 7, 8, 6, 9], qlens=qlens, prefix_lens=prefix_lens)
    _ragged_vs_sequential([38, 0, 21, 9, 17, 30, 2], qlens=qlens, prefix_lens=prefix_lens)


def test_a_gpu_attends_in_one_call_while_the_padding_is_small() -> None:
    from dspark.models.llama import ONE_CALL_ELEMENTS, attention_groups

    qlens, starts, slots = [1, 8, 1, 3], [100, 90, 120, 50], [0, 1, 2, 3]
    # the CPU splits by query length, then by context: requests 0 and 2 would read slot 1 too
    assert attention_groups(qlens, starts, slots, 3, "cpu") == [[0], [1], [2], [3]]
    assert attention_groups(qlens, starts, slots, 3, "cuda") == [[0, 1, 2, 3]]
    # a 512-token prefill chunk beside 63 decoding requests at 2k context would pad them all to 512
    qlens, starts, slots = [1] * 63 + [512], [2000] * 63 + [1536], list(range(64))
    assert 64 * 3 * 512 * 2048 > ONE_CALL_ELEMENTS
    assert attention_groups(qlens, starts, slots, 3, "cuda") == [list(range(63)), [63]]


def test_the_gpu_layout_equals_one_request_at_a_time(monkeypatch) -> None:
    """What a GPU runs (one padded call for decodes, verifications and a short prefill chunk),
    checked on the CPU by giving the CPU the GPU's choice."""
    from dspark.models import llama

    chosen = llama.attention_groups
    monkeypatch.setattr(llama, "attention_groups", lambda q, st, sl, h, _device: chosen(q, st, sl, h, "cuda"))
    _ragged_vs_sequential([5, 3, 4, 7, 8, 6], qlens=(1, 3, 1, 4, 1, 12), prefix_lens=(12, 4, 25, 9, 30, 2))
    _ragged_vs_sequential([38, 0, 21, 9, 17, 30], qlens=(1, 3, 1, 4, 1, 12), prefix_lens=(12, 4, 25, 9, 30, 2))


def test_decodes_beside_verifications_equal_one_request_at_a_time() -> None:
    """Decoding requests, two verifying requests (one part, not adjacent in the batch) and a
    prefill chunk: three attention parts whose rows interleave in the batch."""
    _ragged_vs_sequential([5, 3, 4, 7, 8, 6], qlens=(1, 3, 1, 4, 1, 12), prefix_lens=(12, 4, 25, 9, 30, 2))
    _ragged_vs_sequential([38, 0, 21, 9, 17, 30], qlens=(1, 3, 1, 4, 1, 12), prefix_lens=(12, 4, 25, 9, 30, 2))


def test_rollback_equals_never_forwarding_rejected_tokens() -> None:
    model = tiny_target(2)
    tokens = random_tokens(30, seed=4)
    cache = model.new_cache(2, 64)
    a, b = cache.allocate(), cache.allocate()
    forward(model, cache, [(a, tokens[:20]), (b, tokens[:10])])
    forward(model, cache, [(a, random_tokens(6, seed=9)), (b, random_tokens(3, seed=8))])  # drafts, all rejected
    cache.truncate(a, 20)
    cache.truncate(b, 10)
    after_rollback = forward(model, cache, [(a, tokens[20:25]), (b, tokens[10:12])])
    clean = model.new_cache(2, 64)
    a2, b2 = clean.allocate(), clean.allocate()
    forward(model, clean, [(a2, tokens[:20]), (b2, tokens[:10])])
    reference = forward(model, clean, [(a2, tokens[20:25]), (b2, tokens[10:12])])
    torch.testing.assert_close(after_rollback.logits, reference.logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_taps_and_last_hidden_match_hf_hidden_states(family: str) -> None:
    model = tiny_target(5, family=family, num_layers=3)
    hf = hf_reference(family, 5, num_layers=3)
    tokens = random_tokens(12, seed=3)
    cache = model.new_cache(1, 32)
    slot = cache.allocate()
    forward(model, cache, [(slot, tokens[:8])])
    out = forward(model, cache, [(slot, tokens[8:])], tap_layers=(1, 0), want_last_hidden=True, logits_rows=torch.tensor([3, 0]))
    with torch.no_grad():
        ref = hf(torch.tensor([tokens]), output_hidden_states=True)
    assert out.tapped_hidden.shape == (4, 2, 64)
    torch.testing.assert_close(out.tapped_hidden[:, 0], ref.hidden_states[2][0, 8:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.tapped_hidden[:, 1], ref.hidden_states[1][0, 8:], atol=1e-5, rtol=0)
    # HF's last hidden state is the final-normed one, i.e. our last_hidden
    torch.testing.assert_close(out.last_hidden, ref.hidden_states[3][0, 8:], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.logits, ref.logits[0, [11, 8]], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.compute_logits(out.last_hidden[[3]]), out.logits[:1], atol=1e-5, rtol=0)


def test_bfloat16_runtime_is_self_consistent_and_close_to_float32() -> None:
    """Same runtime and dtype: greedy parity tests compare like with like; bf16 stays close to fp32."""
    model32 = tiny_target(0)
    model16 = tiny_target(0).to(torch.bfloat16)
    tokens = random_tokens(16, seed=2)
    outs = []
    for model in (model32, model16):
        cache = model.new_cache(1, 32)
        slot = cache.allocate()
        outs.append(forward(model, cache, [(slot, tokens)]).logits)
    assert outs[1].dtype == torch.float32
    assert (outs[0] - outs[1]).abs().max() < 0.25
    assert (outs[0].argmax(-1) == outs[1].argmax(-1)).float().mean() > 0.8


def test_state_dict_uses_hf_names_and_round_trips() -> None:
    model = tiny_target(0, family="qwen3")
    state = model.state_dict()
    assert "model.layers.0.self_attn.q_proj.weight" in state and "model.layers.1.mlp.up_proj.weight" in state
    assert "model.layers.0.self_attn.q_norm.weight" in state
    assert not any("qkv_proj" in k or "gate_up" in k for k in state)
    clone = tiny_target(7, family="qwen3")
    clone.load_state_dict(state)
    for name, value in clone.state_dict().items():
        torch.testing.assert_close(value, state[name], atol=0, rtol=0)
    assert model.lm_head_weight is model.embed_tokens.weight


def test_out_of_range_tap_is_refused_before_touching_the_cache() -> None:
    model = tiny_target(0)
    cache = model.new_cache(1, 8)
    slot = cache.allocate()
    with pytest.raises(ValueError, match=r"tap_layers \[2\] out of range"):
        forward(model, cache, [(slot, [1, 2])], tap_layers=(0, 2))
    assert cache.length(slot) == 0

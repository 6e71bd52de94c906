"""KV-cache slot bookkeeping, rollback and limits."""

from __future__ import annotations

import pytest
import torch

from dspark.models.kv_cache import KVCache
from dspark.models.tiny import tiny_config, tiny_target
from dspark.types import RaggedBatch


def test_slots_allocate_lowest_first_and_reuse() -> None:
    cache = KVCache(tiny_config(), max_slots=3, max_seq_len=16)
    assert [cache.allocate() for _ in range(3)] == [0, 1, 2]
    assert cache.num_free_slots == 0
    with pytest.raises(RuntimeError, match="no free slot"):
        cache.allocate()
    cache.free(1)
    assert cache.num_free_slots == 1 and cache.allocate() == 1
    with pytest.raises(ValueError, match="not allocated"):
        cache.length(7)


def test_lengths_truncate_and_token_budget() -> None:
    model = tiny_target(0)
    cache = model.new_cache(4, 32)
    a, b = cache.allocate(), cache.allocate()
    model(RaggedBatch(torch.arange(10), [a, b], [7, 3]), cache)
    assert (cache.length(a), cache.length(b), cache.tokens_in_use()) == (7, 3, 10)
    cache.truncate(a, 4)
    assert cache.length(a) == 4 and cache.tokens_in_use() == 7
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(a, 5)
    cache.free(a)
    assert cache.tokens_in_use() == 3
    # 2 layers * (keys + values) * 2 kv heads * head dim 16 * 4 bytes
    assert cache.bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert model.to(torch.bfloat16).new_cache(1, 8).bytes_per_token == cache.bytes_per_token // 2


def test_truncate_is_o1_no_copy() -> None:
    model = tiny_target(0)
    cache = model.new_cache(1, 32)
    slot = cache.allocate()
    model(RaggedBatch(torch.arange(12), [slot], [12]), cache)
    before = cache.keys[0][slot, :, :12].clone()
    pointer = cache.keys[0].data_ptr()
    cache.truncate(slot, 5)
    assert cache.keys[0].data_ptr() == pointer
    torch.testing.assert_close(cache.keys[0][slot, :, :12], before, atol=0, rtol=0)


def test_writing_past_max_seq_len_is_refused_without_side_effects() -> None:
    model = tiny_target(0)
    cache = model.new_cache(2, 8)
    slot = cache.allocate()
    model(RaggedBatch(torch.arange(6), [slot], [6]), cache)
    with pytest.raises(ValueError, match="past max_seq_len=8"):
        model(RaggedBatch(torch.arange(3), [slot], [3]), cache)
    assert cache.length(slot) == 6


def test_batch_naming_a_slot_twice_or_a_free_slot_is_refused() -> None:
    model = tiny_target(0)
    cache = model.new_cache(3, 8)
    slot = cache.allocate()
    with pytest.raises(ValueError, match="same cache slot twice"):
        model(RaggedBatch(torch.arange(2), [slot, slot], [1, 1]), cache)
    with pytest.raises(ValueError, match="not allocated"):
        model(RaggedBatch(torch.arange(2), [slot, 2], [1, 1]), cache)


def test_copy_slot_continues_like_the_source() -> None:
    model = tiny_target(0)
    cache = model.new_cache(3, 32)
    a, b = cache.allocate(), cache.allocate()
    model(RaggedBatch(torch.arange(9), [a], [9]), cache)
    cache.copy_slot(a, b)
    assert cache.length(b) == 9
    out = model(RaggedBatch(torch.tensor([4, 5, 4, 5]), [a, b], [2, 2]), cache)
    torch.testing.assert_close(out.logits[:2], out.logits[2:], atol=1e-6, rtol=0)


def test_garbage_in_unwritten_cache_memory_never_reaches_outputs():
    """KV buffers start as uninitialised memory; a ragged forward reads each
    slot up to the longest request. NaN there must not leak through the mask
    (0 * NaN = NaN): the cache zeroes never-written positions before reading."""
    import torch

    from dspark.models.tiny import tiny_target
    from dspark.types import RaggedBatch

    target = tiny_target(seed=5)
    clean = target.new_cache(2, 32)
    dirty = target.new_cache(2, 32)
    for buf in (*dirty.keys, *dirty.values):
        buf.fill_(float("nan"))
    outs = []
    for cache in (clean, dirty):
        slots = [cache.allocate(), cache.allocate()]
        for buf in (*clean.keys, *clean.values):
            if cache is clean:
                buf.zero_()
        batch = RaggedBatch(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9]), slots, [2, 7])
        first = target.forward(batch, cache).logits
        step = target.forward(RaggedBatch(torch.tensor([10, 11]), slots, [1, 1]), cache).logits
        outs.append(torch.cat([first, step]))
    assert torch.isfinite(outs[1]).all()
    torch.testing.assert_close(outs[1], outs[0])

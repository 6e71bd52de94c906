"""Per-request KV cache with O(1) rollback.

Each request owns a *slot*: a preallocated region of `max_seq_len` positions in
every layer's key and value buffers. Appending new tokens writes into the slot
in place; rolling back rejected draft tokens only moves the slot's length (the
stale entries are overwritten by the next append and never read, because
attention only looks at positions below the length).

Layout of one layer's buffer: [max_slots, kv_heads, max_seq_len, head_dim]
(head-major), so a request's keys `[kv_heads, length, head_dim]` are a strided
view that attention reads without copying.
"""

from __future__ import annotations

import torch

from dspark.models.config import TargetConfig


ZERO_CHUNK = 256  # positions zeroed at a time when a slot's readable region grows


class KVCache:
    """Key/value buffers for up to `max_slots` requests of `max_seq_len` tokens.

    Buffers are allocated with `torch.empty`, so memory pages are only touched
    (and resident) once tokens are written into them.
    """

    def __init__(
        self,
        config: TargetConfig,
        max_slots: int,
        max_seq_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_slots < 1 or max_seq_len < 1:
            raise ValueError(f"KVCache needs max_slots >= 1 and max_seq_len >= 1, got {max_slots}, {max_seq_len}")
        self.config = config
        self.max_slots = max_slots
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (max_slots, config.num_key_value_heads, max_seq_len, config.head_dim)
        with torch.inference_mode(False):
            # keys[layer], values[layer]: [max_slots, kv_heads, max_seq_len, head_dim]
            self.keys = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(config.num_hidden_layers)]
            self.values = [torch.empty(shape, dtype=dtype, device=self.device) for _ in range(config.num_hidden_layers)]
        self._lengths = [0] * max_slots
        # positions [0, _readable[slot]) of a slot hold finite values (written or zeroed):
        # attention reads a batch's slots up to the longest request, and masked
        # garbage (NaN in reused memory) would still poison softmax (0 * NaN = NaN)
        self._readable = [0] * max_slots
        self._in_use = [False] * max_slots
        self._free = list(range(max_slots - 1, -1, -1))  # stack; pops the lowest slot first

    # ---- slot bookkeeping -------------------------------------------------
    def allocate(self) -> int:
        """Claim a free slot (length 0) and return its index."""
        if not self._free:
            raise RuntimeError(f"KVCache has no free slot (all {self.max_slots} in use); free one first")
        slot = self._free.pop()
        self._in_use[slot] = True
        self._lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Release a slot so a later `allocate()` can reuse it."""
        self._check_slot(slot)
        self._in_use[slot] = False
        self._lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def length(self, slot: int) -> int:
        """Tokens cached for the request in `slot`."""
        self._check_slot(slot)
        return self._lengths[slot]

    def truncate(self, slot: int, new_length: int) -> None:
        """Drop cached tokens past `new_length` (rollback of rejected drafts); O(1)."""
        self._check_slot(slot)
        if not 0 <= new_length <= self._lengths[slot]:
            raise ValueError(
                f"cannot truncate slot {slot} of length {self._lengths[slot]} to {new_length}"
            )
        self._lengths[slot] = new_length

    def copy_slot(self, src: int, dst: int) -> None:
        """Make slot `dst` hold a copy of slot `src`'s cached tokens (a shared prompt)."""
        self._check_slot(src)
        self._check_slot(dst)
        n = self._lengths[src]
        for buffers in (self.keys, self.values):
            for layer in buffers:
                layer[dst, :, :n] = layer[src, :, :n]
        self._lengths[dst] = n
        self._readable[dst] = max(self._readable[dst], n)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def tokens_in_use(self) -> int:
        """Cached tokens over all slots (for a token memory budget)."""
        return sum(self._lengths)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached token takes over all layers (keys and values)."""
        c = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * elem

    def _check_slot(self, slot: int) -> None:
        if not (0 <= slot < self.max_slots) or not self._in_use[slot]:
            raise ValueError(f"KV-cache slot {slot} is not allocated")

    # ---- used by the model's forward ---------------------------------------
    def reserve(self, slots: list[int], query_lens: list[int]) -> list[int]:
        """Check that the new tokens fit; return each slot's current length.

        The lengths are advanced by `commit()` after the forward wrote the keys.
        """
        starts = []
        for slot, q in zip(slots, query_lens):
            self._check_slot(slot)
            start = self._lengths[slot]
            if start + q > self.max_seq_len:
                raise ValueError(
                    f"KV-cache slot {slot} would hold {start + q} tokens, past max_seq_len="
                    f"{self.max_seq_len}; stop the request or build the cache with a larger max_seq_len"
                )
            starts.append(start)
        if len(set(slots)) != len(slots):
            raise ValueError(f"a ragged batch names the same cache slot twice: {slots}")
        return starts

    def make_readable(self, slots: list[int], upto: int) -> None:
        """Zero never-written positions below `upto` of these slots, once per slot
        lifetime, before a forward reads them. Call before writing new keys."""
        for slot in slots:
            start = self._readable[slot]
            if start >= upto:
                continue
            # zero a whole chunk ahead, so decoding pays these 2 x layers small ops once
            # per ZERO_CHUNK tokens rather than at every step
            end = min(self.max_seq_len, -(-upto // ZERO_CHUNK) * ZERO_CHUNK)
            for buf in (*self.keys, *self.values):
                buf[slot, :, start:end].zero_()
            self._readable[slot] = end

    def commit(self, slots: list[int], query_lens: list[int]) -> None:
        """Advance each slot's length by its query length (after a forward)."""
        for slot, q in zip(slots, query_lens):
            self._lengths[slot] += q

    def write(self, layer: int, flat_index: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write new keys/values [N * kv_heads, head_dim] at flat positions `flat_index` [N * kv_heads].

        The flat index of (slot, head, position) is (slot * kv_heads + head) * max_seq_len + position.
        """
        hd = self.config.head_dim
        self.keys[layer].view(-1, hd).index_copy_(0, flat_index, keys)
        self.values[layer].view(-1, hd).index_copy_(0, flat_index, values)

    def flat_index(self, slots: list[int], starts: list[int], query_lens: list[int]) -> torch.Tensor:
        """Flat write positions [N * kv_heads] for the new tokens, ordered (token, head), on the
        CPU (the forward moves its plan to the cache's device in one go)."""
        kv_heads, s = self.config.num_key_value_heads, self.max_seq_len
        parts = []
        heads = torch.arange(kv_heads) * s
        for slot, start, q in zip(slots, starts, query_lens):
            pos = torch.arange(start, start + q) + slot * kv_heads * s
            parts.append((pos[:, None] + heads[None, :]).reshape(-1))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

"""Target features for drafter training: the frozen target's tapped hidden
states over each training sequence, and its next-token distribution at the
sampled block positions.

Online (the default): run the target (eval mode, no grad) on the batch as one
ragged forward per chunk. The LM head is applied only at the block positions,
from the final-normed last hidden state (paper 5.1: communicate hidden
states, project locally), never over the whole sequence.

Cached (optional, bounded): precompute per sequence the tapped hidden states
and the last hidden state in float16 into safetensors shards once; training
then reads them instead of running the target (the LM head is still applied
at the block positions). The cache states its size before writing and refuses
to exceed a cap.

Shapes: B sequences, S padded length, T tapped layers, D hidden size,
A anchors, G block size, V vocabulary, N tokens of a ragged forward.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark.errors import UserError
from dspark.train.anchors import AnchorBatch
from dspark.types import RaggedBatch

MAX_TOKENS_PER_FORWARD = 8192  # tokens of one ragged target forward (bounds attention memory)


@dataclass
class TargetFeatures:
    tapped_hidden: torch.Tensor  # [B, S, T, D] target hidden states (zeros past each length)
    target_logits: torch.Tensor  # [B, A, G, V] float32, target logits predicting each block label


def _chunks(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices so each group has at most max_tokens tokens (or one sequence)."""
    groups, current, total = [], [], 0
    for i, n in enumerate(lengths):
        if current and total + n > max_tokens:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        groups.append(current)
    return groups


class CachePool:
    """One KV cache reused across target forwards, zero-filled when (re)allocated.

    The zero fill matters: attention over a ragged batch reads cache entries
    past a shorter request's length (masked out), and 0 * NaN from
    uninitialised memory would poison its output. Entries written later are
    real keys/values, always finite."""

    def __init__(self, model) -> None:
        self.model = model
        self.cache = None

    def get(self, slots: int, length: int):
        c = self.cache
        if c is None or c.max_slots < slots or c.max_seq_len < length:
            old_slots, old_len = (c.max_slots, c.max_seq_len) if c is not None else (0, 0)
            self.cache = None  # free the old buffers first
            c = self.model.new_cache(max(slots, old_slots), max(length, old_len))
            for buf in c.keys + c.values:
                buf.zero_()
            self.cache = c
        return c


@torch.no_grad()
def run_target(model, sequences: list[torch.Tensor], tap_layers: tuple[int, ...], pool: CachePool | None = None,
               max_tokens: int = MAX_TOKENS_PER_FORWARD):
    """Tapped hidden [n_i, T, D] and last hidden [n_i, D] of each sequence [n_i]."""
    pool = pool or CachePool(model)
    lengths = [int(s.numel()) for s in sequences]
    tapped_out, last_out = [None] * len(sequences), [None] * len(sequences)
    device = model.embed_tokens.weight.device
    for group in _chunks(lengths, max_tokens):
        cache = pool.get(len(group), max(lengths[i] for i in group))
        slots = [cache.allocate() for _ in group]
        batch = RaggedBatch(
            token_ids=torch.cat([sequences[i] for i in group]).to(device),
            slots=slots,
            query_lens=[lengths[i] for i in group],
        )
        try:
            # one logits row (the cheapest the forward allows); block positions are projected in assemble()
            out = model.forward(batch, cache, logits_rows=torch.zeros(1, dtype=torch.int64, device=device),
                                tap_layers=tap_layers, want_last_hidden=True)
        finally:
            for slot in slots:
                cache.free(slot)
        for i, tapped, last in zip(group, out.tapped_hidden.split(batch.query_lens), out.last_hidden.split(batch.query_lens)):
            tapped_out[i], last_out[i] = tapped, last
    return tapped_out, last_out


@torch.no_grad()
def assemble(model, batch: AnchorBatch, tapped: list[torch.Tensor], last: list[torch.Tensor]) -> TargetFeatures:
    """Pad per-sequence hidden states into [B, S, T, D]; LM head at block positions."""
    b, s = batch.token_ids.shape
    t, d = tapped[0].shape[1:]
    dtype = model.embed_tokens.weight.dtype
    hidden = torch.zeros(b, s, t, d, dtype=dtype, device=tapped[0].device)
    for i, h in enumerate(tapped):
        hidden[i, : h.shape[0]] = h.to(dtype)
    batch_index, positions = batch.target_rows()  # [B, A, G] each
    lengths = torch.tensor([x.shape[0] for x in last], device=positions.device)
    positions = torch.minimum(positions, lengths[batch_index] - 1)  # past the end: masked by `valid`
    starts = torch.cumsum(torch.cat([lengths.new_zeros(1), lengths[:-1]]), 0)
    rows = (starts[batch_index] + positions).flatten()
    last_all = torch.cat(last)
    logits = model.compute_logits(last_all.index_select(0, rows.to(last_all.device)).to(dtype))
    return TargetFeatures(tapped_hidden=hidden, target_logits=logits.view(*positions.shape, -1))


class OnlineFeatures:
    """Runs the frozen target on every training batch."""

    def __init__(self, model, tap_layers: tuple[int, ...], max_tokens: int = MAX_TOKENS_PER_FORWARD) -> None:
        self.model = model
        self.tap_layers = tuple(tap_layers)
        self.max_tokens = max_tokens
        self.pool = CachePool(model)

    def __call__(self, batch: AnchorBatch, indices: list[int]) -> TargetFeatures:
        seqs = [batch.token_ids[i, : int(n)] for i, n in enumerate(batch.lengths)]
        tapped, last = run_target(self.model, seqs, self.tap_layers, self.pool, self.max_tokens)
        return assemble(self.model, batch, tapped, last)


# ------------------------------------------------------------------ offline cache
CACHE_META = "cache_meta.json"


def cache_bytes(num_tokens: int, num_taps: int, hidden_size: int) -> int:
    """float16 bytes of tapped (T x D) plus last (D) hidden states per token."""
    return num_tokens * (num_taps + 1) * hidden_size * 2


def build_feature_cache(
    model, store, indices: list[int], tap_layers: tuple[int, ...], folder: Path, *, max_seq_len: int,
    max_gb: float, target_name: str, seqs_per_shard: int = 64, progress: bool = True,
) -> Path:
    """Write the feature cache of sequences `indices` (resumable by shard)."""
    folder = Path(folder)
    meta = {"tap_layers": list(tap_layers), "max_seq_len": max_seq_len, "target": target_name,
            "num_sequences": len(indices), "seqs_per_shard": seqs_per_shard}
    lengths = [min(int(store.offsets[i + 1] - store.offsets[i]), max_seq_len) for i in indices]
    size = cache_bytes(sum(lengths), len(tap_layers), model.config.hidden_size)
    print(f"dspark train: feature cache of {len(indices)} sequences, {sum(lengths)} tokens: {size / 1e9:.2f} GB in {folder}")
    if size > max_gb * 1e9:
        raise UserError(
            f"the feature cache would take {size / 1e9:.2f} GB, over the cap of {max_gb} GB; "
            "raise [features] cache_max_gb, cut [data] max_seq_len, or use mode = \"online\""
        )
    folder.mkdir(parents=True, exist_ok=True)
    old = folder / CACHE_META
    if old.is_file() and json.loads(old.read_text()) != meta:
        raise UserError(f"feature cache {folder} was built with other settings; delete it or set [features] cache_dir")
    old.write_text(json.dumps(meta, indent=2))
    from tqdm import tqdm

    pool = CachePool(model)
    for shard, start in enumerate(tqdm(range(0, len(indices), seqs_per_shard), desc="feature cache", disable=not progress)):
        path = folder / f"features-{shard:05d}.safetensors"
        if path.is_file():
            continue
        chunk = indices[start : start + seqs_per_shard]
        seqs = [store.get(i, max_seq_len)[0] for i in chunk]
        tapped, last = run_target(model, seqs, tap_layers, pool)
        offsets = torch.tensor([0] + [int(x.shape[0]) for x in last]).cumsum(0)
        tensors = {"tapped": torch.cat(tapped).half().cpu(), "last": torch.cat(last).half().cpu(), "offsets": offsets}
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={"indices": json.dumps(chunk)})
        os.replace(tmp, path)
    return folder


class CachedFeatures:
    """Reads a feature cache built by `build_feature_cache`."""

    def __init__(self, model, folder: Path, tap_layers: tuple[int, ...]) -> None:
        self.model = model
        folder = Path(folder)
        meta_path = folder / CACHE_META
        if not meta_path.is_file():
            raise UserError(f"no feature cache in {folder}; build it first (or use [features] mode = \"online\")")
        stored = json.loads(meta_path.read_text())["tap_layers"]
        missing = sorted(set(tap_layers) - set(stored))
        if missing:
            raise UserError(f"feature cache {folder} stores layers {stored}, not the drafter's {missing}; "
                            "delete it and rebuild, or add the layers to [features] cache_tap_layers")
        # the drafter's layers, in its order, picked out of the stored ones
        self.select = None if list(tap_layers) == stored else torch.tensor([stored.index(t) for t in tap_layers])
        self.where: dict[int, tuple[Path, int, int]] = {}
        for path in sorted(folder.glob("features-*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                chunk = json.loads(f.metadata()["indices"])
                offsets = f.get_tensor("offsets").tolist()
            for j, index in enumerate(chunk):
                self.where[index] = (path, offsets[j], offsets[j + 1])

    def _read(self, index: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index not in self.where:
            raise UserError(f"sequence {index} is missing from the feature cache; rebuild it")
        path, start, end = self.where[index]
        end = min(end, start + length)
        with safe_open(str(path), framework="pt") as f:
            tapped = f.get_slice("tapped")[start:end]
            return (tapped if self.select is None else tapped[:, self.select]), f.get_slice("last")[start:end]

    def __call__(self, batch: AnchorBatch, indices: list[int]) -> TargetFeatures:
        device = self.model.embed_tokens.weight.device
        pairs = [self._read(i, int(n)) for i, n in zip(indices, batch.lengths)]
        tapped = [t.to(device) for t, _ in pairs]
        last = [h.to(device) for _, h in pairs]
        return assemble(self.model, batch, tapped, last)

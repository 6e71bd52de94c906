"""Anchor sampling: cut G-token training blocks out of target sequences
(paper 3.3 and 5.1 "anchor-bounded sequence packing").

A block anchored at position p predicts tokens p+1 .. p+G. Block position k
(0-based here, k = 1..G in the paper) is supervised only while the predicted
tokens p+1 .. p+1+k are all inside the sequence and all inside the loss mask
(assistant tokens): a block never learns across a turn boundary or past the
end. Anchors are drawn among positions whose first predicted token is an
assistant token, without replacement.

Shapes: B sequences, S padded length, A anchors per sequence, G block size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass
class AnchorBatch:
    """A teacher-forced training batch for `TrainableDrafter.forward_train`."""

    token_ids: torch.Tensor  # [B, S] int64, padded with pad_id past each length
    lengths: torch.Tensor  # [B] int64, tokens the target must run per sequence
    anchors: torch.Tensor  # [B, A] int64, anchor positions p (p + G < S)
    labels: torch.Tensor  # [B, A, G] int64, token_ids[b, p + 1 + k] (pad_id where invalid)
    valid: torch.Tensor  # [B, A, G] bool, position k of the block is supervised

    @property
    def block_size(self) -> int:
        return int(self.labels.shape[-1])

    def target_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(batch index [B, A, G], position [B, A, G]) of the target hidden state
        that predicts each block label: position p + k predicts token p + 1 + k."""
        k = torch.arange(self.block_size)
        positions = self.anchors[:, :, None] + k  # [B, A, G]
        batch_index = torch.arange(self.anchors.shape[0])[:, None, None].expand_as(positions)
        return batch_index, positions.clamp(max=self.token_ids.shape[1] - 1)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A per-(run, epoch, sequence) seed, the same on any number of ranks."""
    digest = hashlib.sha256(f"{seed}/{epoch}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def sample_anchors(
    loss_mask: torch.Tensor,  # [S] bool
    num: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors [num] int64, real [num] bool). Fewer candidates than num are
    padded by repeating the first candidate with real = False."""
    candidates = torch.nonzero(loss_mask[1:], as_tuple=False).flatten()  # p with mask[p + 1]
    if candidates.numel() == 0:
        return torch.zeros(num, dtype=torch.int64), torch.zeros(num, dtype=torch.bool)
    order = torch.randperm(candidates.numel(), generator=generator)[:num]
    chosen = candidates[order].sort().values
    real = torch.ones(num, dtype=torch.bool)
    if chosen.numel() < num:
        real[chosen.numel():] = False
        chosen = torch.cat([chosen, chosen[:1].expand(num - chosen.numel())])
    return chosen, real


def block_validity(
    loss_mask: torch.Tensor,  # [S] bool
    anchors: torch.Tensor,  # [A] int64
    real: torch.Tensor,  # [A] bool
    block_size: int,
) -> torch.Tensor:
    """valid [A, G]: position k counts while p+1..p+1+k are in range and masked."""
    length = loss_mask.numel()
    targets = anchors[:, None] + 1 + torch.arange(block_size)  # [A, G]
    inside = targets < length
    masked = loss_mask[targets.clamp(max=length - 1)] & inside
    return torch.cumprod(masked.to(torch.int64), dim=1).bool() & real[:, None]


def make_batch(
    sequences: list[tuple[torch.Tensor, torch.Tensor]],  # B pairs (token_ids [S_b], loss_mask [S_b])
    seeds: list[int],  # B anchor-sampling seeds (see sample_seed)
    anchors_per_seq: int,
    block_size: int,
    pad_id: int = 0,
) -> AnchorBatch:
    """Sample anchors per sequence and pad everything into one batch."""
    per_seq = []
    for (tokens, mask), seed in zip(sequences, seeds):
        gen = torch.Generator().manual_seed(seed)
        anchors, real = sample_anchors(mask, anchors_per_seq, gen)
        valid = block_validity(mask, anchors, real, block_size)
        # the target must run through position p + G - 1 of the last anchor
        needed = min(int(tokens.numel()), int(anchors.max()) + block_size)
        per_seq.append((tokens, anchors, valid, needed))
    width = max(int(a.max()) + block_size + 1 for _, a, _, _ in per_seq)
    num = len(per_seq)
    token_ids = torch.full((num, width), pad_id, dtype=torch.int64)
    labels = torch.full((num, anchors_per_seq, block_size), pad_id, dtype=torch.int64)
    for b, (tokens, anchors, valid, _) in enumerate(per_seq):
        n = min(tokens.numel(), width)
        token_ids[b, :n] = tokens[:n]
        targets = anchors[:, None] + 1 + torch.arange(block_size)
        labels[b] = torch.where(valid, token_ids[b, targets.clamp(max=width - 1)], pad_id)
    return AnchorBatch(
        token_ids=token_ids,
        lengths=torch.tensor([n for *_, n in per_seq], dtype=torch.int64),
        anchors=torch.stack([a for _, a, _, _ in per_seq]),
        labels=labels,
        valid=torch.stack([v for _, _, v, _ in per_seq]),
    )

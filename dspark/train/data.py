"""Prepared training data on disk and in memory.

A data folder (written by `prepare`) holds `meta.json` and shards
`shard-NNNNN.safetensors`. A shard stores its sequences back to back:

    token_ids  [L] int32   all tokens of the shard's sequences, concatenated
    loss_mask  [L] uint8   1 on assistant tokens (the tokens a drafter learns)
    offsets    [n+1] int64 sequence i is token_ids[offsets[i]:offsets[i+1]]

and, in the safetensors metadata, the JSON lists `ids` and `domains`.
Shards are written to a temporary name and renamed, so a shard either exists
whole or not at all.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dspark.errors import UserError

SHARD_PREFIX = "shard-"
META_FILE = "meta.json"


@dataclass
class TrainRecord:
    """One training sequence: a chat prompt and the target's own answer(s)."""

    id: str
    domain: str
    token_ids: list[int]  # [S] prompt and answer tokens
    loss_mask: list[int]  # [S] 1 where the token is an assistant (generated) token


def shard_paths(folder: Path) -> list[Path]:
    return sorted(Path(folder).glob(f"{SHARD_PREFIX}*.safetensors"))


def write_shard(folder: Path, records: list[TrainRecord]) -> Path:
    """Write records as the next shard of `folder`, atomically."""
    if not records:
        raise ValueError("a shard needs at least one record")
    existing = shard_paths(folder)
    index = int(existing[-1].stem[len(SHARD_PREFIX):]) + 1 if existing else 0
    path = Path(folder) / f"{SHARD_PREFIX}{index:05d}.safetensors"
    lengths = [len(r.token_ids) for r in records]
    offsets = torch.zeros(len(records) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors = {
        "token_ids": torch.tensor([t for r in records for t in r.token_ids], dtype=torch.int32),
        "loss_mask": torch.tensor([m for r in records for m in r.loss_mask], dtype=torch.uint8),
        "offsets": offsets,
    }
    metadata = {"ids": json.dumps([r.id for r in records]), "domains": json.dumps([r.domain for r in records])}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


def read_shard(path: Path) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    """Tensors, ids and domains of one shard."""
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in ("token_ids", "loss_mask", "offsets")}
            meta = f.metadata() or {}
        ids, domains = json.loads(meta["ids"]), json.loads(meta["domains"])
    except Exception as exc:  # noqa: BLE001 - any unreadable shard is the same user problem
        raise UserError(f"data shard {path} is unreadable ({exc}); delete it and rerun prepare") from None
    if len(ids) + 1 != tensors["offsets"].numel():
        raise UserError(f"data shard {path} is inconsistent; delete it and rerun prepare")
    return tensors, ids, domains


def completed_ids(folder: Path) -> set[str]:
    """Ids already written to shards of `folder` (prepare resumes after them)."""
    done: set[str] = set()
    for path in shard_paths(folder):
        done.update(read_shard(path)[1])
    return done


def is_heldout(record_id: str, fraction: float) -> bool:
    """Stable split: a record is held out by a hash of its id, not by order."""
    digest = hashlib.sha256(record_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


class SequenceStore:
    """All sequences of a data folder in memory (token ids are small)."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        paths = shard_paths(folder)
        if not paths:
            raise UserError(f"no data shards in {folder}; run `dspark prepare` first")
        tokens, masks, offsets, self.ids, self.domains = [], [], [0], [], []
        for path in paths:
            tensors, ids, domains = read_shard(path)
            base = offsets[-1]
            offsets.extend((tensors["offsets"][1:] + base).tolist())
            tokens.append(tensors["token_ids"])
            masks.append(tensors["loss_mask"])
            self.ids += ids
            self.domains += domains
        self.token_ids = torch.cat(tokens).to(torch.int64)  # [L]
        self.loss_mask = torch.cat(masks).bool()  # [L]
        self.offsets = torch.tensor(offsets, dtype=torch.int64)  # [n+1]
        self.meta = read_meta(folder)

    def __len__(self) -> int:
        return len(self.ids)

    def get(self, index: int, max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(token_ids [S], loss_mask [S]) of sequence `index`, cut to max_len."""
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        if max_len is not None:
            end = min(end, start + max_len)
        return self.token_ids[start:end], self.loss_mask[start:end]

    def split(self, holdout_fraction: float) -> tuple[list[int], list[int]]:
        """(train indices, held-out indices), skipping sequences with no assistant token."""
        train, heldout = [], []
        for i, rid in enumerate(self.ids):
            if not bool(self.loss_mask[self.offsets[i] + 1 : self.offsets[i + 1]].any()):
                continue
            (heldout if is_heldout(rid, holdout_fraction) else train).append(i)
        return train, heldout


def write_meta(folder: Path, meta: dict) -> None:
    path = Path(folder) / META_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def read_meta(folder: Path) -> dict:
    path = Path(folder) / META_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text())

"""Shared pieces of the training tests: a toy TrainableDrafter, tiny prepared
data, and safetensors drafter IO. Imported by tests/test_train_*.py and by
the subprocess workers of the data-parallel test."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dspark.draft.base import DraftTrainOutput, TrainableDrafter
from dspark.train.data import TrainRecord, write_meta, write_shard
from dspark.train.trainer import DrafterIO


class ToyDrafter(nn.Module, TrainableDrafter):
    """Block position k of anchor p: logits = LM_head(W [h_{p-1}; emb(x_p)] + pos_k + M emb(x_{p+k}))
    (teacher-forced previous token, like a sequential head), confidence = a linear map."""

    name = "toy"

    def __init__(self, target, block_size: int = 3, tap_layers: tuple[int, ...] = (0, 1)) -> None:
        super().__init__()
        d = target.config.hidden_size
        self.block_size, self.tap_layers = block_size, tap_layers
        self.embed = target.embed_tokens.weight.detach()
        self.lm_head = target.lm_head_weight.detach()
        self.proj = nn.Linear(len(tap_layers) * d + d, d)
        self.prev = nn.Linear(d, d, bias=False)
        self.pos = nn.Parameter(0.02 * torch.randn(block_size, d))
        self.conf = nn.Linear(d, 1)

    def forward_train(self, tapped_hidden, token_ids, anchors) -> DraftTrainOutput:
        b = torch.arange(anchors.shape[0])[:, None]
        ctx = tapped_hidden[b, (anchors - 1).clamp(min=0)].flatten(-2)  # [B, A, T*D]
        x = self.proj(torch.cat([ctx, self.embed[token_ids[b, anchors]]], -1))  # [B, A, D]
        prev_pos = anchors[..., None] + torch.arange(self.block_size)  # [B, A, G]
        prev = self.prev(self.embed[token_ids[b[..., None], prev_pos]])
        h = torch.tanh(x[:, :, None] + self.pos + prev)  # [B, A, G, D]
        return DraftTrainOutput(logits=h @ self.lm_head.T, confidence_logits=self.conf(h).squeeze(-1))

    def new_state(self):  # the engine side is not under test here
        raise NotImplementedError

    def observe(self, states, token_ids, tapped_hidden):
        raise NotImplementedError

    def propose(self, states, anchors, params, generators):
        raise NotImplementedError


def toy_io() -> DrafterIO:
    def save(drafter, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().contiguous() for k, v in drafter.state_dict().items()}
        save_file(state, str(folder / "model.safetensors"))

    def load(drafter, folder: Path) -> None:
        drafter.load_state_dict(load_file(str(folder / "model.safetensors")))

    return DrafterIO(save=save, load_weights=load)


def toy_records(num: int, vocab: int, seed: int = 0) -> list[TrainRecord]:
    """Sequences: a random prompt (mask 0), then a learnable answer (mask 1):
    token t+1 = (3 * t + 1) mod vocab, so a drafter can learn it."""
    gen = torch.Generator().manual_seed(seed)
    records = []
    for i in range(num):
        prompt_len = int(torch.randint(4, 10, (1,), generator=gen))
        answer_len = int(torch.randint(8, 24, (1,), generator=gen))
        prompt = torch.randint(2, vocab, (prompt_len,), generator=gen).tolist()
        answer = [int(torch.randint(2, vocab, (1,), generator=gen))]
        for _ in range(answer_len - 1):
            answer.append((3 * answer[-1] + 1) % vocab)
        records.append(TrainRecord(f"toy-{i:04d}", ("math", "code", "chat")[i % 3], prompt + answer,
                                   [0] * prompt_len + [1] * answer_len))
    return records


def write_toy_data(folder: Path, num: int = 48, vocab: int = 96, seed: int = 0, per_shard: int = 16) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    records = toy_records(num, vocab, seed)
    for start in range(0, num, per_shard):
        write_shard(folder, records[start : start + per_shard])
    write_meta(folder, {"target": "tiny", "vocab_size": vocab})
    return folder

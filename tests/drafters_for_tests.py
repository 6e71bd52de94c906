"""A drafter for engine tests: a random bigram table that disagrees with the
target, sampling left to right with the exact probabilities it reports, and a
Markov-style confidence that depends on the previously drafted token."""

from __future__ import annotations

import torch

from dspark.draft.base import Drafter
from dspark.types import DraftProposal


class BigramDrafter(Drafter):
    name = "bigram-test"
    has_confidence = True

    def __init__(self, vocab_size: int, block_size: int = 4, seed: int = 0, sharpness: float = 2.0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.logits = torch.randn(vocab_size, vocab_size, generator=g) * sharpness
        self.conf_logit = torch.randn(vocab_size, generator=g)

    def new_state(self) -> dict:
        return {"n": 0}

    def observe(self, states, token_ids, tapped_hidden) -> None:
        for s, ids in zip(states, token_ids):
            s["n"] += len(ids)

    def truncate(self, state, num_context: int) -> None:
        state["n"] = num_context

    def propose(self, states, anchors, params, generators) -> DraftProposal:
        R, G, V = len(states), self.block_size, self.logits.shape[0]
        tokens = torch.zeros(R, G, dtype=torch.int64)
        probs = torch.zeros(R, G, V)
        conf = torch.zeros(R, G)
        for r in range(R):
            prev = int(anchors[r])
            for k in range(G):
                temp = params[r].temperature
                dist = torch.softmax(self.logits[prev] / (temp if temp > 0 else 1.0), -1)
                if temp == 0:
                    tok = int(dist.argmax())
                else:
                    tok = int(torch.multinomial(dist, 1, generator=generators[r]))
                tokens[r, k], probs[r, k] = tok, dist
                conf[r, k] = torch.sigmoid(self.conf_logit[prev])
                prev = tok
        return DraftProposal(tokens, torch.full((R,), G, dtype=torch.int64), probs, conf)

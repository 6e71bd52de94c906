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


def assert_batch_equals_alone(drafter, tokens: list, hidden: list, temps=(1.0, 0.5, 0.0), seed: int = 1) -> None:
    """One `propose` over requests with contexts (tokens[r], hidden[r]) drafts, for each,
    what a `propose` of that request alone drafts: same anchor (5 + r), temperature and
    generator seed (seed + r), same tokens, the same probabilities to float rounding."""
    from dspark.types import SamplingParams

    def propose(states, anchors, temperatures, seeds):
        params = [SamplingParams(temperature=t) for t in temperatures]
        return drafter.propose(states, torch.tensor(anchors), params, [torch.Generator().manual_seed(s) for s in seeds])

    n = len(tokens)
    batch = [drafter.new_state() for _ in range(n)]
    drafter.observe(batch, tokens, hidden)
    together = propose(batch, [5 + r for r in range(n)], temps[:n], [seed + r for r in range(n)])
    for r in range(n):
        alone = drafter.new_state()
        drafter.observe([alone], [tokens[r]], [hidden[r]])
        one = propose([alone], [5 + r], [temps[r]], [seed + r])
        assert torch.equal(one.draft_tokens[0], together.draft_tokens[r])
        torch.testing.assert_close(one.draft_probs[0], together.draft_probs[r], rtol=1e-5, atol=1e-6)

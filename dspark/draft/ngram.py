"""Model-free drafters: `none` (plain autoregressive decoding) and `ngram`
(prompt lookup: copy what followed the most recent earlier occurrence of the
last few tokens)."""

from __future__ import annotations

import torch

from dspark.draft.base import Drafter, empty_proposal
from dspark.types import DraftProposal, SamplingParams


class NoDrafter(Drafter):
    """Proposes nothing: every round is one plain target decode step."""

    name = "none"

    def __init__(self, block_size: int = 1) -> None:
        self.block_size = block_size

    def new_state(self) -> object:
        return None

    def observe(self, states, token_ids, tapped_hidden) -> None:  # noqa: D102
        return None

    def propose(self, states, anchors, params, generators) -> DraftProposal:  # noqa: D102
        return empty_proposal(len(states), self.block_size)

    def truncate(self, state: object, num_context: int) -> None:  # noqa: D102
        return None


class NgramState:
    """The request's committed context tokens, as a plain list."""

    def __init__(self) -> None:
        self.tokens: list[int] = []


class NgramDrafter(Drafter):
    """Prompt lookup decoding (Saxena, 2023). Drafts are point masses
    (`draft_probs=None`): the verifier accepts draft token x with probability
    p_target(x), which keeps sampling lossless.

    For n from max_ngram down to min_ngram, find the most recent earlier
    occurrence of the last n tokens (context + anchor) and propose the tokens
    that followed it.
    """

    name = "ngram"

    def __init__(self, block_size: int = 7, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.block_size = block_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def new_state(self) -> NgramState:
        return NgramState()

    def observe(self, states, token_ids, tapped_hidden) -> None:  # noqa: D102
        for state, ids in zip(states, token_ids):
            state.tokens.extend(int(t) for t in ids)

    def truncate(self, state: NgramState, num_context: int) -> None:  # noqa: D102
        del state.tokens[num_context:]

    def lookup(self, history: list[int]) -> list[int]:
        """Continuation of the most recent earlier match of history's suffix."""
        size = len(history)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            suffix = history[size - n :]
            # scan right to left over start positions of earlier occurrences
            for start in range(size - n - 1, -1, -1):
                if history[start : start + n] == suffix:
                    follow = history[start + n : start + n + self.block_size]
                    if follow:
                        return follow
        return []

    def propose(
        self,
        states: list[NgramState],
        anchors: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> DraftProposal:
        proposal = empty_proposal(len(states), self.block_size)
        for r, state in enumerate(states):
            follow = self.lookup(state.tokens + [int(anchors[r])])
            if follow:
                proposal.draft_tokens[r, : len(follow)] = torch.tensor(follow, dtype=torch.int64)
                proposal.num_drafted[r] = len(follow)
        return proposal

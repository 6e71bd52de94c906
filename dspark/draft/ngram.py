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
    """The request's committed context tokens, and the running hit counts behind its confidences."""

    def __init__(self, num_lengths: int, block_size: int) -> None:
        self.tokens: list[int] = []
        self.scored: int | None = None  # positions before this one were looked up; None: no draft asked yet
        self.pending: list[tuple[int, int, list[int]]] = []  # (position looked up at, match length, continuation)
        # per match length n and draft position k, decayed counts of the continuations whose
        # tokens 1..k-1 matched the stream (reached) and of those whose token k matched too (hits)
        self.hits = [[0.0] * block_size for _ in range(num_lengths)]
        self.reached = [[0.0] * block_size for _ in range(num_lengths)]


class NgramDrafter(Drafter):
    """Prompt lookup decoding (Saxena, 2023). Drafts are point masses
    (`draft_probs=None`): the verifier accepts draft token x with probability
    p_target(x), which keeps sampling lossless.

    For n from max_ngram down to min_ngram, find the most recent earlier
    occurrence of the last n tokens (context + anchor) and propose the tokens
    that followed it.

    Confidences (`has_confidence`), so the DSpark scheduler verifies only the
    prefixes worth a target forward: c_k estimates P(token k is accepted |
    tokens 1..k-1 were) from how well this drafter's lookups have predicted.

    - At every generated position the drafter makes the lookup it would draft
      there (whether or not that step drafted) and, as the following tokens
      commit, scores it: token k is *reached* when tokens 1..k-1 matched the
      stream, and a *hit* when it matched too. For a point-mass draft x the
      committed token equals x with probability p_target(x), accepted or
      sampled afresh, which is the probability that verification accepts x:
      hits / reached estimates c_k without bias, greedy or sampled. Only
      committed tokens are read, never what the current round decides.
    - Counts are kept per match length n: a 3-token match predicts far better
      than a 1-token one (on the target's own answers, 76 % against 24 % for
      the first token).
    - Each request keeps its own counts (decaying by 1 - 1/memory per score: a
      request that copies a code block, then explains it, changes its odds),
      shrunk towards the drafter's shared counts over all requests (decaying
      by 1 - 1/shared_memory), which start from a Beta(prior_hits,
      prior_misses) prior:
          shared = (hits_all + prior_hits) / (reached_all + prior_hits + prior_misses)
          c_k    = (hits + shrink * shared) / (reached + shrink)
      The shared counts live as long as the drafter object (a server's life).
    """

    name = "ngram"
    has_confidence = True

    def __init__(self, block_size: int = 7, max_ngram: int = 3, min_ngram: int = 1, *,
                 prior_hits: float = 1.0, prior_misses: float = 2.0, shrink: float = 4.0,
                 memory: float = 32.0, shared_memory: float = 1024.0) -> None:
        if not (1 <= min_ngram <= max_ngram):
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if prior_hits <= 0 or prior_misses <= 0 or shrink <= 0 or memory < 1 or shared_memory < 1:
            raise ValueError("need prior_hits > 0, prior_misses > 0, shrink > 0, memory >= 1 and shared_memory >= 1")
        self.block_size = block_size
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.prior = (prior_hits, prior_misses)
        self.shrink = shrink
        self.decay = 1.0 - 1.0 / memory
        self.shared_decay = 1.0 - 1.0 / shared_memory
        lengths = max_ngram - min_ngram + 1
        self.shared_hits = [[0.0] * block_size for _ in range(lengths)]
        self.shared_reached = [[0.0] * block_size for _ in range(lengths)]

    def new_state(self) -> NgramState:
        return NgramState(self.max_ngram - self.min_ngram + 1, self.block_size)

    def observe(self, states, token_ids, tapped_hidden) -> None:  # noqa: D102
        for state, ids in zip(states, token_ids):
            state.tokens.extend(int(t) for t in ids)

    def truncate(self, state: NgramState, num_context: int) -> None:  # noqa: D102
        del state.tokens[num_context:]
        if state.scored is not None:
            state.scored = min(state.scored, num_context)
        state.pending = [p for p in state.pending if p[0] < num_context]

    def match(self, history: list[int]) -> tuple[int, list[int]]:
        """(n, continuation) of the most recent earlier match of history's longest matching
        suffix of n tokens; (0, []) when none matches."""
        size = len(history)
        for n in range(min(self.max_ngram, size - 1), self.min_ngram - 1, -1):
            suffix = history[size - n :]
            # scan right to left over start positions of earlier occurrences
            for start in range(size - n - 1, -1, -1):
                if history[start : start + n] == suffix:
                    follow = history[start + n : start + n + self.block_size]
                    if follow:
                        return n, follow
        return 0, []

    def lookup(self, history: list[int]) -> list[int]:
        """Continuation of the most recent earlier match of history's suffix."""
        return self.match(history)[1]

    def _score(self, state: NgramState, history: list[int]) -> None:
        """Queue the lookups of the history positions not yet looked up (the last one is the
        anchor's: the one drafted now), then score every queued continuation the stream has
        settled: it mismatched somewhere, or all its tokens are known. Scoring starts at the
        request's first draft, so a long prompt costs no lookups."""
        if state.scored is None:
            state.scored = len(history) - 1
        for at in range(state.scored, len(history)):
            n, follow = self.match(history[: at + 1])
            if follow:
                state.pending.append((at, n, follow))
        state.scored = len(history)
        waiting = []
        for at, n, follow in state.pending:
            known = history[at + 1 : at + 1 + len(follow)]
            matched = 0
            while matched < len(known) and known[matched] == follow[matched]:
                matched += 1
            if matched == len(known) and len(known) < len(follow):
                waiting.append((at, n, follow))  # every known token matches: wait for the next ones
                continue
            i = n - self.min_ngram
            for k in range(min(matched + 1, len(follow))):
                hit = 1.0 if k < matched else 0.0
                state.reached[i][k] = self.decay * state.reached[i][k] + 1.0
                state.hits[i][k] = self.decay * state.hits[i][k] + hit
                self.shared_reached[i][k] = self.shared_decay * self.shared_reached[i][k] + 1.0
                self.shared_hits[i][k] = self.shared_decay * self.shared_hits[i][k] + hit
        state.pending = waiting

    def confidences(self, state: NgramState, n: int) -> list[float]:
        """c_1..c_G of a draft from a match of n tokens."""
        a, b = self.prior
        i = n - self.min_ngram
        shared = [(h + a) / (r + a + b) for h, r in zip(self.shared_hits[i], self.shared_reached[i])]
        return [(h + self.shrink * g) / (r + self.shrink) for h, r, g in zip(state.hits[i], state.reached[i], shared)]

    def propose(
        self,
        states: list[NgramState],
        anchors: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> DraftProposal:
        proposal = empty_proposal(len(states), self.block_size)
        proposal.confidences = torch.zeros(len(states), self.block_size, dtype=torch.float32)
        for r, state in enumerate(states):
            history = state.tokens + [int(anchors[r])]
            self._score(state, history)
            last = state.pending[-1] if state.pending else None
            if last is not None and last[0] == len(history) - 1:  # the anchor's own lookup matched
                _, n, follow = last
                proposal.draft_tokens[r, : len(follow)] = torch.tensor(follow, dtype=torch.int64)
                proposal.num_drafted[r] = len(follow)
                proposal.confidences[r] = torch.tensor(self.confidences(state, n), dtype=torch.float32)
        return proposal

"""The drafter protocol: every drafter (none, ngram, DSpark, DFlash, Eagle3,
MTP-1) is driven the same way by the engine, so the loop never asks which one
is on.

Per request, a drafter keeps a state object of its own (`new_state`). The
engine feeds it the *context*: committed tokens whose target forward has run,
with the target hidden states the drafter asked for (`tap_layers`). The last
committed token, whose target forward has not run yet, is the *anchor*: it is
passed to `propose`, which drafts up to `block_size` tokens after it.

One round, for a request with context c_1..c_n and anchor x_0:
    propose(anchor=x_0)              -> draft tokens x_1..x_G
    target forward over x_0..x_l     (l = verify length)
    verifier accepts x_1..x_a and samples one more token y
    observe(tokens=[x_0, x_1..x_a], hidden of those positions)
    next anchor = y
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from dspark.types import DraftProposal, SamplingParams


class Drafter(ABC):
    """Proposes draft blocks for a batch of requests."""

    name: str = "drafter"
    block_size: int = 1  # G: most draft tokens per request per round
    tap_layers: tuple[int, ...] = ()  # target decoder layers whose outputs observe() needs
    has_confidence: bool = False  # proposals carry calibrated confidences c_k

    @abstractmethod
    def new_state(self) -> object:
        """A fresh per-request state with empty context."""

    @abstractmethod
    def observe(
        self,
        states: list[object],
        token_ids: list[torch.Tensor],  # R tensors [n_r] int64, newly committed context tokens
        tapped_hidden: list[torch.Tensor] | None,  # R tensors [n_r, T, D] (None when tap_layers is empty)
    ) -> None:
        """Append newly committed context to each request's state, in order."""

    @abstractmethod
    def propose(
        self,
        states: list[object],
        anchors: torch.Tensor,  # [R] int64
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> DraftProposal:
        """Draft up to block_size tokens after each anchor, in one batched call."""

    def pending_rows(self, state: object) -> int:
        """Context rows `observe` took but the next `propose` for this request must still process
        first (0 for drafters that process context as it comes). A draft gate prices them: the
        first draft of a request with a long prompt costs more than the next (docs/LOAD.md, run BH)."""
        return 0

    def truncate(self, state: object, num_context: int) -> None:
        """Forget context beyond the first num_context tokens (preemption)."""
        raise NotImplementedError(f"{self.name} does not support truncation")

    def release(self, state: object) -> None:
        """Free what the state holds; the request is finished."""


def empty_proposal(num_requests: int, block_size: int) -> DraftProposal:
    """A proposal with no usable draft tokens (every verify length becomes 0)."""
    return DraftProposal(
        draft_tokens=torch.zeros(num_requests, block_size, dtype=torch.int64),
        num_drafted=torch.zeros(num_requests, dtype=torch.int64),
    )


def spread_proposal(proposal: DraftProposal, rows: list[int], num_requests: int) -> DraftProposal:
    """A proposal made for `rows` (increasing) of a batch of `num_requests`, laid out over the
    whole batch; every other row has no usable draft tokens (its verify length becomes 0)."""
    index = torch.tensor(rows, dtype=torch.int64, device=proposal.draft_tokens.device)

    def spread(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        return t.new_zeros((num_requests, *t.shape[1:])).index_copy_(0, index.to(t.device), t)

    return DraftProposal(
        draft_tokens=spread(proposal.draft_tokens),
        num_drafted=spread(proposal.num_drafted),
        draft_probs=spread(proposal.draft_probs),
        confidences=spread(proposal.confidences),
    )


class DraftTrainOutput:
    """What a trainable drafter returns for a teacher-forced training batch.

    B sequences, A anchors per sequence, G block size, V vocabulary.
    """

    def __init__(
        self, logits: torch.Tensor, confidence_logits: torch.Tensor | None, vocab_ids: torch.Tensor | None = None
    ) -> None:
        self.logits = logits  # [B, A, G, V] float: draft logits (sequential bias included), or [B, A, G, K]
        self.confidence_logits = confidence_logits  # [B, A, G] float, pre-sigmoid c_k; None if no head
        # [K] sorted token ids the last axis of `logits` covers (a draft vocabulary); None: all V tokens
        self.vocab_ids = vocab_ids

    def full_logits(self, vocab_size: int) -> torch.Tensor:
        """The logits over all V tokens: -inf outside a draft vocabulary (its tokens are never drafted)."""
        if self.vocab_ids is None:
            return self.logits
        full = self.logits.new_full((*self.logits.shape[:-1], vocab_size), float("-inf"))
        full[..., self.vocab_ids.to(self.logits.device)] = self.logits
        return full


class TrainableDrafter(Drafter):
    """A learned drafter that the trainer can fit.

    Block j of sequence b has its anchor at position p = anchors[b, j]: the
    anchor token is token_ids[b, p], the context is the target hidden states
    of positions 0..p-1, and block position k (0..G-1) predicts
    token_ids[b, p + 1 + k]. Sequential heads are teacher-forced: the previous
    token of position k is token_ids[b, p + k].
    """

    @abstractmethod
    def forward_train(
        self,
        tapped_hidden: torch.Tensor,  # [B, S, T, D] target hidden states of tap_layers
        token_ids: torch.Tensor,  # [B, S] int64
        anchors: torch.Tensor,  # [B, A] int64, each p with p + G < S
    ) -> DraftTrainOutput:
        """Draft logits and confidence logits for every anchored block."""

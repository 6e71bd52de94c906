"""Records that cross module boundaries.

Shape symbols, used in every shape comment in dspark:

    R  requests in a step (batch of requests)
    G  block size gamma: the most draft tokens a drafter proposes per request
    V  vocabulary size
    N  flattened tokens of a ragged batch (sum of per-request query lengths)
    M  rows whose logits were asked for (a subset of N)
    T  number of tapped target layers
    D  target hidden size

Vocabulary (used the same way everywhere): a *proposal* holds *draft tokens*;
the scheduler picks a *verify length* l in 0..G per request; the verifier
*accepts* a prefix of the l draft tokens, then samples one more token from the
target: the *recovered* token at the first rejection or the *bonus* token when
all l were accepted. Accepted tokens plus that one token are *committed*. The
*acceptance length* tau of a round is accepted + 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from dspark.errors import UserError


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. The same transform applies to the target
    distribution and to the verifier's residual distribution."""

    temperature: float = 1.0  # 0 means exact greedy (argmax)
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 keeps all
    seed: int | None = None  # per-request RNG seed; None draws one
    max_new_tokens: int = 128  # generated tokens at most (>= 1)
    stop: tuple[str, ...] = ()  # stop strings, matched on decoded text
    ignore_eos: bool = False  # keep generating past the end-of-sequence token

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise UserError(
                f"temperature must be a finite number >= 0, got {self.temperature}; "
                "use 0 for greedy decoding"
            )
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}; use 1.0 to disable it")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class DraftProposal:
    """What a drafter proposes for R requests in one round.

    `draft_probs[r, k]` is exactly the distribution `draft_tokens[r, k]` was
    sampled from (same values and dtype the sampler used). It is None for
    deterministic drafters (prompt lookup, greedy drafting), whose draft
    distribution is a point mass on the draft token. Once a step's verify
    lengths are chosen the engine cuts `draft_probs` to [R, W, V], W the
    longest of them: positions past W are never verified, so never read.
    """

    draft_tokens: torch.Tensor  # [R, G] int64
    num_drafted: torch.Tensor  # [R] int64, usable draft tokens per request (<= G)
    draft_probs: torch.Tensor | None = None  # [R, G, V] float32, or None (point masses)
    confidences: torch.Tensor | None = None  # [R, G] float32 c_k, P(accept k | 1..k-1 accepted)

    @property
    def num_requests(self) -> int:
        return int(self.draft_tokens.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.draft_tokens.shape[1])


@dataclass
class VerifyResult:
    """Outcome of verifying R requests' scheduled prefixes."""

    num_accepted: torch.Tensor  # [R] int64, accepted draft tokens (0..verify_len)
    output_tokens: torch.Tensor  # [R, G + 1] int64: accepted drafts then the recovered/bonus token, -1 padded

    def committed(self, r: int) -> list[int]:
        """Tokens request r commits this round (accepted + recovered/bonus)."""
        n = int(self.num_accepted[r]) + 1
        return [int(t) for t in self.output_tokens[r, :n]]

    def on_host(self) -> tuple[list[int], list[list[int]]]:
        """(accepted drafts per request, committed tokens per request), read in two copies:
        `committed(r)` for every r reads 2 + committed scalars per request, each a sync on a
        GPU."""
        accepted = self.num_accepted.tolist()
        rows = self.output_tokens.tolist()
        return accepted, [row[: n + 1] for row, n in zip(rows, accepted)]


@dataclass
class SpecStats:
    """Speculation counters, defined once and shared by generate, eval, the
    engine's metrics and the benchmarks."""

    block_size: int
    rounds: int = 0
    draft_tokens: int = 0  # draft tokens sent to verification (sum of verify lengths)
    accepted_tokens: int = 0  # draft tokens accepted
    committed_tokens: int = 0  # accepted + recovered/bonus
    # reached[k]: rounds whose verified prefix had a position k+1 with all earlier accepted;
    # accepted_at[k]: those of them where position k+1 was accepted.
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    # live calibration: predicted expected accepted tokens (sum of prefix survival
    # probabilities over the verified prefix) against realised accepted tokens.
    predicted_accepted: float = 0.0
    calibrated_rounds: int = 0
    calibrated_accepted: int = 0

    def __post_init__(self) -> None:
        if not self.reached:
            self.reached = [0] * self.block_size
            self.accepted_at = [0] * self.block_size

    def record(self, verify_len: int, num_accepted: int, predicted: float | None = None) -> None:
        """Record one round of one request."""
        self.rounds += 1
        self.draft_tokens += verify_len
        self.accepted_tokens += num_accepted
        self.committed_tokens += num_accepted + 1
        for k in range(min(verify_len, num_accepted + 1)):
            self.reached[k] += 1
            if k < num_accepted:
                self.accepted_at[k] += 1
        if predicted is not None:
            self.predicted_accepted += predicted
            self.calibrated_rounds += 1
            self.calibrated_accepted += num_accepted

    def merge(self, other: "SpecStats") -> None:
        if other.block_size != self.block_size:
            raise ValueError("cannot merge SpecStats of different block sizes")
        self.rounds += other.rounds
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.committed_tokens += other.committed_tokens
        self.reached = [a + b for a, b in zip(self.reached, other.reached)]
        self.accepted_at = [a + b for a, b in zip(self.accepted_at, other.accepted_at)]
        self.predicted_accepted += other.predicted_accepted
        self.calibrated_rounds += other.calibrated_rounds
        self.calibrated_accepted += other.calibrated_accepted

    @property
    def mean_accepted_length(self) -> float:
        """tau: committed tokens per round (accepted + bonus), as in the paper."""
        return self.committed_tokens / self.rounds if self.rounds else 0.0

    @property
    def per_position_acceptance(self) -> list[float | None]:
        """Conditional acceptance at position k given 1..k-1 accepted (paper 4.3.1)."""
        return [a / n if n else None for a, n in zip(self.accepted_at, self.reached)]

    @property
    def mean_verify_length(self) -> float:
        return self.draft_tokens / self.rounds if self.rounds else 0.0

    @property
    def calibration_error(self) -> float | None:
        """Mean (predicted - realised) accepted draft tokens per calibrated round."""
        if not self.calibrated_rounds:
            return None
        return (self.predicted_accepted - self.calibrated_accepted) / self.calibrated_rounds

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_length": self.mean_accepted_length,
            "per_position_acceptance": self.per_position_acceptance,
        }


@dataclass
class RaggedBatch:
    """New tokens of R requests flattened into one sequence (paper section 5.3).

    Request r owns KV-cache slot `slots[r]` and contributes `query_lens[r]`
    consecutive tokens, which continue its cached sequence: their positions are
    cache_len(slot), cache_len(slot) + 1, ... Each token attends to its own
    request's cache and causally to the request's earlier new tokens.
    """

    token_ids: torch.Tensor  # [N] int64, requests' new tokens back to back
    slots: list[int]  # R cache slots, one per request
    query_lens: list[int]  # R counts, each >= 1, summing to N

    def __post_init__(self) -> None:
        if len(self.slots) != len(self.query_lens):
            raise ValueError("slots and query_lens must have one entry per request")
        if sum(self.query_lens) != int(self.token_ids.shape[0]):
            raise ValueError("query_lens must sum to the number of tokens")
        if any(q < 1 for q in self.query_lens):
            raise ValueError("every request in a ragged batch needs at least one token")


@dataclass
class TargetOutput:
    """Result of one ragged target forward."""

    logits: torch.Tensor  # [M, V] float32, rows asked for via logits_rows (in that order)
    tapped_hidden: torch.Tensor | None  # [N, T, D]: output of each tapped decoder layer, or None
    last_hidden: torch.Tensor | None  # [N, D]: final-normed hidden state (LM head input), or None

"""Training objective of paper 3.3 and the acceptance statistics logged with it.

    L = a_ce L_ce + a_tv L_tv + a_conf L_conf

    L_ce   = sum_k w_k * -log p_draft_k(x*_k)
    L_tv   = sum_k w_k * || p_draft_k - p_target_k ||_1
    L_conf = sum_k w_k * BCE(c_k, c*_k),   c*_k = 1 - 0.5 || p_draft_k - p_target_k ||_1

with position weights w_k = exp(-(k - 1) / decay) (k = 1..G, decay = G by
default). c*_k is the analytic per-step acceptance probability of
speculative sampling (Leviathan et al.), detached: the confidence head learns
to predict it; it is not a path for gradients into the draft distribution.

Each term is a weighted mean: the sum over supervised positions of
w_k * term, divided by `normalizer`, by default the sum of w_k over the
supervised positions of this batch. Data-parallel training passes the
global normalizer, so per-rank losses sum to the single-process loss.

A drafter trained over a draft vocabulary of K tokens (`vocab_ids`) drafts
nothing outside it, so its distribution is p_draft over the K tokens and zero
elsewhere: L_tv is exactly || p_draft - p_target ||_1 of that distribution,
sum over the K tokens of |p_draft - p_target| plus the target's mass outside
them, and c*_k is its acceptance probability. A label outside the K tokens
adds no cross-entropy (the drafter cannot propose it; its TV term still
counts it).

Shapes: B sequences, A anchors, G block size, V vocabulary, K draft vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossWeights:
    a_ce: float = 0.1
    a_tv: float = 0.9
    a_conf: float = 1.0
    decay: float = 0.0  # 0 means decay = G


@dataclass
class LossOutput:
    """Loss terms of one batch (already divided by the normalizer)."""

    total: torch.Tensor  # [] differentiable
    ce: torch.Tensor  # [] detached
    tv: torch.Tensor  # [] detached
    conf: torch.Tensor  # [] detached (0 when the drafter has no confidence head)
    soft_accept: torch.Tensor  # [B, A, G] float c*_k, detached
    confidence: torch.Tensor | None  # [B, A, G] float sigmoid(confidence logits), detached
    top1_match: torch.Tensor  # [B, A, G] bool, argmax draft == label


def position_weights(block_size: int, decay: float = 0.0) -> torch.Tensor:
    """w_k = exp(-(k - 1) / decay) for k = 1..G; [G] float32."""
    decay = float(block_size) if decay <= 0 else decay
    return torch.exp(-torch.arange(block_size, dtype=torch.float32) / decay)


def weight_normalizer(valid: torch.Tensor, block_size: int, decay: float = 0.0) -> torch.Tensor:
    """Sum of w_k over supervised positions of valid [B, A, G]; [] float32."""
    return (valid.float() * position_weights(block_size, decay).to(valid.device)).sum()


def draft_loss(
    draft_logits: torch.Tensor,  # [B, A, G, V], or [B, A, G, K] over the draft vocabulary vocab_ids
    target_logits: torch.Tensor,  # [B, A, G, V]
    labels: torch.Tensor,  # [B, A, G] int64
    valid: torch.Tensor,  # [B, A, G] bool
    confidence_logits: torch.Tensor | None,  # [B, A, G] or None
    weights: LossWeights,
    normalizer: torch.Tensor | None = None,  # [] float; default: this batch's weight sum
    vocab_ids: torch.Tensor | None = None,  # [K] sorted token ids of a draft vocabulary; None: all V
) -> LossOutput:
    """The three-term objective over the supervised positions of a batch."""
    block_size = draft_logits.shape[2]
    w = position_weights(block_size, weights.decay).to(draft_logits.device)
    w = w * valid.float()  # [B, A, G]
    if normalizer is None:
        normalizer = w.sum()
    normalizer = normalizer.clamp(min=1e-12)
    if (vocab_ids is None and draft_logits.shape[-1] != target_logits.shape[-1]) or (
        vocab_ids is not None and vocab_ids.numel() != draft_logits.shape[-1]
    ):
        raise ValueError(f"draft logits over {draft_logits.shape[-1]} tokens do not match the target's "
                         f"{target_logits.shape[-1]} or the draft vocabulary's "
                         f"{None if vocab_ids is None else vocab_ids.numel()}")

    draft_logp = F.log_softmax(draft_logits.float(), dim=-1)
    outside = None
    with torch.no_grad():
        target_probs = F.softmax(target_logits.float(), dim=-1)
        if vocab_ids is not None:  # the target's probabilities of the draft vocabulary, and its mass elsewhere
            vocab_ids = vocab_ids.to(target_probs.device)
            target_probs = target_probs.index_select(-1, vocab_ids)
            outside = (1.0 - target_probs.sum(-1)).clamp(min=0.0)
            local = torch.full((target_logits.shape[-1],), -1, dtype=torch.int64, device=labels.device)
            local[vocab_ids.to(labels.device)] = torch.arange(vocab_ids.numel(), device=labels.device)
            draft_labels = local[labels.clamp(min=0)]  # -1: outside the draft vocabulary
        else:
            draft_labels = labels
    draft_probs = draft_logp.exp()
    ce = -draft_logp.gather(-1, draft_labels.clamp(min=0)[..., None]).squeeze(-1)  # [B, A, G]
    if outside is not None:
        ce = ce * (draft_labels >= 0)
    l1 = (draft_probs - target_probs).abs().sum(-1)  # [B, A, G]
    if outside is not None:
        l1 = l1 + outside
    soft_accept = (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)

    loss_ce = (w * ce).sum() / normalizer
    loss_tv = (w * l1).sum() / normalizer
    total = weights.a_ce * loss_ce + weights.a_tv * loss_tv
    confidence = None
    loss_conf = torch.zeros((), device=draft_logits.device)
    if confidence_logits is not None:
        bce = F.binary_cross_entropy_with_logits(confidence_logits.float(), soft_accept, reduction="none")
        loss_conf = (w * bce).sum() / normalizer
        total = total + weights.a_conf * loss_conf
        confidence = torch.sigmoid(confidence_logits.detach().float())
    return LossOutput(
        total=total,
        ce=loss_ce.detach(),
        tv=loss_tv.detach(),
        conf=loss_conf.detach(),
        soft_accept=soft_accept,
        confidence=confidence,
        top1_match=_top1(draft_logits.detach(), vocab_ids) == labels,
    )


def _top1(logits: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """The draft's most likely token ids [B, A, G]."""
    best = logits.argmax(-1)
    return best if vocab_ids is None else vocab_ids.to(best.device)[best]


@dataclass
class AcceptanceStats:
    """Running sums of per-position acceptance over logged steps.

    Per position k: supervised count, sum of c*_k (expected acceptance),
    sum of c_k (confidence head) and top-1 matches. Expected acceptance
    length tau = 1 + sum_k prod_{i<=k} c*_i, averaged over blocks whose G
    positions are all supervised (a block cut by the end of an answer would
    bias it low).
    """

    block_size: int
    count: list[float] | None = None
    soft_accept: list[float] | None = None
    confidence: list[float] | None = None
    top1: list[float] | None = None
    tau_sum: float = 0.0
    tau_blocks: int = 0

    def __post_init__(self) -> None:
        zeros = [0.0] * self.block_size
        self.count = self.count or list(zeros)
        self.soft_accept = self.soft_accept or list(zeros)
        self.confidence = self.confidence or list(zeros)
        self.top1 = self.top1 or list(zeros)

    def update(self, out: LossOutput, valid: torch.Tensor) -> None:
        v = valid.float().reshape(-1, self.block_size)
        add = lambda acc, x: [a + b for a, b in zip(acc, (x.float().reshape(-1, self.block_size) * v).sum(0).tolist())]  # noqa: E731
        self.count = [a + b for a, b in zip(self.count, v.sum(0).tolist())]
        self.soft_accept = add(self.soft_accept, out.soft_accept)
        self.top1 = add(self.top1, out.top1_match)
        if out.confidence is not None:
            self.confidence = add(self.confidence, out.confidence)
        full = valid.reshape(-1, self.block_size).all(-1)
        if bool(full.any()):
            survival = torch.cumprod(out.soft_accept.reshape(-1, self.block_size)[full].double(), dim=1)
            self.tau_sum += float((1.0 + survival.sum(1)).sum())
            self.tau_blocks += int(full.sum())

    def as_vector(self) -> torch.Tensor:
        """All sums as one float64 vector (for all-reduce across ranks)."""
        return torch.tensor(self.count + self.soft_accept + self.confidence + self.top1 + [self.tau_sum, self.tau_blocks], dtype=torch.float64)

    @classmethod
    def from_vector(cls, block_size: int, vec: torch.Tensor) -> "AcceptanceStats":
        g, xs = block_size, vec.tolist()
        return cls(g, xs[:g], xs[g : 2 * g], xs[2 * g : 3 * g], xs[3 * g : 4 * g], xs[4 * g], int(xs[4 * g + 1]))

    def summary(self) -> dict:
        mean = lambda xs: [round(x / n, 5) if n else None for x, n in zip(xs, self.count)]  # noqa: E731
        return {
            "accept_per_position": mean(self.soft_accept),
            # sigmoid outputs are never exactly 0: all-zero sums mean "no confidence head"
            "confidence_per_position": mean(self.confidence) if any(self.confidence) else None,
            "top1_per_position": mean(self.top1),
            "expected_accept_len": round(self.tau_sum / self.tau_blocks, 5) if self.tau_blocks else None,
            "blocks_full": self.tau_blocks,
        }


def expected_acceptance_length(per_step_accept: torch.Tensor) -> torch.Tensor:
    """tau = 1 + sum_k prod_{i<=k} c_i for per_step_accept [..., G]; [...]."""
    return 1.0 + torch.cumprod(per_step_accept, dim=-1).sum(-1)


"""Sequential heads (paper eq. 4-6) and the confidence head (eq. 7).

Every sequential head computes, per draft position k, a rank-r *latent*
u_k from the previous token x_{k-1} (x_0 = anchor), the backbone hidden h_k
and (RNN only) a recurrent state; the transition bias is B_k = W2 u_k, so
p_k = softmax(U_k + B_k). Parameter names and orientations are DeepSpec's:
`markov_w1` is an embedding [V, r], `markov_w2` a linear r -> V (weight
[V, r]), `gate_proj` a linear D + r -> r, `joint_proj` a linear 2r + D -> 3r
split into gate, candidate and output.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.models.layers import Linear, linear


class MarkovHead(nn.Module):
    """Vanilla Markov head, eq. 5: u_k = W1[x_{k-1}]."""

    recurrent = False

    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__()
        del hidden_size
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, vocab_size, bias=False)

    @property
    def rank(self) -> int:
        return int(self.markov_w1.weight.shape[1])

    def prev_embedding(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """prev_ids [...] -> W1[x_{k-1}] [..., r]."""
        return self.markov_w1(prev_ids)

    def start_state(self, batch: int) -> torch.Tensor | None:
        """The state before position 1 (only the RNN head has one)."""
        return None

    def step(
        self, state: torch.Tensor | None, prev_ids: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """prev_ids [...], hidden [..., D] -> latent u_k [..., r], next state."""
        return self.prev_embedding(prev_ids), state

    def bias(self, latent: torch.Tensor, w2_rows: torch.Tensor | None = None) -> torch.Tensor:
        """latent [..., r] -> float32 transition bias over the vocabulary [..., V], or over a
        draft vocabulary [..., K] given its rows of W2 (w2_rows [K, r])."""
        if w2_rows is None:
            return self.markov_w2(latent).float()
        return linear(latent, w2_rows).float()

    def candidate_bias(
        self, latent: torch.Tensor, candidates: torch.Tensor, w2_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """latent [R, r], candidates [R, K] indices into the vocabulary (or into the draft
        vocabulary whose W2 rows are w2_rows) -> bias of just those tokens [R, K]."""
        rows = (self.markov_w2.weight if w2_rows is None else w2_rows)[candidates]  # [R, K, r]
        return (rows @ latent.unsqueeze(-1)).squeeze(-1).float()

    def block_latents(self, prev_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: prev_ids [..., G], hidden [..., G, D] -> latents [..., G, r]."""
        if not self.recurrent:
            return self.step(None, prev_ids, hidden)[0]
        state = self.start_state(prev_ids[..., 0].numel()).reshape(*prev_ids.shape[:-1], self.rank)
        latents = []
        for k in range(prev_ids.shape[-1]):
            latent, state = self.step(state, prev_ids[..., k], hidden[..., k, :])
            latents.append(latent)
        return torch.stack(latents, dim=-2)


class GatedMarkovHead(MarkovHead):
    """u_k = sigmoid(W_g [h_k; W1[x_{k-1}]] + b_g) * W1[x_{k-1}]."""

    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, rank, hidden_size)
        self.gate_proj = Linear(hidden_size + rank, rank, bias=True)

    def step(self, state, prev_ids, hidden):  # noqa: D102
        prev = self.prev_embedding(prev_ids)
        gate = torch.sigmoid(self.gate_proj(torch.cat([hidden.to(prev.dtype), prev], dim=-1)))
        return gate * prev, state


class RNNHead(MarkovHead):
    """Eq. 6: z_k = [s_{k-1}; W1[x_{k-1}]; h_k];
    s_k = g * s_{k-1} + (1 - g) * tanh(W_c z_k) with g = sigmoid(W_g z_k);
    u_k = tanh(W_o z_k); s_0 = 0."""

    recurrent = True

    def __init__(self, vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__(vocab_size, rank, hidden_size)
        self.joint_proj = Linear(2 * rank + hidden_size, 3 * rank, bias=True)

    def start_state(self, batch: int) -> torch.Tensor:
        w = self.markov_w1.weight
        return torch.zeros(batch, self.rank, dtype=w.dtype, device=w.device)

    def step(self, state, prev_ids, hidden):  # noqa: D102
        prev = self.prev_embedding(prev_ids)
        z = torch.cat([state, prev, hidden.to(prev.dtype)], dim=-1)
        gate_raw, cand_raw, out_raw = self.joint_proj(z).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        new_state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return torch.tanh(out_raw), new_state


HEAD_TYPES = {"vanilla": MarkovHead, "gated": GatedMarkovHead, "rnn": RNNHead}


def build_markov_head(kind: str, vocab_size: int, rank: int, hidden_size: int) -> MarkovHead | None:
    """The sequential head named by `kind` ("none" gives None)."""
    if kind == "none":
        return None
    return HEAD_TYPES[kind](vocab_size, rank, hidden_size)


class ConfidenceHead(nn.Module):
    """Eq. 7: c_k = sigmoid(w^T [h_k; W1[x_{k-1}]] + b) (or w^T h_k + b
    without the Markov feature). Returns the pre-sigmoid logit."""

    def __init__(self, hidden_size: int, markov_rank: int) -> None:
        super().__init__()
        self.proj = Linear(hidden_size + markov_rank, 1, bias=True)

    def forward(self, hidden: torch.Tensor, prev_embedding: torch.Tensor | None) -> torch.Tensor:
        """hidden [..., D], prev_embedding [..., r] or None -> logits [...] float32."""
        features = hidden if prev_embedding is None else torch.cat([hidden, prev_embedding.to(hidden.dtype)], -1)
        return self.proj(features).squeeze(-1).float()

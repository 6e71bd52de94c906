"""Drafting-side sampling: temperature distributions, inverse-CDF sampling
with per-request generators, and DSpark's sequential left-to-right loop.

The probabilities a drafter hands to the verifier are the very tensors the
draft tokens were drawn from (float32), so rejection sampling stays exact.
Inverse-CDF sampling (one uniform per draft token, a cumulative sum and a
binary search) is ~20x faster than torch.multinomial over V=49152 on CPU.
"""

from __future__ import annotations

import torch

from dspark.draft.heads import MarkovHead


def draw_uniforms(generators: list[torch.Generator], count: int, device: torch.device) -> torch.Tensor:
    """One uniform in [0, 1) per draft position from each request's own
    generator -> [R, count] float32."""
    if not generators:
        return torch.empty(0, count, device=device)
    rows = [torch.rand(count, generator=g, device=g.device) for g in generators]
    return torch.stack(rows).to(device)


def temperature_probs(logits: torch.Tensor, temperatures: torch.Tensor,
                      any_greedy: bool | None = None) -> torch.Tensor:
    """logits [R, V] float32, temperatures [R] -> probabilities [R, V] float32:
    softmax(logits / T), or a one-hot at the argmax where T == 0 (greedy).

    any_greedy: whether some T is 0, when the caller knows it. Reading it from `temperatures`
    is a host read, on a GPU a sync; a loop over draft positions asks it once."""
    greedy = temperatures == 0
    safe_t = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    probs = torch.softmax(logits / safe_t[:, None], dim=-1)
    if any_greedy is None:
        any_greedy = bool(greedy.any())
    if any_greedy:
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (need not sum exactly to 1), uniforms [R] in [0, 1) ->
    indices [R] int64 with P(i) = probs[i] / sum(probs). Only indices of
    positive probability can come out (first index whose cumulative sum
    exceeds u * total)."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(uniforms[:, None].to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def to_vocab(tokens: torch.Tensor, probs: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int):
    """Map draws over a draft vocabulary back to the target's: tokens [R, G] local indices ->
    token ids, probs [R, G, K] -> [R, G, V] (zero outside the draft vocabulary)."""
    if vocab_ids is None:
        return tokens, probs
    full = probs.new_zeros(*probs.shape[:-1], vocab_size).index_copy_(-1, vocab_ids, probs)
    return vocab_ids[tokens], full


def sample_parallel(
    base_logits: torch.Tensor,  # [R, G, K] float32 (K = V, or the draft vocabulary's size)
    temperatures: torch.Tensor,  # [R]
    uniforms: torch.Tensor,  # [R, G]
    vocab_ids: torch.Tensor | None = None,  # [K] token ids of a draft vocabulary (None: K = V)
    vocab_size: int = 0,  # V, needed with vocab_ids
) -> tuple[torch.Tensor, torch.Tensor]:
    """No sequential head: every position samples from its own base logits
    independently -> tokens [R, G] int64, probs [R, G, V] float32."""
    r, g, k = base_logits.shape
    probs = temperature_probs(base_logits.reshape(r * g, k), temperatures.repeat_interleave(g))
    tokens = inverse_cdf(probs, uniforms.reshape(r * g))
    return to_vocab(tokens.view(r, g), probs.view(r, g, k), vocab_ids, vocab_size)


def sample_sequential(
    head: MarkovHead,
    base_logits: torch.Tensor,  # [R, G, K] float32, U_k (K = V, or the draft vocabulary's size)
    hidden: torch.Tensor,  # [R, G, D] backbone hidden h_k
    anchors: torch.Tensor,  # [R] int64, x_0
    temperatures: torch.Tensor,  # [R]
    uniforms: torch.Tensor,  # [R, G]
    top_k: int = 0,  # restrict each step to the top_k tokens of U_k (0 = whole vocabulary)
    vocab_ids: torch.Tensor | None = None,  # [K] token ids of a draft vocabulary (None: K = V)
    vocab_size: int = 0,  # V, needed with vocab_ids
    w2_rows: torch.Tensor | None = None,  # [K, r] the head's W2 rows of the draft vocabulary
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 4: x_k ~ p_k = softmax((U_k + B_k(x_{k-1}, ...)) / T), left to right.
    -> tokens [R, G] int64, probs [R, G, V] float32 (exactly the sampled p_k;
    zero outside the candidates when top_k > 0 and outside the draft vocabulary)."""
    r, g, v = base_logits.shape
    cand_logits = candidates = None
    if 0 < top_k < v:
        cand_logits, candidates = base_logits.topk(top_k, dim=-1)  # [R, G, top_k] local indices
    # every row is written in full on the whole-vocabulary path; zeros are needed only with top_k
    probs = base_logits.new_empty(r, g, v) if candidates is None else base_logits.new_zeros(r, g, v)
    local = torch.empty(r, g, dtype=torch.int64, device=base_logits.device)
    state = head.start_state(r)
    any_greedy = bool((temperatures == 0).any())  # one host read for the whole block, not one per position
    prev = anchors  # token ids: the head's W1 is indexed by the target's vocabulary
    for k in range(g):
        latent, state = head.step(state, prev, hidden[:, k])
        if candidates is None:
            p_k = temperature_probs(base_logits[:, k] + head.bias(latent, w2_rows), temperatures, any_greedy)
            idx = inverse_cdf(p_k, uniforms[:, k])
            probs[:, k] = p_k
        else:
            cand_k = candidates[:, k]
            p_k = temperature_probs(cand_logits[:, k] + head.candidate_bias(latent, cand_k, w2_rows), temperatures,
                                    any_greedy)
            idx = cand_k.gather(1, inverse_cdf(p_k, uniforms[:, k])[:, None]).squeeze(1)
            probs[:, k].scatter_(-1, cand_k, p_k)
        local[:, k] = idx
        prev = idx if vocab_ids is None else vocab_ids[idx]
    return to_vocab(local, probs, vocab_ids, vocab_size)

"""Slow, obviously-correct verification, one request and one token at a time.

Plain Python floats (float64) and loops, written straight from the rule in
`rejection.py`'s docstring, for tests to check the vectorised path against:
given the same uniforms, both must make the same accept/reject decisions and
commit the same tokens.
"""

from __future__ import annotations

import math

import torch

from dspark.types import SamplingParams


def reference_target_probs(logits: torch.Tensor, params: SamplingParams) -> list[float]:
    """One row's sampling distribution: temperature, top-k, top-p, renormalised.

    logits: [V]. Greedy (temperature 0) is a one-hot on the first argmax.
    """
    values = logits.float().tolist()
    vocab = len(values)
    if params.greedy:
        best = max(range(vocab), key=lambda i: (values[i], -i))
        return [1.0 if i == best else 0.0 for i in range(vocab)]
    # Divide in float32 like the fast path, so near-ties order the same way.
    scaled = (logits.float() / torch.tensor(params.temperature, dtype=torch.float32)).tolist()
    order = sorted(range(vocab), key=lambda i: -scaled[i])  # stable: ties in index order
    keep = [True] * vocab
    if 0 < params.top_k < vocab:
        kth = scaled[order[params.top_k - 1]]
        keep = [s >= kth for s in scaled]
    top = max(scaled[i] for i in range(vocab) if keep[i])
    weights = [math.exp(scaled[i] - top) if keep[i] else 0.0 for i in range(vocab)]
    probs = _normalise(weights)
    if params.top_p < 1.0:
        mass = 0.0
        last_kept = order[0]
        for i in order:
            if mass >= params.top_p:  # the mass before token i already reaches top_p
                break
            last_kept = i
            mass += probs[i]
        # Tokens tied with the last one kept stay too.
        probs = _normalise([p if p >= probs[last_kept] else 0.0 for p in probs])
    return probs


def reference_sample(weights: list[float], uniform: float) -> int:
    """The first token whose running mass exceeds uniform * total mass."""
    total = sum(weights)
    point = uniform * total
    running = 0.0
    last_positive = -1
    for i, w in enumerate(weights):
        if w > 0:
            last_positive = i
            running += w
            if running > point:
                return i
    return last_positive


def reference_verify_request(
    draft_tokens: list[int],  # G draft tokens (only the first verify_len are read)
    draft_probs: torch.Tensor | None,  # [G, V] or None (point masses)
    target_logits: torch.Tensor,  # [G + 1, V]
    verify_len: int,
    params: SamplingParams,
    uniforms: list[float],  # G + 1: acceptance uniforms of positions 1..G, then the final-token uniform
) -> list[int]:
    """The committed tokens of one request: accepted drafts, then one target token."""
    final_uniform = uniforms[len(draft_tokens)]
    committed = []
    for k in range(verify_len):
        target = reference_target_probs(target_logits[k], params)
        token = draft_tokens[k]
        if draft_probs is None:
            draft = [1.0 if i == token else 0.0 for i in range(len(target))]
        else:
            draft = draft_probs[k].double().tolist()
        if draft[token] > 0:
            accept_prob = min(1.0, target[token] / draft[token])
        else:  # a drafter that reports p_draft = 0 for its own token: accept iff the target allows it
            accept_prob = 1.0 if target[token] > 0 else 0.0
        if uniforms[k] < accept_prob:
            committed.append(token)
            continue
        residual = [max(0.0, t - d) for t, d in zip(target, draft)]
        if sum(residual) <= 0:
            residual = target
        committed.append(reference_sample(residual, final_uniform))
        return committed
    bonus = reference_target_probs(target_logits[verify_len], params)
    committed.append(reference_sample(bonus, final_uniform))
    return committed


def _normalise(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]

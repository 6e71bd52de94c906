"""Sampling transforms (temperature, top-k, top-p) and inverse-CDF sampling,
checked against the one-row-at-a-time reference in dspark.verify.reference."""

from __future__ import annotations

import itertools

import pytest
import torch
from scipy import stats

from dspark.types import SamplingParams
from dspark.verify.reference import reference_sample, reference_target_probs
from dspark.verify.sampling import SamplingTensors, sample, target_probs

GRID = [
    SamplingParams(temperature=t, top_k=k, top_p=p)
    for t, k, p in itertools.product([0.0, 0.5, 1.0, 1.7], [0, 1, 3, 39, 40], [1.0, 0.9, 0.5, 1e-6])
]


def _rows_close(fast: torch.Tensor, ref: list[float]) -> None:
    torch.testing.assert_close(fast.double(), torch.tensor(ref, dtype=torch.float64), atol=2e-6, rtol=1e-5)


def test_target_probs_matches_reference_per_request_params():
    """A [R, K, V] batch with a different parameter set per request equals the
    reference transform row by row, sums to 1, and keeps shape and float32."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(GRID), 3, 40, generator=gen) * 2.5
    sampling = SamplingTensors.from_params(GRID)
    probs = target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(len(GRID), 3))
    for r, params in enumerate(GRID):
        for k in range(3):
            _rows_close(probs[r, k], reference_target_probs(logits[r, k], params))


def test_target_probs_scalar_params_and_2d_input():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    probs = target_probs(logits, 0.8, 5, 0.7)
    assert probs.shape == (5, 30) and probs.dtype == torch.float32
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.7)
    for m in range(5):
        _rows_close(probs[m], reference_target_probs(logits[m], params))


def test_top_k_one_and_tiny_top_p_are_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    onehot = torch.nn.functional.one_hot(logits.argmax(-1), 50).float()
    assert torch.equal(target_probs(logits, 1.3, 1, 1.0), onehot)
    assert torch.equal(target_probs(logits, 1.3, 0, 1e-9), onehot)
    assert torch.equal(target_probs(logits, 0.0, 7, 0.3), onehot)  # greedy ignores top-k/top-p


def test_ties_at_the_boundary_are_kept():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, 1.0]])
    probs = target_probs(logits, 1.0, 2, 1.0)  # the 2nd largest is tied three ways
    assert (probs[0] > 0).tolist() == [True, True, True, False, True]
    flat = torch.zeros(1, 4)
    probs = target_probs(flat, 1.0, 0, 0.3)  # nucleus of one token, tied with all others
    torch.testing.assert_close(probs, torch.full((1, 4), 0.25))


def test_nucleus_wider_than_first_head():
    """top_p = 0.99 on a flat vocabulary of 1000 needs > 64 tokens (the first
    head the fast path looks at), so the widening loop runs."""
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3)) * 0.3
    params = SamplingParams(temperature=1.0, top_p=0.99)
    probs = target_probs(logits, 1.0, 0, 0.99)
    assert int((probs[0] > 0).sum()) > 256
    for m in range(3):
        _rows_close(probs[m], reference_target_probs(logits[m], params))


def test_sample_matches_reference_on_the_same_uniforms():
    gen = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(200, 17, generator=gen) * 2, -1)
    probs[:, 5] = 0.0
    probs[::3, 0] = 0.0
    uniforms = torch.rand(200, generator=gen, dtype=torch.float64)
    tokens = sample(probs, uniforms)
    assert tokens.shape == (200,) and tokens.dtype == torch.int64
    expected = [reference_sample([float(x) for x in probs[m]], float(uniforms[m])) for m in range(200)]
    assert tokens.tolist() == expected


def test_sample_never_returns_a_zero_probability_token():
    probs = torch.tensor(
        [[0.0, 0.3, 0.0, 0.7, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 5.0]]
    )
    edge = [0.0, 1e-300, 0.5, 1.0 - 2.0**-53]
    for u in edge:
        tokens = sample(probs, torch.full((4,), u, dtype=torch.float64))
        assert all(float(probs[m, t]) > 0 for m, t in enumerate(tokens.tolist())), (u, tokens)
    assert sample(probs, torch.full((4,), 1.0 - 2.0**-53, dtype=torch.float64)).tolist() == [3, 2, 0, 4]


def test_sample_distribution_chi_square():
    """200,000 draws (one call, [200000, 10]) from a fixed distribution with
    zeros and unnormalised weights; Pearson chi-square on the 8 positive cells
    (all expected counts >= 8,000), alpha = 1e-6: false-failure probability
    1e-6. A zero-weight token drawn even once fails the test."""
    weights = torch.tensor([0.0, 3.0, 1.0, 0.5, 0.0, 2.0, 0.25, 1.0, 0.75, 1.5])
    gen = torch.Generator().manual_seed(5)
    tokens = sample(weights.expand(200_000, 10), torch.rand(200_000, generator=gen, dtype=torch.float64))
    counts = torch.bincount(tokens, minlength=10).double()
    assert counts[weights == 0].sum() == 0
    positive = weights > 0
    expected = weights[positive].double() / weights.sum() * 200_000
    statistic = float(((counts[positive] - expected) ** 2 / expected).sum())
    assert stats.chi2.sf(statistic, int(positive.sum()) - 1) > 1e-6


def test_sampling_tensors():
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]
    t = SamplingTensors.from_params(params)
    assert t.greedy.tolist() == [True, False]
    assert t.top_k.tolist() == [0, 5] and t.top_p.tolist() == [1.0, 0.9]
    assert t.repeat_interleave(torch.tensor([2, 1])).temperature.tolist() == pytest.approx([0.0, 0.0, 0.7])
    with pytest.raises(ValueError):
        SamplingTensors.uniform(3, temperature=-1.0)

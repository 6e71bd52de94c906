"""Drafting-side sampling primitives: inverse-CDF sampling draws from the
distribution it is given, never picks a zero-probability token, and greedy
rows are point masses."""

from __future__ import annotations

import torch
from scipy.stats import chisquare

from dspark.draft.sampling import draw_uniforms, inverse_cdf, temperature_probs


def test_inverse_cdf_matches_the_distribution():
    """Chi-square goodness of fit of 40000 draws against a fixed 12-token
    distribution (with zero-probability tokens excluded from the test's
    categories but checked never to occur). Under the null the p-value is
    uniform, so the false-failure probability is 1e-4 for the seeded draw."""
    probs = torch.tensor([0.3, 0.0, 0.1, 0.05, 0.2, 0.0, 0.15, 0.02, 0.08, 0.05, 0.05, 0.0])
    n = 40000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    idx = inverse_cdf(probs.expand(n, -1), u)
    counts = torch.bincount(idx, minlength=12).double()
    assert counts[probs == 0].sum() == 0
    pos = probs > 0
    expected = probs[pos].double() / probs[pos].double().sum() * n
    assert chisquare(counts[pos].numpy(), expected.numpy()).pvalue > 1e-4


def test_inverse_cdf_can_fail_on_a_biased_sampler():
    """The chi-square check above is not vacuous: an off-by-one sampler fails it."""
    probs = torch.tensor([0.5, 0.3, 0.2])
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(1))
    idx = (inverse_cdf(probs.expand(n, -1), u) + 1) % 3
    counts = torch.bincount(idx, minlength=3).double()
    expected = probs.double() / probs.double().sum() * n
    assert chisquare(counts.numpy(), expected.numpy()).pvalue < 1e-6


def test_inverse_cdf_edges():
    probs = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.25, 0.25, 0.25, 0.25], [0.0, 0.5, 0.5, 0.0]])
    below_one = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
    for u in (0.0, 0.5, float(below_one)):
        idx = inverse_cdf(probs, torch.full((3,), u))
        assert bool((probs.gather(1, idx[:, None]) > 0).all()), u
    assert inverse_cdf(probs, torch.zeros(3)).tolist() == [2, 0, 1]
    assert inverse_cdf(probs, torch.full((3,), float(below_one))).tolist() == [2, 3, 2]


def test_temperature_probs_greedy_rows_are_point_masses():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]])
    probs = temperature_probs(logits, torch.tensor([0.0, 2.0]))
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 2.0, -1))


def test_draw_uniforms_uses_each_request_generator():
    gens = [torch.Generator().manual_seed(s) for s in (3, 4)]
    u = draw_uniforms(gens, 5, torch.device("cpu"))
    assert u.shape == (2, 5)
    assert torch.equal(u[1], torch.rand(5, generator=torch.Generator().manual_seed(4)))

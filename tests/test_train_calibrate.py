"""Calibration metrics and Sequential Temperature Scaling on synthetic data."""

import math

import torch

from dspark.train.calibrate import auc, brier, ece, plot_reliability, position_metrics, sts_fit, survival


def _overconfident(n: int, true_temps: list[float], seed: int = 0):
    """Confidence logits that are `true_temps` times too sharp.

    The true conditional acceptance of position k is sigmoid(z_k); the head
    reports z_k * T_k, so dividing by T_k restores calibration exactly.
    """
    gen = torch.Generator().manual_seed(seed)
    g = len(true_temps)
    z = 1.0 + 1.5 * torch.randn(n, g, generator=gen, dtype=torch.float64)
    accepted = (torch.rand(n, g, generator=gen, dtype=torch.float64) < torch.sigmoid(z)).double()
    return z * torch.tensor(true_temps, dtype=torch.float64), accepted


def test_ece_known_values():
    # two bins: predictions 0.1 (labels mean 0.5) and 0.9 (labels mean 0.5) -> |0.1-0.5|/2 + |0.9-0.5|/2
    p = torch.tensor([0.1, 0.1, 0.9, 0.9])
    y = torch.tensor([0.0, 1.0, 0.0, 1.0])
    assert math.isclose(ece(p, y, bins=10), 0.4, abs_tol=1e-6)
    assert ece(torch.tensor([0.25, 0.75]), torch.tensor([0.25, 0.75])) < 1e-12


def test_auc_matches_pair_counting_with_ties():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 5, (200,), generator=gen).double()
    labels = (torch.rand(200, generator=gen) < 0.4).double()
    pos, neg = scores[labels > 0.5], scores[labels < 0.5]
    diff = pos[:, None] - neg[None, :]
    expected = float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
    assert math.isclose(auc(scores, labels), expected, abs_tol=1e-12)
    assert auc(scores, torch.ones(200)) is None
    assert auc(torch.tensor([0.1, 0.9]), torch.tensor([0.0, 1.0])) == 1.0


def test_brier():
    assert math.isclose(brier(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0])), 0.5)


def test_sts_recovers_known_temperatures():
    """n = 40000 blocks, G = 4. At the true temperatures the prefix product
    equals the true survival probability, so the ECE minimiser should sit
    near them; the tolerance (20%) is several times the grid-search noise
    seen across seeds (< 6%)."""
    true = [2.0, 1.5, 3.0, 0.7]
    logits, accepted = _overconfident(40000, true)
    temps = sts_fit(logits, accepted)
    for got, want in zip(temps.tolist(), true):
        assert abs(got / want - 1) < 0.2, (temps, true)
    before = position_metrics(logits, accepted)
    after = position_metrics(logits, accepted, temps)
    for k in range(3):  # positions made overconfident: ECE must drop well below
        assert after[k].ece < 0.5 * before[k].ece
    assert max(m.ece for m in after) < 0.02
    # temperature scaling keeps the order of position 1's scores: same AUC there
    assert math.isclose(after[0].auc, before[0].auc, abs_tol=1e-12)


def test_sts_leaves_calibrated_scores_alone():
    logits, accepted = _overconfident(40000, [1.0, 1.0, 1.0], seed=3)
    temps = sts_fit(logits, accepted)
    assert torch.allclose(temps, torch.ones(3, dtype=torch.float64), rtol=0.2)


def test_survival_is_prefix_product():
    acc = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    assert survival(acc).tolist() == [[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]]


def test_reliability_plot_written(tmp_path):
    logits, accepted = _overconfident(2000, [2.0, 2.0])
    temps = sts_fit(logits, accepted)
    path = plot_reliability(logits, accepted, temps, tmp_path / "rel.png")
    assert path.stat().st_size > 5000


def test_positions_without_enough_survivors_keep_temperature_one():
    """No held-out block reaches position 3 accepted: its ECE would be smallest
    at T -> 0 (every confidence pushed to 0 or 1); STS leaves T = 1 there."""
    logits, accepted = _overconfident(4000, [2.0, 2.0, 2.0], seed=5)
    accepted[:, 2] = 0.0
    temps = sts_fit(logits, accepted)
    assert temps[2] == 1.0 and temps[0] != 1.0
    few = accepted.clone()
    few[:, 1] = 0.0
    few[:4, :2] = 1.0  # four survivors of position 2: below the minimum of 5
    assert sts_fit(logits, few)[1] == 1.0

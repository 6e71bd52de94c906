"""Anchor sampling, block validity and the three-term training loss."""

import math

import pytest
import torch
import torch.nn.functional as F

from dspark.train.anchors import block_validity, make_batch, sample_anchors, sample_seed
from dspark.train.losses import (
    AcceptanceStats,
    LossWeights,
    draft_loss,
    expected_acceptance_length,
    position_weights,
    weight_normalizer,
)


def test_anchors_inside_loss_mask():
    mask = torch.tensor([0, 0, 0, 1, 1, 1, 0, 0, 1, 1], dtype=torch.bool)
    anchors, real = sample_anchors(mask, 4, torch.Generator().manual_seed(0))
    assert real.all()
    assert all(bool(mask[p + 1]) for p in anchors.tolist())
    anchors, real = sample_anchors(mask, 9, torch.Generator().manual_seed(0))
    assert int(real.sum()) == 5 and sorted(set(anchors.tolist())) == [2, 3, 4, 7, 8]


def test_block_validity_stops_at_mask_gap_and_end():
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1], dtype=torch.bool)
    valid = block_validity(mask, torch.tensor([0, 3, 5]), torch.tensor([True, True, False]), 3)
    # anchor 0: targets 1,2 masked, 3 not -> [1,1,0]; anchor 3: targets 4,5,6 -> [1,1,1]; anchor 5 not real
    assert valid.int().tolist() == [[1, 1, 0], [1, 1, 1], [0, 0, 0]]
    valid = block_validity(mask, torch.tensor([4]), torch.tensor([True]), 3)  # targets 5, 6, 7 (past end)
    assert valid.int().tolist() == [[1, 1, 0]]


def test_make_batch_labels_and_lengths():
    tokens = torch.arange(10, 30)
    mask = torch.zeros(20, dtype=torch.bool)
    mask[5:] = True
    batch = make_batch([(tokens, mask), (tokens[:12], mask[:12])], [1, 2], anchors_per_seq=3, block_size=4)
    for b in range(2):
        for a in range(3):
            p = int(batch.anchors[b, a])
            assert p + 4 < batch.token_ids.shape[1]
            for k in range(4):
                if batch.valid[b, a, k]:
                    assert int(batch.labels[b, a, k]) == 10 + p + 1 + k
        assert int(batch.lengths[b]) == min([20, 12][b], int(batch.anchors[b].max()) + 4)
    assert sample_seed(0, 1, 2) == sample_seed(0, 1, 2) != sample_seed(0, 2, 1)


def test_position_weights():
    w = position_weights(7)
    assert math.isclose(float(w[0]), 1.0) and math.isclose(float(w[6]), math.exp(-6 / 7), rel_tol=1e-6)
    assert math.isclose(float(position_weights(4, decay=2.0)[1]), math.exp(-0.5), rel_tol=1e-6)


def _reference_loss(draft, target, labels, valid, conf, weights):
    """Slow per-position loop of paper eqs. 9-12 (weighted mean over supervised positions)."""
    g = draft.shape[2]
    total = ce = tv = bce = norm = 0.0
    for b in range(draft.shape[0]):
        for a in range(draft.shape[1]):
            for k in range(g):
                if not valid[b, a, k]:
                    continue
                w = math.exp(-k / g)
                pd, pt = F.softmax(draft[b, a, k].double(), -1), F.softmax(target[b, a, k].double(), -1)
                l1 = float((pd - pt).abs().sum())
                c_star = 1 - 0.5 * l1
                c = float(torch.sigmoid(conf[b, a, k].double()))
                ce += w * -math.log(float(pd[labels[b, a, k]]))
                tv += w * l1
                bce += w * -(c_star * math.log(c) + (1 - c_star) * math.log(1 - c))
                norm += w
    ce, tv, bce = ce / norm, tv / norm, bce / norm
    total = weights.a_ce * ce + weights.a_tv * tv + weights.a_conf * bce
    return total, ce, tv, bce


def test_loss_matches_reference_loop():
    gen = torch.Generator().manual_seed(0)
    draft = torch.randn(2, 3, 4, 11, generator=gen)
    target = 2 * torch.randn(2, 3, 4, 11, generator=gen)
    labels = torch.randint(0, 11, (2, 3, 4), generator=gen)
    valid = torch.rand(2, 3, 4, generator=gen) < 0.7
    conf = torch.randn(2, 3, 4, generator=gen)
    weights = LossWeights()
    out = draft_loss(draft, target, labels, valid, conf, weights)
    ref = _reference_loss(draft, target, labels, valid, conf, weights)
    for got, want in zip((out.total, out.ce, out.tv, out.conf), ref):
        assert math.isclose(float(got), want, rel_tol=1e-5), (float(got), want)


def test_confidence_target_is_detached_and_padding_ignored():
    gen = torch.Generator().manual_seed(1)
    draft = torch.randn(1, 2, 3, 7, generator=gen, requires_grad=True)
    target = torch.randn(1, 2, 3, 7, generator=gen)
    labels = torch.randint(0, 7, (1, 2, 3), generator=gen)
    valid = torch.ones(1, 2, 3, dtype=torch.bool)
    valid[0, 1] = False  # the whole second block is padding
    conf = torch.zeros(1, 2, 3, requires_grad=True)
    only_conf = draft_loss(draft, target, labels, valid, conf, LossWeights(0.0, 0.0, 1.0))
    only_conf.total.backward()
    assert draft.grad is None or float(draft.grad.abs().sum()) == 0.0  # c* carries no gradient
    assert float(conf.grad[0, 1].abs().sum()) == 0.0 and float(conf.grad[0, 0].abs().sum()) > 0


def test_global_normalizer_splits_into_rank_sums():
    """Sum of per-part losses with the global normalizer == loss of the whole batch."""
    gen = torch.Generator().manual_seed(2)
    draft, target = torch.randn(4, 2, 3, 9, generator=gen), torch.randn(4, 2, 3, 9, generator=gen)
    labels = torch.randint(0, 9, (4, 2, 3), generator=gen)
    valid = torch.rand(4, 2, 3, generator=gen) < 0.8
    conf = torch.randn(4, 2, 3, generator=gen)
    whole = draft_loss(draft, target, labels, valid, conf, LossWeights())
    norm = weight_normalizer(valid, 3)
    parts = [draft_loss(draft[s], target[s], labels[s], valid[s], conf[s], LossWeights(), norm) for s in (slice(0, 1), slice(1, 4))]
    assert math.isclose(float(sum(p.total for p in parts)), float(whole.total), rel_tol=1e-6)


def test_acceptance_stats_and_tau():
    c = torch.tensor([[0.5, 0.5, 1.0]])
    assert math.isclose(float(expected_acceptance_length(c)[0]), 1 + 0.5 + 0.25 + 0.25)
    draft = torch.zeros(1, 2, 3, 5)
    out = draft_loss(draft, draft.clone(), torch.zeros(1, 2, 3, dtype=torch.long), torch.ones(1, 2, 3, dtype=torch.bool), None, LossWeights())
    stats = AcceptanceStats(3)
    valid = torch.tensor([[[True, True, True], [True, False, False]]])
    stats.update(out, valid)
    summary = AcceptanceStats.from_vector(3, stats.as_vector()).summary()
    assert summary["accept_per_position"] == [1.0, 1.0, 1.0]  # identical distributions accept surely
    assert summary["expected_accept_len"] == 4.0 and summary["blocks_full"] == 1
    assert summary["confidence_per_position"] is None  # no confidence head


def _restricted_case(seed: int = 0, v: int = 50, k: int = 12):
    gen = torch.Generator().manual_seed(seed)
    b, a, g = 2, 3, 4
    vocab_ids = torch.randperm(v, generator=gen)[:k].sort().values
    draft_k = torch.randn(b, a, g, k, generator=gen, requires_grad=True)
    target = torch.randn(b, a, g, v, generator=gen) * 2
    labels = vocab_ids[torch.randint(0, k, (b, a, g), generator=gen)]
    valid = torch.rand(b, a, g, generator=gen) > 0.2
    conf = torch.randn(b, a, g, generator=gen)
    return vocab_ids, draft_k, target, labels, valid, conf


def test_draft_vocab_loss_is_the_full_loss_of_the_restricted_distribution():
    """Logits over K draft tokens give exactly the loss (and gradients) of the whole-vocabulary
    loss of the distribution that is zero outside them: its TV counts the target's mass there."""
    vocab_ids, draft_k, target, labels, valid, conf = _restricted_case()
    weights = LossWeights(a_ce=0.3, a_tv=0.7, a_conf=1.0)
    restricted = draft_loss(draft_k, target, labels, valid, conf, weights, vocab_ids=vocab_ids)
    restricted.total.backward()
    grad_k = draft_k.grad.clone()

    draft_k.grad = None
    full = torch.full((*draft_k.shape[:-1], target.shape[-1]), float("-inf"))
    full = full.index_copy(-1, vocab_ids, draft_k)
    whole = draft_loss(full, target, labels, valid, conf, weights)
    whole.total.backward()
    for name in ("total", "ce", "tv", "conf"):
        assert torch.allclose(getattr(restricted, name), getattr(whole, name), atol=1e-5), name
    assert torch.allclose(restricted.soft_accept, whole.soft_accept, atol=1e-6)
    assert torch.equal(restricted.top1_match, whole.top1_match)
    assert torch.allclose(grad_k, draft_k.grad, atol=1e-6)
    # the target's mass outside the K tokens is never accepted
    outside = 1.0 - torch.softmax(target, -1)[..., vocab_ids].sum(-1)
    assert bool((restricted.soft_accept <= 1.0 - 0.5 * outside + 1e-6).all())


def test_draft_vocab_loss_skips_cross_entropy_of_tokens_it_cannot_draft():
    vocab_ids, draft_k, target, labels, valid, conf = _restricted_case(seed=1)
    valid = torch.ones_like(valid)
    weights = LossWeights(a_ce=1.0, a_tv=0.0, a_conf=0.0)
    base = draft_loss(draft_k, target, labels, valid, None, weights, vocab_ids=vocab_ids)
    not_drafted = torch.tensor(sorted(set(range(target.shape[-1])) - set(vocab_ids.tolist())))
    moved = labels.clone()
    moved[0, 0, 0] = not_drafted[0]  # this label is now outside the draft vocabulary
    out = draft_loss(draft_k, target, moved, valid, None, weights, vocab_ids=vocab_ids)
    assert torch.isfinite(out.total)
    logp = torch.log_softmax(draft_k.detach(), -1)
    local = torch.searchsorted(vocab_ids, labels[0, 0, 0])
    w = position_weights(4)[0]
    assert out.ce == pytest.approx(float(base.ce) + float(w * logp[0, 0, 0, local]) / float(weight_normalizer(valid, 4)), abs=1e-5)
    assert not bool(out.top1_match[0, 0, 0])
    assert torch.equal(out.tv, base.tv)  # TV does not depend on the label
    with pytest.raises(ValueError, match="do not match"):
        draft_loss(draft_k, target, labels, valid, None, weights)  # K logits without their token ids

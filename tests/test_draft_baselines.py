"""Eagle3 and MTP-1 baselines on tiny shapes (proposal shapes, incremental
context vs recompute, training-time-test unroll vs inference), and every
learned drafter driven through the real engine on a tiny target."""

from __future__ import annotations

import pytest
import torch

from dspark.draft.factory import build_drafter
from dspark.engine.engine import Engine, EngineConfig
from dspark.engine.generate import generate
from dspark.engine.policy import build_policy
from dspark.models.tiny import tiny_target
from dspark.schedule import CostTable
from dspark.types import SamplingParams

V = 96


def _target(family="llama"):
    return tiny_target(seed=2, vocab_size=V, hidden_size=32, num_layers=4, heads=4, kv_heads=2, family=family)


def _drafter(target, kind, **cfg):
    d = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=5, **cfg)
    with torch.no_grad():
        for p in d.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return d


def _propose(d, states, anchors, temps, seed=0):
    params = [SamplingParams(temperature=t) for t in temps]
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(states))]
    return d.propose(states, torch.tensor(anchors), params, gens)


KINDS = [("eagle3", {"block_size": 3}), ("mtp", {})]


@pytest.mark.parametrize("kind,cfg", KINDS)
def test_proposal_shapes(kind, cfg):
    target = _target()
    d = _drafter(target, kind, **cfg)
    g = d.block_size
    assert g == cfg.get("block_size", 1)
    states = [d.new_state() for _ in range(2)]
    d.observe(states, [torch.arange(4), torch.arange(2)], [torch.randn(4, len(d.tap_layers), 32), torch.randn(2, len(d.tap_layers), 32)])
    p = _propose(d, states, [3, 4], [1.0, 0.0])
    assert p.draft_tokens.shape == (2, g) and p.draft_tokens.dtype == torch.int64
    assert p.draft_probs.shape == (2, g, V) and p.draft_probs.dtype == torch.float32
    assert p.num_drafted.tolist() == [g, g] and p.confidences is None
    torch.testing.assert_close(p.draft_probs.sum(-1), torch.ones(2, g))
    assert torch.equal(p.draft_probs[1].argmax(-1), p.draft_tokens[1])
    assert bool((p.draft_probs.gather(-1, p.draft_tokens[..., None]) > 0).all())


def test_mtp_taps_the_last_layer_and_eagle3_three_layers():
    target = _target()
    assert _drafter(target, "mtp").tap_layers == (3,)
    assert len(_drafter(target, "eagle3").tap_layers) == 3


@pytest.mark.parametrize("kind,cfg", KINDS)
def test_incremental_context_equals_recompute_also_after_truncation(kind, cfg):
    target = _target()
    d = _drafter(target, kind, **cfg)
    t = len(d.tap_layers)
    tokens, hidden = torch.randint(0, V, (10,)), torch.randn(10, t, 32)
    chunked, whole = d.new_state(), d.new_state()
    for lo, hi in [(0, 4), (4, 5), (5, 10)]:
        d.observe([chunked], [tokens[lo:hi]], [hidden[lo:hi]])
    d.observe([whole], [tokens], [hidden])
    a, b = _propose(d, [chunked], [7], [1.0], 3), _propose(d, [whole], [7], [1.0], 3)
    assert torch.equal(a.draft_tokens, b.draft_tokens)
    torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-5, atol=1e-6)
    d.truncate(chunked, 6)
    new_tokens, new_hidden = torch.randint(0, V, (2,)), torch.randn(2, t, 32)
    d.observe([chunked], [new_tokens], [new_hidden])
    fresh = d.new_state()
    d.observe([fresh], [torch.cat([tokens[:6], new_tokens])], [torch.cat([hidden[:6], new_hidden])])
    a, b = _propose(d, [chunked], [7], [1.0], 3), _propose(d, [fresh], [7], [1.0], 3)
    assert torch.equal(a.draft_tokens, b.draft_tokens)
    torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("one_call", [False, True], ids=["per-request", "one-call"])
@pytest.mark.parametrize("kind,cfg", KINDS)
def test_batched_propose_equals_one_request_at_a_time(kind, cfg, one_call):
    """Contexts of 3, 10 and 1 positions; `one_call`: the padded attention a GPU runs,
    given to the CPU (`runtime_layouts`)."""
    from dspark.bench.layouts import runtime_layouts
    from drafters_for_tests import assert_batch_equals_alone

    d = _drafter(_target(), kind, **cfg)
    gen = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, V, (n,), generator=gen) for n in (3, 10, 1)]
    hidden = [torch.randn(n, len(d.tap_layers), 32, generator=gen) for n in (3, 10, 1)]
    with runtime_layouts("cuda" if one_call else "cpu"):
        assert_batch_equals_alone(d, tokens, hidden)


@pytest.mark.parametrize("vocab", [0, 20])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kind,cfg", KINDS)
def test_forward_train_matches_inference(kind, cfg, family, vocab):
    """Training-time test with teacher-forced tokens equals drafting when the
    sequence continues with the drafted tokens; with a draft vocabulary of K
    tokens the training logits cover just those K."""
    target = _target(family)
    d = _drafter(target, kind, **cfg)
    if vocab:
        d.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(2)), vocab)
    g, t = d.block_size, len(d.tap_layers)
    s = 16
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(2, s, t, 32, generator=gen)
    ids = torch.randint(0, V, (2, s), generator=gen)
    anchors = [[2, 8], [0, 11]]
    proposals = {}
    for b in range(2):
        for a, p in enumerate(anchors[b]):
            state = d.new_state()
            d.observe([state], [ids[b, :p]], [hidden[b, :p]])
            prop = _propose(d, [state], [int(ids[b, p])], [1.0], seed=b * 10 + a)
            ids[b, p + 1 : p + 1 + g] = prop.draft_tokens[0]
            proposals[b, a] = prop
    out = d.forward_train(hidden, ids, torch.tensor(anchors))
    assert out.logits.shape == (2, 2, g, vocab or V) and out.confidence_logits is None
    assert (out.vocab_ids is None) == (not vocab)
    for (b, a), prop in proposals.items():
        want = prop.draft_probs[0] if not vocab else prop.draft_probs[0][:, out.vocab_ids]
        torch.testing.assert_close(torch.softmax(out.logits[b, a], -1), want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.softmax(out.full_logits(V)[b, a], -1), prop.draft_probs[0], rtol=1e-4, atol=1e-5)


def test_eagle3_unroll_feeds_its_own_hidden_state():
    """Changing the target feature at the anchor's previous position changes
    every unrolled step (the chain carries the drafter's hidden forward), while
    a feature after the anchor changes nothing."""
    target = _target()
    d = _drafter(target, "eagle3", block_size=3)
    hidden, ids = torch.randn(1, 10, 3, 32), torch.randint(0, V, (1, 10))
    base = d.forward_train(hidden, ids, torch.tensor([[4]])).logits
    bumped = hidden.clone()
    bumped[0, 3] += 1.0
    changed = d.forward_train(bumped, ids, torch.tensor([[4]])).logits
    assert all(not torch.allclose(base[0, 0, k], changed[0, 0, k]) for k in range(3))
    later = hidden.clone()
    later[0, 6] += 1.0
    torch.testing.assert_close(d.forward_train(later, ids, torch.tensor([[4]])).logits, base)


def _engine(target, drafter, policy="fixed"):
    cost = CostTable({1: 0.010, 4: 0.011, 16: 0.016, 64: 0.040})
    return Engine(target, drafter, build_policy(policy, block_size=drafter.block_size, cost=cost, threshold=0.3), EngineConfig())


@pytest.mark.parametrize("kind,cfg", [("dspark", {"block_size": 4, "num_hidden_layers": 1, "markov_rank": 8}),
                                      ("dspark", {"block_size": 4, "num_hidden_layers": 1, "markov_rank": 8,
                                                  "draft_vocab": 20, "transition_top_k": 6}),
                                      ("dflash", {"block_size": 4, "num_hidden_layers": 1}),
                                      ("dflash", {"block_size": 4, "num_hidden_layers": 1, "draft_vocab": 20}),
                                      ("eagle3", {"block_size": 3}), ("eagle3", {"block_size": 3, "draft_vocab": 20}),
                                      ("mtp", {}), ("mtp", {"draft_vocab": 20})])
def test_engine_greedy_output_unchanged_by_learned_drafters(kind, cfg):
    """Through the real engine (tapped target hidden states, verification,
    rollback), a randomly initialised drafter leaves greedy output unchanged,
    also when it drafts from a small draft vocabulary."""
    from dspark.draft.ngram import NoDrafter

    target = tiny_target(seed=0, vocab_size=V)
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    prompt = [5, 17, 33, 5, 17, 33, 5, 17]
    want = generate(_engine(target, NoDrafter()), prompt, params).token_ids
    cfg = dict(cfg)
    vocab = cfg.pop("draft_vocab", 0)
    drafter = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, **cfg)
    if vocab:
        drafter.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(5)), vocab)
    policy = "dspark" if kind == "dspark" else "fixed"
    assert generate(_engine(target, drafter, policy), prompt, params).token_ids == want


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "mtp"])
def test_final_norm_starts_from_the_targets(kind):
    """build_drafter(final_norm_weight=...) copies the target's final RMSNorm
    scale into the drafter's `norm` (the one feeding the shared LM head); a
    wrong shape is refused."""
    from dspark.errors import UserError

    target = tiny_target(seed=1)
    scale = torch.rand(target.config.hidden_size) + 0.5
    size = 1 if kind == "mtp" else 4
    d = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, block_size=size,
                      final_norm_weight=scale)
    assert torch.equal(d.norm.weight.detach(), scale)
    plain = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, block_size=size)
    assert torch.equal(plain.norm.weight.detach(), torch.ones_like(scale))
    with pytest.raises(UserError, match="final norm"):
        build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, block_size=size,
                      final_norm_weight=scale[:-1])

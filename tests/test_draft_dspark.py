"""DSpark / DFlash drafter on tiny shapes: proposal shapes and dtypes, the
sequential head's exact probabilities, the incremental context cache, and
forward_train against the inference path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.draft.config import DSparkConfig
from dspark.draft.dspark import DSparkDrafter
from dspark.draft.factory import build_drafter
from dspark.errors import UserError
from dspark.models.tiny import tiny_target
from dspark.types import SamplingParams

G = 4
HEADS = ["none", "vanilla", "gated", "rnn"]


def _target(family: str = "llama"):
    return tiny_target(seed=1, vocab_size=96, hidden_size=32, num_layers=3, heads=4, kv_heads=2, family=family)


def _drafter(target, head: str = "vanilla", **cfg) -> DSparkDrafter:
    kind = "dflash" if head == "none" else "dspark"
    extra = {} if head == "none" else {"markov_head_type": head, "markov_rank": 8}
    d = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=3,
                      block_size=G, num_hidden_layers=2, **extra, **cfg)
    with torch.no_grad():  # larger than the training init so that every term matters
        for p in d.parameters():
            if p.ndim > 1:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return d


def _context(drafter, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    t, d = len(drafter.tap_layers), drafter.target_config.hidden_size
    hidden = [torch.randn(n, t, d, generator=g) for n in lengths]
    tokens = [torch.randint(0, 96, (n,), generator=g) for n in lengths]
    return tokens, hidden


def _propose(drafter, states, anchors, temps, seed=0):
    params = [SamplingParams(temperature=t) for t in temps]
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(states))]
    return drafter.propose(states, torch.tensor(anchors), params, gens)


@pytest.mark.parametrize("head", HEADS)
def test_proposal_shapes_and_dtypes(head):
    target = _target()
    d = _drafter(target, head, enable_confidence_head=head != "none", confidence_head_with_markov=head != "none")
    states = [d.new_state() for _ in range(3)]
    tokens, hidden = _context(d, [5, 1, 9])
    d.observe(states, tokens, hidden)
    p = _propose(d, states, [3, 4, 5], [1.0, 0.0, 0.7])
    assert p.draft_tokens.shape == (3, G) and p.draft_tokens.dtype == torch.int64
    assert p.num_drafted.tolist() == [G] * 3 and p.num_drafted.dtype == torch.int64
    assert p.draft_probs.shape == (3, G, 96) and p.draft_probs.dtype == torch.float32
    torch.testing.assert_close(p.draft_probs.sum(-1), torch.ones(3, G))
    picked = p.draft_probs.gather(-1, p.draft_tokens[..., None])
    assert bool((picked > 0).all())
    assert bool((p.draft_probs[1].max(-1).values == 1).all())  # greedy row: point masses
    if head == "none":
        assert p.confidences is None and d.name == "dflash" and not d.has_confidence
    else:
        assert p.confidences.shape == (3, G) and p.confidences.dtype == torch.float32
        assert bool(((p.confidences > 0) & (p.confidences < 1)).all())


def test_no_sequential_head_gives_exactly_the_backbone_distribution():
    target = _target()
    d = _drafter(target, "none")
    states = [d.new_state(), d.new_state()]
    d.observe(states, *_context(d, [6, 3]))
    p = _propose(d, states, [7, 8], [0.8, 1.0])
    block = d.draft_block(states, torch.tensor([7, 8]))
    temps = torch.tensor([0.8, 1.0])[:, None, None]
    assert torch.equal(p.draft_probs, torch.softmax(block.base_logits / temps, dim=-1))


def test_zero_transition_matrix_leaves_backbone_logits_unchanged():
    target = _target()
    dspark, dflash = _drafter(target, "vanilla", enable_confidence_head=False), _drafter(target, "none")
    dflash.load_state_dict({k: v for k, v in dspark.state_dict().items() if not k.startswith("markov")})
    with torch.no_grad():
        dspark.markov_head.markov_w2.weight.zero_()
    hidden = torch.randn(2, 14, len(dspark.tap_layers), 32)
    ids = torch.randint(0, 96, (2, 14))
    anchors = torch.tensor([[0, 5], [3, 9]])
    a, b = dspark.forward_train(hidden, ids, anchors), dflash.forward_train(hidden, ids, anchors)
    assert torch.equal(a.logits, b.logits)
    assert b.confidence_logits is None


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_draft_probs_rederived_independently(head):
    """Recompute p_k = softmax((U_k + W2 u_k) / T) by hand from the sampled prefix."""
    target = _target()
    d = _drafter(target, head)
    states = [d.new_state(), d.new_state()]
    d.observe(states, *_context(d, [4, 7]))
    anchors, temps = torch.tensor([11, 12]), torch.tensor([1.0, 0.6])
    p = _propose(d, states, anchors.tolist(), temps.tolist(), seed=5)
    block = d.draft_block(states, anchors)
    head_mod, w1, w2 = d.markov_head, d.markov_head.markov_w1.weight, d.markov_head.markov_w2.weight
    state = torch.zeros(2, 8)
    prev = anchors
    with torch.no_grad():
        for k in range(G):
            h, e = block.hidden[:, k], w1[prev]
            if head == "vanilla":
                latent = e
            elif head == "gated":
                latent = torch.sigmoid(torch.cat([h, e], -1) @ head_mod.gate_proj.weight.T + head_mod.gate_proj.bias) * e
            else:
                z = torch.cat([state, e, h], -1) @ head_mod.joint_proj.weight.T + head_mod.joint_proj.bias
                gate, cand, out = z.chunk(3, -1)
                state = torch.sigmoid(gate) * state + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
                latent = torch.tanh(out)
            want = torch.softmax((block.base_logits[:, k] + latent @ w2.T) / temps[:, None], -1)
            torch.testing.assert_close(p.draft_probs[:, k], want, rtol=1e-5, atol=1e-6)
            prev = p.draft_tokens[:, k]


def test_transition_top_k_restricts_and_renormalises():
    target = _target()
    d = _drafter(target, "vanilla", transition_top_k=5)
    states = [d.new_state()]
    d.observe(states, *_context(d, [5]))
    p = _propose(d, states, [3], [1.0])
    block = d.draft_block(states, torch.tensor([3]))
    prev = torch.tensor([3])
    for k in range(G):
        cand = block.base_logits[0, k].topk(5).indices
        support = (p.draft_probs[0, k] > 0).nonzero().flatten()
        assert set(support.tolist()) <= set(cand.tolist())
        logits = block.base_logits[0, k] + d.markov_head.bias(d.markov_head.prev_embedding(prev))[0]
        want = torch.softmax(logits[cand], -1)
        torch.testing.assert_close(p.draft_probs[0, k, cand], want, rtol=1e-5, atol=1e-6)
        assert int(p.draft_tokens[0, k]) in cand.tolist()
        prev = p.draft_tokens[:, k]


@pytest.mark.parametrize("head,top_k", [("vanilla", 0), ("vanilla", 4), ("rnn", 0), ("none", 0)])
def test_draft_vocabulary_restricts_support_and_renormalises(head, top_k):
    """With a draft vocabulary of K tokens the reported p_k is the softmax of the
    full-vocabulary logits (+ transition bias) restricted to those K tokens (and to
    the top_k of them by base logit); every draft token lies in its support."""
    target = _target()
    d = _drafter(target, head, transition_top_k=top_k, enable_confidence_head=head != "none",
                 confidence_head_with_markov=head != "none")
    states = [d.new_state() for _ in range(2)]
    d.observe(states, *_context(d, [5, 3]))
    full_block = d.draft_block(states, torch.tensor([3, 8]))
    ranking = torch.randperm(96, generator=torch.Generator().manual_seed(2))
    d.set_draft_vocab(ranking, 12)
    allowed = ranking[:12].sort().values
    torch.testing.assert_close(d.draft_block(states, torch.tensor([3, 8])).base_logits,
                               full_block.base_logits[..., allowed], rtol=1e-5, atol=1e-5)
    p = _propose(d, states, [3, 8], [0.9, 0.9])
    prev = torch.tensor([3, 8])
    state = None if d.markov_head is None else d.markov_head.start_state(2)
    for k in range(G):
        logits = full_block.base_logits[:, k, allowed]
        if d.markov_head is not None:
            latent, state = d.markov_head.step(state, prev, full_block.hidden[:, k])
            logits = logits + d.markov_head.bias(latent)[:, allowed]
        keep = torch.ones_like(logits, dtype=torch.bool)
        if top_k:
            keep = torch.zeros_like(keep).scatter_(-1, full_block.base_logits[:, k, allowed].topk(top_k).indices, True)
        want = torch.zeros(2, 96)
        want[:, allowed] = torch.softmax(logits.masked_fill(~keep, float("-inf")) / 0.9, -1)
        torch.testing.assert_close(p.draft_probs[:, k], want, rtol=1e-5, atol=1e-6)
        assert bool((want.gather(1, p.draft_tokens[:, k : k + 1]) > 0).all())
        prev = p.draft_tokens[:, k]
    d.set_draft_vocab(ranking, 0)  # back to the whole vocabulary
    assert d.draft_block(states, torch.tensor([3, 8])).base_logits.shape[-1] == 96


def test_draft_vocabulary_refuses_bad_rankings():
    target = _target()
    d = _drafter(target, "vanilla")
    with pytest.raises(UserError, match="needs the token ranking"):
        d.set_draft_vocab(None, 10)
    with pytest.raises(UserError, match="outside 0..95"):
        d.set_draft_vocab(torch.tensor([0, 96]), 1)
    with pytest.raises(UserError, match="repeats"):
        d.set_draft_vocab(torch.tensor([1, 1, 2]), 2)
    with pytest.raises(UserError, match="exceeds the 3 ranked"):
        d.set_draft_vocab(torch.tensor([1, 2, 3]), 4)
    with pytest.raises(UserError, match="needs the token ranking"):
        _drafter(target, "vanilla", draft_vocab_size=8)


def test_greedy_drafts_are_argmax_of_the_reported_distribution():
    target = _target()
    d = _drafter(target, "rnn")
    states = [d.new_state()]
    d.observe(states, *_context(d, [6]))
    p = _propose(d, states, [2], [0.0])
    assert torch.equal(p.draft_probs[0].argmax(-1), p.draft_tokens[0])


@pytest.mark.parametrize("head", ["vanilla", "rnn"])
def test_incremental_cache_equals_recompute_also_after_truncation(head):
    target = _target()
    d = _drafter(target, head)
    tokens, hidden = _context(d, [12], seed=2)
    tokens, hidden = tokens[0], hidden[0]
    chunked, whole = d.new_state(), d.new_state()
    for lo, hi in [(0, 5), (5, 6), (6, 12)]:
        d.observe([chunked], [tokens[lo:hi]], [hidden[lo:hi]])
    d.observe([whole], [tokens], [hidden])
    a = _propose(d, [chunked], [9], [1.0], seed=7)
    b = _propose(d, [whole], [9], [1.0], seed=7)
    assert torch.equal(a.draft_tokens, b.draft_tokens)
    torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-5, atol=1e-6)
    # truncate to 8 and observe 3 different positions; compare with a fresh state
    new_hidden = torch.randn(3, len(d.tap_layers), 32)
    d.truncate(chunked, 8)
    d.observe([chunked], [tokens[:3]], [new_hidden])
    fresh = d.new_state()
    d.observe([fresh], [tokens[:11]], [torch.cat([hidden[:8], new_hidden])])
    assert chunked.num_context == fresh.num_context == 11
    a = _propose(d, [chunked], [9], [1.0], seed=7)
    b = _propose(d, [fresh], [9], [1.0], seed=7)
    assert torch.equal(a.draft_tokens, b.draft_tokens)
    torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.confidences, b.confidences)


def test_observe_projects_lazily_and_equals_eager_projection():
    """observe only buffers the hidden states; the next propose (or truncate, or a full
    buffer) projects every pending request at once, giving what one-by-one projection gives."""
    from dspark.draft.dspark import MAX_PENDING_ROWS

    target = _target()
    d = _drafter(target, "vanilla")
    tokens, hidden = _context(d, [9, 4], seed=3)
    lazy, eager = [d.new_state(), d.new_state()], [d.new_state(), d.new_state()]
    for lo, hi in [(0, 2), (2, 3), (3, 4)]:
        d.observe(lazy, [t[lo:hi] for t in tokens], [h[lo:hi] for h in hidden])
        d.observe(eager, [t[lo:hi] for t in tokens], [h[lo:hi] for h in hidden])
        d.project_pending(eager)
    d.observe(lazy, [tokens[0][4:], tokens[1][4:]], [hidden[0][4:], hidden[1][4:]])
    d.observe(eager, [tokens[0][4:], tokens[1][4:]], [hidden[0][4:], hidden[1][4:]])
    assert [s.kv.length for s in lazy] == [0, 0] and [s.num_context for s in lazy] == [9, 4]
    a = _propose(d, lazy, [5, 6], [1.0, 1.0], seed=4)
    b = _propose(d, eager, [5, 6], [1.0, 1.0], seed=4)
    assert [s.kv.length for s in lazy] == [9, 4] and not lazy[0].pending
    assert torch.equal(a.draft_tokens, b.draft_tokens)
    torch.testing.assert_close(a.draft_probs, b.draft_probs, rtol=1e-5, atol=1e-6)
    # a request never drafted for projects once it holds MAX_PENDING_ROWS rows
    state = d.new_state()
    many = torch.randn(MAX_PENDING_ROWS - 1, len(d.tap_layers), 32)
    d.observe([state], [torch.zeros(MAX_PENDING_ROWS - 1, dtype=torch.int64)], [many])
    assert state.kv.length == 0 and state.num_pending == MAX_PENDING_ROWS - 1
    d.observe([state], [torch.zeros(1, dtype=torch.int64)], [many[:1]])
    assert state.kv.length == MAX_PENDING_ROWS and state.num_pending == 0
    # truncating into pending rows, and release, leave a consistent state
    d.observe([state], [torch.zeros(3, dtype=torch.int64)], [many[:3]])
    d.truncate(state, MAX_PENDING_ROWS + 1)
    assert state.num_context == MAX_PENDING_ROWS + 1 and not state.pending
    d.observe([state], [torch.zeros(2, dtype=torch.int64)], [many[:2]])
    d.release(state)
    assert state.num_context == 0


@pytest.mark.parametrize("one_call", [False, True], ids=["per-request", "one-call"])
def test_batched_propose_equals_one_request_at_a_time(one_call):
    """Contexts of 3, 10 and 1 positions; `one_call`: the padded attention a GPU runs,
    given to the CPU (`runtime_layouts`)."""
    from dspark.bench.layouts import runtime_layouts
    from drafters_for_tests import assert_batch_equals_alone

    d = _drafter(_target(), "gated")
    with runtime_layouts("cuda" if one_call else "cpu"):
        assert_batch_equals_alone(d, *_context(d, [3, 10, 1]))


@pytest.mark.parametrize("vocab", [0, 30])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("head", HEADS)
def test_forward_train_matches_inference(family, head, vocab):
    """Sample a block at inference, write it into the sequence as the
    continuation, and check forward_train's teacher-forced distributions and
    confidences equal the ones the drafter sampled from; with a draft
    vocabulary of K tokens, over just those K."""
    target = _target(family)
    d = _drafter(target, head, enable_confidence_head=head != "none", confidence_head_with_markov=head != "none")
    if vocab:
        d.set_draft_vocab(torch.randperm(96, generator=torch.Generator().manual_seed(6)), vocab)
    s, anchors = 22, [[3, 12], [0, 9]]
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, s, len(d.tap_layers), 32, generator=g)
    ids = torch.randint(0, 96, (2, s), generator=g)
    for b in range(2):
        for a, p in enumerate(anchors[b]):
            state = d.new_state()
            d.observe([state], [ids[b, :p]], [hidden[b, :p]])
            prop = _propose(d, [state], [int(ids[b, p])], [1.0], seed=10 * b + a)
            ids[b, p + 1 : p + 1 + G] = prop.draft_tokens[0]
            anchors[b][a] = (p, prop)
    out = d.forward_train(hidden, ids, torch.tensor([[p for p, _ in row] for row in anchors]))
    assert out.logits.shape == (2, 2, G, vocab or 96)
    for b in range(2):
        for a, (p, prop) in enumerate(anchors[b]):
            want = prop.draft_probs[0] if not vocab else prop.draft_probs[0][:, out.vocab_ids]
            torch.testing.assert_close(torch.softmax(out.logits[b, a], -1), want, rtol=1e-4, atol=1e-5)
            if head != "none":
                torch.testing.assert_close(torch.sigmoid(out.confidence_logits[b, a]), prop.confidences[0], rtol=1e-4, atol=1e-5)


def test_forward_train_refuses_anchor_too_close_to_the_end():
    target = _target()
    d = _drafter(target)
    with pytest.raises(ValueError, match="anchor"):
        d.forward_train(torch.randn(1, 8, len(d.tap_layers), 32), torch.zeros(1, 8, dtype=torch.int64), torch.tensor([[4]]))


def test_calibration_temperatures_scale_confidence_logits():
    target = _target()
    d = _drafter(target)
    states = [d.new_state()]
    d.observe(states, *_context(d, [5]))
    raw = _propose(d, states, [1], [1.0])
    temps = [1.0, 2.0, 0.5, 3.0]
    d.set_calibration(temps)
    cal = _propose(d, states, [1], [1.0])
    want = torch.sigmoid(torch.logit(raw.confidences) / torch.tensor(temps))
    torch.testing.assert_close(cal.confidences, want, rtol=1e-4, atol=1e-5)
    assert d.config.calibration_temperatures == tuple(temps)


def test_config_validation():
    target = _target()
    cfg = target.config
    with pytest.raises(UserError, match="unknown"):
        DSparkConfig.from_dict({"block_size": 4, "markov_rnak": 3})
    bad = [
        {"block_size": 0},
        {"markov_head_type": "lstm"},
        {"markov_head_type": "vanilla", "markov_rank": 0},
        {"target_layer_ids": [2, 1]},
        {"target_layer_ids": [0, 3]},
        {"mask_token_id": 96},
        {"calibration_temperatures": [1.0, 1.0]},
        {"markov_head_type": "none", "markov_rank": 0, "confidence_head_with_markov": True},
    ]
    for values in bad:
        with pytest.raises(UserError):
            DSparkConfig.from_dict({"block_size": 4, **values}).resolved(cfg)
    with pytest.raises(UserError, match="dflash"):
        build_drafter("dflash", cfg, target.embed_tokens, target.lm_head_weight, markov_head_type="rnn")
    resolved = DSparkConfig().resolved(cfg)
    assert resolved.target_layer_ids == (0, 1, 2) and resolved.mask_token_id == 95
    assert dataclasses.replace(resolved, block_size=4).block_size == 4

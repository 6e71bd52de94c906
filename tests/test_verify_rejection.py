"""The vectorised verifier against the one-request reference, its randomness
contract (per-request generators, fixed order, greedy draws nothing), shapes
and edge cases. Statistical losslessness is in test_verify_lossless.py."""

from __future__ import annotations

import pytest
import torch

from dspark.draft.base import empty_proposal
from dspark.types import DraftProposal, SamplingParams
from dspark.verify import SamplingTensors, draw_uniforms, verify, verify_greedy, verify_with_uniforms
from dspark.verify.reference import reference_verify_request

MIXED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.5, top_p=0.8),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.6),
    SamplingParams(temperature=1.0, top_k=1),
]


def _random_round(seed: int, num_requests: int, block: int, vocab: int, point_mass: bool):
    """Logits and a proposal whose drafts were sampled from reported draft
    probabilities (some with zeros, via a draft top-k), or point masses."""
    gen = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(num_requests, block + 1, vocab, generator=gen) * 2
    # Drafts near the target for some requests, so long accepted runs happen too.
    near = torch.rand(num_requests, 1, 1, generator=gen) < 0.5
    draft_logits = torch.where(near, target_logits[:, :block] * 1.3, torch.randn(num_requests, block, vocab, generator=gen))
    draft_probs = torch.softmax(draft_logits, -1)
    draft_probs = draft_probs * (draft_probs >= draft_probs.topk(6, -1).values[..., -1:])
    draft_probs = draft_probs / draft_probs.sum(-1, keepdim=True)
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).reshape(num_requests, block)
    num_drafted = torch.randint(0, block + 1, (num_requests,), generator=gen)
    verify_lens = (torch.rand(num_requests, generator=gen) * (num_drafted + 1)).long()
    proposal = DraftProposal(tokens, num_drafted, None if point_mass else draft_probs)
    return proposal, target_logits, verify_lens


def _reference(proposal, target_logits, verify_lens, params, uniforms) -> list[list[int]]:
    out = []
    for r in range(proposal.num_requests):
        draft_probs = None if proposal.draft_probs is None else proposal.draft_probs[r]
        out.append(
            reference_verify_request(
                proposal.draft_tokens[r].tolist(), draft_probs, target_logits[r], int(verify_lens[r]),
                params[r], uniforms[r].tolist(),
            )
        )
    return out


@pytest.mark.parametrize("point_mass", [False, True])
def test_fast_path_makes_the_reference_decisions(point_mass):
    """40 random rounds of 12 requests (mixed greedy, temperature, top-k, top-p;
    random verify lengths including 0 and num_drafted): given the same
    uniforms, the vectorised verifier commits exactly the reference's tokens."""
    for seed in range(40):
        proposal, logits, lens = _random_round(seed, 12, 5, 40, point_mass)
        params = [MIXED[(seed + r) % len(MIXED)] for r in range(12)]
        uniforms = torch.rand(12, 6, generator=torch.Generator().manual_seed(100 + seed), dtype=torch.float64)
        result = verify_with_uniforms(proposal, logits, lens, SamplingTensors.from_params(params), uniforms)
        committed = [result.committed(r) for r in range(12)]
        assert committed == _reference(proposal, logits, lens, params, uniforms), seed
        assert result.on_host() == ([len(c) - 1 for c in committed], committed), seed  # the engine's one copy


def test_verify_draws_from_each_generator_in_a_fixed_order():
    proposal, logits, lens = _random_round(7, 6, 4, 30, point_mass=False)
    params = [MIXED[r] for r in range(6)]  # request 1 is greedy

    def generators():
        return [torch.Generator().manual_seed(1000 + r) for r in range(6)]

    gens = generators()
    greedy_state = gens[1].get_state()
    result = verify(proposal, logits, lens, params, gens)
    assert torch.equal(gens[1].get_state(), greedy_state), "a greedy request must not consume randomness"
    uniforms = draw_uniforms(generators(), [p.greedy for p in params], 4)
    expected = verify_with_uniforms(proposal, logits, lens, SamplingTensors.from_params(params), uniforms)
    assert torch.equal(result.output_tokens, expected.output_tokens)
    again = verify(proposal, logits, lens, params, generators())
    assert torch.equal(again.output_tokens, result.output_tokens)
    # Each non-greedy request drew exactly G + 1 float64 uniforms, the greedy one none.
    replay = generators()
    for gen, p in zip(replay, params):
        if not p.greedy:
            torch.rand(5, generator=gen, dtype=torch.float64)
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(replay, gens))


def test_greedy_is_exact_and_ignores_uniforms():
    """All-greedy batches take verify_greedy; the general path gives the same
    result for any uniforms; top_k = 1 sampling is greedy too."""
    for seed in range(10):
        proposal, logits, lens = _random_round(seed, 8, 5, 25, point_mass=seed % 2 == 0)
        # Make some drafts the argmax so accepted runs are long.
        argmax = logits.argmax(-1)[:, :5]
        take = torch.rand(8, 5, generator=torch.Generator().manual_seed(seed)) < 0.7
        proposal.draft_tokens = torch.where(take, argmax, proposal.draft_tokens)
        if proposal.draft_probs is not None:
            proposal.draft_probs = torch.full_like(proposal.draft_probs, 1 / 25)
        greedy = verify(proposal, logits, lens, [SamplingParams(temperature=0)] * 8, [torch.Generator()] * 8)
        direct = verify_greedy(proposal, logits, lens)
        assert torch.equal(greedy.output_tokens, direct.output_tokens)
        for u_seed in range(3):
            u = torch.rand(8, 6, generator=torch.Generator().manual_seed(u_seed), dtype=torch.float64)
            for params in (SamplingTensors.uniform(8, 0.0), SamplingTensors.uniform(8, 1.2, top_k=1)):
                general = verify_with_uniforms(proposal, logits, lens, params, u)
                assert torch.equal(general.output_tokens, greedy.output_tokens)
        for r in range(8):  # accepted iff equal to the argmax; then the argmax
            a = int(greedy.num_accepted[r])
            assert torch.equal(greedy.output_tokens[r, :a], argmax[r, :a])
            assert int(greedy.output_tokens[r, a]) == int(logits[r, a].argmax())
            assert a == int(lens[r]) or int(proposal.draft_tokens[r, a]) != int(argmax[r, a])


def test_shapes_dtypes_and_padding():
    proposal, logits, lens = _random_round(3, 5, 4, 20, point_mass=False)
    lens = torch.tensor([0, 1, 2, 0, 0]).clamp(max=proposal.num_drafted)
    result = verify_with_uniforms(proposal, logits, lens, SamplingTensors.uniform(5), torch.rand(5, 5, dtype=torch.float64))
    assert result.num_accepted.shape == (5,) and result.num_accepted.dtype == torch.int64
    assert result.output_tokens.shape == (5, 5) and result.output_tokens.dtype == torch.int64
    for r in range(5):
        n = int(result.num_accepted[r]) + 1
        assert (result.output_tokens[r, n:] == -1).all() and (result.output_tokens[r, :n] >= 0).all()
        assert int(result.num_accepted[r]) <= int(lens[r])


def test_verify_length_zero_is_a_plain_decode_step():
    proposal, logits, _ = _random_round(4, 4, 3, 16, point_mass=False)
    lens = torch.zeros(4, dtype=torch.int64)
    u = torch.rand(4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    result = verify_with_uniforms(proposal, logits, lens, SamplingTensors.uniform(4), u)
    assert result.num_accepted.tolist() == [0, 0, 0, 0]
    cdf = torch.softmax(logits[:, 0].double(), -1).cumsum(-1)
    expected = (cdf <= u[:, 3:] * cdf[:, -1:]).sum(-1)  # inverse CDF of p_target at position 0
    assert result.output_tokens[:, 0].tolist() == expected.tolist()
    assert (result.output_tokens[:, 1:] == -1).all()


def test_empty_block_size():
    proposal = empty_proposal(3, 0)
    logits = torch.randn(3, 1, 10)
    result = verify(proposal, logits, torch.zeros(3, dtype=torch.int64), [SamplingParams()] * 3,
                    [torch.Generator().manual_seed(r) for r in range(3)])
    assert result.output_tokens.shape == (3, 1) and result.num_accepted.tolist() == [0, 0, 0]


def test_all_accepted_then_bonus_from_the_next_position():
    """Draft distribution = target distribution: acceptance probability 1 at
    every position (up to float rounding, hence u = 0.9999 rather than a u
    just below 1), so the bonus comes from row l."""
    logits = torch.randn(2, 4, 12, generator=torch.Generator().manual_seed(5))
    draft_probs = torch.softmax(logits[:, :3], -1)
    tokens = torch.multinomial(draft_probs.reshape(-1, 12), 1).reshape(2, 3)
    proposal = DraftProposal(tokens, torch.tensor([3, 3]), draft_probs)
    u = torch.full((2, 4), 0.9999, dtype=torch.float64)
    result = verify_with_uniforms(proposal, logits, torch.tensor([3, 2]), SamplingTensors.uniform(2), u)
    assert result.num_accepted.tolist() == [3, 2]
    assert result.output_tokens[0, :3].tolist() == tokens[0].tolist()
    last = torch.softmax(logits, -1)
    assert float(last[0, 3, result.output_tokens[0, 3]]) > 0 and float(last[1, 2, result.output_tokens[1, 2]]) > 0


def test_zero_residual_mass_falls_back_to_the_target():
    """A drafter reporting twice the target probability (a broken contract:
    it sums to 2) makes rejections happen with residual max(0, p - 2p) = 0;
    the recovered token is then sampled from p_target, as in the reference.
    Point-mass drafts with p_target(x) = 1 are always accepted."""
    logits = torch.randn(3, 3, 9, generator=torch.Generator().manual_seed(6))
    target = torch.softmax(logits, -1)
    tokens = target[:, :2].argmax(-1)
    proposal = DraftProposal(tokens, torch.tensor([2, 2, 2]), 2 * target[:, :2])
    u = torch.tensor([[0.99, 0.1, 0.3], [0.99, 0.5, 0.6], [0.999, 0.2, 0.9]], dtype=torch.float64)
    params = [SamplingParams()] * 3
    result = verify_with_uniforms(proposal, logits, torch.tensor([2, 2, 2]), SamplingTensors.from_params(params), u)
    assert result.num_accepted.tolist() == [0, 0, 0]
    assert [result.committed(r) for r in range(3)] == _reference(proposal, logits, torch.tensor([2, 2, 2]), params, u)
    sure = torch.full((1, 3, 9), -1e4)
    sure[0, :, 4] = 0.0  # p_target(4) = 1 to float precision
    point = DraftProposal(torch.tensor([[4, 4]]), torch.tensor([2]))
    u_high = torch.full((1, 3), 1.0 - 2.0**-53, dtype=torch.float64)
    assert verify_with_uniforms(point, sure, torch.tensor([2]), SamplingTensors.uniform(1), u_high).committed(0) == [4, 4, 4]


def test_draft_token_outside_the_target_support_is_always_rejected():
    logits = torch.zeros(1, 2, 6)
    logits[0, 0, 0], logits[0, 0, 1] = 5.0, 4.0  # top-2 support {0, 1}
    proposal = DraftProposal(torch.tensor([[3]]), torch.tensor([1]), torch.full((1, 1, 6), 1 / 6))
    u = torch.tensor([[0.0, 0.42]], dtype=torch.float64)
    result = verify_with_uniforms(proposal, logits, torch.tensor([1]), SamplingTensors.uniform(1, top_k=2), u)
    assert result.num_accepted.tolist() == [0] and int(result.output_tokens[0, 0]) != 3


def test_bad_inputs_are_rejected():
    proposal, logits, lens = _random_round(8, 3, 4, 10, point_mass=False)
    params, gens = [SamplingParams()] * 3, [torch.Generator()] * 3
    with pytest.raises(ValueError, match="verify lengths"):
        verify(proposal, logits, proposal.num_drafted + 1, params, gens)
    with pytest.raises(ValueError, match="target_logits"):
        verify(proposal, logits[:, :3], lens, params, gens)
    with pytest.raises(ValueError, match="one SamplingParams"):
        verify(proposal, logits, lens, params[:2], gens)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(DraftProposal(proposal.draft_tokens, proposal.num_drafted, proposal.draft_probs[..., :5]),
               logits, lens, params, gens)


@pytest.mark.parametrize("seed", range(4))
def test_cutting_the_block_to_the_longest_verify_length_changes_nothing(seed):
    """The engine verifies a proposal cut to W - 1 = the step's longest verify length,
    with draw_block_size = G: same committed tokens, and every generator advanced by
    the same G + 1 uniforms, as verifying the whole block."""
    from dspark.engine.forward import StepBatch

    block, vocab = 6, 20
    proposal, logits, lens = _random_round(seed, len(MIXED), block, vocab, point_mass=False)
    lens = lens.clamp(max=2)  # the longest verify length is at most 2 < G
    width = int(lens.max()) + 1
    batch = StepBatch(ragged=None, segments=[], entries=[], proposal=proposal, verify_lens=lens,
                      logits_rows=torch.empty(0), block_size=block)
    assert batch.verify_width == width and batch.verify_proposal().block_size == width - 1
    gens_a = [torch.Generator().manual_seed(9 + i) for i in range(len(MIXED))]
    gens_b = [torch.Generator().manual_seed(9 + i) for i in range(len(MIXED))]
    whole = verify(proposal, logits, lens, MIXED, gens_a)
    cut = verify(batch.verify_proposal(), logits[:, :width], lens, MIXED, gens_b, draw_block_size=block)
    assert torch.equal(whole.num_accepted, cut.num_accepted)
    assert [whole.committed(r) for r in range(len(MIXED))] == [cut.committed(r) for r in range(len(MIXED))]
    assert all(torch.equal(a.get_state(), b.get_state()) for a, b in zip(gens_a, gens_b))
    with pytest.raises(ValueError, match="draw_block_size"):
        verify(proposal, logits, lens, MIXED, gens_b, draw_block_size=block - 1)


def test_scattered_logits_are_padded_rows_and_a_view_when_every_entry_has_the_full_width():
    """scatter_logits lays [M, V] rows out as [E, W, V]: entry e's verify_len + 1 rows first,
    zeros after. When every entry has W rows (a step that verifies nothing: W = 1) it returns
    the same values as a view, without the zeroed copy."""
    from types import SimpleNamespace

    from dspark.engine.forward import StepBatch

    def batch(lens):
        entries = [SimpleNamespace(verify_len=l) for l in lens]
        return StepBatch(ragged=None, segments=entries, entries=entries, proposal=None,
                         verify_lens=torch.tensor(lens), logits_rows=torch.empty(0), block_size=4)

    ragged = torch.randn(2 + 1 + 4, 5)  # verify lengths 1, 0, 3: W = 4
    out = batch([1, 0, 3]).scatter_logits(ragged)
    assert out.shape == (3, 4, 5)
    assert torch.equal(out[0, :2], ragged[:2]) and not out[0, 2:].any()
    assert torch.equal(out[1, :1], ragged[2:3]) and not out[1, 1:].any()
    assert torch.equal(out[2], ragged[3:])
    for lens in ([0, 0, 0], [2, 2]):
        rows = torch.randn(len(lens) * (lens[0] + 1), 5)
        even = batch(lens).scatter_logits(rows)
        assert even.shape == (len(lens), lens[0] + 1, 5) and torch.equal(even.flatten(0, 1), rows)
        assert even.data_ptr() == rows.data_ptr()

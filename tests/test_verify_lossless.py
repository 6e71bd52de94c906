"""Statistical losslessness of speculative decoding with dspark's verifier, on
the enumerable synthetic world of tests/lossless_harness.py, plus power checks
(the same test rejects known-biased schemes) and greedy parity.

Every statistical test here: S = 100,000 independent continuations of
n = 3 tokens after a fixed prefix (vocabulary 8, so 512 cells; a random trigram
target, a disagreeing bigram drafter, block size G = 4, fresh random verify
lengths in 0..G each round unless stated), Pearson chi-square against the
exact target distribution computed by enumeration with the reference sampling
transform, cells with expected count < 5 pooled, and a sample in a cell of
target probability 0 failing outright. The test fails when p < ALPHA = 1e-6,
so a correct verifier fails it with probability ~1e-6 (chi-square
approximation); the seeds are fixed, so each run is deterministic.
"""

from __future__ import annotations

import pytest
import torch

from dspark.types import SamplingParams, VerifyResult
from dspark.verify import SamplingTensors, sample, target_probs, verify_greedy, verify_with_uniforms
from lossless_harness import (
    ALPHA,
    NgramTable,
    PointMassDrafter,
    RoundState,
    TableDrafter,
    World,
    chi_square,
    exact_joint,
    fixed_length,
    lossless_check,
    plain_greedy,
    random_lengths,
    random_world,
    run_speculative,
)

SAMPLES = 100_000


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0.8, top_k=3),
        SamplingParams(temperature=1.2, top_p=0.7),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
    ],
    ids=["t1", "t0.7", "t1.5", "topk3", "topp0.7", "topk5-topp0.9"],
)
def test_lossless_sampled_drafts(params):
    """Sampled drafts (draft_probs reported), random verify lengths: the
    continuation follows the target under temperature / top-k / top-p. 100,000
    samples, chi-square, alpha 1e-6 (false failure ~1e-6)."""
    result = lossless_check(random_lengths, params, drafter="table", num_samples=SAMPLES, seed=11)
    assert result.p_value > ALPHA, result


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)], ids=["t1", "t0.7-topk4"]
)
def test_lossless_point_mass_drafts(params):
    """Point-mass drafts (draft_probs None: accept with p_target(x), residual =
    p_target without x). 100,000 samples, chi-square, alpha 1e-6."""
    result = lossless_check(random_lengths, params, drafter="point", num_samples=SAMPLES, seed=12)
    assert result.p_value > ALPHA, result


@pytest.mark.parametrize("length", [0, 4], ids=["l0", "full"])
def test_lossless_fixed_verify_length(length):
    """Verify length 0 every round (plain decoding through the verifier) and
    the full block every round. 100,000 samples, chi-square, alpha 1e-6."""
    result = lossless_check(fixed_length(length), SamplingParams(temperature=0.9), num_samples=SAMPLES, seed=13)
    assert result.p_value > ALPHA, result


def test_lossless_draft_probs_with_zeros():
    """A drafter with its own top-k = 3 (draft probability 0 on most tokens, so
    the residual keeps target mass there), at temperature 0.8 with a target
    top-p = 0.85. 100,000 samples, chi-square, alpha 1e-6."""
    world = random_world(seed=14)
    drafter = TableDrafter(NgramTable.random(8, 2, seed=15, scale=3.0), temperature=1.0, top_k=3)
    params = SamplingParams(temperature=0.8, top_p=0.85)
    sampling = SamplingTensors.uniform(SAMPLES, 0.8, 0, 0.85)
    samples = run_speculative(world, drafter, random_lengths, sampling, 3, seed=16)
    result = chi_square(samples, exact_joint(world, params, 3), world.vocab)
    assert result.p_value > ALPHA, result


def test_lossless_mixed_params_in_one_batch():
    """Three parameter sets interleaved request by request in one batch (the
    per-request vectorised path); each group of ~33,000 samples is tested on
    its own at alpha 1e-6, so the false-failure probability is ~3e-6."""
    world = random_world(vocab=8, seed=17)
    groups = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=4),
        SamplingParams(temperature=1.4, top_p=0.8),
    ]
    index = torch.arange(SAMPLES) % 3
    sampling = SamplingTensors(
        temperature=torch.tensor([g.temperature for g in groups], dtype=torch.float32)[index],
        top_k=torch.tensor([g.top_k for g in groups])[index],
        top_p=torch.tensor([g.top_p for g in groups], dtype=torch.float64)[index],
    )
    drafter = TableDrafter(NgramTable.random(8, 2, seed=18, scale=2.5))
    samples = run_speculative(world, drafter, random_lengths, sampling, 3, seed=19)
    for g, params in enumerate(groups):
        result = chi_square(samples[index == g], exact_joint(world, params, 3), world.vocab)
        assert result.p_value > ALPHA, (params, result)


def test_lossless_stateful_policy_through_observe():
    """A policy that learns from realised acceptances (next verify length =
    last round's accepted count + 1, per sequence) is still lossless: its
    decisions depend on past rounds only. 100,000 samples, chi-square,
    alpha 1e-6."""
    last = torch.full((SAMPLES,), 4, dtype=torch.int64)

    def choose(state: RoundState) -> torch.Tensor:
        return last.clamp(max=state.block_size)

    def observe(state: RoundState, lens: torch.Tensor, result: VerifyResult) -> None:
        last.copy_(result.num_accepted + 1)

    result = lossless_check(choose, SamplingParams(temperature=1.1), num_samples=SAMPLES, seed=22, observe=observe)
    assert result.p_value > ALPHA, result


def test_harness_enumeration_and_chi_square_basics():
    """The enumerated joint sums to 1 and puts zero mass where top-k forbids;
    a sample in a zero-probability cell gives p = 0; exact frequencies pass."""
    world = random_world(seed=23)
    joint = exact_joint(world, SamplingParams(top_k=2), 3)
    assert abs(float(joint.sum()) - 1.0) < 1e-12 and int((joint > 0).sum()) <= 8
    cells = torch.tensor([[a, b, c] for a in range(8) for b in range(8) for c in range(8)])
    exact = torch.repeat_interleave(cells, (joint * 10_000).round().long(), dim=0)
    assert chi_square(exact, joint, 8).p_value > 0.5
    impossible = cells[joint == 0][:1]
    assert chi_square(torch.cat([exact, impossible]), joint, 8).p_value == 0.0


def _appendix_a_world() -> tuple[World, TableDrafter]:
    """Paper Appendix A: vocabulary {A, B} = {0, 1}, p_target = (0.7, 0.3),
    p_draft = (0.5, 0.5) at every position, block size 2."""
    return World(NgramTable.constant([0.7, 0.3]), (0,), 2), TableDrafter(NgramTable.constant([0.5, 0.5]))


def _retrospective(state: RoundState) -> torch.Tensor:
    """Admits x1 (l = 2) when it is A, verifies nothing (l = 0) when it is B:
    the admission of x1 depends on x1 itself."""
    return torch.where(state.draft_tokens[:, 0] == 0, 2, 0)


def test_power_appendix_a_retrospective_admission_is_rejected():
    """The same test on the paper's retrospective scheduler: 100,000 samples
    of 3 tokens; the first token must come out (0.85, 0.15) instead of
    (0.7, 0.3), and the chi-square test must reject (p < 1e-6). A lossless
    policy on the same world (always l = 2) passes."""
    world, drafter = _appendix_a_world()
    params = SamplingParams()
    expected = exact_joint(world, params, 3)
    sampling = SamplingTensors.uniform(SAMPLES)
    biased = run_speculative(world, drafter, _retrospective, sampling, 3, seed=20)
    first_a = float((biased[:, 0] == 0).double().mean())
    assert abs(first_a - 0.85) < 5 * (0.85 * 0.15 / SAMPLES) ** 0.5, first_a
    assert chi_square(biased, expected, 2).p_value < ALPHA
    causal = run_speculative(world, drafter, fixed_length(2), sampling, 3, seed=21)
    assert chi_square(causal, expected, 2).p_value > ALPHA


def _recovered_from_target(proposal, target_logits, verify_lens, sampling, uniforms) -> VerifyResult:
    """A broken verifier: accepts with min(1, p_target / p_draft) but draws the
    recovered token from p_target instead of the residual."""
    result = verify_with_uniforms(proposal, target_logits, verify_lens, sampling, uniforms)
    rejected = result.num_accepted < verify_lens
    probs = target_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p)
    rows = probs[torch.arange(probs.shape[0]), result.num_accepted]  # [S, V]
    wrong = sample(rows, uniforms[:, -1])
    out = result.output_tokens.clone()
    out[rejected, result.num_accepted[rejected]] = wrong[rejected]
    return VerifyResult(result.num_accepted, out)


def test_power_recovered_token_from_target_is_rejected():
    """The test must catch a verifier that skips the residual: 100,000
    samples, chi-square p < 1e-6 expected (observed p is far smaller)."""
    result = lossless_check(random_lengths, SamplingParams(), num_samples=SAMPLES, seed=11, verify_fn=_recovered_from_target)
    assert result.p_value < ALPHA, result


def test_power_peeking_at_the_target_is_rejected():
    """A policy that verifies x1 only when the target likes it more than the
    drafter (peek_target_probs) is biased; 100,000 samples, p < 1e-6."""

    def peek(state: RoundState) -> torch.Tensor:
        x1 = state.draft_tokens[:, 0]
        p_target = state.peek_target_probs[:, 0].gather(1, x1[:, None]).squeeze(1)
        p_draft = state.draft_probs[:, 0].gather(1, x1[:, None]).squeeze(1)
        return torch.where(p_target >= p_draft, state.block_size, 0)

    result = lossless_check(peek, SamplingParams(), num_samples=SAMPLES, seed=11)
    assert result.p_value < ALPHA, result


def _greedy_via_verify_greedy(proposal, target_logits, verify_lens, sampling, uniforms) -> VerifyResult:
    return verify_greedy(proposal, target_logits, verify_lens)


@pytest.mark.parametrize("verify_fn", [verify_with_uniforms, _greedy_via_verify_greedy], ids=["general", "greedy"])
def test_greedy_parity_with_plain_greedy(verify_fn):
    """30 random worlds (vocab 8-16, bigram/trigram targets, block size 1-6),
    sampled and point-mass drafters (every third one a sharpened copy of the
    target, so whole blocks are accepted), 50 sequences under each verify
    length pattern (each fixed length 0..G, and fresh random lengths every
    round). Every speculative greedy continuation of 12 tokens equals plain
    greedy decoding token for token."""
    for seed in range(30):
        vocab, order, block = 8 + seed % 9, 2 + seed % 2, 1 + seed % 6
        world = World(NgramTable.random(vocab, order, seed), (seed % vocab, (3 * seed) % vocab), block)
        expected = torch.tensor(plain_greedy(world, 12))
        if seed % 3 == 0:
            draft_table = NgramTable(world.target.logits * 3, order)
        else:
            draft_table = NgramTable.random(vocab, 2, seed + 500, scale=1.0)
        drafter = PointMassDrafter(draft_table) if seed % 2 else TableDrafter(draft_table)
        pattern = torch.arange((block + 2) * 50) // 50  # 0..G: that fixed length; G + 1: random

        def choose(state: RoundState) -> torch.Tensor:
            return torch.where(pattern <= block, pattern, random_lengths(state))

        sampling = SamplingTensors.uniform(pattern.numel(), temperature=0.0)
        out = run_speculative(world, drafter, choose, sampling, 12, seed=seed, verify_fn=verify_fn)
        assert (out == expected).all(), seed

"""End-to-end losslessness of the real engine on a tiny random-weight target.

What is tested: the joint distribution of the first three generated tokens (the first sampled at the end of prefill, the next two verified from one draft block)
after a fixed prompt, produced by the full engine (batched drafting with a
disagreeing bigram drafter whose confidences depend on the previous draft
token, a verify-length policy, one ragged target forward, rejection sampling,
KV rollback), against the exact distribution computed by enumeration with
the slow reference sampling transform. Vocabulary 8, so 512 cells.

Statistic: Pearson chi-square with cells of expected count < 5 pooled.
Sample size: 16,384 continuations per case (8,192 for each untrained
learned drafter). Significance alpha = 1e-6, which
is each case's false-failure probability. Power: the same test must reject a
drafter that reports probabilities other than the ones it sampled from (the
bug that has broken losslessness in public implementations).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.engine.engine import Engine, EngineConfig
from dspark.engine.policy import build_policy
from dspark.models.kv_cache import KVCache
from dspark.models.tiny import tiny_target
from dspark.schedule import CostTable
from dspark.types import RaggedBatch, SamplingParams
from dspark.verify.reference import reference_target_probs
from drafters_for_tests import BigramDrafter
from lossless_harness import ALPHA, chi_square

VOCAB = 8
NUM_TOKENS = 3  # tokens compared: the first comes from prefill, the next two from one verified block
PROMPT = [3, 1, 4, 1, 5, 7, 2, 6]
BATCH = 512
SAMPLES = 16 * 1024


def _next_probs(target, seqs: list[list[int]], params: SamplingParams) -> torch.Tensor:
    """Reference sampling distribution after each sequence: [len(seqs), VOCAB] float64."""
    cache = KVCache(target.config, len(seqs), 32)
    slots = [cache.allocate() for _ in seqs]
    batch = RaggedBatch(torch.tensor(sum(seqs, [])), slots, [len(s) for s in seqs])
    rows = torch.tensor([sum(len(s) for s in seqs[: i + 1]) - 1 for i in range(len(seqs))])
    with torch.no_grad():
        logits = target.forward(batch, cache, logits_rows=rows).logits
    return torch.stack([torch.tensor(reference_target_probs(l, params), dtype=torch.float64) for l in logits])


def _exact_joint(target, params: SamplingParams) -> torch.Tensor:
    """P(x_1..x_n | prompt) over VOCAB**n cells (first token most significant), by enumeration."""
    joint = torch.ones(1, dtype=torch.float64)
    for depth in range(NUM_TOKENS):
        prefixes = [PROMPT + list(t) for t in itertools.product(range(VOCAB), repeat=depth)]
        joint = (joint[:, None] * _next_probs(target, prefixes, params)).reshape(-1)
    return joint


def _engine_samples(
    target, drafter, policy: str, params: SamplingParams, num_samples: int = SAMPLES, batch: int = BATCH,
    cost: CostTable | None = None,
) -> torch.Tensor:
    # flat up to about two tokens per request, steep after: the schedulers verify part of each block
    cost = cost or CostTable({1: 0.010, 512: 0.020, 1024: 0.024, 1536: 0.040, 4096: 0.300})
    engine = Engine(
        target, drafter, build_policy(policy, block_size=drafter.block_size, cost=cost, threshold=0.4),
        EngineConfig(max_running=batch, max_seq_len=32, kv_budget_tokens=batch * 32, max_prefill_tokens=batch * 8),
    )
    out, verified, rounds = [], 0, 0
    for start in range(0, num_samples, batch):
        ids = [
            engine.add_request(PROMPT, SamplingParams(**{**params.__dict__, "seed": start + i}))
            for i in range(batch)
        ]
        while engine.has_work():
            engine.step()
        for i in ids:
            req = engine.pop_finished(i)
            out.append(req.output_ids[:NUM_TOKENS])
            verified, rounds = verified + req.stats.draft_tokens, rounds + req.stats.rounds
    mean_verify = verified / rounds
    # the policy must really verify draft tokens, and (but for "fixed") not always all of them
    assert 0.1 < mean_verify and (policy == "fixed" or mean_verify < drafter.block_size - 0.1), mean_verify
    return torch.tensor(out, dtype=torch.int64)


class LyingDrafter(BigramDrafter):
    """Samples from its table but reports uniform probabilities: a known bug."""

    def propose(self, states, anchors, params, generators):
        proposal = super().propose(states, anchors, params, generators)
        proposal.draft_probs = torch.full_like(proposal.draft_probs, 1.0 / VOCAB)
        return proposal


def _flat_target(block_quantized: bool = False):
    """The tiny target with its logits scaled down so continuations spread
    over most of the 256 cells (the raw tiny target puts ~all mass on one)."""
    target = tiny_target(seed=21, vocab_size=VOCAB, block_quantized=block_quantized)
    with torch.no_grad():
        target.model.norm.weight.mul_(0.08)
    return target


CASES = [
    ("dspark", SamplingParams(temperature=1.0, max_new_tokens=NUM_TOKENS + 1, ignore_eos=True)),
    ("dspark-async", SamplingParams(temperature=0.7, top_k=5, top_p=0.9, max_new_tokens=NUM_TOKENS + 1, ignore_eos=True)),
    ("threshold", SamplingParams(temperature=1.3, max_new_tokens=NUM_TOKENS + 1, ignore_eos=True)),
]


@pytest.mark.parametrize("policy,params", CASES, ids=[c[0] for c in CASES])
def test_engine_output_matches_target_distribution(policy, params):
    target = _flat_target()
    drafter = BigramDrafter(VOCAB, block_size=3, seed=4, sharpness=1.5)
    samples = _engine_samples(target, drafter, policy, params)
    result = chi_square(samples, _exact_joint(target, params), VOCAB)
    assert result.p_value > ALPHA, result


@pytest.mark.parametrize("policy", ["dspark", "dspark-async"])
def test_prompt_lookup_with_its_confidences_is_lossless(policy):
    """The ngram drafter's point-mass drafts, verified to the lengths the DSpark schedulers pick
    from its running hit-rate confidences (the prompt repeats tokens, so lookups find matches).
    Its copies are accepted about as often as a random token here (~0.15), so the step cost
    makes a first verified token per request cheap and further ones dear."""
    from dspark.draft.ngram import NgramDrafter

    target = _flat_target()
    params = SamplingParams(temperature=0.9, max_new_tokens=NUM_TOKENS + 1, ignore_eos=True)
    cost = CostTable({1: 0.010, 512: 0.0100, 1024: 0.0105, 1536: 0.014, 2048: 0.030})
    samples = _engine_samples(target, NgramDrafter(block_size=3), policy, params, num_samples=8192, cost=cost)
    result = chi_square(samples, _exact_joint(target, params), VOCAB)
    assert result.p_value > ALPHA, result


LEARNED = [
    ("dspark", {"block_size": 3, "markov_head_type": "vanilla", "markov_rank": 4}, "dspark"),
    ("dspark", {"block_size": 3, "markov_head_type": "rnn", "markov_rank": 4}, "dspark-async"),
    ("dflash", {"block_size": 3}, "fixed"),
    ("eagle3", {"block_size": 3}, "fixed"),
    ("mtp", {}, "fixed"),
]


@pytest.mark.parametrize("kind,cfg,policy", LEARNED, ids=[f"{k}-{c.get('markov_head_type', '')}" for k, c, _ in LEARNED])
def test_untrained_learned_drafters_are_lossless(kind, cfg, policy):
    """The same test through each learned drafter, untrained (random weights
    disagree with the target): tapped hidden states, incremental context
    caches and sequential sampling must all leave the distribution exact."""
    from dspark.draft.factory import build_drafter

    target = _flat_target()
    drafter = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=3, **cfg)
    params = SamplingParams(temperature=1.0, max_new_tokens=NUM_TOKENS + 1, ignore_eos=True)
    samples = _engine_samples(target, drafter, policy, params, num_samples=8192)
    result = chi_square(samples, _exact_joint(target, params), VOCAB)
    assert result.p_value > ALPHA, result


@pytest.fixture
def gpu_layouts():
    """Give the CPU what a GPU runs (`dspark.bench.layouts.runtime_layouts`): the target
    and the drafters attend in one padded call."""
    from dspark.bench.layouts import runtime_layouts

    with runtime_layouts("cuda"):
        yield


@pytest.mark.parametrize("kind,policy", [("dspark", "dspark"), ("dspark", "fixed"), ("eagle3", "fixed")])
def test_gpu_layouts_keep_greedy_output(kind, policy, gpu_layouts):
    """Five requests at once, of different prompt lengths, verifying different numbers of
    draft tokens: speculative greedy output equals plain greedy decoding, token for token."""
    from dspark.draft.factory import build_drafter
    from dspark.draft.ngram import NoDrafter
    from dspark.models.tiny import tiny_target

    target = tiny_target(seed=7)
    cfg = {"markov_head_type": "vanilla", "markov_rank": 4} if kind == "dspark" else {}
    drafter = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=3,
                            block_size=3, **cfg)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9], [2] * 11, [7, 7]]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)

    def run(drafter, policy):
        cost = CostTable({1: 0.010, 512: 0.020, 1024: 0.024, 1536: 0.040, 4096: 0.300})
        engine = Engine(target, drafter, build_policy(policy, block_size=drafter.block_size, cost=cost, threshold=0.4),
                        EngineConfig(max_running=len(prompts), max_seq_len=64))
        ids = [engine.add_request(p, params) for p in prompts]
        while engine.has_work():
            engine.step()
        return [engine.pop_finished(i).output_ids for i in ids], engine

    plain, _ = run(NoDrafter(1), "none")
    drafted, engine = run(drafter, policy)
    assert drafted == plain and engine.num_full_drafts + engine.num_partial_drafts > 0


@pytest.mark.parametrize("kind,policy", [("dspark", "dspark"), ("eagle3", "fixed")])
def test_gpu_layouts_are_lossless_on_the_cpu(kind, policy, gpu_layouts):
    """The distribution test through the GPU layouts (`gpu_layouts`)."""
    from dspark.draft.factory import build_drafter

    target = _flat_target()
    cfg = {"markov_head_type": "vanilla", "markov_rank": 4} if kind == "dspark" else {}
    drafter = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=3,
                            block_size=3, **cfg)
    params = SamplingParams(temperature=1.0, max_new_tokens=NUM_TOKENS + 1, ignore_eos=True)
    samples = _engine_samples(target, drafter, policy, params, num_samples=8192)
    result = chi_square(samples, _exact_joint(target, params), VOCAB)
    assert result.p_value > ALPHA, result


@pytest.mark.parametrize("kind,cfg", [("dspark", {"block_size": 3, "markov_head_type": "vanilla", "markov_rank": 4}),
                                      ("dflash", {"block_size": 3}), ("eagle3", {"block_size": 3}), ("mtp", {})])
def test_draft_vocabulary_is_lossless(kind, cfg):
    """A drafter restricted to 5 of the 8 tokens can never propose the other 3;
    the engine's output must still follow the target exactly."""
    from dspark.draft.factory import build_drafter

    target = _flat_target()
    drafter = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=3, **cfg)
    drafter.set_draft_vocab(torch.tensor([6, 1, 4, 0, 3, 7, 2, 5]), 5)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=NUM_TOKENS + 1, ignore_eos=True)
    samples = _engine_samples(target, drafter, "dspark" if kind == "dspark" else "fixed", params, num_samples=8192)
    result = chi_square(samples, _exact_joint(target, params), VOCAB)
    assert result.p_value > ALPHA, result
    assert drafter.draft_ids.tolist() == [0, 1, 3, 4, 6]  # the first 5 ranked, sorted


@pytest.mark.parametrize("kind", ["bigram", "dspark", "dspark-bf16", "bigram-block-quantized"])
def test_engine_with_cpu_kernels_matches_target_distribution(kind, monkeypatch):
    """The small-row CPU kernel (csrc/rowgemm.c, 1-48 rows) in the loop, in the target and (for
    a learned drafter) in the drafter: 4 requests at a time, so every decode and verification
    forward has at most 16 rows and runs on it. "block-quantized": a target whose weights lie on
    the Q4_1 / Q8_0 grids, as the embedded model's do, served from 4- and 8-bit records.
    "dspark-bf16": the drafter's products of 8 rows or more in bfloat16 (DSPARK_DRAFTER_BF16=on),
    "dspark" the same drafter on the exact kernel only (=off)."""
    from dspark.draft.factory import build_drafter
    from dspark.models.cpu_kernels import cpu_kernels_available, enable_cpu_kernels, enable_drafter_cpu_kernels

    if not cpu_kernels_available():
        pytest.skip("the CPU kernel is unavailable here")
    monkeypatch.setenv("DSPARK_DRAFTER_BF16", "on" if kind == "dspark-bf16" else "off")
    target = _flat_target(block_quantized=kind == "bigram-block-quantized")
    assert enable_cpu_kernels(target)
    if kind == "bigram-block-quantized":
        assert target.model.layers[0].mlp.down_proj.cpu_kernel.format == "q4" and target.head_kernel.format == "q8"
    if kind.startswith("bigram"):
        drafter = BigramDrafter(VOCAB, block_size=3, seed=4, sharpness=1.5)
    else:
        drafter = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, seed=3,
                                block_size=3, markov_head_type="vanilla", markov_rank=4)
        assert enable_drafter_cpu_kernels(drafter, target)
    params = SamplingParams(temperature=1.0, max_new_tokens=NUM_TOKENS + 1, ignore_eos=True)
    samples = _engine_samples(target, drafter, "fixed", params, num_samples=2048, batch=4)
    served = target.model.layers[0].mlp.down_proj.cpu_kernel.fast_calls
    assert served >= 2048 // 4, served  # at least one verification forward per batch took the kernel
    if kind == "dspark":
        assert drafter.head_kernel.fast_calls >= 2048 // 4
    if kind == "dspark-bf16":  # 4 requests x 3 positions = 12 rows a round through every draft layer
        layer = drafter.layers[0].mlp.down_proj.cpu_kernel
        assert layer.bf16_calls >= 2048 // 4  # (rounds with fewer rows, e.g. one request left, take the kernel)
    result = chi_square(samples, _exact_joint(target, params), VOCAB)
    assert result.p_value > ALPHA, result


def test_drafter_bf16_path_keeps_greedy_output(monkeypatch):
    """Greedy parity with the drafter's many-row products in bfloat16 (DSPARK_DRAFTER_BF16=on): four
    requests at a time through the engine, verifying every drafted token, give plain decoding's tokens."""
    from dspark.draft.ngram import NoDrafter
    from dspark.draft.factory import build_drafter
    from dspark.models.cpu_kernels import cpu_kernels_available, enable_cpu_kernels, enable_drafter_cpu_kernels

    if not cpu_kernels_available():
        pytest.skip("the CPU kernel is unavailable here")
    monkeypatch.setenv("DSPARK_DRAFTER_BF16", "on")
    target = tiny_target(seed=5, vocab_size=VOCAB)
    assert enable_cpu_kernels(target)
    drafter = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, seed=3,
                            block_size=3, markov_head_type="vanilla", markov_rank=4)
    assert enable_drafter_cpu_kernels(drafter, target)
    params = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:] + [0, 1], [7, 6, 5]]
    outputs = {}
    for name, drafting in (("plain", NoDrafter(3)), ("drafted", drafter)):
        engine = Engine(target, drafting, build_policy("fixed", block_size=3),
                        EngineConfig(max_running=4, max_seq_len=32, kv_budget_tokens=4 * 32))
        ids = [engine.add_request(p, params) for p in prompts]
        while engine.has_work():
            engine.step()
        outputs[name] = [engine.pop_finished(i).output_ids for i in ids]
    assert outputs["drafted"] == outputs["plain"]
    assert drafter.layers[0].mlp.down_proj.cpu_kernel.bf16_calls > 0


def test_engine_test_rejects_misreported_draft_probabilities():
    target = _flat_target()
    params = SamplingParams(temperature=1.0, max_new_tokens=NUM_TOKENS + 1, ignore_eos=True)
    samples = _engine_samples(target, LyingDrafter(VOCAB, block_size=3, seed=4, sharpness=3.0), "fixed", params)
    result = chi_square(samples, _exact_joint(target, params), VOCAB)
    assert result.p_value < ALPHA, result

"""Engine behaviour on tiny random-weight targets: speculative greedy output
equals plain greedy token for token, whatever the drafter, the policy, the
batch composition, chunked prefill or preemption."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark.draft.ngram import NgramDrafter, NoDrafter
from dspark.engine.engine import Engine, EngineConfig
from dspark.engine.generate import generate
from dspark.errors import UserError
from dspark.models.tiny import tiny_target
from dspark.engine.policy import build_policy
from dspark.schedule import CostTable
from dspark.types import SamplingParams
from tests.drafters_for_tests import BigramDrafter

VOCAB = 96
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)


def _prompts(seed: int, count: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # repetitive prompts give the ngram drafter something to copy
    out = []
    for i in range(count):
        base = torch.randint(0, VOCAB, (3 + i % 4,), generator=g).tolist()
        out.append((base * 4)[: 5 + 3 * i])
    return out


def _engine(target, drafter, policy="fixed", **cfg) -> Engine:
    cost = CostTable({1: 0.010, 4: 0.011, 16: 0.016, 64: 0.040, 256: 0.150})
    return Engine(target, drafter, build_policy(policy, block_size=drafter.block_size, cost=cost, threshold=0.3), EngineConfig(**cfg))


def _plain_greedy(target, prompt, params=GREEDY) -> list[int]:
    return generate(_engine(target, NoDrafter()), prompt, params).token_ids


@pytest.mark.parametrize("seed", range(6))
def test_speculative_greedy_equals_plain_greedy(seed):
    target = tiny_target(seed=seed, vocab_size=VOCAB)
    drafters = [NgramDrafter(block_size=5), BigramDrafter(VOCAB, block_size=4, seed=seed)]
    for prompt in _prompts(seed, 3):
        want = _plain_greedy(target, prompt)
        assert len(want) == GREEDY.max_new_tokens
        for drafter in drafters:
            for policy in ("fixed", "threshold", "dspark", "dspark-async"):
                got = generate(_engine(target, drafter, policy), prompt, GREEDY)
                assert got.token_ids == want, (drafter.name, policy)


def test_plain_greedy_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from dspark.models import load_target
    from dspark.models.tiny import tiny_hf_folder

    folder = tiny_hf_folder(tmp_path, seed=3, vocab_size=VOCAB)
    ours = load_target(str(folder)).model
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = _prompts(3, 4)[-1]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt):].tolist()
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    assert _plain_greedy(ours, prompt, params) == ref


def test_batched_requests_match_running_alone():
    target = tiny_target(seed=11, vocab_size=VOCAB)
    prompts = _prompts(11, 6)
    alone = [_plain_greedy(target, p) for p in prompts]
    drafter = BigramDrafter(VOCAB, block_size=4, seed=5)
    engine = _engine(target, drafter, "dspark", max_running=4, max_prefill_tokens=7)
    ids = [engine.add_request(p, GREEDY) for p in prompts[:3]]
    for _ in range(3):
        engine.step()
    ids += [engine.add_request(p, GREEDY) for p in prompts[3:]]  # join mid-flight
    while engine.has_work():
        engine.step()
    assert [engine.pop_finished(i).output_ids for i in ids] == alone


def test_preemption_by_recomputation_keeps_outputs():
    target = tiny_target(seed=12, vocab_size=VOCAB)
    prompts = _prompts(12, 4)
    alone = [_plain_greedy(target, p) for p in prompts]
    engine = _engine(target, NgramDrafter(block_size=4), kv_budget_tokens=120, max_running=4)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.has_work():
        engine.step()
    reqs = [engine.pop_finished(i) for i in ids]
    assert sum(r.num_preemptions for r in reqs) > 0, "budget too loose to exercise preemption"
    assert [r.output_ids for r in reqs] == alone
    assert engine.kv.tokens_in_use() == 0 and engine.kv.num_free_slots == 4


def test_abort_frees_kv_and_other_requests_continue():
    target = tiny_target(seed=13, vocab_size=VOCAB)
    prompts = _prompts(13, 3)
    engine = _engine(target, NgramDrafter(block_size=4), max_running=3)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()
    engine.step()
    engine.abort(ids[1])
    while engine.has_work():
        engine.step()
    assert engine.pop_finished(ids[1]).finish_reason == "abort"
    assert engine.pop_finished(ids[0]).output_ids == _plain_greedy(target, prompts[0])
    assert engine.kv.tokens_in_use() == 0


def test_eos_and_max_tokens_stop_generation():
    target = tiny_target(seed=14, vocab_size=VOCAB)
    prompt = _prompts(14, 2)[1]
    full = _plain_greedy(target, prompt)
    eos = full[7]
    target.config = dataclasses.replace(target.config, eos_token_ids=(eos,))
    params = SamplingParams(temperature=0.0, max_new_tokens=40)
    out = generate(_engine(target, NgramDrafter(block_size=5)), prompt, params)
    assert out.token_ids == full[: full.index(eos)] and out.finish_reason == "stop"
    short = generate(_engine(target, NgramDrafter(block_size=5)), prompt, SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
    assert short.token_ids == full[:3] and short.finish_reason == "length"


def test_bad_requests_are_refused():
    target = tiny_target(seed=15, vocab_size=VOCAB)
    engine = _engine(target, NoDrafter(), max_seq_len=32)
    with pytest.raises(UserError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(UserError, match="context"):
        engine.add_request([1] * 40, GREEDY)
    with pytest.raises(UserError, match="token ids"):
        engine.add_request([VOCAB + 5], GREEDY)



@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_stop_the_step_with_a_clear_error(bad):
    """One poisoned LM-head weight (NaN or infinite) makes the next step fail loudly, where
    healthy weights pass (the check is one float32 sum of the logits)."""
    target = tiny_target(seed=16, vocab_size=VOCAB)
    engine = _engine(target, NoDrafter())
    engine.add_request([1, 2, 3], GREEDY)
    engine.step()  # healthy weights: no error
    with torch.no_grad():
        target.lm_head_weight[7, 0] = bad
    with pytest.raises(RuntimeError, match="non-finite logits"):
        engine.step()

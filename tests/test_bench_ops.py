"""The op counter (python -m dspark.bench.ops): per step and phase, on a tiny target with
a tiny DSpark drafter, and the GPU attention layout seen in the counts on a CPU."""

from __future__ import annotations

import pytest

from dspark.bench import ops
from dspark.draft.factory import build_drafter
from dspark.engine.engine import Engine, EngineConfig
from dspark.models import llama
from dspark.models.tiny import tiny_target
from dspark.schedule import make_policy
from dspark.types import SamplingParams


def _engine(policy: str, k: int | None = None, max_prefill_tokens: int = 512):
    target = tiny_target(seed=0)
    drafter = build_drafter(
        "dspark", target.config, target.embed_tokens, target.lm_head_weight, seed=3, block_size=3,
        markov_head_type="vanilla", markov_rank=4)
    return Engine(target, drafter, make_policy(policy, None, **({"k": k} if k else {})),
                  EngineConfig(max_running=4, max_seq_len=96, max_prefill_tokens=max_prefill_tokens))


PROMPTS = [[5, 6, 7, 8, 9], [9, 10, 11], [3, 4], [12, 13, 14, 15]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12)


def test_steps_are_counted_by_phase_and_the_engine_is_restored():
    engine = _engine("none")
    plain = ops.count_step_ops(engine, PROMPTS, GREEDY, 3, 5)
    assert len(plain) == 5 and not any(r.drafted for r in plain)
    assert all(r.count("forward") > 100 and r.count("propose") == 0 and r.count() > r.count("forward") for r in plain)
    assert "forward" not in vars(engine.target)  # the counting wrappers are gone
    engine = _engine("fixed", k=3)
    drafting = ops.count_step_ops(engine, PROMPTS, GREEDY, 3, 5)
    assert sum(r.drafted for r in drafting) >= 3  # but a step that only prefills a replacement prompt
    assert all((r.count("propose") > 50) == r.drafted for r in drafting)
    assert "propose" not in vars(engine.drafter) and "observe" not in vars(engine.drafter)
    text = ops.summarise_ops(plain + drafting)
    n = sum(r.drafted for r in drafting)
    assert f"| plain | {10 - n} |" in text and f"| drafting | {n} |" in text and "- drafting, propose:" in text
    with pytest.raises(ValueError, match="concurrency"):
        ops.count_step_ops(engine, PROMPTS, GREEDY, 0, 1)


@pytest.mark.parametrize("policy, k", [("none", None), ("fixed", 3)])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_step_reads_as_many_scalars_back_for_four_requests_as_for_one(policy, k, temperature):
    """Each scalar a step reads back to Python is a sync on a GPU; the verifier's outcome and
    the drafts' confidences are read as one copy per step, not a few scalars per request (a
    step of 16 requests read 54 before)."""
    params = SamplingParams(temperature=temperature, max_new_tokens=12, seed=1)
    reads = {c: [r.host_reads() for r in ops.count_step_ops(_engine(policy, k), PROMPTS, params, c, 5, warmup=1)]
             for c in (1, 4)}
    assert reads[4] == reads[1] and max(reads[1]) <= 12, reads


def test_one_attention_call_takes_fewer_ops_when_query_lengths_differ():
    """Requests verifying drafts beside one still in its prompt (different query lengths):
    the GPU layout attends in one call, the CPU one in a call per length."""
    from dspark.bench.layouts import runtime_layouts

    prompts = [[5, 6, 7, 8, 9], [9, 10, 11], [3, 4] * 20, [12, 13, 14, 15]]
    counts = {}
    for device in ("cpu", "cuda"):
        engine = _engine("fixed", k=3, max_prefill_tokens=8)  # the long prompt comes in chunks beside verifications
        with runtime_layouts(device):
            counts[device] = [r.count("forward") for r in ops.count_step_ops(engine, prompts, GREEDY, 4, 3, warmup=1)]
    assert llama.attention_groups([1, 8], [0, 0], [0, 1], 2, "cpu") == [[0], [1]]  # restored
    assert all(gpu < cpu for gpu, cpu in zip(counts["cuda"], counts["cpu"])), counts


def test_bad_arguments_stop_before_loading():
    with pytest.raises(SystemExit, match="usage"):
        ops.main(["none", "none", "0", "5"])
    with pytest.raises(SystemExit, match="usage"):
        ops.main(["none", "none", "1", "5", "tpu"])

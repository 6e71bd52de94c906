"""The step trace (dspark.bench.steps): per-step records of a closed-loop engine,
the summary that sets measured forwards beside the profile, and the wrapped
methods put back afterwards."""

from __future__ import annotations

import pytest

from dspark.bench.steps import StepRecord, summarise, trace_steps
from dspark.draft.ngram import NgramDrafter
from dspark.engine.engine import Engine, EngineConfig
from dspark.models.tiny import tiny_target
from dspark.schedule import CostTable, make_policy
from dspark.schedule.cost import ForwardGrid, SplitCost
from dspark.types import SamplingParams


def test_trace_records_every_step_and_restores_the_engine():
    target = tiny_target(seed=0)
    drafter = NgramDrafter(block_size=3)
    engine = Engine(target, drafter, make_policy("fixed", None, k=3), EngineConfig(max_running=2, max_seq_len=64))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11]]
    records = trace_steps(engine, prompts, SamplingParams(temperature=0.0, max_new_tokens=6), 2, 12, progress=False)
    assert len(records) == 12
    assert records[0].budget == records[0].prefill == 14 and records[0].requests == 2  # both prompts in step 1
    assert all(r.forward > 0 and r.seconds >= r.forward for r in records)
    assert sum(r.tokens for r in records) >= 12  # at least one token per decoding request and step
    assert all(r.decoding == 2 for r in records)  # closed loop: a finished request is replaced at once
    assert any(r.drafted for r in records[1:])  # the prompts repeat: prompt lookup finds matches
    assert "forward" not in vars(target) and "propose" not in vars(drafter)  # the wrappers are gone
    assert "plan" not in vars(engine.batcher)
    grid = ForwardGrid({2: CostTable({2: 0.01, 8: 0.02})})
    text = summarise(records, SplitCost(grid, CostTable({1: 0.001, 2: 0.002})))
    assert "decode-only steps of 2 requests" in text and "profile F(2," in text
    with pytest.raises(ValueError, match="concurrency"):
        trace_steps(engine, prompts, SamplingParams(), 0, 1)


def test_summary_groups_decode_steps_by_budget():
    def rec(budget, forward, drafted):
        return StepRecord(seconds=forward + 0.01, forward=forward, propose=0.01 if drafted else 0.0, observe=0.0,
                          budget=budget, requests=4, decoding=4, prefill=56 if budget == 60 else 0, drafted=drafted,
                          tokens=4 + (budget - 4) * drafted)
    records = [rec(4, 0.10, False), rec(4, 0.12, False), rec(6, 0.15, True), rec(60, 0.5, False)]  # last: a prefill
    text = summarise(records)
    assert "3 decode-only steps of 4 requests" in text
    assert "B=4: 2 steps, forward median 110.0 ms" in text and "B=60" not in text
    assert "   plain: 2 steps" in text and " drafted: 1 steps" in text
    assert summarise([]) == "no steps"


def test_generate_ab_refuses_bad_arguments():
    from dspark.bench.generate_ab import main

    for argv in (["x"], ["0"], ["1", "default", "extra"]):
        with pytest.raises(SystemExit, match="usage"):
            main(argv)
    with pytest.raises(SystemExit, match="compared with `--drafter none`"):
        main(["1", "none"])


def test_every_kth_quarter_drafts_a_probe_sized_part_and_delegates_the_rest():
    from dspark.bench.steps import EveryKthQuarter, main

    inner = make_policy("fixed", None, k=3)
    policy = EveryKthQuarter(inner, 3)
    chosen = [policy.choose_drafts(list(range(9))) for _ in range(6)]
    assert [sum(c) for c in chosen] == [0, 0, 2, 0, 0, 2] and chosen[2][:2] == [True, True]
    assert policy.choose_drafts([7]) == [False] and EveryKthQuarter(inner, 1).choose_drafts([7]) == [True]
    assert policy.name == "fixed" and policy.k == 3 and policy.policy is inner  # the rest is the wrapped policy's
    with pytest.raises(ValueError, match="probe interval"):
        EveryKthQuarter(inner, 0)
    for argv in (["d", "dspark", "16"], ["d", "dspark", "0", "10"], ["d", "dspark", "16", "10", "x"],
                 ["d", "dspark", "16", "10", "0", "0"], ["d", "dspark", "16", "10", "0", "300", "1"]):
        with pytest.raises(SystemExit, match="usage"):
            main(argv)

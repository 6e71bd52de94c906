"""The step trace (dspark.bench.steps): per-step records of a closed-loop engine,
the summary that sets measured forwards beside the profile, and the wrapped
methods put back afterwards."""

from __future__ import annotations

from dataclasses import replace

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
    assert "decide" not in vars(engine.policy) and "choose_drafts" not in vars(engine.policy)
    # fixed k verifies every drafted token, and has no gate to probe
    assert all(r.verified > 0 for r in records if r.drafted) and not any(r.probe for r in records)
    assert all(r.verified == 0 for r in records if not r.drafted)
    grid = ForwardGrid({2: CostTable({2: 0.01, 8: 0.02})})
    text = summarise(records, SplitCost(grid, CostTable({1: 0.001, 2: 0.002})))
    assert "decode-only steps of 2 requests" in text and "profile F(2," in text
    with pytest.raises(ValueError, match="concurrency"):
        trace_steps(engine, prompts, SamplingParams(), 0, 1)


def test_think_steps_let_the_batch_shrink_and_regrow():
    prompts = [[5, 6, 7, 5, 6], [9, 10, 11, 9], [4, 8, 4, 8, 4]]
    params = SamplingParams(temperature=0.0, max_new_tokens=4)

    def trace(think):  # a fresh engine each time: a trace leaves its last requests running
        engine = Engine(tiny_target(seed=0), NgramDrafter(block_size=3), make_policy("none", None),
                        EngineConfig(max_running=3, max_seq_len=64))
        return trace_steps(engine, prompts, params, 3, 30, progress=False, think_steps=think)

    assert all(r.decoding == 3 for r in trace(0.0))  # closed loop: a finished request is replaced at once
    paused, again = trace(3.0), trace(3.0)
    assert len(paused) == 30 and min(r.decoding for r in paused) < 3 and max(r.decoding for r in paused) == 3
    assert [r.decoding for r in paused] == [r.decoding for r in again]  # seeded: the same pauses every time
    assert all(r.decoding >= 1 for r in paused)  # when everyone pauses, the trace skips to the first to join
    with pytest.raises(ValueError, match="think_steps"):
        trace(-1.0)


def test_summary_groups_decode_steps_by_budget():
    def rec(budget, forward, drafted):
        return StepRecord(seconds=forward + 0.01, forward=forward, propose=0.01 if drafted else 0.0, observe=0.0,
                          budget=budget, requests=4, decoding=4, prefill=56 if budget == 60 else 0, drafted=drafted,
                          tokens=4 + (budget - 4) * drafted, verified=(budget - 4) * drafted)
    records = [rec(4, 0.10, False), rec(4, 0.12, False), rec(6, 0.15, True), rec(60, 0.5, False)]  # last: a prefill
    text = summarise(records)
    assert "3 decode-only steps of 4 requests" in text
    assert "B=4: 2 steps, forward median 110.0 ms" in text and "B=60" not in text
    assert "   plain: 2 steps" in text and " drafted: 1 steps" in text and "gate:" not in text
    records += [StepRecord(seconds=0.2, forward=0.1, propose=0.05, observe=0.0, budget=4, requests=4, decoding=4,
                           prefill=0, drafted=True, tokens=4, verified=0, probe=probe) for probe in (True, True, False)]
    assert ("gate: 4 drafted steps: 2 probes (2 verified nothing, propose 0.10 s), 2 chosen (1 verified nothing, "
            "propose 0.06 s, 2 tokens past one a request); 7 vetoes" in summarise(records, vetoes=7))
    assert summarise([]) == "no steps"


def test_generate_ab_refuses_bad_arguments():
    from dspark.bench.generate_ab import main

    for argv in (["x"], ["0"], ["1", "default", "extra"]):
        with pytest.raises(SystemExit, match="usage"):
            main(argv)
    with pytest.raises(SystemExit, match="compared with `--drafter none`"):
        main(["1", "none"])


def test_generate_ab_leaves_its_warm_up_runs_out_of_the_totals(monkeypatch, capsys):
    from dspark.bench import generate_ab

    calls = []

    def fake(prompt, arm):  # the warm-up runs are 100x slower: counted, they would show
        calls.append(arm)
        seconds = 100.0 if len(calls) <= 2 else (1.0 if arm == "none" else 0.5)
        return {"num_generated": 10, "seconds": seconds, "tokens_per_second": 10 / seconds, "token_ids": [1, 2],
                "stats": {"rounds": 1, "draft_tokens": 0, "mean_accepted_length": 1.0}}

    monkeypatch.setattr(generate_ab, "generate", fake)
    generate_ab.main(["1"])
    assert calls == ["none", "default"] + ["none", "default"] * len(generate_ab.PROMPTS)
    assert "none 10.0 tok/s, default 20.0 tok/s over 30 tokens each: 2.000x; same tokens in every pair: True" in capsys.readouterr().out


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


def test_trace_marks_the_gates_probes_and_counts_what_was_verified():
    """Under a prefix scheduler the gate's first choice, before any curve exists, is a probe;
    afterwards prompt lookup's confident matches are the gate's own choices."""
    target = tiny_target(seed=0)
    cost = SplitCost(ForwardGrid({2: CostTable({2: 0.01, 8: 0.02})}), CostTable({1: 0.001, 2: 0.002}))
    engine = Engine(target, NgramDrafter(block_size=3), make_policy("dspark", cost),
                    EngineConfig(max_running=2, max_seq_len=64))
    observe = engine.policy.observe_step

    def as_priced(timing):  # a busy machine's wall clock would steer the gate: tell it each step cost its price
        observe(replace(timing, seconds=cost.seconds(timing.budget, timing.requests, drafted=timing.drafted)))

    engine.policy.observe_step = as_priced
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10, 11]]
    records = trace_steps(engine, prompts, SamplingParams(temperature=0.0, max_new_tokens=6), 2, 8, progress=False)
    assert [r.probe for r in records[:2]] == [False, True] and records[1].drafted and records[1].verified == 1
    chosen = [r for r in records[2:] if r.drafted]
    assert chosen and not any(r.probe for r in chosen) and all(r.verified == 0 for r in records if not r.drafted)
    nothing = sum(r.verified == 0 for r in chosen)
    assert "decide" not in vars(engine.policy) and "choose_drafts" not in vars(engine.policy)
    text = summarise(records, cost, engine.policy.gate.vetoed)
    assert f"gate: {1 + len(chosen)} drafted steps: 1 probes (0 verified nothing, propose " in text
    assert f"{len(chosen)} chosen ({nothing} verified nothing, propose " in text
    assert f"past one a request); {engine.policy.gate.vetoed} vetoes" in text


def test_trace_sets_the_async_schedulers_snapshot_choices_beside_algorithm_1():
    """In each step the asynchronous scheduler reads its capacity off the snapshot, the trace asks
    Algorithm 1 what it would verify on the same confidences; the summary adds up the difference."""
    target = tiny_target(seed=0)
    cost = SplitCost(ForwardGrid({2: CostTable({2: 0.01, 8: 0.02})}), CostTable({1: 0.0001, 2: 0.0002}))
    engine = Engine(target, NgramDrafter(block_size=3), make_policy("dspark-async", cost),
                    EngineConfig(max_running=2, max_seq_len=64))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 9, 10, 11, 9, 10]]
    records = trace_steps(engine, prompts, SamplingParams(temperature=0.0, max_new_tokens=8), 2, 16, progress=False)
    snap = [r for r in records if r.snapshot]
    assert snap and all(r.drafted for r in snap)  # only a drafted step's decide can read a snapshot
    assert not any(r.causal_verified or r.causal_expected for r in records if not r.snapshot)
    assert all(r.expected <= r.verified + 1e-9 and r.causal_expected <= r.causal_verified + 1e-9 for r in snap)
    text = summarise(records, cost)
    extra = sum(r.verified - r.causal_verified for r in snap)
    assert f"   async: {len(snap)} decides read the snapshot; against Algorithm 1 on the same confidences " \
           f"they verified {extra:+d} tokens" in text
    # the causal scheduler's trace has no such line
    causal = Engine(tiny_target(seed=0), NgramDrafter(block_size=3), make_policy("dspark", cost),
                    EngineConfig(max_running=2, max_seq_len=64))
    plain = trace_steps(causal, prompts, SamplingParams(temperature=0.0, max_new_tokens=8), 2, 8, progress=False)
    assert not any(r.snapshot for r in plain) and "async:" not in summarise(plain, cost)


def test_summary_prices_the_async_schedulers_difference_to_algorithm_1():
    def rec(verified, causal, expected, causal_expected):
        return StepRecord(seconds=0.03, forward=0.02, propose=0.01, observe=0.0, budget=2 + verified, requests=2,
                          decoding=2, prefill=0, drafted=True, tokens=2, verified=verified, snapshot=True,
                          causal_verified=causal, expected=expected, causal_expected=causal_expected)
    records = [rec(4, 1, 1.2, 0.7), rec(0, 2, 0.0, 0.9), rec(3, 3, 1.0, 1.0)]
    cost = SplitCost(ForwardGrid({2: CostTable({2: 0.010, 8: 0.022})}), CostTable({1: 0.001, 2: 0.002}))
    text = summarise(records, cost)  # F(2, B) = 10 ms + 2 ms per verified token
    assert ("   async: 3 decides read the snapshot; against Algorithm 1 on the same confidences they verified +1 "
            "tokens (1 steps more, 1 fewer), -0.40 expected accepted tokens, +2.0 ms of target forward at the "
            "profile's prices") in text


def test_step_trace_names_its_device_and_times_to_the_end_of_device_work(monkeypatch):
    from dspark.bench import steps
    from dspark.errors import UserError

    with pytest.raises(UserError, match="auto, cpu, cuda"):
        steps.main(["none", "none", "1", "5", "--device", "gpu0"])
    with pytest.raises(SystemExit, match=r"\[--device D\]"):
        steps.main(["none", "none", "0", "5", "--device", "cpu"])
    synced = []
    monkeypatch.setattr(steps, "synchronize", lambda device: synced.append(str(device)))
    target = tiny_target(seed=0)
    engine = Engine(target, NgramDrafter(block_size=3), make_policy("fixed", None, k=3),
                    EngineConfig(max_running=2, max_seq_len=64))
    trace_steps(engine, [[5, 6, 7, 5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=4), 1, 3, progress=False)
    # around every step and every timed phase, on the target's device
    assert len(synced) >= 2 * 3 + 2 * 3 and set(synced) == {"cpu"}


def test_the_taps_bench_times_both_modes_on_one_cache():
    """dspark.bench.taps: interleaved decode forwards with and without taps, same model and
    cache; each mode gets its forwards, and the cache holds prompt + two tokens a round."""
    from dspark.bench.taps import time_taps
    from dspark.models.tiny import tiny_target

    model = tiny_target()
    times = time_taps(model, requests=2, iterations=3, prompt_tokens=5, tap_layers=(0, 1))
    assert set(times) == {"none", "taps"} and all(len(v) == 3 and min(v) > 0 for v in times.values())
    with pytest.raises(ValueError, match="tap layer"):
        time_taps(model, 2, 3, 5, ())

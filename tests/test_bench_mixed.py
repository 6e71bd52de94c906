"""The mixed-batch benchmark (`python -m dspark.bench.mixed`) on a tiny random target: it
times every layout both ways, and the two ways compute the same logits."""

from __future__ import annotations

import pytest
import torch

from dspark.bench import mixed
from dspark.models.tiny import tiny_hf_folder


def test_every_layout_is_timed_both_ways(tmp_path, capsys):
    folder = tiny_hf_folder(tmp_path, seed=2, vocab_size=96)
    rows = mixed.run_mixed_bench(repeats=1, warmup=0, context=16, target=str(folder))
    assert [r["layout"] for r in rows] == [label for label, _ in mixed.LAYOUTS]
    assert all(r["parts_ms"] > 0 and r["padded_ms"] > 0 for r in rows)
    text = mixed.format_rows(rows, 1, 16)
    assert "| 15 decoding, 1 prefilling 64 | 79 |" in text and "parts / padded" in text


def test_one_padded_call_computes_what_the_parts_compute(tmp_path):
    from dspark.models import llama, load_target
    from dspark.types import RaggedBatch

    loaded = load_target(str(tiny_hf_folder(tmp_path, seed=3, vocab_size=96)))
    qlens = dict(mixed.LAYOUTS)["15 decoding, 1 verifying 7"]
    cache, slots = mixed.prefilled_cache(loaded, 16, 16, max(qlens))
    tokens = torch.randint(0, 96, (sum(qlens),), generator=torch.Generator().manual_seed(0))
    outs = []
    for padded in (False, True):
        with torch.inference_mode(), mixed.attention_layout(one_call=padded):
            outs.append(loaded.model(RaggedBatch(tokens, slots, qlens), cache).logits)
        for slot in slots:
            cache.truncate(slot, 16)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=0)
    assert llama.attention_groups([1, 8], [0, 0], [0, 1], 2, "cpu") == [[0], [1]]  # back after the context
    assert llama.attention_groups([1, 8], [0, 0], [0, 1], 2, "cuda") == [[0, 1]]


@pytest.mark.parametrize("argv,message", [(["--repeats", "0"], "--repeats takes a whole number >= 1"),
                                          (["--fast"], "unknown option --fast")])
def test_bad_options_stop_before_running(argv, message):
    with pytest.raises(SystemExit, match=message):
        mixed.main(argv)


def test_context_parts_refuses_bad_arguments():
    from dspark.bench import context_parts

    for argv in ([], ["4", "300"], ["4", "0", "2"], ["four", "300", "2"], ["4", "300", "2", "2000", "9"]):
        with pytest.raises(SystemExit, match="usage"):
            context_parts.main(argv)


def test_engine_ab_refuses_bad_arguments():
    from dspark.bench import engine_ab

    good = ["nospec=none:none", "dspark=default:dspark"]
    for argv in ([], ["4", "2", "32", good[0]], ["4", "0", "32", *good], ["4", "2", "32", "nospec", good[1]],
                 ["4", "2", "32", "nospec=none", good[1]], ["4", "2", "32", *good, "--prompt-chars"],
                 ["4", "2", "32", *good, "--prompt-chars", "0"]):
        with pytest.raises(SystemExit, match="usage|prompt-chars"):
            engine_ab.main(argv)
    with pytest.raises(SystemExit, match="must differ"):
        engine_ab.main(["4", "2", "32", good[0], good[0]])


def test_engine_ab_interleaved_rounds_run_each_arm_as_it_runs_alone():
    """Interleaving the arms' engines step by step changes when each arm's steps run, never
    what they do: greedy requests, the same closed loop, so every arm makes the same steps and
    tokens as when it runs alone, and its seconds are its own steps' only."""
    from dspark.bench.engine_ab import closed_loop, run_round
    from dspark.types import SamplingParams
    from tests.server_harness import make_engine

    prompts = [[3 + (7 * i + j) % 40 for j in range(5 + 3 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_new_tokens=12)

    def loops(policies):
        return {name: closed_loop(make_engine(seed=2, policy=policy), prompts, params, 2, 5, 1)
                for name, policy in policies.items()}

    policies = {"nospec": "none", "fixed": "fixed"}
    alone = run_round(loops(policies), interleave=False)
    together = run_round(loops(policies), interleave=True)
    for name in policies:
        for key in ("tokens", "steps", "drafted", "together", "plain_steps"):
            assert together[name][key] == alone[name][key], (name, key)
        assert together[name]["tokens"] == 5 * 12
        row = together[name]
        assert row["seconds"] == pytest.approx(row["prefill_s"] + row["decode_s"]) and row["seconds"] > 0
        # every prompt token is forwarded in a prompt-chunk step (prompts that start together share one)
        assert 0 < row["prefill_steps"] <= row["steps"] - row["plain_steps"]
        assert row["prefill_positions"] >= sum(len(p) for p in prompts)
    assert together["nospec"]["drafted"] == 0 < together["fixed"]["drafted"]
    assert together["fixed"]["plain_steps"] == 0 < together["nospec"]["plain_steps"] < together["nospec"]["steps"]


def test_engine_ab_times_the_target_forward_per_engine_and_matches_batch_shapes():
    """A TimedTarget times one engine's forwards without touching the shared model; an arm's plain
    steps compared with a fit of its own read 1; forwards twice as slow at the same shapes read 2."""
    from dspark.bench.engine_ab import TimedTarget, closed_loop, fit_forward, matched_forward, run_round
    from dspark.types import SamplingParams
    from tests.server_harness import make_engine

    prompts = [[3 + (7 * i + j) % 40 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    engine = make_engine(seed=2, policy="none")
    model = engine.target
    engine.target = TimedTarget(model)
    row = run_round({"nospec": closed_loop(engine, prompts, params, 3, 6, 0)}, interleave=False)["nospec"]
    assert "forward" not in vars(model)  # the shared model is untouched
    plain = row["plain"]
    assert len(plain) == row["plain_steps"] > 10
    for seconds, last in plain:
        assert 0 < last["forward"] <= seconds
        assert last["rows"] == last["requests"] >= 1  # a plain step: one row a request
        assert last["longest"] * last["requests"] >= last["context"] >= last["longest"] > 5
    coef = fit_forward(plain)
    assert matched_forward(coef, plain) == pytest.approx(1.0, rel=1e-6)
    slower = [(2 * seconds, dict(last, forward=2 * last["forward"])) for seconds, last in plain]
    assert matched_forward(coef, slower) == pytest.approx(2.0, rel=1e-6)

"""The eval harness on a tiny random-weight target with a fake tokenizer:
mt-bench's two-turn flow, per-round recording for confidence drafters, the
order of failures (bad input before any model work), and the saved run."""

from __future__ import annotations

import json

import pytest
import dspark.models
from dspark.draft.ngram import NgramDrafter, NoDrafter
from dspark.errors import CheckpointError, UserError
from dspark.eval import harness
from dspark.eval.benchmarks import Prompt
from dspark.eval.harness import evaluate, parse_drafters, run_eval
from dspark.eval.records import EvalRun, EvalSettings, load_runs
from dspark.eval.tables import format_eval
from dspark.models.tiny import tiny_target
from tests.drafters_for_tests import BigramDrafter

VOCAB = 96


class FakeTokenizer:
    """Characters <-> ids 3..95; a ChatML-like template with role ids 2 (user)
    and 3 (assistant). It keeps every conversation it was asked to encode."""

    def __init__(self) -> None:
        self.conversations: list[list[dict]] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [4 + (ord(ch) % 90) for ch in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        self.conversations.append([dict(m) for m in messages])
        ids = []
        for m in messages:
            ids += [2 if m["role"] == "user" else 3] + self.encode(m["content"])
        return ids + [3]


def _settings(**kw) -> EvalSettings:
    base = dict(benchmarks=("mt-bench", "gsm8k"), limit=2, temperature=0.0, block_size=None, max_new_tokens=12,
                seed=5, target="tiny", dtype="float32")
    return EvalSettings(**{**base, **kw})


def _suites() -> dict[str, list[Prompt]]:
    return {
        "mt-bench": [Prompt(f"mt-bench-{i}", "mt-bench", "chat", "s", (f"first {i} abab abab", f"second {i}"))
                     for i in range(2)],
        "gsm8k": [Prompt(f"gsm8k-{i}", "gsm8k", "math", "s", (f"count 1 2 3 1 2 3 1 2 {i}",)) for i in range(2)],
    }


def test_mt_bench_second_turn_follows_the_models_own_answer():
    target, tok = tiny_target(seed=3, vocab_size=VOCAB), FakeTokenizer()
    runs = evaluate(target, tok, [("ngram", "ngram", NgramDrafter(block_size=4))], _suites(), _settings(),
                    progress=False)
    mt = runs[0].benches["mt-bench"]
    assert mt.prompts == 2 and mt.generations == 4
    second_turns = [c for c in tok.conversations if len(c) == 3]
    assert len(second_turns) == 2
    for i, conv in enumerate(second_turns):
        assert [m["role"] for m in conv] == ["user", "assistant", "user"]
        assert conv[0]["content"] == f"first {i} abab abab" and conv[2]["content"] == f"second {i}"
        assert conv[1]["content"]  # the model's own (decoded) first answer
    # the answer fed back is exactly what the model generated for turn 1
    first = harness.run_conversation(_engine(target, tok), _suites()["mt-bench"][0],
                                     harness.SamplingParams(temperature=0.0, max_new_tokens=12, seed=5), 0)
    assert second_turns[0][1]["content"] == tok.decode(first[0].token_ids)


def _engine(target, tok, drafter=None):
    from dspark.engine.engine import Engine, EngineConfig

    drafter = drafter or NgramDrafter(block_size=4)
    policy = harness.RecordingPolicy(drafter.block_size, keep_rounds=False)
    return Engine(target, drafter, policy, EngineConfig(max_running=1, max_seq_len=512), tokenizer=tok)


def test_greedy_outputs_and_stats_are_consistent_across_drafters():
    """Greedy speculative decoding is lossless: every drafter generates the same
    tokens, so `none` and `ngram` count the same tokens; tau(none) is exactly 1."""
    target, tok = tiny_target(seed=1, vocab_size=VOCAB), FakeTokenizer()
    drafters = [("none", "none", NoDrafter()), ("ngram", "ngram", NgramDrafter(block_size=4))]
    runs = evaluate(target, tok, drafters, _suites(), _settings(), progress=False)
    none, ngram = runs
    for name in ("mt-bench", "gsm8k"):
        assert none.benches[name].generated_tokens == ngram.benches[name].generated_tokens
        assert none.benches[name].tau == 1.0
        s = ngram.benches[name].stats
        assert s.committed_tokens == s.accepted_tokens + s.rounds
        assert ngram.benches[name].tau >= 1.0
    assert none.benches["gsm8k"].rounds == []  # no confidences: no round records
    for bench in (*none.benches.values(), *ngram.benches.values()):  # per-prompt counts add up to the stats
        assert [pid for pid, _, _ in bench.per_prompt] == [p.id for p in _suites()[bench.benchmark]]
        assert sum(n for _, n, _ in bench.per_prompt) == bench.stats.rounds
        assert sum(c for _, _, c in bench.per_prompt) == bench.stats.committed_tokens
    # the ngram drafter's confidences are its running hit rates: one record per drafted round
    records = ngram.benches["gsm8k"].rounds
    assert records and all(0.0 < c < 1.0 for r in records for c in r.confidences)


def test_confidence_drafter_rounds_match_its_stats():
    target, tok = tiny_target(seed=2, vocab_size=VOCAB), FakeTokenizer()
    drafter = BigramDrafter(VOCAB, block_size=4, seed=0, sharpness=0.5)
    runs = evaluate(target, tok, [("bigram", "bigram", drafter)], _suites(), _settings(temperature=1.0),
                    progress=False)
    for bench in runs[0].benches.values():
        assert len(bench.rounds) == bench.stats.rounds > 0
        assert sum(r.num_accepted for r in bench.rounds) == bench.stats.accepted_tokens
        assert sum(r.verify_len for r in bench.rounds) == bench.stats.draft_tokens
        assert all(len(r.confidences) >= r.verify_len and all(0 <= c <= 1 for c in r.confidences)
                   for r in bench.rounds)


def test_parse_drafters_adds_the_baseline_and_rejects_duplicates():
    assert parse_drafters("ngram", baseline=True) == ["none", "ngram"]
    assert parse_drafters(["ngram", "none"], baseline=True) == ["ngram", "none"]
    assert parse_drafters("ngram", baseline=False) == ["ngram"]
    with pytest.raises(UserError, match="given twice"):
        parse_drafters("ngram,ngram", baseline=True)
    with pytest.raises(UserError, match="no drafter"):
        parse_drafters(" , ", baseline=True)


class _Loaded:
    def __init__(self) -> None:
        self.model, self.tokenizer, self.name = tiny_target(seed=0, vocab_size=VOCAB), FakeTokenizer(), "tiny"


def test_bad_benchmark_fails_before_the_target_loads(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("the target must not load before the benchmarks are validated")

    monkeypatch.setattr(dspark.models, "load_target", boom, raising=False)
    with pytest.raises(UserError, match="unknown benchmark"):
        run_eval("ngram", "gsm8k,nope", results_dir=None, progress=False)
    with pytest.raises(UserError, match="block-size"):
        run_eval("ngram", "gsm8k", block_size=0, results_dir=None, progress=False)


def test_mismatched_drafter_fails_before_any_generation(monkeypatch):
    import dspark.draft.registry as registry

    monkeypatch.setattr(dspark.models, "load_target", lambda *a, **k: _Loaded(), raising=False)

    def load_drafter(spec, target, block_size=None, embedded=True):
        if spec == "/drafters/other":
            raise CheckpointError("drafter /drafters/other was trained for vocab 151936, this target has 96")
        return NgramDrafter(block_size=block_size or 7)

    monkeypatch.setattr(registry, "load_drafter", load_drafter)
    monkeypatch.setattr(harness, "evaluate", lambda *a, **k: pytest.fail("generation started"))
    with pytest.raises(CheckpointError, match="vocab 151936"):
        run_eval("ngram,/drafters/other", "gsm8k", limit=1, results_dir=None, progress=False)


def test_run_eval_saves_a_run_that_loads_back(monkeypatch, tmp_path):
    monkeypatch.setattr(dspark.models, "load_target", lambda *a, **k: _Loaded(), raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run = run_eval("ngram", "gsm8k,alpaca", limit=1, max_new_tokens=8, temperature=0.0, seed=3,
                   results_dir=tmp_path, progress=False)
    assert run.command == ("dspark eval --drafter none,ngram --bench gsm8k,alpaca --limit 1 --temperature 0 "
                           "--max-new-tokens 8 --seed 3")
    assert [d.label for d in run.drafters] == ["none", "ngram"]
    (loaded,) = load_runs(tmp_path)
    assert loaded.as_dict() == run.as_dict()
    data = json.loads(run.saved_path.read_text())
    assert set(data["summary"]["ngram"]["tau"]) == {"gsm8k", "alpaca"}
    assert data["summary"]["none"]["speedup_vs_none"] == pytest.approx(1.0)
    text = format_eval(run)
    assert "GSM8K" in text and "Alpaca" in text and "dspark eval --drafter none,ngram" in text
    brief = json.loads(json.dumps(run.brief()))
    assert brief["saved_to"] == str(run.saved_path) and brief["summary"] == data["summary"]


def test_conversations_longer_than_the_context_are_skipped_and_listed():
    target, tok = tiny_target(seed=0, vocab_size=VOCAB), FakeTokenizer()  # context 4096
    suites = {"alpaca": [Prompt("alpaca-0", "alpaca", "chat", "s", ("short",)),
                         Prompt("alpaca-1", "alpaca", "chat", "s", ("x" * 5000,))]}
    (run,) = evaluate(target, tok, [("none", "none", NoDrafter())], suites,
                      _settings(benchmarks=("alpaca",)), progress=False)
    bench = run.benches["alpaca"]
    assert bench.prompts == 1 and bench.generations == 1 and bench.skipped == ["alpaca-1"]
    view = EvalRun(_settings(benchmarks=("alpaca",)), "cmd", [run])
    assert "skipped (longer than the target's context): Alpaca 1 (alpaca-1)" in format_eval(view)

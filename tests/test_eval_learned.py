"""Smoke test with a real (untrained) learned drafter folder on a tiny target:
run_eval loads it through the drafter registry, records its confidences, and
the report draws the confidence figures from that run. A drafter saved for
another target fails before any generation."""

from __future__ import annotations

import pytest
import torch

import dspark.models
from dspark.draft.checkpoint import save_drafter
from dspark.draft.factory import build_drafter
from dspark.errors import CheckpointError
from dspark.eval import harness
from dspark.eval.harness import run_eval
from dspark.eval.report import run_report
from dspark.models.tiny import tiny_target
from tests.test_eval_harness import FakeTokenizer

VOCAB = 96


class _Loaded:
    def __init__(self, vocab: int = VOCAB) -> None:
        self.model, self.tokenizer, self.name = tiny_target(seed=0, vocab_size=vocab), FakeTokenizer(), "tiny"


def _drafter_folder(tmp_path, temps=(1.5, 1.2, 1.0, 0.8)):
    target = tiny_target(seed=0, vocab_size=VOCAB)
    d = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, seed=3,
                      block_size=4, num_hidden_layers=1, markov_rank=8)
    d.set_calibration(list(temps))
    return save_drafter(d, tmp_path / "dspark-tiny", dtype=torch.float32)


def test_untrained_dspark_drafter_runs_and_feeds_the_confidence_figures(monkeypatch, tmp_path):
    monkeypatch.setattr(dspark.models, "load_target", lambda *a, **k: _Loaded(), raising=False)
    folder = _drafter_folder(tmp_path)
    run = run_eval(str(folder), "mt-bench,alpaca,gsm8k", limit=1, max_new_tokens=10, seed=1,
                   results_dir=tmp_path / "runs", progress=False)
    learned = run.drafter("dspark-tiny")
    assert learned.kind == "dspark" and learned.has_confidence and learned.block_size == 4
    assert learned.calibration_temperatures == pytest.approx([1.5, 1.2, 1.0, 0.8])
    for bench in learned.benches.values():
        assert len(bench.rounds) == bench.stats.rounds > 0
        assert all(len(r.confidences) == r.verify_len <= 4 for r in bench.rounds)  # the whole drafted block is verified
    report = run_report(tmp_path / "runs", tmp_path / "RESULTS.md", tmp_path / "figures")
    names = sorted(p.name for p in report.figures)
    assert names == ["fig2_conditional_acceptance.png", "fig5_threshold_sweep_dspark-tiny.png",
                     "fig6_reliability_dspark-tiny.png"]
    assert [n.split(":")[0] for n in report.left_out] == ["fig4"]


def test_drafter_for_another_target_fails_before_generation(monkeypatch, tmp_path):
    folder = _drafter_folder(tmp_path)
    monkeypatch.setattr(dspark.models, "load_target", lambda *a, **k: _Loaded(vocab=128), raising=False)
    monkeypatch.setattr(harness, "evaluate", lambda *a, **k: pytest.fail("generation started"))
    with pytest.raises(CheckpointError, match="vocab_size=96.*vocab_size=128"):
        run_eval(f"ngram,{folder}", "gsm8k", limit=1, results_dir=None, progress=False)

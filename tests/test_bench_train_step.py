"""The training-step benchmark on a tiny target and toy data: one row per draft-vocabulary
size and precision, timed on the same batches; bad sizes and precisions are refused with a message."""

import json

import pytest

from dspark.bench.train_step import format_table, time_train_steps
from dspark.cli import main
from dspark.models.tiny import tiny_hf_folder
from train_toys import write_toy_data


def _recipe(tmp_path):
    target_dir = tiny_hf_folder(tmp_path)
    data = write_toy_data(tmp_path / "data", num=24)
    (data / "meta.json").write_text(json.dumps({"target": target_dir.name, "vocab_size": 96}))
    cfg = {
        "run": {"out_dir": str(tmp_path / "run"), "seed": 1},
        "data": {"dir": str(data), "max_seq_len": 32, "holdout_fraction": 0.25},
        "target": {"path": str(target_dir)},
        "drafter": {"kind": "dspark", "block_size": 3,
                    "options": {"num_hidden_layers": 1, "markov_rank": 8, "intermediate_size": 64}},
        "optim": {"total_steps": 10, "warmup_steps": 1, "global_batch": 4, "anchors_per_seq": 4},
        "log": {"progress": False},
    }
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(cfg))
    return path


def test_one_row_per_size_on_the_same_batches(tmp_path):
    recipe = _recipe(tmp_path)
    result = time_train_steps(recipe, [0, 24], repeats=2, warmup=1, progress=False)
    rows = result["rows"]
    assert [r["draft_vocab_size"] for r in rows] == [0, 24]
    for r in rows:
        assert r["step_ms"] > 0 and 0 <= r["features_ms"] <= r["step_ms"]
        assert 0 < r["drafter_ms"] <= r["step_ms"]  # the median of each step's time less its features' time
    assert rows[0]["step_speedup"] == 1.0 and rows[0]["drafter_speedup"] == 1.0
    table = format_table(result)
    assert "| whole |" in table and "| 24 |" in table
    assert not (tmp_path / "run" / "checkpoints").exists()  # a benchmark writes no checkpoint


def test_one_row_per_size_and_precision(tmp_path):
    recipe = _recipe(tmp_path)
    result = time_train_steps(recipe, [24], repeats=1, warmup=0, progress=False, precisions=["fp32", "bf16"])
    assert [(r["draft_vocab_size"], r["precision"]) for r in result["rows"]] == [(24, "fp32"), (24, "bf16")]
    table = format_table(result)
    assert "| 24 | fp32 |" in table and "| 24 | bf16 |" in table and "step vs (24, fp32, 4)" in table


def test_one_row_per_anchor_count_with_more_blocks_each(tmp_path):
    recipe = _recipe(tmp_path)
    result = time_train_steps(recipe, [24], repeats=1, warmup=0, progress=False, anchors=[2, 8])
    assert [(r["draft_vocab_size"], r["anchors_per_seq"]) for r in result["rows"]] == [(24, 2), (24, 8)]
    assert "| 24 | auto | 8 |" in format_table(result)  # the recipe's own precision


def test_bad_sizes_are_refused(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    assert main(["bench", "train-step", str(recipe), "--sizes", "0,lots"]) == 2
    assert "comma-separated whole numbers" in capsys.readouterr().err
    assert main(["bench", "train-step", str(recipe), "--sizes", "0,-4"]) == 2
    assert "sizes are >= 0" in capsys.readouterr().err
    assert main(["bench", "train-step", str(recipe), "--sizes", "0,96"]) == 2  # not below the tiny target's 96 tokens
    assert "not below the target's 96 tokens" in capsys.readouterr().err
    assert main(["bench", "train-step", str(recipe), "--sizes", "0", "--precisions", "fp32,half"]) == 2
    assert "--precisions half: use auto, bf16, fp32" in capsys.readouterr().err
    assert main(["bench", "train-step", str(recipe), "--sizes", "0", "--anchors", "16,0"]) == 2
    assert "anchors per sequence are in [1, 1024]" in capsys.readouterr().err


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    recipe = _recipe(tmp_path)
    out = tmp_path / "bench" / "step.json"
    assert main(["bench", "train-step", str(recipe), "--sizes", "0,24", "--repeats", "1", "--warmup", "0",
                 "--out", str(out)]) == 0
    assert "| 24 |" in capsys.readouterr().out
    assert [r["draft_vocab_size"] for r in json.loads(out.read_text())["rows"]] == [0, 24]

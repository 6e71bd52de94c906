"""dspark train-equal: recipes probed side by side, then trained to one budget;
the probe-then-resume run equals a run of that budget from the start."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark.draft.checkpoint import load_drafter_folder
from dspark.errors import UserError
from dspark.models.loading import load_target
from dspark.models.tiny import tiny_hf_folder
from dspark.cli import main
from dspark.train.equal_budget import choose_budget
from train_toys import write_toy_data


def _recipes(tmp_path: Path) -> list[Path]:
    target_dir = tiny_hf_folder(tmp_path)
    data = write_toy_data(tmp_path / "data", num=40)
    (data / "meta.json").write_text(json.dumps({"target": target_dir.name, "vocab_size": 96}))
    paths = []
    for kind, options in (("dspark", {"num_hidden_layers": 1, "markov_rank": 8, "intermediate_size": 64}),
                          ("dflash", {"num_hidden_layers": 1, "intermediate_size": 64})):
        cfg = {
            "run": {"out_dir": str(tmp_path / "ignored"), "seed": 3},
            "data": {"dir": str(data), "max_seq_len": 32, "holdout_fraction": 0.25},
            "target": {"path": str(target_dir)},
            "drafter": {"kind": kind, "block_size": 3, "options": options},
            "optim": {"total_steps": 100, "warmup_steps": 4, "global_batch": 4, "anchors_per_seq": 4, "lr": 3e-3},
            "log": {"log_every": 1, "ckpt_every": 50, "progress": False},
        }
        path = tmp_path / f"{kind}-tiny.json"
        path.write_text(json.dumps(cfg))
        paths.append(path)
    return paths


def test_probe_then_equal_budget_matches_a_run_of_that_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the children and the reference reduce in the same order
    recipes = _recipes(tmp_path)
    out = tmp_path / "out"
    rc = main(["train-equal", *map(str, recipes), "--out", str(out), "--deadline-s", "600", "--probe-steps", "3",
               "--max-steps", "6", "--round-to", "2", "--no-eval", "--device", "cpu"])
    assert rc == 0
    summary = json.loads((out / "equal_budget.json").read_text())
    assert summary["total_steps"] == 6 and [r["name"] for r in summary["recipes"]] == ["dspark-tiny", "dflash-tiny"]
    assert all(r["steps_per_s"] > 0 for r in summary["recipes"])
    for recipe in recipes:
        log = [json.loads(x) for x in (out / recipe.stem / "log.jsonl").read_text().splitlines()]
        assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
        assert (out / recipe.stem / "drafter" / "model.safetensors").is_file()

    # the reference: the DSpark recipe trained for 6 steps from the start, in one process
    cfg = json.loads(recipes[0].read_text())
    cfg["run"]["out_dir"] = str(tmp_path / "reference")
    cfg["optim"]["total_steps"] = 6
    ref = tmp_path / "reference.json"
    ref.write_text(json.dumps(cfg))
    subprocess.run([sys.executable, "-m", "dspark.cli", "train", str(ref), "--device", "cpu"], check=True,
                   capture_output=True)
    target = load_target(cfg["target"]["path"])
    a = load_drafter_folder(tmp_path / "reference" / "drafter", target.model).state_dict()
    b = load_drafter_folder(out / "dspark-tiny" / "drafter", target.model).state_dict()
    diff = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not diff, diff


def test_refusals(tmp_path, capsys):
    recipes = [str(p) for p in _recipes(tmp_path)]
    # a probe past the warm-up would train steps whose learning rate depends on the budget
    assert main(["train-equal", *recipes, "--out", str(tmp_path / "o"), "--deadline-s", "60", "--probe-steps", "5"]) == 2
    assert "past its warmup_steps" in capsys.readouterr().err
    # two recipes with one name would train into one folder
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "dspark-tiny.json").write_text(Path(recipes[0]).read_text())
    assert main(["train-equal", recipes[0], str(twin / "dspark-tiny.json"), "--out", str(tmp_path / "o"), "--deadline-s", "60",
                 "--probe-steps", "2"]) == 2
    assert "share a file name" in capsys.readouterr().err


def test_choose_budget():
    # the slowest recipe sets the budget: 20 + 2 steps/s x 100 s = 220
    assert choose_budget([5.0, 2.0, 3.0], 20, 100.0, 50, None) == 200
    assert choose_budget([5.0, 2.0], 20, 100.0, 10, None) == 220
    assert choose_budget([5.0, 2.0], 20, 100.0, 10, 150) == 150
    with pytest.raises(UserError, match="no time is left"):
        choose_budget([1.0], 20, -5.0, 50, None)
    with pytest.raises(UserError, match="add no whole"):
        choose_budget([0.1], 20, 100.0, 50, None)


def test_a_failed_run_stops_the_others_and_names_itself(tmp_path):
    recipes = _recipes(tmp_path)
    broken = json.loads(recipes[1].read_text())
    broken["data"]["dir"] = str(tmp_path / "no-such-data")
    recipes[1].write_text(json.dumps(broken))
    with pytest.raises(RuntimeError, match="dflash-tiny.json exited with"):
        main(["train-equal", *map(str, recipes), "--out", str(tmp_path / "out"), "--deadline-s", "600", "--probe-steps", "3",
              "--no-eval", "--device", "cpu"])
    assert not (tmp_path / "out" / "dflash-tiny" / "log.jsonl").exists()

"""python -m dspark.train.report: the side-by-side table of training runs."""

from __future__ import annotations

import json

import pytest

from dspark.train.report import load_run, main


def _run(folder, kind, block, steps, total, summary=True, start_step=None):
    folder.mkdir(parents=True)
    (folder / "train_config.json").write_text(json.dumps(
        {"drafter": {"kind": kind, "block_size": block}, "optim": {"total_steps": total}}))
    log = [{"step": s, "loss": 1.0 / s, "accept_per_position": [0.1 * s / total] * block,
            "expected_accept_len": 1 + 0.2 * s / total} for s in range(10, steps + 1, 10)]
    (folder / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    if summary:
        held = {"loss": 2.5, "expected_accept_len": 1.15, "accept_per_position": [0.2] * block}
        facts = {"step": steps, "seconds": 80.0, "heldout": held}
        if start_step is not None:  # a resumed run: its seconds cover steps start_step..steps
            facts["start_step"] = start_step
        (folder / "summary.json").write_text(json.dumps(facts))
    return folder


def test_report_lists_finished_and_unfinished_runs(tmp_path, capsys):
    a = _run(tmp_path / "runs" / "dspark", "dspark", 3, 40, 40)
    b = _run(tmp_path / "runs" / "mtp", "mtp", 1, 20, 40, summary=False)
    c = _run(tmp_path / "runs" / "resumed", "dflash", 3, 40, 40, start_step=20)
    out = tmp_path / "docs" / "RUNS.md"
    assert main([str(a), str(b), str(c), "--out", str(out), "--figures", str(tmp_path / "docs" / "figures")]) == 0
    text = out.read_text()
    assert "| dspark | dspark | 3 | 40/40 | 80 | 2.00 | 0.100 | 1.200 | 2.500 | 1.150 | 0.20, 0.20, 0.20 |" in text
    assert "| mtp | mtp | 1 | 20/40 | - | - | 0.050 | 1.100 | - | - | - |" in text
    assert "| resumed | dflash | 3 | 40/40 | 80 | 4.00 |" in text  # 80 s for the 20 steps after the resume
    assert "](figures/runs.png)" in text and (tmp_path / "docs" / "figures" / "runs.png").stat().st_size > 0  # named after the page


def test_a_folder_that_is_not_a_run_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a training run"):
        load_run(tmp_path)


def test_bad_command_lines_say_how_to_call(capsys):
    assert main([]) == 2 and "no run folder" in capsys.readouterr().err
    assert main(["runs/x", "--bogus"]) == 2 and "unknown option --bogus" in capsys.readouterr().err
    assert main(["runs/x", "--out"]) == 2 and "--out needs a value" in capsys.readouterr().err

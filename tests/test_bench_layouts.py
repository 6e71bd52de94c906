"""The layout benchmark (python -m dspark.bench.layouts) on a tiny random target."""

from __future__ import annotations

import pytest

from dspark.bench import layouts
from dspark.draft import backbone
from dspark.models import load_target
from dspark.models.tiny import tiny_hf_folder


def test_propose_is_timed_in_both_layouts_and_the_choice_is_restored(tmp_path):
    chosen = backbone.attend_in_one_call
    target = load_target(str(tiny_hf_folder(tmp_path, seed=2, vocab_size=96))).model
    rows = layouts.propose_ms(target, batches=(1, 3), context=8, repeats=1, warmup=0)
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["one_call_ms"] > 0 and r["per_request_ms"] > 0 for r in rows)
    assert backbone.attend_in_one_call is chosen
    text = layouts.format_propose(rows, "cpu", 1)
    assert "| 3 |" in text and "one call / per request" in text


def test_random_folder_like_keeps_the_shape(tmp_path):
    from dspark.models.tiny import random_folder_like

    source = tiny_hf_folder(tmp_path / "a", seed=2, vocab_size=96)
    copy = load_target(str(random_folder_like(source / "config.json", tmp_path / "b")))
    original = load_target(str(source))
    assert copy.config == original.config
    shapes = {k: v.shape for k, v in original.model.state_dict().items()}
    assert {k: v.shape for k, v in copy.model.state_dict().items()} == shapes


def test_bad_options_stop_before_loading():
    with pytest.raises(SystemExit, match="unknown option --fast"):
        layouts.main(["--fast"])
    with pytest.raises(SystemExit, match="--repeats takes a whole number"):
        layouts.main(["--repeats", "0"])


def test_bench_options_name_what_is_wrong():
    from dspark.bench.options import parse_options

    defaults = {"--repeats": "20", "--blocks": "", "--target": ""}
    assert parse_options([], defaults, whole=("--repeats", "--blocks")) == defaults
    assert parse_options(["--blocks", "3", "--target", "x"], defaults, whole=("--repeats", "--blocks"))["--blocks"] == "3"
    for argv, message in ((["--blocks"], "--blocks takes a whole number >= 1, got ''"),
                          (["--repeats", "0"], "--repeats takes a whole number"),
                          (["--fast", "1"], "unknown option --fast; the options are --repeats, --blocks, --target")):
        with pytest.raises(SystemExit, match=message):
            parse_options(argv, defaults, whole=("--repeats", "--blocks"))

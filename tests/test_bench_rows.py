"""`python -m dspark.bench.rows`: its table reads each case against the one-token step, and bad
options stop it before anything is timed."""

from __future__ import annotations

import pytest

from dspark.bench import rows


def _result(scale: float) -> dict:
    timings = [{"runtime": runtime, "dtype": "float32", "batch": b, "new_tokens": q, "ms": scale * k * (b * q)}
               for runtime, k in (("dspark", 10.0), ("dspark, CPU kernels off", 20.0)) for b, q in rows.CASES]
    return {"context": 256, "repeats": 3, "threads": 1, "timings": timings}


def test_table_gives_ms_and_multiples_of_the_one_token_step():
    table = rows.rows_table(_result(1.0))
    lines = table.splitlines()
    assert lines[2].startswith("| runtime | 1x1 | 1x2 |") and lines[2].endswith("| 8x1 |")
    assert lines[4].startswith("| dspark | 10.0 (1.00x) | 20.0 (2.00x) | 30.0 (3.00x) |")
    assert lines[5].startswith("| dspark, CPU kernels off | 20.0 (1.00x) | 40.0 (2.00x) |")


@pytest.mark.parametrize("argv,message", [(["--threads", "0"], "--threads takes a whole number"),
                                          (["--repeats", "x"], "--repeats takes a whole number"),
                                          (["--fast"], "unknown option --fast")])
def test_bad_options_stop_before_timing(monkeypatch, argv, message):
    monkeypatch.setattr(rows, "run_decode_bench", lambda *a, **kw: pytest.fail("timed"))
    with pytest.raises(SystemExit, match=message):
        rows.main(argv)


def test_blocks_table_gives_both_arms_and_their_ratio():
    ms = {"compiled": {case: [20.0, 22.0, 21.0] for case in rows.CASES},
          "tuned": {case: [18.0, 16.0, 17.0] if case == (1, 2) else [21.0] for case in rows.CASES}}
    lines = rows.blocks_table(ms, "q4 8,4,4,1,1,1,1,1 (measured)", 1, 5, 3).splitlines()
    assert "median of 3 alternating rounds of 5 repeats, 1 thread(s)" in lines[0] and "q4 8,4,4" in lines[0]
    assert lines[4].startswith("| compiled | 21.0 | 21.0 |")
    assert lines[5].startswith("| tuned | 21.0 | 17.0 |")
    assert lines[6].startswith("| tuned / compiled | 1.00 | 0.81 | 1.00 |")


def test_a_bad_blocks_option_stops_before_loading(monkeypatch):
    monkeypatch.setattr(rows, "compare_blocks", lambda *a: pytest.fail("timed"))
    with pytest.raises(SystemExit, match="--blocks takes a whole number"):
        rows.main(["--blocks", "-1"])

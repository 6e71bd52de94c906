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

"""SPS cost table: interpolation, extrapolation, monotone cleaning, JSON cache, profiling, plot."""

import json

import pytest

from dspark.errors import UserError
from dspark.schedule import CostKey, CostKeyMismatch, CostTable, budget_grid, profile_points, settings_fingerprint

KEY = CostKey(model="smollm2-135m:fp32", drafter="dspark:g8", hardware="cpu:2", settings="abc123")


def test_exact_points_and_sps_is_inverse_of_time():
    table = CostTable({1: 0.010, 4: 0.016, 8: 0.040})
    assert table.seconds_per_step(1) == pytest.approx(0.010)
    assert table.seconds_per_step(4) == pytest.approx(0.016)
    assert table.sps(8) == pytest.approx(25.0)


def test_interpolates_time_linearly_between_points():
    table = CostTable({2: 0.010, 6: 0.030})
    assert table.seconds_per_step(3) == pytest.approx(0.015)
    assert table.seconds_per_step(5) == pytest.approx(0.025)
    assert table.sps(4) == pytest.approx(1 / 0.020)


def test_below_first_point_is_flat():
    table = CostTable({4: 0.02, 8: 0.03})
    assert table.seconds_per_step(1) == pytest.approx(0.02)
    assert table.seconds_per_step(3) == pytest.approx(0.02)


def test_extrapolates_with_last_segment_slope():
    table = CostTable({1: 0.010, 10: 0.010, 20: 0.030})  # flat, then 2 ms per token
    assert table.seconds_per_step(30) == pytest.approx(0.050)
    assert table.seconds_per_step(120) == pytest.approx(0.230)


def test_extrapolation_never_decreases_time():
    # the last segment falls (a jagged cliff): use the mean slope over the range
    table = CostTable({1: 0.010, 10: 0.030, 12: 0.020})
    mean = (0.020 - 0.010) / 11
    assert table.seconds_per_step(22) == pytest.approx(0.020 + 10 * mean)
    # falling overall: flat beyond the last point
    falling = CostTable({1: 0.030, 5: 0.020})
    assert falling.seconds_per_step(50) == pytest.approx(0.020)


def test_single_point_is_a_flat_curve():
    table = CostTable({1: 0.05})
    assert [table.sps(b) for b in (1, 7, 500)] == pytest.approx([20.0, 20.0, 20.0])


def test_raw_jaggedness_kept_and_monotone_fit_non_decreasing():
    raw = {1: 0.010, 2: 0.014, 3: 0.012, 4: 0.013, 5: 0.020}
    table = CostTable(raw)
    assert table.seconds_per_step(2) > table.seconds_per_step(3)  # jagged lookup
    mono = table.monotone()
    assert mono.is_monotone and not table.is_monotone
    times = [mono.seconds_per_step(b) for b in range(1, 9)]
    assert all(t1 <= t2 + 1e-15 for t1, t2 in zip(times, times[1:]))
    # pool adjacent violators: 0.014, 0.012, 0.013 pool to their mean
    assert mono.seconds_per_step(2) == pytest.approx(0.013)
    assert mono.seconds_per_step(3) == pytest.approx(0.013)
    assert mono.points() == table.points()  # raw points survive the fit


def test_rejects_bad_points():
    with pytest.raises(ValueError):
        CostTable({})
    with pytest.raises(ValueError):
        CostTable({0: 0.01})
    with pytest.raises(ValueError):
        CostTable({1: -0.01})
    with pytest.raises(ValueError):
        CostTable({1: float("nan")})
    with pytest.raises(ValueError):
        CostTable([(2, 0.01), (2, 0.02)])
    with pytest.raises(ValueError):
        CostTable({1: 0.01}).sps(0)


def test_json_round_trip(tmp_path):
    table = CostTable({1: 0.010, 3: 0.012, 2: 0.015, 9: 0.040}, key=KEY, monotone=True)
    path = tmp_path / "cache" / "sps.json"
    table.save(path)
    loaded = CostTable.load(path, KEY)
    assert loaded.key == KEY and loaded.is_monotone
    assert loaded.points() == table.points()
    assert [loaded.sps(b) for b in range(1, 20)] == [table.sps(b) for b in range(1, 20)]


def test_load_refuses_other_key(tmp_path):
    path = tmp_path / "sps.json"
    CostTable({1: 0.01}, key=KEY).save(path)
    other = CostKey(model=KEY.model, drafter=KEY.drafter, hardware=KEY.hardware, settings="different")
    with pytest.raises(CostKeyMismatch, match="re-profile"):
        CostTable.load(path, other)
    assert isinstance(CostKeyMismatch("x"), UserError)
    assert CostTable.try_load(path, other) is None
    assert CostTable.try_load(tmp_path / "missing.json", KEY) is None
    assert CostTable.try_load(path, KEY).points() == [(1, 0.01)]


def test_load_reports_missing_and_malformed_files(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        CostTable.load(tmp_path / "nope.json", KEY)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        CostTable.load(bad, KEY)
    bad.write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(UserError, match="not a dspark cost table"):
        CostTable.load(bad, KEY)
    data = CostTable({1: 0.01}, key=KEY).to_json()
    data["points"] = [[1, -3.0]]
    bad.write_text(json.dumps(data))
    with pytest.raises(UserError, match="malformed"):
        CostTable.load(bad, KEY)


def test_settings_fingerprint_is_stable_and_order_free():
    a = settings_fingerprint({"dtype": "fp32", "max_batch": 16})
    assert a == settings_fingerprint({"max_batch": 16, "dtype": "fp32"})
    assert a != settings_fingerprint({"dtype": "bf16", "max_batch": 16})


def test_profile_points_calls_measure_once_per_budget():
    calls = []

    def measure(b: int) -> float:
        calls.append(b)
        return 0.01 + 0.001 * b

    table = profile_points(measure, [1, 2, 4, 8], key=KEY, progress=False)
    assert calls == [1, 2, 4, 8]
    assert table.key == KEY
    assert table.seconds_per_step(6) == pytest.approx(0.016)
    with pytest.raises(ValueError, match="seconds per step"):
        profile_points(lambda b: 0.0, [1], progress=False)
    with pytest.raises(ValueError):
        profile_points(measure, [], progress=False)


def test_budget_grid_dense_then_geometric():
    grid = budget_grid(100, dense_until=8)
    assert grid[:8] == list(range(1, 9))
    assert grid[-1] == 100 and grid == sorted(set(grid))
    assert budget_grid(5) == [1, 2, 3, 4, 5]


def test_budget_grid_measures_both_sides_of_row_group_edges():
    """A kernel multiplying rows in groups of 8 makes B = 17 cost a third pass over the weights:
    the grid holds 16 and 17 (and 24, 25, ...) up to the kernel's largest row count."""
    plain = budget_grid(128, dense_until=8, ratio=1.3)
    grid = budget_grid(128, dense_until=8, ratio=1.3, row_group=8, row_group_until=48)
    assert set(plain) <= set(grid) and grid == sorted(set(grid))
    assert {8, 9, 16, 17, 24, 25, 32, 33, 40, 41, 48, 49} <= set(grid)
    assert not {56, 57, 64} & set(grid)  # past the kernel's rows: the geometric grid only
    assert set(budget_grid(20, dense_until=4, row_group=8)) - set(budget_grid(20, dense_until=4)) == {9, 16, 17}
    with pytest.raises(ValueError, match="row_group"):
        budget_grid(20, row_group=0)


def test_plot_writes_png(tmp_path):
    path = tmp_path / "sps.png"
    CostTable({1: 0.01, 4: 0.012, 16: 0.03}, key=KEY).plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedule_package_imports_no_torch():
    """dspark.schedule is pure Python: importing it must not pull in torch."""
    import subprocess
    import sys

    code = "import sys, dspark.schedule; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0

"""The target forward measured over (requests, tokens), F(R, B): lookups
between and beyond the measured request counts, the file it is cached in,
the split step cost that uses it, the profile that measures it, and the
decision it changes: with a per-request cost, a scheduler that sees F(R, B)
verifies tokens that a curve over B alone (measured on the fewest requests)
makes look too dear."""

from __future__ import annotations

import json

import pytest

from dspark.engine.profile import (
    ProfileSettings, StepBench, format_split, load_or_profile_grid, spread_budget, synthetic_context,
)
from dspark.draft.ngram import NgramDrafter
from dspark.errors import UserError
from dspark.models.tiny import tiny_target
from dspark.schedule import CostKey, CostTable, PrefixScheduler, ScheduleRequest
from dspark.schedule.cost import ForwardGrid, SplitCost

KEY = CostKey(model="m|float32", drafter="d|G=7|forward", hardware="cpu:x", settings="abc")
G = 7


def f_model(requests: int, budget: int) -> float:
    """A made-up forward: 20 ms, 3 ms per request (its context and attention part), 1 ms per token."""
    return (20 + 3 * requests + 1 * budget) / 1e3


def grid_of(rows=(1, 2, 4, 8, 16), model=f_model) -> ForwardGrid:
    return ForwardGrid({r: CostTable({b: model(r, b) for b in range(r, r * (1 + G) + 1)}) for r in rows}, key=KEY)


def test_measured_rows_are_exact_and_rows_between_are_interpolated():
    grid = grid_of()
    assert grid.seconds_per_step(12, 4) == pytest.approx(f_model(4, 12))
    # R = 6 is not measured: halfway between R = 4 and R = 8 at the same B (the model is linear)
    assert grid.seconds_per_step(20, 6) == pytest.approx(f_model(6, 20))
    assert grid.seconds_per_step(3, 3) == pytest.approx(f_model(3, 3))


def test_outside_the_measured_counts():
    grid = grid_of(rows=(2, 4))
    assert grid.seconds_per_step(2, 1) == pytest.approx(f_model(2, 2))  # below: the smallest row
    # above: the largest row scaled at the same tokens per request, 8 requests verifying 16 tokens
    # price as twice 4 requests verifying 8
    assert grid.seconds_per_step(16, 8) == pytest.approx(2 * f_model(4, 8))
    # ... read between that row's budgets: 6 requests verifying 16 tokens as 1.5 x 4 requests verifying 10.67
    assert grid.seconds_per_step(16, 6) == pytest.approx(1.5 * f_model(4, 16 * 4 / 6))
    proportional = grid_of(rows=(2, 4), model=lambda r, b: (5 * r + 2 * b) / 1e3)  # cost proportional to the batch
    assert proportional.seconds_per_step(40, 12) == pytest.approx((5 * 12 + 2 * 40) / 1e3)  # exact
    single = grid_of(rows=(3,))
    assert single.seconds_per_step(10, 8) == pytest.approx(8 / 3 * f_model(3, 10 * 3 / 8))


def test_past_the_largest_row_a_verified_token_keeps_its_measured_price():
    """Regression (docs/LOAD.md, run X2): extrapolating in R at fixed B multiplied the noise of two
    rows' difference by R - R_max, and at 64 requests made extra verified tokens look nearly free."""
    def noisy(r: int, b: int) -> float:  # 6 ms a token; row 14 happens to be slow at small budgets
        return (6 * b + (8 if r == 14 and b < 40 else 0)) / 1e3

    grid = grid_of(rows=(14, 16), model=noisy)
    plain = grid.seconds_per_step(64, 64)
    assert plain == pytest.approx(64 * 6e-3)
    for extra in (1, 4, 16):
        per_token = (grid.seconds_per_step(64 + extra, 64) - plain) / extra
        assert per_token == pytest.approx(6e-3)  # what a token costs in the largest row
    with pytest.raises(ValueError, match="requests"):
        grid.seconds_per_step(4, 0)
    with pytest.raises(ValueError, match="request counts"):
        ForwardGrid({0: CostTable({1: 0.1})})
    with pytest.raises(ValueError, match="at least one"):
        ForwardGrid({})


def test_split_cost_with_a_grid_prices_requests_and_drafters_apart():
    draft = CostTable({r: 0.005 * r for r in (1, 2, 4, 8, 16)})
    cost = SplitCost(grid_of(), draft)
    # 8 requests, 3 of which drafted, verify 14 tokens: F(8, 14) + D(3)
    assert cost.seconds(14, 8, drafted=3) == pytest.approx(f_model(8, 14) + 0.015)
    assert cost.seconds(8, 8, drafted=False) == pytest.approx(f_model(8, 8))  # a plain step
    assert cost.seconds(8, 8, drafted=0) == cost.seconds(8, 8, drafted=False)
    assert cost.seconds(12, 8) == pytest.approx(f_model(8, 12) + 0.040)  # all drafted
    assert cost.given_requests(3, 8).seconds_per_step(14) == pytest.approx(cost.seconds(14, 8, drafted=3))
    assert cost.given_requests(4).seconds_per_step(9) == pytest.approx(f_model(4, 9) + 0.020)
    assert cost.points() == cost.forward.points() and cost.points()[0] == (1, 1, f_model(1, 1))


def test_grid_file_round_trip_and_refusals(tmp_path):
    path = tmp_path / "grid.json"
    grid = grid_of(rows=(1, 3))
    grid.save(path)
    back = ForwardGrid.try_load(path, KEY)
    assert back is not None and back.points() == grid.points() and back.key == KEY
    other = CostKey(model="other", drafter=KEY.drafter, hardware=KEY.hardware, settings=KEY.settings)
    assert ForwardGrid.try_load(path, other) is None  # measured for another key: measure again
    assert ForwardGrid.try_load(tmp_path / "missing.json", KEY) is None
    path.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON.*delete it"):
        ForwardGrid.try_load(path, KEY)
    path.write_text(json.dumps({"format": "dspark-cost-table", "version": 1}))
    with pytest.raises(UserError, match="not a dspark forward grid"):
        ForwardGrid.try_load(path, KEY)
    data = grid.to_json()
    data["rows"]["1"] = [[1, -2.0]]
    path.write_text(json.dumps(data))
    with pytest.raises(UserError, match="malformed"):
        ForwardGrid.try_load(path, KEY)


def test_load_or_profile_grid_measures_each_point_once_then_reuses(tmp_path):
    path = tmp_path / "g.json"
    calls = []

    def measure(r, b):
        calls.append((r, b))
        return f_model(r, b)

    rows = {1: [1, 2, 8], 2: [2, 9, 16]}
    grid, reused = load_or_profile_grid(KEY, measure, rows, path=path, progress=False)
    assert not reused and calls == [(1, 1), (1, 2), (1, 8), (2, 2), (2, 9), (2, 16)]
    again, reused = load_or_profile_grid(KEY, measure, rows, path=path, progress=False)
    assert reused and len(calls) == 6 and again.points() == grid.points()
    path.write_text("garbage")  # a damaged cache file: said on stderr, measured again
    _, reused = load_or_profile_grid(KEY, measure, rows, path=path, progress=False)
    assert not reused and len(calls) == 12
    with pytest.raises(ValueError, match="must return seconds"):
        load_or_profile_grid(KEY, lambda r, b: 0.0, rows, path=None, progress=False)


def test_spread_budget_and_the_rows_a_profile_measures():
    assert spread_budget(11, 4, 3) == [3, 3, 3, 2]
    assert spread_budget(4, 4, 3) == [1, 1, 1, 1] and spread_budget(16, 4, 3) == [4, 4, 4, 4]
    with pytest.raises(ValueError, match="4 requests verify 4..16"):
        spread_budget(17, 4, 3)
    with pytest.raises(ValueError, match="4 requests verify"):
        spread_budget(3, 4, 3)
    settings = ProfileSettings(max_requests=16, rows_dense_until=4, rows_ratio=1.5)
    assert settings.request_rows(7) == [1, 2, 3, 4, 6, 9, 14, 16]
    budgets = settings.budgets(7)
    for r in settings.request_rows(7):
        row = settings.row_budgets(r, 7, budgets)
        assert row[0] == r and row[-1] == 8 * r and set(row) - {r, 8 * r} <= set(budgets)
    assert ProfileSettings(max_requests=8, max_budget=5).request_rows(7) == [1, 2, 3, 4]  # 6 > 5
    with pytest.raises(UserError, match="rows_ratio"):
        ProfileSettings(rows_ratio=1.0)


def test_step_bench_measures_on_exactly_the_requests_asked():
    settings = ProfileSettings(context_len=24, max_requests=4, repeats=1, warmup=0)
    target = tiny_target(seed=2, vocab_size=96)
    seen = []
    with StepBench(target, NgramDrafter(block_size=3), settings, synthetic_context(24, 96)) as bench:
        step = bench.step_seconds
        bench.step_seconds = lambda lens, include_propose=True: seen.append(list(lens)) or step(lens, include_propose)
        bench.measure(8, include_propose=False, requests=4)  # 4 requests x 2 tokens
        bench.measure(8, include_propose=False)  # the fewest: 2 requests x 4 tokens
        assert [bench.cache.length(s) for s in bench.slots] == [24] * 4
    assert seen == [[2, 2, 2, 2], [4, 4]]


def test_format_split_shows_the_grid():
    cost = SplitCost(grid_of(rows=(1, 2)), CostTable({1: 0.004, 2: 0.006}))
    text = format_split(cost)
    lines = text.splitlines()
    assert "R =" in lines[0] and lines[1].split() == ["1", "2"]
    row_9 = next(line for line in lines if line.split()[:1] == ["9"])
    assert row_9.split() == ["9", "-", f"{1e3 * f_model(2, 9):.2f}"]  # one request cannot verify 9 tokens
    assert "D ms" in text and "6.00" in text


def _requests(count, confidence):
    return [ScheduleRequest(request_id=i, num_drafted=G, confidences=[confidence] * G) for i in range(count)]


def test_the_grid_lets_the_scheduler_verify_what_a_fewest_requests_curve_hides():
    """f_model: 3 ms per request, 1 ms per token. 16 requests, plain: F(16, 16) = 84 ms.
    One more token costs 1 ms on the grid, F(16, 17) = 85 ms, so it pays iff its
    acceptance a satisfies (16 + a) / 85 > 16 / 84, a > 0.19. A curve over B measured on
    the fewest requests, F(B) = 20 + 3 ceil(B / 8) + B, says F(16) = 42 and F(17) = 46 ms:
    (16 + a) / 46 > 16 / 42 needs a > 1.52, never. At a = 0.5 only the grid verifies."""
    draft = CostTable({r: 1e-9 for r in (1, 16)})  # Algorithm 1 runs after drafting: drafting is paid
    fewest = CostTable({b: f_model(-(-b // (1 + G)), b) for b in range(1, 16 * (1 + G) + 1)})
    with_grid = PrefixScheduler(SplitCost(grid_of(), draft)).decide(_requests(16, 0.5))
    with_fewest = PrefixScheduler(SplitCost(fewest, draft)).decide(_requests(16, 0.5))
    assert sum(with_fewest) == 0
    assert sum(with_grid) > 0


def test_the_gate_prices_a_partly_drafted_step_at_all_its_requests():
    """16 requests, one of which has a curve worth drafting. The gate prices drafting it
    alone at F(16, 16 + n) + D(1): the step still reads 16 contexts. Drafting costs 5 ms a
    request. Plain: 16 / 84 ms = 190.5 tok/s. Curve 0.9, 0.81, ...: 7 tokens give
    (16 + 4.70) / (84 + 7 + 5) ms = 215.6 tok/s, so draft it. Curve 0.5, 0.25, ...: the best,
    one token, gives 16.5 / 90 ms = 183 tok/s, so draft no one (priced at one request's
    forward, F(1, 17) = 40 ms, it would look like 367 tok/s)."""
    from dspark.schedule.gate import DraftGate

    gate = DraftGate(SplitCost(grid_of(), CostTable({r: 0.005 * r for r in (1, 2, 4, 8, 16)})))
    assert gate.plain_rate(16) == pytest.approx(16 / 0.084)
    flat = [0.01 ** k for k in range(1, G + 1)]
    good = [0.9 ** k for k in range(1, G + 1)]
    fair = [0.5 ** k for k in range(1, G + 1)]
    assert gate.best_drafts([good] + [flat] * 15) == [True] + [False] * 15
    assert gate.best_drafts([fair] + [flat] * 15) == [False] * 16


def test_lookups_never_fall_with_more_tokens_and_a_noisy_dip_does_not_open_the_gate():
    """Session 20's profile, taken while another job ran: a plain step of 16 requests at
    153 ms, the same step verifying one or two more tokens at 125 ms. Read raw, any draft
    looked cheaper than none and the gate drafted in 86 % of the steps at 16 clients."""
    from dspark.schedule.gate import DraftGate

    noisy = {16: 0.1527, 17: 0.1252, 18: 0.1251, 23: 0.1478, 24: 0.1592, 32: 0.2215}
    grid = ForwardGrid({16: CostTable(noisy)}, key=KEY)
    assert grid.points() == [(16, b, s) for b, s in sorted(noisy.items())]  # the raw points are kept
    fitted = [grid.seconds_per_step(b, 16) for b in range(16, 33)]
    assert all(a <= b for a, b in zip(fitted, fitted[1:]))  # time never falls as B grows
    assert grid.seconds_per_step(16, 16) == pytest.approx((0.1527 + 0.1252 + 0.1251) / 3)  # the dip pooled
    assert grid.seconds_per_step(32, 16) == pytest.approx(0.2215)  # real upward steps stay
    draft = CostTable({1: 0.0104, 2: 0.0143, 3: 0.0193, 4: 0.0322, 5: 0.0285, 16: 0.0877})  # D(5) < D(4): noise
    cost = SplitCost(grid, draft)
    assert cost.draft_seconds(5) >= cost.draft_seconds(4) and cost.draft_seconds(0) == 0.0
    assert cost.draft.points() == sorted(draft.points())
    # 16 requests whose drafts are worth 0.3 tokens at the first position, less after: not worth it
    curves = [[0.3, 0.1, 0.03, 0.01, 0.0, 0.0, 0.0]] * 16
    assert not any(DraftGate(cost).best_drafts(curves))
    # read raw, the same profile made drafting two requests look cheaper than a plain step
    assert noisy[18] + draft.seconds_per_step(2) < noisy[16]
    # good drafts still open it
    assert any(DraftGate(cost).best_drafts([[0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5]] * 16))


def test_measure_in_passes_sweeps_back_and_forth_and_a_burst_spoils_one_timing():
    from dspark.schedule.cost import measure_in_passes

    calls = []

    def measure(p):
        calls.append(p)
        burst = 10.0 if len(calls) in (2, 3) else 1.0  # a few seconds of another job's load
        return p * burst

    timed = measure_in_passes(measure, [1, 2, 3], passes=3, progress=False)
    assert calls == [1, 2, 3, 3, 2, 1, 1, 2, 3]
    assert timed == {1: 1.0, 2: 2.0, 3: 3.0}  # the burst hit points 2 and 3 once each: medians drop it
    with pytest.raises(ValueError, match="passes"):
        measure_in_passes(measure, [1], passes=0, progress=False)
    with pytest.raises(ValueError, match="at least one"):
        measure_in_passes(measure, [], progress=False)
    with pytest.raises(ValueError, match="seconds"):
        measure_in_passes(lambda p: -1.0, [1], progress=False)

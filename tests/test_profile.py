"""SPS(B) profiling: the cache is reused exactly when the CostKey matches, any
mismatch (or a refresh, or a damaged file) measures again; budget splitting;
and a real measurement on a tiny target that releases what it used."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from dspark.draft.ngram import NgramDrafter
from dspark.engine.profile import (
    ProfileSettings, StepBench, load_or_profile, profile_engine, profile_key, profile_path, split_budget,
    synthetic_context,
)
from dspark.errors import UserError
from dspark.models.tiny import tiny_target
from dspark.schedule import CostKey
from tests.server_harness import SlowDrafter

KEY = CostKey(model="m|float32", drafter="d|G=4", hardware="cpu:x|threads=2|torch=2", settings="abc")
BUDGETS = [1, 2, 3, 5, 8]


class FakeMeasure:
    """Seconds per step = 10 ms + 1 ms per token; counts its calls."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, budget: int) -> float:
        self.calls.append(budget)
        return 0.010 + 0.001 * budget


def test_measures_every_budget_then_reuses_the_cache(tmp_path):
    path = tmp_path / "p.json"
    measure = FakeMeasure()
    first = load_or_profile(KEY, measure, BUDGETS, path=path, progress=False)
    assert not first.reused and measure.calls == BUDGETS and path.is_file()
    assert first.table.points() == [(b, pytest.approx(0.010 + 0.001 * b)) for b in BUDGETS]
    assert first.table.sps(5) == pytest.approx(1 / 0.015)
    again = load_or_profile(KEY, measure, BUDGETS, path=path, progress=False)
    assert again.reused and measure.calls == BUDGETS  # nothing measured the second time
    assert again.table.points() == first.table.points() and again.table.key == KEY


@pytest.mark.parametrize("field", ["model", "drafter", "hardware", "settings"])
def test_a_key_mismatch_measures_again(tmp_path, field):
    """Same file, a table measured for another key: re-profile and overwrite."""
    path = tmp_path / "p.json"
    load_or_profile(KEY, FakeMeasure(), BUDGETS, path=path, progress=False)
    other = dataclasses.replace(KEY, **{field: getattr(KEY, field) + "-other"})
    measure = FakeMeasure()
    outcome = load_or_profile(other, measure, BUDGETS, path=path, progress=False)
    assert not outcome.reused and measure.calls == BUDGETS
    assert json.loads(path.read_text())["key"][field] == getattr(other, field)


def test_refresh_and_damaged_files_measure_again(tmp_path):
    path = tmp_path / "p.json"
    load_or_profile(KEY, FakeMeasure(), BUDGETS, path=path, progress=False)
    measure = FakeMeasure()
    assert not load_or_profile(KEY, measure, BUDGETS, path=path, refresh=True, progress=False).reused
    path.write_text("{not json")
    assert not load_or_profile(KEY, measure, BUDGETS, path=path, progress=False).reused
    assert measure.calls == BUDGETS * 2
    assert load_or_profile(KEY, measure, BUDGETS, path=path, progress=False).reused


def test_cache_path_depends_on_every_key_field(tmp_path):
    paths = {profile_path(KEY, tmp_path)} | {
        profile_path(dataclasses.replace(KEY, **{f: "x"}), tmp_path) for f in ("model", "drafter", "hardware", "settings")
    }
    assert len(paths) == 5 and all(p.parent == tmp_path / "profiles" for p in paths)


def test_profile_key_covers_dtype_settings_and_machine():
    base = profile_key("tiny", "ngram|G=4", torch.float32, "cpu", ProfileSettings())
    assert base != profile_key("tiny", "ngram|G=4", torch.bfloat16, "cpu", ProfileSettings())
    assert base != profile_key("tiny", "ngram|G=4", torch.float32, "cpu", ProfileSettings(context_len=128))
    assert base == profile_key("tiny", "ngram|G=4", torch.float32, "cpu", ProfileSettings())
    assert f"threads={torch.get_num_threads()}" in base.hardware and torch.__version__ in base.hardware


def test_split_budget_uses_the_fewest_requests():
    for block in (1, 4, 7):
        for budget in range(1, 5 * (1 + block) + 1):
            lens = split_budget(budget, block, 5)
            assert sum(lens) == budget and all(1 <= q <= 1 + block for q in lens)
            assert len(lens) == -(-budget // (1 + block)) and max(lens) - min(lens) <= 1
    with pytest.raises(ValueError):
        split_budget(11, 1, 5)


def test_settings_are_validated_and_bound_the_grid():
    with pytest.raises(UserError, match="repeats"):
        ProfileSettings(repeats=0)
    with pytest.raises(UserError, match="context_len"):
        ProfileSettings(context_len=0)
    assert ProfileSettings(max_requests=2).budgets(3)[-1] == 8  # 2 requests x (1 + G)
    assert ProfileSettings(max_requests=8, max_budget=20).budgets(3)[-1] == 20


SMALL = ProfileSettings(context_len=24, max_requests=3, repeats=1, warmup=0, dense_until=4, ratio=1.5)


def test_profiles_a_tiny_target_and_reuses_it_without_touching_the_model(tmp_path):
    target = tiny_target(seed=1, vocab_size=96)
    drafter = SlowDrafter(NgramDrafter(block_size=4))
    first = profile_engine(target, drafter, model_id="tiny", settings=SMALL, home=tmp_path, progress=False)
    assert not first.reused and first.path.is_file()
    assert first.table.budgets == SMALL.budgets(4)
    assert all(s > 0 for _, s in first.table.points())
    assert drafter.released == SMALL.max_requests  # every scratch state released
    drafter.fail_next = True  # a cache hit must not run the drafter (or the target)
    again = profile_engine(target, drafter, model_id="tiny", settings=SMALL, home=tmp_path, progress=False)
    assert again.reused and again.table.points() == first.table.points()
    changed = profile_engine(target, NgramDrafter(block_size=4), model_id="tiny", home=tmp_path, progress=False,
                             settings=dataclasses.replace(SMALL, context_len=16))
    assert not changed.reused and changed.path != first.path


def test_step_bench_rolls_back_to_the_context():
    target = tiny_target(seed=2, vocab_size=96)
    bench = StepBench(target, NgramDrafter(block_size=3), SMALL, synthetic_context(SMALL.context_len, 96))
    bench.measure(11)  # 3 requests: 4 + 4 + 3 tokens
    assert [bench.cache.length(s) for s in bench.slots] == [SMALL.context_len] * 3
    cache = bench.cache
    bench.close()
    assert cache.num_free_slots == SMALL.max_requests and cache.tokens_in_use() == 0


def test_synthetic_context_uses_the_tokenizer_when_given():
    from tests.server_harness import CharTokenizer

    ids = synthetic_context(300, 96, CharTokenizer())
    assert len(ids) == 300 and CharTokenizer().decode(ids).startswith("The river town")
    pseudo = synthetic_context(100, 50)
    assert len(pseudo) == 100 and all(0 <= t < 50 for t in pseudo) and pseudo == synthetic_context(100, 50)


def test_run_profile_prints_the_table_and_plots(tmp_path, capsys):
    from dspark.engine.profile import run_profile
    from dspark.models.tiny import tiny_hf_folder

    folder = tiny_hf_folder(tmp_path, seed=4, vocab_size=96)
    png = tmp_path / "sps.png"
    table = run_profile(str(folder), "ngram", home=tmp_path / "home", block_size=3, settings=SMALL, out_png=png)
    out = capsys.readouterr().out
    assert "measured in" in out and "ms/step" in out and png.stat().st_size > 0
    assert (tmp_path / "sps-forward.png").stat().st_size > 0 and "F(R, B) ms, R =" in out  # the grid
    from dspark.models.cpu_kernels import MAX_ROWS, ROW_GROUP, cpu_kernels_available

    # with the CPU kernel on, both sides of its row-group edges are measured as well
    edges = {"row_group": ROW_GROUP, "row_group_until": MAX_ROWS} if cpu_kernels_available() else {}
    assert table.budgets == SMALL.budgets(3, **edges) and "tiny-llama-4" in table.key.model
    again = run_profile(str(folder), "ngram", home=tmp_path / "home", block_size=3, settings=SMALL, out_png=png)
    assert "reused" in capsys.readouterr().out and again.points() == table.points()


def test_other_kernel_block_shapes_measure_the_profile_again(tmp_path):
    """The kernel's block shapes set step times, so a profile measured under one choice is never
    reused under another (tuned on another machine, or DSPARK_KERNEL_BLOCKS=default)."""
    from dspark.models import cpu_kernels

    if not cpu_kernels.cpu_kernels_available():
        pytest.skip(cpu_kernels.cpu_kernels_status())
    target = tiny_target(seed=1, vocab_size=96)
    assert cpu_kernels.enable_cpu_kernels(target, home=tmp_path, tune=False)
    drafter = NgramDrafter(block_size=4)
    other = {k: dict(v) for k, v in cpu_kernels.DEFAULT_BLOCKS.items()}
    other["f32"][2] = 1
    try:
        cpu_kernels.use_blocks(cpu_kernels.DEFAULT_BLOCKS, "default")
        first = profile_engine(target, drafter, model_id="tiny", settings=SMALL, home=tmp_path, progress=False)
        assert not first.reused
        assert profile_engine(target, drafter, model_id="tiny", settings=SMALL, home=tmp_path, progress=False).reused
        cpu_kernels.use_blocks(other, "measured")
        assert not profile_engine(target, drafter, model_id="tiny", settings=SMALL, home=tmp_path, progress=False).reused
    finally:
        cpu_kernels.use_blocks(cpu_kernels.DEFAULT_BLOCKS, "default")


def test_a_drafter_with_its_bf16_path_measures_d_again_not_f(tmp_path, monkeypatch):
    """The drafter's bfloat16 path (DSPARK_DRAFTER_BF16) changes D(R) only: a profile taken with it
    off reuses its forward grid F(R, B) with it on, and measures the drafting rounds again."""
    from dspark.draft.factory import build_drafter
    from dspark.models import cpu_kernels

    if not cpu_kernels.cpu_kernels_available():
        pytest.skip(cpu_kernels.cpu_kernels_status())
    target = tiny_target(seed=1, vocab_size=96)
    assert cpu_kernels.enable_cpu_kernels(target, home=tmp_path, tune=False)
    drafters = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("DSPARK_DRAFTER_BF16", mode)
        drafters[mode] = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, seed=2,
                                       block_size=4, markov_rank=8)
        assert cpu_kernels.enable_drafter_cpu_kernels(drafters[mode], target)
    first = profile_engine(target, drafters["off"], model_id="tiny", drafter_id="d", settings=SMALL, home=tmp_path,
                           progress=False)
    assert not first.reused
    with_bf16 = profile_engine(target, drafters["on"], model_id="tiny", drafter_id="d", settings=SMALL, home=tmp_path,
                               progress=False)
    assert not with_bf16.reused and with_bf16.cost.forward.points() == first.cost.forward.points()
    assert profile_engine(target, drafters["on"], model_id="tiny", drafter_id="d", settings=SMALL, home=tmp_path,
                          progress=False).reused


def test_profile_measures_forward_and_drafting_apart(tmp_path):
    """outcome.cost holds F(R, B) over (request count, budget) and D(R) for
    R = 1..max_requests; a drafter that sleeps 30 ms per propose shows up in D, not
    in F, and the single curve is F(R, B) + D(R) at the fewest requests R that verify B."""
    from dspark.schedule.cost import ForwardGrid, SplitCost

    target = tiny_target(seed=1, vocab_size=96)
    drafter = SlowDrafter(NgramDrafter(block_size=4), delay_s=0.03)
    out = profile_engine(target, drafter, model_id="tiny", settings=SMALL, home=tmp_path, progress=False)
    cost = out.cost
    assert isinstance(cost, SplitCost) and isinstance(cost.forward, ForwardGrid)
    budgets = SMALL.budgets(4)
    assert cost.forward.counts == SMALL.request_rows(4) == [1, 2, 3] and cost.draft.budgets == [1, 2, 3]
    for r, table in cost.forward.rows.items():  # R requests verify R..5R tokens
        assert table.budgets == SMALL.row_budgets(r, 4, budgets)
        assert table.budgets[0] == r and table.budgets[-1] == min(5 * r, budgets[-1])
    assert all(s >= 0.03 for _, s in cost.draft.points())
    assert all(s < 0.03 for _, _, s in cost.forward.points())  # a tiny target's forward: well under 30 ms
    for b, s in out.table.points():
        fewest = -(-b // 5)
        assert s == pytest.approx(cost.forward.seconds_per_step(b, fewest) + cost.draft_seconds(fewest))  # D read through its fit
    again = profile_engine(target, drafter, model_id="tiny", settings=SMALL, home=tmp_path, progress=False)
    assert again.reused and again.cost.draft.points() == cost.draft.points()
    assert again.cost.forward.points() == cost.forward.points()


def test_a_drafter_that_defers_its_context_gets_p_measured_and_cached(tmp_path):
    """The DSpark drafter processes observed context lazily (`pending_rows`), so its profile also
    measures P(n), the processing of n pending rows before a propose, at PROJECT_ROWS, and caches
    it; prompt lookup defers nothing and gets none."""
    from dspark.draft.factory import build_drafter
    from dspark.engine.profile import PROJECT_ROWS, format_split

    target = tiny_target(seed=1, vocab_size=96)
    drafter = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, seed=2,
                            block_size=4, markov_rank=8)
    out = profile_engine(target, drafter, model_id="tiny", drafter_id="d", settings=SMALL, home=tmp_path,
                         progress=False)
    assert out.cost.project is not None and out.cost.project.budgets == list(PROJECT_ROWS)
    assert all(s > 0 for _, s in out.cost.project.points())
    assert out.cost.project_seconds(PROJECT_ROWS[-1]) >= out.cost.project_seconds(1) > 0
    assert "P ms (pending context rows" in format_split(out.cost)
    again = profile_engine(target, drafter, model_id="tiny", drafter_id="d", settings=SMALL, home=tmp_path,
                           progress=False)
    assert again.reused and again.cost.project.points() == out.cost.project.points()
    plain = profile_engine(target, NgramDrafter(block_size=4), model_id="tiny", settings=SMALL, home=tmp_path,
                           progress=False)
    assert plain.cost.project is None and plain.cost.project_seconds(500) == 0.0

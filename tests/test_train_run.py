"""The library entry points on a tiny target folder with real drafters:
recipes in configs/, run_train (resume through the drafter checkpoint
format), run_calibrate."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dspark.draft.checkpoint import load_drafter_folder
from dspark.draft.factory import make_drafter
from dspark.errors import UserError
from dspark.models.config import TargetConfig
from dspark.models.loading import load_target
from dspark.models.tiny import tiny_hf_folder
from dspark.train.config import config_from_dict, load_config
from dspark.train.run import evaluate_drafter, run_calibrate, run_train
from train_toys import write_toy_data

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_shipped_recipes_load_and_share_one_budget():
    cfgs = {k: load_config(CONFIGS / f"{k}.toml") for k in ("dspark", "dflash", "eagle3", "mtp")}
    assert {c.drafter.kind for c in cfgs.values()} == set(cfgs)
    assert len({(c.data.dir, c.optim.total_steps, c.optim.global_batch, c.optim.anchors_per_seq) for c in cfgs.values()}) == 1
    assert all(c.drafter.block_size == 7 for k, c in cfgs.items() if k != "mtp")


# SmolLM2-135M-Instruct's shape, the target every recipe in configs/ names ("" = the embedded model)
SMOLLM2_135M = TargetConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                            num_attention_heads=9, num_key_value_heads=3, head_dim=64)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.toml")), ids=lambda p: p.stem)
def test_every_recipe_builds_its_drafter(path):
    """Each recipe's [drafter] section is valid for the embedded target (options are checked only when a
    drafter is built, which a typo would otherwise reach after the feature cache and target load), and a
    recipe reading a feature cache names the layers its drafter taps. Built on the meta device: no weights."""
    cfg = load_config(path)
    assert cfg.target.path == ""
    v, d = SMOLLM2_135M.vocab_size, SMOLLM2_135M.hidden_size
    with torch.device("meta"):
        drafter = make_drafter(cfg.drafter.kind, SMOLLM2_135M, torch.empty(v, d), torch.empty(v, d),
                               {**cfg.drafter.options, "block_size": cfg.drafter.block_size})
    assert drafter.block_size == cfg.drafter.block_size
    if cfg.features.mode == "cache" and cfg.features.cache_tap_layers:
        assert set(drafter.tap_layers) <= set(cfg.features.cache_tap_layers)


def test_config_rejects_unknown_and_out_of_range_keys(tmp_path):
    with pytest.raises(UserError, match="unknown key.*lr_max"):
        config_from_dict({"optim": {"lr_max": 1.0}})
    with pytest.raises(UserError, match="unknown key.*bogus"):
        config_from_dict({"bogus": {}})
    with pytest.raises(UserError, match="global_batch"):
        config_from_dict({"optim": {"global_batch": 0}})
    with pytest.raises(UserError, match="must be of type int"):
        config_from_dict({"optim": {"total_steps": "many"}})
    with pytest.raises(UserError, match="may not set block_size"):
        config_from_dict({"drafter": {"options": {"block_size": 3}}})
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\n")
    with pytest.raises(UserError, match="cannot parse"):
        load_config(bad)
    empty = tmp_path / "empty.toml"
    empty.write_text("# a recipe whose tables were lost\n")
    with pytest.raises(UserError, match="empty.toml sets nothing"):
        load_config(empty)  # not a run of every default into runs/train


def _recipe(tmp_path: Path, kind: str = "dspark", steps: int = 4) -> Path:
    target_dir = tiny_hf_folder(tmp_path)
    data = write_toy_data(tmp_path / "data", num=40)
    (data / "meta.json").write_text(json.dumps({"target": target_dir.name, "vocab_size": 96}))
    options = {"num_hidden_layers": 1, "markov_rank": 8, "intermediate_size": 64} if kind == "dspark" else {}
    cfg = {
        "run": {"out_dir": str(tmp_path / f"run-{kind}"), "seed": 3},
        "data": {"dir": str(data), "max_seq_len": 32, "holdout_fraction": 0.25},
        "target": {"path": str(target_dir)},
        "drafter": {"kind": kind, "block_size": 1 if kind == "mtp" else 3, "options": options},
        "optim": {"total_steps": steps, "warmup_steps": 1, "global_batch": 4, "anchors_per_seq": 4, "lr": 3e-3},
        "log": {"log_every": 1, "ckpt_every": 2, "progress": False},
    }
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps(cfg))
    return path


def _kill_after_first_checkpoint(recipe: Path, out_dir: Path) -> bool:
    """Run run_train in a subprocess and SIGKILL it once a checkpoint exists;
    True if it was killed before finishing. The child uses this process's
    thread count: bit-exact results need the same reduction order."""
    code = (f"import torch; torch.set_num_threads({torch.get_num_threads()}); "
            f"from dspark.train.run import run_train; run_train({str(recipe)!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    marker = out_dir / "checkpoints" / "latest"
    deadline = time.time() + 120
    while proc.poll() is None and not marker.exists() and time.time() < deadline:
        time.sleep(0.05)
    killed = proc.poll() is None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return killed


def test_killed_run_resumes_exactly_then_calibrates(tmp_path):
    recipe = _recipe(tmp_path, steps=12)
    whole = run_train(recipe)
    target = load_target(json.loads(recipe.read_text())["target"]["path"])
    a = load_drafter_folder(whole, target.model).state_dict()
    summary = json.loads((whole.parent / "summary.json").read_text())
    assert summary["step"] == 12 and summary["heldout"]["expected_accept_len"] >= 1.0

    cfg = json.loads(recipe.read_text())
    cfg["run"]["out_dir"] = str(tmp_path / "run-b")
    recipe_b = tmp_path / "b.json"
    recipe_b.write_text(json.dumps(cfg))
    assert _kill_after_first_checkpoint(recipe_b, tmp_path / "run-b")
    assert not (tmp_path / "run-b" / "drafter").exists()
    b = load_drafter_folder(run_train(recipe_b), target.model).state_dict()
    diff = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not diff, diff
    log_a = (whole.parent / "log.jsonl").read_text().splitlines()
    log_b = (tmp_path / "run-b" / "log.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in log_a] == [json.loads(x)["loss"] for x in log_b]

    report = run_calibrate(whole, cfg["data"]["dir"], target_path=cfg["target"]["path"], holdout_fraction=0.25,
                           max_seq_len=32, anchors_per_seq=8, out_dir=tmp_path / "cal", write=True)
    assert len(report["temperatures"]) == 3 and all(t > 0 for t in report["temperatures"])
    assert len(report["before"]) == len(report["after"]) == 3 and report["num_blocks"] > 0
    assert (tmp_path / "cal" / "reliability.png").stat().st_size > 5000
    reloaded = load_drafter_folder(whole, target.model)
    assert list(reloaded.config.calibration_temperatures) == pytest.approx(report["temperatures"])
    # the trained folder ships its token ranking (draft vocabulary off until asked for); calibrate keeps it
    assert reloaded.draft_ranking is not None and reloaded.config.draft_vocab_size == 0
    assert sorted(reloaded.draft_ranking.tolist()) == list(range(target.config.vocab_size))


def test_stop_at_step_checkpoints_where_it_stops_and_resumes_exactly(tmp_path):
    """`dspark train --stop-at-step 3` with checkpoints every 2 steps keeps step 3 (not only step 2),
    and the run resumed from it ends with the weights of an uninterrupted one."""
    recipe = _recipe(tmp_path, steps=6)
    whole = run_train(recipe)
    cfg = json.loads(recipe.read_text())
    cfg["run"]["out_dir"] = str(tmp_path / "run-b")
    recipe_b = tmp_path / "b.json"
    recipe_b.write_text(json.dumps(cfg))
    stopped = run_train(recipe_b, stop_at_step=3)
    assert (stopped / "checkpoints" / "latest").read_text().strip() == "step-0000003"
    assert not (stopped / "drafter").exists()
    target = load_target(cfg["target"]["path"])
    a = load_drafter_folder(whole, target.model).state_dict()
    b = load_drafter_folder(run_train(recipe_b), target.model).state_dict()
    diff = {k: float((a[k] - b[k]).abs().max()) for k in a if not torch.equal(a[k], b[k])}
    assert not diff, diff


@pytest.mark.parametrize("kind", ["eagle3", "mtp", "dflash"])
def test_run_train_baselines(tmp_path, kind):
    final = run_train(_recipe(tmp_path, kind, steps=2))
    assert (final / "config.json").is_file()
    with pytest.raises(UserError, match="no confidence head"):
        run_calibrate(final, tmp_path / "data", target_path=str(tiny_hf_folder(tmp_path)), holdout_fraction=0.25, max_seq_len=32)


def test_evaluate_drafter_repeats_the_end_of_training_evaluation(tmp_path):
    recipe = _recipe(tmp_path, "dflash", steps=3)
    final = run_train(recipe)
    held = json.loads((final.parent / "summary.json").read_text())["heldout"]
    again = evaluate_drafter(recipe, final)  # the folder holds float16 weights: close, not equal
    assert again["heldout_sequences"] > 0 and again["drafter"] == str(final)
    assert again["expected_accept_len"] == pytest.approx(held["expected_accept_len"], abs=0.02)
    assert again["loss"] == pytest.approx(held["loss"], rel=0.02)


def test_evaluate_drafter_reads_the_recipe_feature_cache(tmp_path):
    """features="cache" reads the features training cached (held-out split included) and repeats the
    end-of-training evaluation, which read them too; online agrees to float16 rounding of the taps.
    Without a usable cache it refuses with the fix."""
    recipe = _recipe(tmp_path, "dspark", steps=3)
    cfg = json.loads(recipe.read_text())
    cfg["features"] = {"mode": "cache", "cache_max_gb": 1.0}
    recipe.write_text(json.dumps(cfg))
    final = run_train(recipe)
    held = json.loads((final.parent / "summary.json").read_text())["heldout"]
    cached = evaluate_drafter(recipe, final, features="cache")
    online = evaluate_drafter(recipe, final)
    assert cached["features"] == "cache" and online["features"] == "online"
    assert cached["expected_accept_len"] == pytest.approx(held["expected_accept_len"], abs=0.02)
    assert cached["expected_accept_len"] == pytest.approx(online["expected_accept_len"], abs=0.02)
    assert cached["loss"] == pytest.approx(online["loss"], rel=0.02)

    shard = sorted((final.parent / "feature_cache").glob("features-*.safetensors"))
    for path in shard:
        path.unlink()
    with pytest.raises(UserError, match="lacks .* held-out sequences"):
        evaluate_drafter(recipe, final, features="cache")
    with pytest.raises(UserError, match="features must be one of online, cache"):
        evaluate_drafter(recipe, final, features="disk")
    plain = _recipe(tmp_path / "plain", "dflash", steps=2)
    with pytest.raises(UserError, match="no feature cache in .*evaluate with features online"):
        evaluate_drafter(plain, final, features="cache")


def _checkpoint_weights(out_dir: Path) -> dict:
    latest = (out_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(out_dir / "checkpoints" / latest / "drafter" / "model.safetensors"))


def test_two_process_data_parallel_matches_single(tmp_path):
    """`torchrun` with 2 CPU ranks (gloo) running `dspark train`, global batch 4 =
    2 x 2, against one process: float32 weights agree to 1e-5 (only the
    order of gradient sums differs) and the logged losses to 4 digits."""
    recipe = _recipe(tmp_path, steps=4)
    run_train(recipe, device="cpu")  # CPU ranks on a GPU machine too
    cfg = json.loads(recipe.read_text())
    cfg["run"]["out_dir"] = str(tmp_path / "ddp")
    ddp = tmp_path / "ddp.json"
    ddp.write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the command the training README gives: torchrun -m dspark.cli train RECIPE
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
           "-m", "dspark.cli", "train", str(ddp), "--device", "cpu"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 rank(s)" in proc.stdout
    a, b = _checkpoint_weights(tmp_path / "run-dspark"), _checkpoint_weights(tmp_path / "ddp")
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4), k
    logs = [[json.loads(x)["loss"] for x in (d / "log.jsonl").read_text().splitlines()]
            for d in (tmp_path / "run-dspark", tmp_path / "ddp")]
    assert [round(x, 4) for x in logs[0]] == [round(x, 4) for x in logs[1]]


def test_ranks_find_their_gpu_or_a_clear_error(monkeypatch):
    """Under torchrun, rank r trains on GPU r; more ranks than GPUs, or one GPU named for
    several ranks, is refused with the fix (checked without a GPU: torch's view is faked)."""
    from dspark.errors import UserError
    from dspark.train.run import init_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert init_distributed("auto").device == torch.device("cuda", 1)  # one process: no group
    assert init_distributed("cuda:0").device == torch.device("cuda", 0)
    assert init_distributed("cpu").device == torch.device("cpu")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(UserError, match="at most one rank per GPU"):
        init_distributed("cuda")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="names one GPU"):
        init_distributed("cuda:1")


def test_snapshots_feed_the_budget_report(tmp_path):
    from dspark.train.budget import main as budget_main, write_budget_report
    from dspark.train.checkpoint import list_snapshots

    recipes = []
    for kind in ("dspark", "dflash"):
        recipe = _recipe(tmp_path, kind, steps=4)
        cfg = json.loads(recipe.read_text())
        cfg["log"]["snapshot_every"] = 2
        recipe.write_text(json.dumps(cfg))
        run_train(recipe)
        out_dir = Path(cfg["run"]["out_dir"])
        assert [s for s, _ in list_snapshots(out_dir)] == [2, 4]
        (out_dir / "snapshots" / "step-0000006.tmp").mkdir()  # a snapshot cut short is not listed
        assert [s for s, _ in list_snapshots(out_dir)] == [2, 4]
        recipes.append((kind, str(recipe)))

    calls = []

    def evaluate(recipe, folder):
        calls.append(folder)
        return evaluate_drafter(recipe, folder)

    page = write_budget_report(recipes, tmp_path / "docs" / "BUDGET.md", "cmd", evaluate)
    assert len(calls) == 4  # two snapshots per run; the final drafter is the step-4 snapshot's step
    text = page.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 2 ") or line.startswith("| 4 ")]
    assert len(rows) == 2 and all(line.rstrip(" |").endswith("x") for line in rows)
    assert "| dspark / dflash |" in text  # the first run over each other run
    from dspark.train.budget import budget_table

    fake = {"A": [{"step": 2, "expected_accept_len": 1.5, "accept_per_position": [0.4]}],
            "B": [{"step": 2, "expected_accept_len": 1.2, "accept_per_position": [0.2]}],
            "C": [{"step": 4, "expected_accept_len": 1.1, "accept_per_position": [0.1]}]}
    table = budget_table(fake)
    assert "| 2 | 1.500 (0.400) | 1.200 (0.200) | - | 1.250x | - |" in table
    assert "| 4 | - | - | 1.100 (0.100) | - | - |" in table
    assert (tmp_path / "docs" / "figures" / "budget.png").stat().st_size > 5000
    step4 = json.loads((tmp_path / "run-dspark" / "budget" / "step-0000004.json").read_text())
    direct = evaluate_drafter(recipes[0][1], tmp_path / "run-dspark" / "snapshots" / "step-0000004")
    assert step4["expected_accept_len"] == pytest.approx(direct["expected_accept_len"])

    def refuse(recipe, folder):
        raise AssertionError("cached results must be reused")

    write_budget_report(recipes, tmp_path / "docs" / "BUDGET.md", "cmd", refuse)
    sources = []

    def record(recipe, folder):
        sources.append(folder)
        return evaluate_drafter(recipe, folder)

    write_budget_report(recipes, tmp_path / "docs" / "BUDGET.md", "cmd", record, features="cache")
    assert len(sources) == 4  # the online results are not reused for a page read from the cache
    assert json.loads((tmp_path / "run-dspark" / "budget" / "step-0000004.json").read_text())["features"] == "cache"
    assert "read from the recipe cache" in (tmp_path / "docs" / "BUDGET.md").read_text()
    assert budget_main(["--run", f"x={recipes[0][1]}", "--features", "disk"]) == 2
    assert budget_main(["--run", "no-equals-sign"]) == 2
    assert budget_main(["--out", "x.md"]) == 2 and budget_main(["--bogus"]) == 2
    fresh = _recipe(tmp_path / "fresh", "dflash", steps=2)  # never trained: nothing to evaluate
    assert budget_main(["--run", f"x={fresh}", "--out", str(tmp_path / "x.md")]) == 2


def _init_recipe(tmp_path: Path, layer_ids: list[int], steps: int = 2, **options) -> Path:
    recipe = _recipe(tmp_path, "dspark", steps=steps)
    cfg = json.loads(recipe.read_text())
    cfg["drafter"]["options"] = {"num_hidden_layers": len(layer_ids), "markov_rank": 8, **options}
    cfg["drafter"]["init_from_target_layers"] = layer_ids
    cfg["run"]["out_dir"] = str(tmp_path / "run-init")
    recipe.write_text(json.dumps(cfg))
    return recipe


def test_init_from_target_layers_copies_then_trains_its_own_weights(tmp_path):
    """Draft layer i starts as target layer ids[i] (every tensor), the copies are the
    drafter's own (training leaves the target untouched), and a 2-step run ends near
    the copied weights, not near a random draw."""
    from dspark.draft.factory import build_drafter
    from dspark.train.run import init_from_target_layers

    target = load_target(str(tiny_hf_folder(tmp_path)))
    model = target.model
    ids = [len(model.model.layers) - 1, 0]
    drafter = build_drafter("dspark", target.config, model.embed_tokens, model.lm_head_weight, block_size=3,
                            num_hidden_layers=2, markov_rank=8)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    init_from_target_layers(drafter, model, ids)
    for draft_layer, i in zip(drafter.layers, ids):
        source = model.model.layers[i].state_dict()
        mine = draft_layer.state_dict()
        assert set(mine) == set(source)
        for k in mine:
            assert torch.equal(mine[k], source[k]), k
    with torch.no_grad():
        for p in drafter.layers.parameters():
            p.add_(1.0)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())

    final = run_train(_init_recipe(tmp_path, ids))
    trained = load_file(str(final / "model.safetensors"))
    for j, i in enumerate(ids):
        for name, value in model.model.layers[i].state_dict().items():
            got = trained[f"layers.{j}.{name}"].float()
            assert (got - value).abs().max() < 0.02, (j, name)  # 2 AdamW steps at lr 3e-3 move little
    assert json.loads((final.parent / "train_config.json").read_text())["drafter"]["init_from_target_layers"] == ids


def test_init_from_target_layers_refuses_what_it_cannot_copy(tmp_path):
    with pytest.raises(UserError, match="dspark and dflash drafters only"):
        config_from_dict({"drafter": {"kind": "eagle3", "init_from_target_layers": [1]}})
    with pytest.raises(UserError, match="list of layer indices"):
        config_from_dict({"drafter": {"init_from_target_layers": [-1]}})
    with pytest.raises(UserError, match="one target layer per draft layer"):
        run_train(_init_recipe(tmp_path, [0, 1], num_hidden_layers=1))
    with pytest.raises(UserError, match="out of range"):
        run_train(_init_recipe(tmp_path, [0, 99]))
    with pytest.raises(UserError, match="intermediate_size = 0"):
        run_train(_init_recipe(tmp_path, [0], intermediate_size=16))
    assert not (tmp_path / "run-init" / "checkpoints").exists()  # refused before any training


def _vocab_recipe(tmp_path: Path, kind: str, size: int, out: str, steps: int = 4) -> Path:
    recipe = tmp_path / f"{kind}.json"
    if not recipe.is_file():  # one toy data set and tiny target per test
        _recipe(tmp_path, kind, steps=steps)
    cfg = json.loads(recipe.read_text())
    cfg["optim"]["total_steps"] = steps
    cfg["drafter"]["draft_vocab_size"] = size
    cfg["run"]["out_dir"] = str(tmp_path / out)
    path = tmp_path / f"{out}.json"
    path.write_text(json.dumps(cfg))
    return path


def test_training_over_a_draft_vocabulary(tmp_path):
    """[drafter] draft_vocab_size = K trains over the K most frequent answer tokens: the drafter
    ships with that draft vocabulary, DSpark's Markov transition is zero for every other token
    (so the checkpoint read over the whole vocabulary adds no bias there), and a run stopped
    and resumed ends exactly where an uninterrupted one does."""
    k = 24
    whole = run_train(_vocab_recipe(tmp_path, "dspark", k, "run-k"))
    target = load_target(str(tiny_hf_folder(tmp_path)))
    drafter = load_drafter_folder(whole, target.model)
    assert drafter.config.draft_vocab_size == k and drafter.draft_ids.numel() == k
    assert set(drafter.draft_ids.tolist()) == set(drafter.draft_ranking[:k].tolist())
    w2 = load_file(str(whole / "model.safetensors"))["markov_head.markov_w2.weight"].float()
    outside = torch.ones(w2.shape[0], dtype=torch.bool)
    outside[drafter.draft_ids] = False
    assert bool((w2[outside] == 0).all()) and bool((w2[~outside] != 0).any())
    held = json.loads((whole.parent / "summary.json").read_text())["heldout"]
    assert held["expected_accept_len"] >= 1.0 and held["tv"] > 0

    recipe_b = _vocab_recipe(tmp_path, "dspark", k, "run-k-b")
    run_train(recipe_b, stop_at_step=2)
    assert not (tmp_path / "run-k-b" / "drafter").exists()
    resumed = load_drafter_folder(run_train(recipe_b), target.model).state_dict()
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, resumed[name]), name

    for kind in ("eagle3", "mtp"):
        final = run_train(_vocab_recipe(tmp_path, kind, k, f"run-{kind}-k", steps=2))
        assert load_drafter_folder(final, target.model).config.draft_vocab_size == k


def test_draft_vocab_size_refusals(tmp_path):
    with pytest.raises(UserError, match="may not set .*draft_vocab_size"):
        config_from_dict({"drafter": {"options": {"draft_vocab_size": 8}}})
    with pytest.raises(UserError, match="draft_vocab_size = -1 is out of range"):
        config_from_dict({"drafter": {"draft_vocab_size": -1}})
    with pytest.raises(UserError, match="not below the target's 96 tokens"):
        run_train(_vocab_recipe(tmp_path, "dspark", 96, "run-all"))
    assert not (tmp_path / "run-all" / "checkpoints").exists()


def _from_recipe(tmp_path: Path, source: Path, out: str, steps: int = 2, seed: int = 5, **drafter) -> Path:
    recipe = _vocab_recipe(tmp_path, "dspark", 24, out, steps=steps)
    cfg = json.loads(recipe.read_text())
    cfg["run"]["seed"] = seed  # another random draw than the source's: what the run starts from must be the source
    cfg["drafter"]["init_from"] = str(source)
    cfg["drafter"].update(drafter)
    recipe.write_text(json.dumps(cfg))
    return recipe


def test_init_from_starts_every_trained_weight_from_a_saved_drafter(tmp_path):
    """[drafter] init_from copies every trained tensor of a saved drafter of the same shape; the run
    then trains from there on its own schedule (a few small steps end near the source, far from
    a fresh draw), keeps DSpark's Markov rows outside its draft vocabulary at zero, and a run
    stopped and resumed ends where an uninterrupted one does (the checkpoint, not the source, wins)."""
    from dspark.train.run import build_recipe_drafter, start_from_drafter

    source = run_train(_vocab_recipe(tmp_path, "dspark", 24, "run-source"))
    target = load_target(str(tiny_hf_folder(tmp_path)))
    saved = load_drafter_folder(source, target.model).state_dict()
    cfg = load_config(_from_recipe(tmp_path, source, "run-from"))
    ranking = load_drafter_folder(source, target.model).draft_ranking
    fresh = build_recipe_drafter(cfg, target, target.model, ranking, torch.device("cpu"))
    assert any(not torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
    line = start_from_drafter(fresh, str(source), target.model, ranking, 24)
    assert "every trained weight started from" in line and "24 of this recipe's 24 draft tokens" in line
    for name, value in fresh.state_dict().items():
        assert torch.equal(value, saved[name]), name

    final = run_train(_from_recipe(tmp_path, source, "run-from", steps=2))
    trained = load_drafter_folder(final, target.model).state_dict()
    moved = max((trained[k] - v).abs().max().item() for k, v in saved.items())
    assert 0 < moved < 0.02  # 2 AdamW steps at lr 3e-3 move little
    w2 = load_file(str(final / "model.safetensors"))["markov_head.markov_w2.weight"].float()
    outside = torch.ones(w2.shape[0], dtype=torch.bool)
    outside[ranking[:24]] = False
    assert bool((w2[outside] == 0).all())
    assert json.loads((final.parent / "train_config.json").read_text())["drafter"]["init_from"] == str(source)

    stopped = _from_recipe(tmp_path, source, "run-from-b", steps=2)
    run_train(stopped, stop_at_step=1)
    resumed = load_drafter_folder(run_train(stopped), target.model).state_dict()
    for name, value in trained.items():
        assert torch.equal(value, resumed[name]), name


def test_init_from_refuses_another_drafter(tmp_path):
    source = run_train(_vocab_recipe(tmp_path, "dspark", 24, "run-source", steps=2))
    with pytest.raises(UserError, match="remove markov_init"):
        config_from_dict({"drafter": {"init_from": str(source), "markov_init": "pmi"}})
    with pytest.raises(UserError, match="is not a drafter folder"):
        run_train(_from_recipe(tmp_path, tmp_path / "nowhere", "run-x"))
    with pytest.raises(UserError, match="markov_rank: 8 there, 4 here"):
        run_train(_from_recipe(tmp_path, source, "run-x", options={"num_hidden_layers": 1, "markov_rank": 4,
                                                                     "intermediate_size": 64}))
    with pytest.raises(UserError, match="block_size: 3 there, 4 here"):
        run_train(_from_recipe(tmp_path, source, "run-x", block_size=4))
    assert not (tmp_path / "run-x" / "checkpoints").exists()  # refused before any training

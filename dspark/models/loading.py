"""Load a local Hugging Face Llama-family folder into the lean TargetModel.

Only safetensors are read (never pickle). Every problem with a folder is a
`CheckpointError` whose one-line message names the file or tensor and the fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dspark.errors import CheckpointError
from dspark.models.config import TargetConfig
from dspark.models.cpu_kernels import enable_cpu_kernels
from dspark.models.device import resolve_device
from dspark.models.embedded import ensure_embedded_target
from dspark.models.llama import TargetModel

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
# Tensors some checkpoints carry that the runtime recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class LoadedTarget:
    """A target ready to serve."""

    model: TargetModel  # eval mode, in the requested dtype
    tokenizer: object | None  # a transformers tokenizer, or None when the folder has none
    config: TargetConfig
    name: str  # folder name, e.g. "SmolLM2-135M-Instruct"
    path: Path  # the folder the weights came from


def load_target(
    path: str | Path | None,
    *,
    home: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    cpu_kernels: bool = True,
    device: str | torch.device = "cpu",
) -> LoadedTarget:
    """Load a target folder; `path=None` loads the embedded SmolLM2 (converting it once).

    device: `cpu`, `cuda`, `cuda:N` or `auto` (a GPU if torch sees one). Drafters loaded
    for the model follow it to its device.
    cpu_kernels: on the CPU, give a float32 model the small-row matmul kernel of
    `dspark.models.cpu_kernels` (a packed copy of the weights: a fifth of their memory for the
    embedded model, as much again for others). Pass False to run torch's own matmuls (the
    CLI's `--no-cpu-kernel`); on a GPU it does nothing."""
    device = resolve_device(device)
    folder = ensure_embedded_target(home) if path is None else Path(path).expanduser()
    config = read_target_config(folder)
    model = load_target_model(folder, config, dtype)
    if device.type != "cpu":
        model = model.to(device)
    elif cpu_kernels:
        enable_cpu_kernels(model, home)
    return LoadedTarget(model=model, tokenizer=load_tokenizer(folder), config=config, name=folder.name, path=folder)


def read_target_config(folder: Path) -> TargetConfig:
    """TargetConfig from `folder/config.json` (eos ids from generation_config.json if absent)."""
    if not folder.is_dir():
        raise CheckpointError(
            f"target folder {folder} does not exist; pass a local Hugging Face model folder "
            "(config.json + *.safetensors), or no path for the embedded SmolLM2"
        )
    cfg = _read_json(folder / "config.json", "the model's config.json")
    if cfg.get("eos_token_id") is None and (folder / "generation_config.json").is_file():
        cfg["eos_token_id"] = _read_json(folder / "generation_config.json", "generation config").get("eos_token_id")
    try:
        return TargetConfig.from_hf(cfg)
    except KeyError as err:
        raise CheckpointError(f"{folder / 'config.json'} lacks the field {err.args[0]!r}; is it a Llama-family model?") from None


def load_target_model(folder: Path, config: TargetConfig, dtype: torch.dtype = torch.float32) -> TargetModel:
    """Build the lean model for `config` and fill it from the folder's safetensors."""
    state = read_safetensors(folder)
    with torch.device("meta"):
        model = TargetModel(config)
    expected = model.state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, meta in expected.items():
        if name not in state:
            raise CheckpointError(
                f"tensor {name!r} is missing from the safetensors in {folder}; the weights do not match "
                "config.json (or are incomplete): re-download or re-convert the model"
            )
        if tuple(state[name].shape) != tuple(meta.shape):
            raise CheckpointError(
                f"tensor {name!r} in {folder} has shape {tuple(state[name].shape)} but config.json implies "
                f"{tuple(meta.shape)}; the weights and config.json belong to different models"
            )
    state = {k: v.to(dtype) for k, v in state.items() if k in expected}
    model.load_state_dict(state, assign=True)
    return model.eval()


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a folder: `model.safetensors`, or the shards listed in
    `model.safetensors.index.json`, or every `*.safetensors` file."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "the safetensors index").get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = [p.name for p in folder.glob("*.bin")] + [p.name for p in folder.glob("*.pt")]
        hint = f" (found {pickles[0]}: dspark never loads pickle files; save the model with safetensors)" if pickles else ""
        raise CheckpointError(f"no *.safetensors weights in {folder}{hint}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(_load_file(file))
    return {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}


def _load_file(file: Path) -> dict[str, torch.Tensor]:
    if not file.is_file():
        raise CheckpointError(f"weight shard {file} is missing (listed in the index); re-download the model")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{file} is corrupt or truncated ({reason}); re-download or re-convert it"
        ) from None


def _read_json(file: Path, what: str) -> dict:
    return read_json_object(
        file,
        missing=f"{file} is missing ({what}); the folder must be a Hugging Face model folder",
        fix="re-download or fix it",
    )


def read_json_object(file: Path, *, missing: str, fix: str) -> dict:
    """The JSON object in `file`; CheckpointError with `missing` when absent, or
    naming the file and `fix` when it is not a JSON object."""
    if not file.is_file():
        raise CheckpointError(missing)
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{file} is not valid JSON ({err}); {fix}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object; {fix}")
    return data


def load_tokenizer(folder: Path):
    """The folder's tokenizer (with its chat template), or None when it ships none.

    A folder with `tokenizer.json` is read by the generic fast tokenizer, which skips
    AutoTokenizer's model-config imports (about 3 s); others go through AutoTokenizer."""
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        return None
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast as tokenizer_class
    else:
        from transformers import AutoTokenizer as tokenizer_class
    try:
        return tokenizer_class.from_pretrained(str(folder))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot read the tokenizer in {folder} ({err}); re-download or re-convert it") from None

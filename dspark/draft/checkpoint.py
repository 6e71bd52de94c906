"""Drafter folders in the DeepSpec / Hugging Face layout.

    folder/config.json        the target's HF fields (num_hidden_layers = draft
                              layers, num_target_layers = the target's), the
                              drafter fields (block_size, mask_token_id,
                              target_layer_ids, markov_rank, markov_head_type,
                              enable_confidence_head, confidence_head_with_markov,
                              ...) and dspark's own (drafter_type,
                              calibration_temperatures, transition_top_k, and the
                              weights file's size and sha256)
    folder/model.safetensors  DeepSpec parameter names (`layers.{i}.self_attn.q_proj.weight`,
                              `fc.weight`, `markov_head.markov_w1.weight`, ...)
    folder/draft_vocab.safetensors  optional, dspark's own: `token_ids`, the target's tokens
                              ranked by frequency in the training answers; with
                              config draft_vocab_size = K > 0 the drafter drafts among
                              the first K only (other engines ignore the file)

The embedding and LM head are the target's: not written unless
`self_contained=True` (for engines that expect them), and taken from the
target on load. Writes are atomic per file (temp file, fsync, rename) and the
config records the weights' sha256, so an interrupted save is detected.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from dspark.draft.base import TrainableDrafter
from dspark.draft.factory import drafter_kind, make_drafter
from dspark.errors import CheckpointError, UserError
from dspark.models.config import TargetConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DRAFT_VOCAB_NAME = "draft_vocab.safetensors"  # dspark's own: token ranking of the draft vocabulary
SHARED = ("embed_tokens.weight", "lm_head.weight")
CONFIG_FIELDS = {
    "dspark": ("block_size", "num_hidden_layers", "target_layer_ids", "mask_token_id", "intermediate_size",
               "markov_head_type", "markov_rank", "enable_confidence_head", "confidence_head_with_markov",
               "calibration_temperatures", "transition_top_k", "draft_vocab_size"),
    "eagle3": ("block_size", "target_layer_ids", "intermediate_size", "draft_vocab_size"),
    "mtp": ("intermediate_size", "draft_vocab_size"),
}
CONFIG_FIELDS["dflash"] = ("block_size", "num_hidden_layers", "target_layer_ids", "mask_token_id",
                           "intermediate_size", "transition_top_k", "draft_vocab_size")


@dataclass(frozen=True)
class FamilyAdapter:
    """What differs between target families in a drafter folder (the layer
    shapes differ only by TargetConfig.qk_norm: Qwen3's q_norm / k_norm)."""

    prefix: str  # architecture name prefix
    per_layer_types: bool  # config lists `layer_types` (HF Qwen3 configs index it per layer)


FAMILIES = {"llama": FamilyAdapter("Llama", False), "qwen3": FamilyAdapter("Qwen3", True)}
ARCH_SUFFIX = {"dspark": "DSparkModel", "dflash": "DSparkModel", "eagle3": "Eagle3Model", "mtp": "MTPModel"}


def drafter_config_dict(drafter) -> dict:
    """The folder's config.json for `drafter` (without the weights record)."""
    kind = drafter_kind(drafter)
    target: TargetConfig = drafter.target_config
    family = FAMILIES[target.model_type]
    fields = asdict(drafter.config)
    cfg = target.to_hf()
    num_layers = fields.get("num_hidden_layers", 1)
    cfg.update(
        architectures=[family.prefix + ARCH_SUFFIX[kind]],
        drafter_type=kind,
        num_target_layers=target.num_hidden_layers,
        num_hidden_layers=num_layers,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    if family.per_layer_types:
        cfg.update(layer_types=["full_attention"] * num_layers, use_sliding_window=False, sliding_window=None)
    for key in CONFIG_FIELDS[kind]:
        value = fields[key]
        cfg[key] = list(value) if isinstance(value, tuple) else value
    if kind == "dflash":
        cfg.update(markov_rank=0, enable_confidence_head=False)
    if kind == "mtp":
        cfg["block_size"] = 1
    cfg.setdefault("num_anchors", 512)  # read (not used at inference) by DeepSpec's model classes
    return cfg


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_drafter(
    drafter: TrainableDrafter,
    folder: str | Path,
    *,
    dtype: torch.dtype = torch.float16,
    self_contained: bool = False,
    extra_config: dict | None = None,
) -> Path:
    """Write `drafter` to `folder` (created if needed) -> the folder path.

    self_contained also writes the target's embed_tokens / lm_head (as the
    DeepSpec model classes expect); extra_config adds keys to config.json
    (e.g. the trainer's num_anchors) and may not override drafter fields."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    if self_contained:
        tensors["embed_tokens.weight"] = drafter.vocab.embed_weight.to("cpu", dtype).contiguous()
        tensors["lm_head.weight"] = drafter.vocab.lm_head_weight.to("cpu", dtype).contiguous()
    blob = save(tensors, metadata={"format": "pt"})
    cfg = drafter_config_dict(drafter)
    for key, value in (extra_config or {}).items():
        if key in cfg and key != "num_anchors":
            raise UserError(f"extra_config may not override the drafter field {key!r}")
        cfg[key] = value
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    cfg["dspark_weights"] = {"bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}
    _atomic_write(folder / WEIGHTS_NAME, blob)
    ranking = getattr(drafter, "draft_ranking", None)
    if ranking is not None:
        write_draft_vocab(folder, ranking)
    _atomic_write(folder / CONFIG_NAME, (json.dumps(cfg, indent=2) + "\n").encode())
    return folder


def read_config(folder: Path) -> dict:
    from dspark.models.loading import read_json_object

    return read_json_object(
        folder / CONFIG_NAME,
        missing=f"{folder} has no {CONFIG_NAME}; pass a drafter folder written by dspark or DeepSpec",
        fix="re-save the drafter",
    )


def kind_of(cfg: dict, folder: Path) -> str:
    kind = cfg.get("drafter_type")
    if kind is None:  # a DeepSpec folder: infer from the architecture
        arch = " ".join(cfg.get("architectures") or [])
        if "DSpark" in arch:
            kind = "dspark" if int(cfg.get("markov_rank", 0)) > 0 or cfg.get("enable_confidence_head") else "dflash"
        elif "Eagle3" in arch:
            kind = "eagle3"
        elif "MTP" in arch:
            kind = "mtp"
    if kind not in CONFIG_FIELDS:
        raise CheckpointError(
            f"{folder / CONFIG_NAME}: cannot tell the drafter type (drafter_type={kind!r}, "
            f"architectures={cfg.get('architectures')}); set drafter_type to one of {sorted(CONFIG_FIELDS)}"
        )
    return kind


def _drafter_fields(cfg: dict, kind: str, folder: Path) -> dict:
    fields = {k: cfg[k] for k in CONFIG_FIELDS[kind] if k in cfg and cfg[k] is not None}
    if kind == "dspark":
        if int(fields.get("markov_rank", 0)) == 0:
            fields["markov_head_type"] = "none"
        if not fields.get("enable_confidence_head", False):
            fields["confidence_head_with_markov"] = False
        fields.setdefault("confidence_head_with_markov", False)
    if -1 in (fields.get("target_layer_ids") or []):
        raise CheckpointError(
            f"{folder}: target_layer_ids {fields['target_layer_ids']} use the embedding output (-1), "
            "which dspark's target runtime does not tap; retrain with decoder layers 0..L-1"
        )
    return fields


def _check_target(cfg: dict, target_config: TargetConfig, folder: Path) -> TargetConfig:
    """The drafter's view of the target, refused when it cannot share the target's vocabulary."""
    for key in ("vocab_size", "hidden_size"):
        if key not in cfg:
            raise CheckpointError(f"{folder / CONFIG_NAME} lacks {key!r}; re-save the drafter")
        if int(cfg[key]) != getattr(target_config, key):
            raise CheckpointError(
                f"drafter {folder} was built for a target with {key}={cfg[key]}, but this target has "
                f"{key}={getattr(target_config, key)}; use a drafter trained for this target"
            )
    n_target = int(cfg.get("num_target_layers", target_config.num_hidden_layers))
    if n_target != target_config.num_hidden_layers:
        raise CheckpointError(
            f"drafter {folder} was trained on a {n_target}-layer target, but this target has "
            f"{target_config.num_hidden_layers} layers; use a drafter trained for this target"
        )
    return TargetConfig.from_hf({**cfg, "num_hidden_layers": n_target, "intermediate_size": target_config.intermediate_size})


def _read_weights(folder: Path, cfg: dict) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointError(f"{folder} has no {WEIGHTS_NAME}; drafter folders hold safetensors weights only")
    record = cfg.get("dspark_weights")
    if isinstance(record, dict):
        size = path.stat().st_size
        if size != record.get("bytes"):
            raise CheckpointError(
                f"{path} is {size} bytes but {CONFIG_NAME} records {record.get('bytes')}: the file is truncated "
                "or from another save; re-save the drafter"
            )
        if hashlib.sha256(path.read_bytes()).hexdigest() != record.get("sha256"):
            raise CheckpointError(f"{path} does not match the sha256 in {CONFIG_NAME} (corrupt or mixed saves); re-save it")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable, probably truncated ({exc}); re-save or re-copy it") from None


def _check_shared(name: str, saved: torch.Tensor, ours: torch.Tensor, folder: Path) -> None:
    if tuple(saved.shape) != tuple(ours.shape):
        raise CheckpointError(f"{folder}: tensor {name} has shape {list(saved.shape)}, the target's is {list(ours.shape)}")
    ref = ours.detach().float().cpu()
    if (saved.float() - ref).abs().max() > 1e-2 * ref.abs().max() + 1e-6:
        raise CheckpointError(
            f"{folder}: tensor {name} differs from this target's; the drafter was trained for another target"
        )


def trained_tensors(folder: Path, cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor) -> dict[str, torch.Tensor]:
    """A drafter folder's trained tensors by name, its copies of the target's shared embedding and
    LM head (if saved) checked against `embed` and `lm_head` and left out."""
    tensors = _read_weights(folder, cfg)
    for name, ours in zip(SHARED, (embed, lm_head)):
        if name in tensors:
            _check_shared(name, tensors.pop(name), ours, folder)
    return tensors


def match_tensors(drafter, tensors: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """Refuse missing, extra or mis-shaped tensors, naming the first offenders."""
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    kind = drafter_kind(drafter)
    if missing:
        raise CheckpointError(
            f"{folder / WEIGHTS_NAME} lacks tensor(s) {missing[:4]} that a {kind} drafter with this config.json "
            "needs; re-export the drafter or fix config.json (e.g. markov_rank, num_hidden_layers)"
        )
    if extra:
        raise CheckpointError(
            f"{folder / WEIGHTS_NAME} has unexpected tensor(s) {extra[:4]} for a {kind} drafter with this "
            "config.json; fix config.json (e.g. markov_head_type, enable_confidence_head) or re-export"
        )
    for name, ref in expected.items():
        if tuple(tensors[name].shape) != tuple(ref.shape):
            raise CheckpointError(
                f"{folder / WEIGHTS_NAME}: tensor {name} has shape {list(tensors[name].shape)}, expected "
                f"{list(ref.shape)} from config.json; the weights and config.json do not belong together"
            )
    return tensors


def load_drafter_folder(folder: str | Path, target, *, dtype: torch.dtype = torch.float32,
                        bf16: str | None = None) -> TrainableDrafter:
    """Load a drafter folder for `target` (an object with `config: TargetConfig`,
    `embed_tokens: nn.Embedding`, `lm_head_weight: Tensor [V, D]`). `bf16`: the CPU kernels'
    bfloat16 path for many rows, auto / on / off (None: `DSPARK_DRAFTER_BF16`, dspark.models.cpu_kernels)."""
    folder = Path(folder)
    cfg = read_config(folder)
    kind = kind_of(cfg, folder)
    draft_target = _check_target(cfg, target.config, folder)
    embed, head = target.embed_tokens.weight, target.lm_head_weight
    fields = _drafter_fields(cfg, kind, folder)
    vocab_size = int(fields.pop("draft_vocab_size", 0) or 0)  # installed after the weights, below
    try:
        drafter = make_drafter(kind, draft_target, embed, head, fields)
    except UserError as exc:
        raise CheckpointError(f"{folder / CONFIG_NAME}: {exc}") from None
    drafter.load_state_dict(match_tensors(drafter, trained_tensors(folder, cfg, embed, head), folder))
    drafter = drafter.to(device=embed.device, dtype=dtype)
    ranking = read_draft_vocab(folder)
    if hasattr(drafter, "set_draft_vocab") and (ranking is not None or vocab_size):
        try:
            drafter.set_draft_vocab(ranking, vocab_size)
        except UserError as exc:
            raise CheckpointError(f"{folder}: {exc}") from None
    from dspark.models.cpu_kernels import enable_drafter_cpu_kernels, has_cpu_kernels

    if has_cpu_kernels(target):  # a target served with the CPU kernel: its drafter gets it too
        enable_drafter_cpu_kernels(drafter, target, bf16)
    return drafter


def drafter_folder_config(folder: str | Path) -> dict:
    """A learned drafter folder's config.json, checked to name a drafter kind and a vocabulary."""
    folder = Path(folder)
    cfg = read_config(folder)
    kind_of(cfg, folder)
    if "vocab_size" not in cfg:
        raise CheckpointError(f"{folder / CONFIG_NAME} lacks 'vocab_size'; re-save the drafter")
    return cfg


def update_config(folder: str | Path, fields: dict) -> dict:
    """Set `fields` in a drafter folder's config.json (atomically; the weights are untouched)
    -> the new config."""
    folder = Path(folder)
    cfg = read_config(folder)
    cfg.update(fields)
    _atomic_write(folder / CONFIG_NAME, (json.dumps(cfg, indent=2) + "\n").encode())
    return cfg


def read_draft_vocab(folder: str | Path) -> torch.Tensor | None:
    """The token ranking of a drafter folder's draft vocabulary (int64 [N], most frequent
    first), or None when the folder has none."""
    path = Path(folder) / DRAFT_VOCAB_NAME
    if not path.is_file():
        return None
    try:
        ranking = load_file(str(path)).get("token_ids")
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is unreadable ({exc}); rebuild it with `dspark draft-vocab`") from None
    if ranking is None or ranking.dim() != 1 or ranking.is_floating_point():
        raise CheckpointError(f"{path} lacks a 1-D integer tensor 'token_ids'; rebuild it with `dspark draft-vocab`")
    return ranking.long()


def write_draft_vocab(folder: str | Path, ranking: torch.Tensor, counts: torch.Tensor | None = None) -> Path:
    """Write a draft-vocabulary token ranking (and the counts behind it) into a drafter folder."""
    tensors = {"token_ids": torch.as_tensor(ranking, dtype=torch.int32).contiguous()}
    if counts is not None:
        tensors["counts"] = torch.as_tensor(counts, dtype=torch.int32).contiguous()
    path = Path(folder) / DRAFT_VOCAB_NAME
    _atomic_write(path, save(tensors, metadata={"format": "pt"}))
    return path

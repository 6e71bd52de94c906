"""Trainer checkpoints: everything needed to continue a run exactly.

A checkpoint folder `<out_dir>/checkpoints/step-NNNNNNN/` holds

    drafter/                        the drafter, written by the drafter's save function
    trainer_state.json              step, optimizer param groups and scalar state, run facts
    optimizer.safetensors           AdamW moment tensors ("state.<param index>.<name>")
    rng-rank<R>.safetensors         torch RNG state of each data-parallel rank

With `[log] snapshot_every = N`, `<out_dir>/snapshots/step-NNNNNNN/` also
keeps the drafter alone (no optimizer) of every N-th step for good: the
drafters a budget curve evaluates (`python -m dspark.train.budget`).

`<out_dir>/checkpoints/latest` names the newest complete checkpoint; it is
written last (atomically), so a run killed mid-save resumes from the previous
one. No pickle anywhere: tensors go to safetensors, the rest to JSON.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspark.errors import CheckpointError

LATEST = "latest"
_TUPLE_KEYS = ("betas",)


def checkpoint_root(out_dir: Path) -> Path:
    return Path(out_dir) / "checkpoints"


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return checkpoint_root(out_dir) / f"step-{step:07d}"


def snapshot_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / "snapshots" / f"step-{step:07d}"


def list_snapshots(out_dir: Path) -> list[tuple[int, Path]]:
    """(step, drafter folder) of every complete snapshot of a run, by step."""
    root = Path(out_dir) / "snapshots"
    found = []
    for folder in root.glob("step-*") if root.is_dir() else ():
        suffix = folder.name[len("step-"):]
        if suffix.isdigit() and (folder / "config.json").is_file():
            found.append((int(suffix), folder))
    return sorted(found)


def latest_checkpoint(out_dir: Path) -> Path | None:
    marker = checkpoint_root(out_dir) / LATEST
    if not marker.is_file():
        return None
    folder = checkpoint_root(out_dir) / marker.read_text().strip()
    if not (folder / "trainer_state.json").is_file():
        raise CheckpointError(f"checkpoint {folder} named by {marker} is incomplete; delete {marker} to start over")
    return folder


def mark_latest(out_dir: Path, folder: Path, keep: int) -> None:
    """Point `latest` at folder, then delete all but the newest `keep` checkpoints."""
    root = checkpoint_root(out_dir)
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(folder.name + "\n")
    os.replace(tmp, root / LATEST)
    done = sorted(p for p in root.glob("step-*") if p.is_dir())
    for old in done[:-keep]:
        if old != folder:
            shutil.rmtree(old, ignore_errors=True)


def optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer state dict into tensors (safetensors) and JSON."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for index, entry in state["state"].items():
        for name, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{index}.{name}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(str(index), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_files(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        _, index, name = key.split(".", 2)
        state.setdefault(int(index), {})[name] = value
    for index, entry in meta["scalars"].items():
        state.setdefault(int(index), {}).update(entry)
    groups = [{k: tuple(v) if k in _TUPLE_KEYS else v for k, v in g.items()} for g in meta["param_groups"]]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def save_trainer_state(folder: Path, optimizer: torch.optim.Optimizer, facts: dict) -> None:
    """Rank 0: optimizer tensors and the JSON facts (step, config, world size ...)."""
    tensors, meta = optimizer_to_files(optimizer)
    save_file(tensors, str(folder / "optimizer.safetensors"))
    (folder / "trainer_state.json").write_text(json.dumps({**facts, "optimizer": meta}, indent=2) + "\n")


def save_rng(folder: Path, rank: int) -> None:
    tensors = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state()
    save_file(tensors, str(folder / f"rng-rank{rank}.safetensors"))


def load_rng(folder: Path, rank: int) -> bool:
    """Restore this rank's RNG; False when the checkpoint has none for it."""
    path = folder / f"rng-rank{rank}.safetensors"
    if not path.is_file():
        return False
    tensors = load_file(str(path))
    torch.set_rng_state(tensors["cpu"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    return True


def load_trainer_state(folder: Path, optimizer: torch.optim.Optimizer) -> dict:
    """Load optimizer state; return the JSON facts."""
    try:
        facts = json.loads((folder / "trainer_state.json").read_text())
        tensors = load_file(str(folder / "optimizer.safetensors"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {folder} is unreadable ({exc}); delete it to resume from an older one") from None
    device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    optimizer_from_files(optimizer, {k: v.to(device) if not k.endswith(".step") else v for k, v in tensors.items()}, facts.pop("optimizer"))
    return facts

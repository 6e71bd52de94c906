"""Turn a `--drafter` value into a Drafter: `none`, `ngram`, `default` (the
shipped DSpark drafter for the embedded target), `mtp1` (the shipped MTP-1
baseline for it, trained on the same data and budget) or a drafter folder."""

from __future__ import annotations

import sys
from pathlib import Path

from dspark.draft.base import Drafter
from dspark.draft.ngram import NgramDrafter, NoDrafter
from dspark.errors import UserError

SHIPPED_DIR = Path(__file__).resolve().parent.parent / "assets" / "drafters"
DEFAULT_DRAFTER = "smollm2-135m-dspark"
SHIPPED = {"default": DEFAULT_DRAFTER, "mtp1": "smollm2-135m-mtp1"}  # --drafter name -> folder in SHIPPED_DIR


def shipped_default(name: str = "default") -> Path | None:
    """Folder of the shipped drafter `name` (`SHIPPED`), if this install has one."""
    folder = SHIPPED_DIR / SHIPPED[name]
    return folder if (folder / "config.json").is_file() else None


def load_drafter(spec: str, target, *, block_size: int | None = None, embedded: bool = True,
                 bf16: str | None = None) -> Drafter:
    """Build the drafter named by `spec` for `target` (a TargetModel).

    `block_size` overrides the model-free drafters' block size; a learned
    drafter keeps the block size it was trained with. `bf16` (auto / on / off; None:
    `DSPARK_DRAFTER_BF16`) is a learned drafter's bfloat16 path on the CPU (dspark.models.cpu_kernels).
    """
    if spec == "none":
        return NoDrafter(block_size or 1)
    if spec == "ngram":
        return NgramDrafter(block_size=block_size or 7)
    if spec == "default":
        folder = shipped_default() if embedded else None
        if folder is None:
            print(
                "dspark: no trained default drafter is installed for this target; using the ngram drafter",
                file=sys.stderr,
            )
            return NgramDrafter(block_size=block_size or 7)
        spec = str(folder)
    elif spec in SHIPPED:
        folder = shipped_default(spec) if embedded else None
        if folder is None:
            raise UserError(f"the shipped {spec} drafter is trained for the embedded SmolLM2-135M-Instruct target "
                            f"{'and is not in this install' if embedded else 'only'}; pass the path of a drafter "
                            "folder trained for this target")
        spec = str(folder)
    path = Path(spec).expanduser()
    if not path.exists():
        raise UserError(
            f"unknown drafter {spec!r}: use none, ngram, default, mtp1, or the path of a drafter folder"
        )
    from dspark.draft.checkpoint import load_drafter_folder  # learned drafters need model code

    return load_drafter_folder(path, target, bf16=bf16)

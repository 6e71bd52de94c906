"""Which device the target (and the drafter that follows it) runs on.

The runtime builds its small index tensors (positions, cache write indices,
attention masks) on the CPU from Python lists and moves them once per forward;
the weights, the KV cache and everything computed from them live on the
model's device. On a CPU every move is a no-op.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from dspark.errors import UserError

DEVICE_CHOICES = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str | torch.device | None) -> torch.device:
    """`auto` (or None): the first CUDA GPU if torch sees one, else the CPU; otherwise the
    named device, checked to exist."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise UserError(f"unknown device {name!r}: use {DEVICE_CHOICES}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise UserError(f"device {name!r} is not supported: use {DEVICE_CHOICES}")
    if not torch.cuda.is_available():
        raise UserError(
            f"device {name!r} was asked for but this torch ({torch.__version__}) sees no CUDA GPU; "
            "use --device cpu, or install a CUDA build of torch on a machine with a GPU"
        )
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise UserError(f"device {name!r} does not exist: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device("cuda", index)


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (GPU kernels run asynchronously, so a timer
    must sync before it reads the clock); nothing to wait for on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (`cuda` and `cuda:0` are, on a single-GPU default)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    return (torch.cuda.current_device() if a.index is None else a.index) == (
        torch.cuda.current_device() if b.index is None else b.index)


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else what `platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware: AMX or AVX512-BF16. Without them bfloat16
    matmuls work but run slower than float32."""
    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flags())


def cpu_has_amx_bf16() -> bool:
    """Whether this CPU has AMX tiles for bfloat16 (Intel Xeon since Sapphire Rapids)."""
    return "amx_bf16" in _cpu_flags()


def hardware_id(device: torch.device | str = "cpu") -> str:
    """The machine as far as step time is concerned: device model, threads, torch version."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return f"{device.type}:{name}|threads={torch.get_num_threads()}|torch={torch.__version__}"

"""Faster float32 matmuls for the target's small forwards on a CPU.

A decode step multiplies one activation row by every weight matrix, a
verification step a few rows per request: both are bound by reading the
weights from memory, yet the kernels `F.linear` reaches through MKL stay far
from that bound for such shapes on the CPUs measured here (2-core AMD EPYC
Zen 3, AVX2, torch 2.13; docs/BENCHMARKS.md): a 2-row product costs about
twice a 1-row one, 3 rows more than 4.

`csrc/rowgemm.c` is a small AVX2/FMA kernel for 1-32 rows that reads each
weight once per call from a copy packed in panels of 8 outputs (one
contiguous stream), with the partial sums of up to 8 rows in registers. On
the embedded target its products for 1, 2, 4 and 8 rows cost about 28, 32,
36 and 56 ms against 42, 80, 93 and 103 ms through `F.linear` (one thread).
Each output is one FMA chain over the input index whatever the number of
rows, so a row's result never depends on the other rows of the call. A
weight whose float32 values are all exact float16 numbers (a drafter loaded
from its float16 checkpoint) is packed in float16 and widened on load: the
same products, bit for bit, from half the bytes.

The kernel is compiled once with the system C compiler (`$CC`, else `cc`)
into `<dspark home>/kernels/` on first use. Without a compiler or on a CPU
without AVX2 and FMA nothing changes: the model runs `F.linear` as before
(as it does with `load_target(..., cpu_kernels=False)`, the CLI's
`--no-cpu-kernel`).

`enable_cpu_kernels(model)` gives each decoder-layer linear and the LM head a
`CpuKernel` holding the packed copy (memory: about twice the weights);
`enable_drafter_cpu_kernels(drafter, model)` does the same for a drafter's
linear layers and its (draft-vocabulary) LM head, for serving. A
kernel answers only for float32 CPU inputs and only while its weight is the
one it packed: after `load_state_dict`, `.to()` or any in-place change it
steps aside (`linear` computes the result), so it can make a forward slower,
never wrong. It also steps aside whenever autograd would need it (training). Results differ from `F.linear` by float32 rounding only (another
summation order), as `F.linear`'s own kernels differ between row counts.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from dspark.models.layers import linear

MAX_ROWS = 32  # row counts up to this go through the kernel; more rows are compute-bound: F.linear
PANEL = 8  # outputs per packed panel (one AVX2 register of float32)
SOURCE = Path(__file__).parent / "csrc" / "rowgemm.c"
# -O2, not -O3: gcc 12 at -O3 spills the accumulators to the stack on every iteration
CFLAGS = ("-O2", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-shared", "-fPIC")


@dataclass(frozen=True)
class RowGemm:
    """The compiled entry points: y = x @ W.T from float32 panels, or from float16 panels."""

    f32: object  # dspark_rowgemm(x, panels, bias, y, rows, in, out)
    f16: object  # dspark_rowgemm_f16(...), panels of float16 bits


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(cc: str, home: str | Path | None) -> Path:
    """Compile csrc/rowgemm.c into the dspark home (once per source, flags and compiler)."""
    from dspark.models.embedded import dspark_home

    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256("\n".join([SOURCE.read_text(), " ".join(CFLAGS), version]).encode()).hexdigest()[:16]
    out = dspark_home(home) / "kernels" / f"rowgemm-{digest}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    done = subprocess.run([cc, *CFLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{cc} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    os.replace(tmp, out)
    return out


def load_rowgemm(cc: str | None = None, home: str | Path | None = None) -> tuple[RowGemm | None, str]:
    """(the kernel's entry points, "") or (None, why not). Compiles the kernel when needed.
    (Every AVX2 CPU also has F16C, which the float16 entry point uses.)"""
    if platform.machine().lower() not in ("x86_64", "amd64") or torch.backends.cpu.get_cpu_capability() not in (
        "AVX2", "AVX512"
    ):
        return None, "off (the kernel needs an x86-64 CPU with AVX2 and FMA)"
    cc = cc or _compiler()
    if cc is None:
        return None, "off (no C compiler found: install gcc or set CC)"
    try:
        library = ctypes.CDLL(str(_build(cc, home)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as err:
        return None, f"off (building {SOURCE.name} failed: {err})"
    for fn in (library.dspark_rowgemm, library.dspark_rowgemm_f16):
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 3
        fn.restype = None
    return RowGemm(f32=library.dspark_rowgemm, f16=library.dspark_rowgemm_f16), ""


@lru_cache(maxsize=1)
def rowgemm() -> tuple[RowGemm | None, str]:
    """This process's kernel: (its entry points, "") or (None, why not); built at the first call."""
    return load_rowgemm()


def cpu_kernels_status() -> str:
    """One line for logs and benchmark headers: on, or off and why."""
    fn, why = rowgemm()
    return f"on ({SOURCE.name}, 1-{MAX_ROWS} rows)" if fn is not None else why


def cpu_kernels_available() -> bool:
    return rowgemm()[0] is not None


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [ceil(out / 8), in, 8]: panel p holds outputs 8p..8p+7, zero-padded."""
    out, n = weight.shape
    panels = -(-out // PANEL)
    padded = torch.zeros(panels * PANEL, n, dtype=torch.float32)
    padded[:out] = weight.detach()
    return padded.view(panels, PANEL, n).transpose(1, 2).contiguous()


def exact_in_float16(weight: torch.Tensor) -> bool:
    """Every value survives a round trip through float16 unchanged (no rounding, no overflow)."""
    return bool(torch.equal(weight.detach().half().float(), weight.detach()))


class CpuKernel:
    """y = x @ weight.T (+ bias) for a fixed float32 CPU weight [out, in], 1-32 rows in C
    (from float16 panels when the weight is exact in float16, else from float32 panels)."""

    def __init__(self, weight: torch.Tensor, kernels: RowGemm, *, allow_float16: bool = True) -> None:
        self.weight = weight
        panels = pack_panels(weight)
        if allow_float16 and exact_in_float16(weight):
            self.panels, self._fn = panels.half(), kernels.f16
        else:
            self.panels, self._fn = panels, kernels.f32
        self._stamp = self._current_stamp()
        self.fast_calls = 0  # products the kernel computed (the rest went through `linear`)

    def _current_stamp(self) -> tuple[int, int]:
        return self.weight.data_ptr(), self.weight._version

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; falls back to `linear` whenever the kernel does not apply."""
        out, n = self.weight.shape
        rows = x.numel() // max(n, 1)
        usable = (
            1 <= rows <= MAX_ROWS
            and x.shape[-1] == n  # else `linear` raises the shape error (the C code would read out of bounds)
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and self._current_stamp() == self._stamp
            and (bias is None or (bias.dtype == torch.float32 and bias.numel() == out))
            and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))  # no autograd in C
        )
        if not usable:
            return linear(x, self.weight, bias)
        flat = x.reshape(rows, n).contiguous()
        b = None if bias is None else bias.detach().contiguous()
        y = torch.empty(rows, out, dtype=torch.float32)
        self._fn(flat.data_ptr(), self.panels.data_ptr(), None if b is None else b.data_ptr(), y.data_ptr(), rows, n, out)
        self.fast_calls += 1
        return y.reshape(*x.shape[:-1], out)


def target_linears(model) -> list:
    """A TargetModel's decoder-layer linear modules (each holding `weight` [out, in], `bias`)."""
    return [
        m
        for layer in model.model.layers
        for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    ]


def enable_cpu_kernels(model) -> bool:
    """Give a float32 CPU `TargetModel` the small-row kernel (see the module doc).

    Returns False, changing nothing, when the model is not float32 on the CPU or the kernel is
    unavailable (`cpu_kernels_status()` says why)."""
    kernels = rowgemm()[0]
    if kernels is None or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in model.parameters()):
        return False
    for module in target_linears(model):
        module.cpu_kernel = CpuKernel(module.weight, kernels)
    model.head_kernel = CpuKernel(model.lm_head_weight, kernels)
    return True


def has_cpu_kernels(model) -> bool:
    """Whether `enable_cpu_kernels` gave this target model its kernels."""
    return "head_kernel" in getattr(model, "__dict__", {})


def disable_cpu_kernels(model) -> None:
    """Drop the kernels and their packed copies."""
    for module in target_linears(model):
        module.__dict__.pop("cpu_kernel", None)
    model.__dict__.pop("head_kernel", None)


def enable_drafter_cpu_kernels(drafter, target=None) -> bool:
    """Give a float32 CPU drafter the kernel on every `Linear` and on its LM head (the draft
    vocabulary's rows, or the target's head kernel when it drafts over the whole vocabulary).
    For serving: under autograd the kernels step aside. False (nothing changed) as above."""
    from dspark.models.layers import Linear

    kernels = rowgemm()[0]
    if kernels is None or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in drafter.parameters()):
        return False
    for module in drafter.modules():
        if isinstance(module, Linear):
            module.cpu_kernel = CpuKernel(module.weight, kernels)
    drafter.__dict__["cpu_kernels_target"] = target  # not `drafter.x = target`: that would register a submodule
    if hasattr(drafter, "refresh_head_kernel"):
        drafter.refresh_head_kernel()
    return True

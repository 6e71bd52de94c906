"""Building blocks of a Llama-family decoder layer, shared by the target
runtime and the drafters (whose layers have the target family's shape).

Linear layers compute `x @ W.T` through `linear()`: `F.linear`, except for
2-3 input rows, where its MKL path is slow on CPU and `W @ x.T` is used
instead (see the notes in docs/BENCHMARKS.md and
docs/DRAFTING.md). Served models on a CPU use the C kernel of `cpu_kernels.py`
instead, for 1-48 rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T (+ bias) for x [..., in], weight [out, in]."""
    rows = x.numel() // max(x.shape[-1], 1)
    if not 2 <= rows <= 3:
        return F.linear(x, weight, bias)
    # contiguous: a transposed [rows, out] result makes the next matmul that reads it slow
    y = (weight @ x.reshape(-1, x.shape[-1]).T).T.contiguous().reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x @ module.weight.T (+ module.bias): through the CPU kernel attached to the module for
    serving (`dspark.models.cpu_kernels`) when it has one, else through `linear()`."""
    kernel = module.__dict__.get("cpu_kernel")
    if kernel is not None:
        return kernel(x, module.bias)
    return linear(x, module.weight, module.bias)


class Linear(nn.Linear):
    """nn.Linear whose forward is `project()`; same parameter names as HF."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return project(self, x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class SwiGLU(nn.Module):
    """Llama MLP: down(silu(gate(x)) * up(x)). Parameter names match HF."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inner, bias=False)
        self.up_proj = Linear(hidden, inner, bias=False)
        self.down_proj = Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [*positions.shape, head_dim] (HF 'rotate_half' layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., S, H, head_dim] by cos/sin [..., S, head_dim] (broadcast over heads)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)

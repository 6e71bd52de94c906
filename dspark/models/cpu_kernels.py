"""Faster float32 matmuls for the target's small forwards on a CPU.

A decode step multiplies one activation row by every weight matrix, a
verification step 2-16 rows: both are bound by reading the weights, yet the
kernels `F.linear` reaches through MKL stay far from that bound for these
shapes on the CPUs measured here (2-core AMD EPYC, AVX2, torch 2.13;
docs/BENCHMARKS.md):

* one row: MKL's matrix-vector product reads a weight stored column-major
  ([in, out] in memory) 25-40% faster than the row-major [out, in] one;
* 2-16 rows: oneDNN's matmul on a weight reordered once into its own blocked
  layout is 1.3-2x faster than MKL's, whose small-row paths also cost more for
  2-3 rows than for 4.

`enable_cpu_kernels(model)` re-lays every decoder-layer weight column-major in
place (same values and shape, other strides: every reader still works) and
gives each linear a `CpuKernel` holding a oneDNN copy for 2-16 rows. The LM
head, tied to the token embeddings (which must stay row-major for lookups),
gets a column-major copy for one row as well. Memory: about twice the weights.

A kernel answers only for float32 CPU inputs and only while its weight is the
one it was built from: after `load_state_dict`, `.to()` or any in-place change
it steps aside (`linear` computes the result), so it can make a forward slower,
never wrong. Results differ from `F.linear` by float32 rounding only (another
summation order), as `F.linear`'s own kernels differ between row counts.
"""

from __future__ import annotations

import os

import torch

from dspark.models.layers import linear

PACKED_ROWS = (2, 16)  # row counts the oneDNN copy serves; others go through `linear`
PACK_HINT_ROWS = 8  # the batch size oneDNN lays the copy out for (measured best for 2-16 rows)
ENV_SWITCH = "DSPARK_CPU_KERNELS"  # "0" turns the kernels off (load_target's default)


def cpu_kernels_available() -> bool:
    """oneDNN is compiled into this torch and the switch is not off."""
    return os.environ.get(ENV_SWITCH, "1") != "0" and torch.backends.mkldnn.is_available()


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_HINT_ROWS)
    except (RuntimeError, AttributeError):  # a torch built without the op
        return None


class CpuKernel:
    """Fast paths for y = x @ weight.T (+ bias) over a fixed float32 CPU weight [out, in]."""

    def __init__(self, weight: torch.Tensor, *, one_row_copy: bool) -> None:
        self.weight = weight
        self.packed = _pack(weight)
        self.column_major = weight.detach().t().contiguous() if one_row_copy else None  # [in, out]
        self._stamp = self._current_stamp()
        self.fast_calls = 0  # products served by a fast path (the rest went through `linear`)

    def _current_stamp(self) -> tuple[int, int]:
        return self.weight.data_ptr(), self.weight._version

    def valid_for(self, x: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and x.dtype == torch.float32
            and self.weight.dtype == torch.float32
            and self._current_stamp() == self._stamp
        )

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]; falls back to `linear` whenever no fast path applies."""
        rows = x.numel() // max(x.shape[-1], 1)
        if not self.valid_for(x):
            return linear(x, self.weight, bias)
        flat = x.reshape(rows, x.shape[-1])
        if rows == 1 and self.column_major is not None:
            y = flat @ self.column_major
            y = y if bias is None else y + bias
        elif PACKED_ROWS[0] <= rows <= PACKED_ROWS[1] and self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), self.packed, bias, "none", [], "")
        else:
            return linear(x, self.weight, bias)
        self.fast_calls += 1
        return y.reshape(*x.shape[:-1], self.weight.shape[0])


def _column_major_(param: torch.Tensor) -> None:
    """Same values and shape, stored transposed: param.t() becomes contiguous."""
    if param.dim() == 2 and not param.t().is_contiguous():
        param.data = param.data.t().contiguous().t()


def enable_cpu_kernels(model) -> bool:
    """Give a float32 CPU `TargetModel` the fast small-row kernels (see the module doc).

    Returns False, changing nothing, when the model is not float32 on the CPU or oneDNN is
    unavailable (or `DSPARK_CPU_KERNELS=0`)."""
    params = list(model.parameters())
    if not cpu_kernels_available() or any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return False
    for layer in model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            _column_major_(module.weight)
            module.cpu_kernel = CpuKernel(module.weight, one_row_copy=False)
    model.head_kernel = CpuKernel(model.lm_head_weight, one_row_copy=True)
    return True


def disable_cpu_kernels(model) -> None:
    """Drop the kernels (the column-major weights stay; `F.linear` reads them directly)."""
    for layer in model.model.layers:
        for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            module.__dict__.pop("cpu_kernel", None)
    model.__dict__.pop("head_kernel", None)

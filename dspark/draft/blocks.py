"""Decoder-layer pieces the learned drafters share, shaped like the target
family's decoder layer (Llama: q/k/v/o, SwiGLU, input/post-attention RMSNorm;
Qwen3 adds per-head q_norm/k_norm), and the per-request K/V buffer of the
drafters' context.

Shape symbols: as in dspark.types, plus Hq / Hkv attention heads, hd head
dim, S sequence positions, L draft layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.config import TargetConfig
from dspark.models.layers import Linear, RMSNorm, SwiGLU, apply_rope, rope_cos_sin


@dataclass(frozen=True)
class LayerShape:
    """Shape of one draft decoder layer (the target family's, possibly a
    different MLP width or attention input width)."""

    hidden_size: int  # D
    intermediate_size: int
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # hd
    rms_norm_eps: float
    rope_theta: float
    qk_norm: bool  # Qwen3 family: RMSNorm over each head of q and k
    bias: bool  # attention projections carry biases
    attn_in: int  # width of the attention input (D; 2D for Eagle3)

    @classmethod
    def of(cls, target: TargetConfig, intermediate_size: int, attn_in: int | None = None) -> "LayerShape":
        return cls(
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size,
            num_heads=target.num_attention_heads,
            num_kv_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            qk_norm=target.qk_norm,
            bias=target.attention_bias,
            attn_in=attn_in or target.hidden_size,
        )

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, hd]."""
        return rope_cos_sin(positions, self.head_dim, self.rope_theta, dtype)


class DraftAttention(nn.Module):
    """Attention projections; the caller assembles keys and masks."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.shape = shape
        hq, hkv, hd = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_proj = Linear(shape.attn_in, hq * hd, bias=shape.bias)
        self.k_proj = Linear(shape.attn_in, hkv * hd, bias=shape.bias)
        self.v_proj = Linear(shape.attn_in, hkv * hd, bias=shape.bias)
        self.o_proj = Linear(hq * hd, shape.hidden_size, bias=shape.bias)
        if shape.qk_norm:
            self.q_norm = RMSNorm(hd, shape.rms_norm_eps)
            self.k_norm = RMSNorm(hd, shape.rms_norm_eps)

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [..., S, attn_in] -> q [..., S, Hq, hd], normed (Qwen3) and rotated."""
        q = self.q_proj(x).unflatten(-1, (self.shape.num_heads, self.shape.head_dim))
        if self.shape.qk_norm:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., S, attn_in] -> k, v [..., S, Hkv, hd]; k normed (Qwen3) and rotated."""
        k = self.k_proj(x).unflatten(-1, (self.shape.num_kv_heads, self.shape.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.shape.num_kv_heads, self.shape.head_dim))
        if self.shape.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin), v

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [..., S, Hq, hd] -> [..., S, D]."""
        return self.o_proj(attn.flatten(-2))


class DraftDecoderLayer(nn.Module):
    """Pre-norm decoder layer; parameter names match HF / DeepSpec."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.self_attn = DraftAttention(shape)
        self.mlp = SwiGLU(shape.hidden_size, shape.intermediate_size)
        self.input_layernorm = RMSNorm(shape.attn_in, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual MLP half of the layer: x + mlp(norm(x))."""
        return x + self.mlp(self.post_attention_layernorm(x))


def attend(
    q: torch.Tensor,  # [B, S_q, Hq, hd]
    k: torch.Tensor,  # [B, S_k, Hkv, hd]
    v: torch.Tensor,  # [B, S_k, Hkv, hd]
    mask: torch.Tensor | None = None,  # [B, S_q, S_k] bool, True = may attend; None = all
) -> torch.Tensor:
    """Grouped-query attention -> [B, S_q, Hq, hd]."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=None if mask is None else mask.unsqueeze(1),
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


class ContextKV:
    """One request's context keys and values for L draft layers, grown by
    doubling. Positions [0, length) hold the context; the slots after it are
    scratch space a propose call may fill with the block's own keys, so
    attention reads one contiguous view without concatenating."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        self.data = torch.empty(num_layers, 2, 0, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.length = 0  # context positions held

    def reserve(self, total: int) -> None:
        """Make room for `total` positions (context + scratch)."""
        cap = self.data.shape[2]
        if total <= cap:
            return
        new_cap = max(total, 2 * cap, 64)
        grown = self.data.new_empty(self.data.shape[0], 2, new_cap, *self.data.shape[3:])
        grown[:, :, : self.length] = self.data[:, :, : self.length]
        self.data = grown

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [L, m, Hkv, hd] at positions start..start+m-1."""
        m = keys.shape[1]
        self.reserve(start + m)
        self.data[:, 0, start : start + m] = keys
        self.data[:, 1, start : start + m] = values

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append context keys/values [L, m, Hkv, hd]."""
        self.write(self.length, keys, values)
        self.length += keys.shape[1]

    def view(self, layer: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [total, Hkv, hd] of positions 0..total-1 (context + scratch)."""
        return self.data[layer, 0, :total], self.data[layer, 1, :total]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a context of {self.length} positions to {length}")
        self.length = length


class RowBuffer:
    """A growable [length, *row_shape] tensor (doubling), for per-position
    features a drafter must keep to survive truncation."""

    def __init__(self, row_shape: tuple[int, ...], dtype: torch.dtype, device) -> None:
        self.data = torch.empty(0, *row_shape, dtype=dtype, device=device)
        self.length = 0

    def append(self, rows: torch.Tensor) -> None:
        end = self.length + rows.shape[0]
        if end > self.data.shape[0]:
            grown = self.data.new_empty(max(end, 2 * self.data.shape[0], 64), *self.data.shape[1:])
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : end] = rows
        self.length = end

    def last(self) -> torch.Tensor | None:
        return self.data[self.length - 1] if self.length else None

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate {self.length} rows to {length}")
        self.length = length

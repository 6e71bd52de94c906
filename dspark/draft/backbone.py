"""The parallel (DFlash-style) backbone of DSpark, paper eq. 2-3.

Context features H_ctx = RMSNorm(W_c [H(l_1); ...; H(l_m)]) are projected by
every draft layer's own k/v projections (RoPE at the context positions) and
placed ahead of the block's keys and values. The block (anchor embedding, then
G-1 mask embeddings, at positions n..n+G-1 after a context of n positions)
attends bidirectionally to itself and fully to the context; one pass gives G
hidden states h_1..h_G.

The context keys/values do not depend on the block, so inference keeps them
per request (`ContextKV`) and projects only newly committed positions.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.draft.blocks import ContextKV, DraftDecoderLayer, LayerShape, attend
from dspark.models.config import TargetConfig
from dspark.models.layers import Linear, RMSNorm, linear


class SharedVocab:
    """The target's embedding and LM head, shared and frozen: held by
    reference, never registered as drafter parameters (not trained, not
    saved unless a self-contained export asks for them)."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        self.embed_weight = embed_weight.detach()  # [V, D]
        self.lm_head_weight = lm_head_weight.detach()  # [V, D]

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head_weight.shape[0])

    def embed(self, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """token_ids [...] -> [..., D] in the drafter's dtype."""
        return self.embed_weight[token_ids].to(dtype)

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [..., D] -> float32 logits [..., V], or [..., K] over a draft vocabulary
        given its LM-head rows (rows [K, D])."""
        w = self.lm_head_weight if rows is None else rows
        flat = hidden.reshape(-1, hidden.shape[-1]).to(w.dtype)
        # contiguous [N, V]: arg-max, softmax and their gradients over a transposed view run up to 10x slower
        return linear(flat, w).float().reshape(*hidden.shape[:-1], w.shape[0])


class ParallelBackbone(nn.Module):
    """fc + hidden_norm over tapped target layers, L draft layers, final norm.
    Parameter names are DeepSpec's (`fc`, `hidden_norm`, `layers.{i}.*`, `norm`)."""

    def __init__(self, target: TargetConfig, num_layers: int, intermediate_size: int, num_taps: int) -> None:
        super().__init__()
        d = target.hidden_size
        self.shape = LayerShape.of(target, intermediate_size)
        self.fc = Linear(num_taps * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, target.rms_norm_eps)
        self.layers = nn.ModuleList(DraftDecoderLayer(self.shape) for _ in range(num_layers))
        self.norm = RMSNorm(d, target.rms_norm_eps)

    @property
    def param_dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def new_context_kv(self) -> ContextKV:
        s = self.shape
        return ContextKV(len(self.layers), s.num_kv_heads, s.head_dim, self.param_dtype, self.device)

    def context_features(self, tapped_hidden: torch.Tensor) -> torch.Tensor:
        """Eq. 2: tapped_hidden [..., T, D] -> H_ctx [..., D]."""
        return self.hidden_norm(self.fc(tapped_hidden.to(self.param_dtype).flatten(-2)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 3, context half: H_ctx [..., S, D] at positions [..., S] ->
        keys, values [L, ..., S, Hkv, hd] (each draft layer's own W_K, W_V)."""
        cos, sin = self.shape.rope(positions, features.dtype)
        keys, values = zip(*(layer.self_attn.keys_values(features, cos, sin) for layer in self.layers))
        return torch.stack(keys), torch.stack(values)

    def _layer(self, layer: DraftDecoderLayer, x: torch.Tensor, cos, sin, attend_block) -> torch.Tensor:
        """One draft layer; attend_block(q, k_block, v_block) returns the attention output."""
        xn = layer.input_layernorm(x)
        q = layer.self_attn.queries(xn, cos, sin)
        k, v = layer.self_attn.keys_values(xn, cos, sin)
        x = x + layer.self_attn.output(attend_block(q, k, v))
        return layer.feed_forward(x)

    def block_hidden(self, block_embeds: torch.Tensor, caches: list[ContextKV]) -> torch.Tensor:
        """Inference: block_embeds [R, G, D] after each request's cached
        context -> final-normed hidden states [R, G, D]. Each layer attends per request
        on the CPU, in one padded call on a GPU (`attend_in_one_call`)."""
        g = block_embeds.shape[1]
        starts = torch.tensor([c.length for c in caches], device=block_embeds.device)
        positions = starts[:, None] + torch.arange(g, device=block_embeds.device)
        cos, sin = self.shape.rope(positions, block_embeds.dtype)
        for cache in caches:
            cache.reserve(cache.length + g)
        padded = padded_context(caches, g) if attend_in_one_call(block_embeds.device.type, len(caches)) else None
        x = block_embeds
        for i, layer in enumerate(self.layers):

            def attend_block(q, k, v, i=i):
                if padded is not None:
                    context, mask = padded
                    keys = torch.cat([context[:, i, 0], k], dim=1)
                    values = torch.cat([context[:, i, 1], v], dim=1)
                    return attend(q, keys, values, mask)
                outs = []
                for r, cache in enumerate(caches):
                    n = cache.length
                    keys, values = cache.view(i, n + g)
                    keys[n:], values[n:] = k[r], v[r]  # scratch slots after the context
                    outs.append(attend(q[r : r + 1], keys[None], values[None]))
                return torch.cat(outs)

            x = self._layer(layer, x, cos, sin, attend_block)
        return self.norm(x)

    def train_hidden(
        self,
        features: torch.Tensor,  # [B, S, D] H_ctx of every position
        block_embeds: torch.Tensor,  # [B, Q, D] all blocks back to back
        block_positions: torch.Tensor,  # [B, Q]
        mask: torch.Tensor,  # [B, Q, S + Q] bool: which context / block keys each query sees
    ) -> torch.Tensor:
        """Training: many blocks per sequence in one pass -> hidden [B, Q, D]."""
        b, s = features.shape[:2]
        ctx_pos = torch.arange(s, device=features.device).expand(b, s)
        ctx_keys, ctx_values = self.context_kv(features, ctx_pos)
        cos, sin = self.shape.rope(block_positions, block_embeds.dtype)
        x = block_embeds.to(self.param_dtype)
        for i, layer in enumerate(self.layers):

            def attend_block(q, k, v, i=i):
                keys = torch.cat([ctx_keys[i], k], dim=1)
                values = torch.cat([ctx_values[i], v], dim=1)
                return attend(q, keys, values, mask)

            x = self._layer(layer, x, cos, sin, attend_block)
        return self.norm(x)


def attend_in_one_call(device_type: str, num_requests: int) -> bool:
    """Whether a drafting round's requests attend in one padded call per layer. On a GPU yes:
    a call per request costs some 29 ops per layer and request (`python -m dspark.bench.ops`),
    and ops, not arithmetic, set a small drafter's price there. On the CPU no: padding copies
    every context (megabytes per round at a few hundred tokens of eight requests)."""
    return device_type != "cpu" and num_requests > 1


def padded_context(caches: list[ContextKV], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' context keys and values padded to the longest, [R, layers, 2, S, Hkv, hd]
    (zeros after each context), and the mask [R, G, S + G] of what a block's queries see:
    their own context, then the whole block (keys appended after the padded contexts)."""
    lengths = [c.length for c in caches]
    longest, first = max(lengths), caches[0].data
    context = first.new_zeros(len(caches), first.shape[0], 2, longest, *first.shape[3:])
    for r, cache in enumerate(caches):
        context[r, :, :, : cache.length] = cache.data[:, :, : cache.length]
    seen = torch.arange(longest, device=first.device)[None, :] < torch.tensor(lengths, device=first.device)[:, None]
    mask = torch.cat([seen, seen.new_ones(len(caches), block_size)], dim=1)  # [R, S + G]
    return context, mask[:, None, :].expand(-1, block_size, -1)


def block_train_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """anchors [B, A] -> mask [B, A*G, S + A*G]: a block's queries see context
    positions before its anchor and every position of their own block."""
    b, a = anchors.shape
    device = anchors.device
    q_block = torch.arange(a * block_size, device=device) // block_size  # [Q]
    ctx = torch.arange(seq_len, device=device)[None, None, :] < anchors[:, q_block, None]  # [B, Q, S]
    own = (q_block[:, None] == q_block[None, :]).expand(b, -1, -1)  # [B, Q, Q]
    return torch.cat([ctx, own], dim=-1)

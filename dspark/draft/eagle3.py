"""Eagle3-style autoregressive drafter (Li et al.), the paper's AR baseline.

Low/mid/high target features are fused by `fc` (T*D -> D). Each step's
decoder layer (`midlayer`) attends over [input_layernorm(emb(x_j));
hidden_norm(f_{j-1})] (2D wide) with the fused feature as the residual; the
output hidden feeds the next step (training-time test). Embedding and LM head
are the target's (full vocabulary; no draft-vocabulary mapping).
Parameter names follow SpecForge/DeepSpec Eagle3: `fc`, `midlayer.*`, `norm`.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.draft.backbone import SharedVocab
from dspark.draft.blocks import DraftAttention, LayerShape
from dspark.draft.chain import ChainDrafter
from dspark.draft.config import Eagle3Config
from dspark.models.config import TargetConfig
from dspark.models.layers import Linear, RMSNorm, SwiGLU


class Eagle3Layer(nn.Module):
    """Eagle3's decoder layer: attention input is 2D wide."""

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        d = shape.hidden_size
        self.self_attn = DraftAttention(shape)
        self.mlp = SwiGLU(d, shape.intermediate_size)
        self.input_layernorm = RMSNorm(d, shape.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(d, shape.rms_norm_eps)  # on the incoming feature / hidden
        self.post_attention_layernorm = RMSNorm(d, shape.rms_norm_eps)


class Eagle3Drafter(ChainDrafter):
    name = "eagle3"

    def __init__(self, target: TargetConfig, config: Eagle3Config, embed_weight, lm_head_weight) -> None:
        super().__init__()
        config = config.resolved(target)
        self.config = config
        self.target_config = target
        self.shape = LayerShape.of(target, config.intermediate_size, attn_in=2 * target.hidden_size)
        self.vocab = SharedVocab(embed_weight, lm_head_weight)
        self.fc = Linear(len(config.target_layer_ids) * target.hidden_size, target.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(self.shape)
        self.norm = RMSNorm(target.hidden_size, target.rms_norm_eps)
        self.block_size = config.block_size
        self.tap_layers = tuple(config.target_layer_ids)
        self._check_no_draft_vocab()

    @property
    def layer(self) -> Eagle3Layer:
        return self.midlayer

    def feature(self, tapped_hidden: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return self.fc(tapped_hidden.to(self.param_dtype).flatten(-2))

    def pair_input(self, prev_hidden, token_embeds):  # noqa: D102
        attn_in = torch.cat([self.midlayer.input_layernorm(token_embeds), self.midlayer.hidden_norm(prev_hidden)], -1)
        return attn_in, prev_hidden

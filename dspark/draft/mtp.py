"""MTP-1 drafter (DeepSeek-V3 multi-token prediction, depth 1).

Pair j: x_j = eh_proj([enorm(emb(t_j)); hnorm(h_{j-1})]) with h the last
target layer's output; one decoder layer (causal over earlier pairs), the
final `norm` and the target's LM head predict t_{j+1}. Block size 1. The
concatenation order (embedding first) is DeepSeek-V3's released weights'.
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.draft.backbone import SharedVocab
from dspark.draft.blocks import DraftDecoderLayer, LayerShape
from dspark.draft.chain import ChainDrafter
from dspark.draft.config import MTPConfig
from dspark.models.config import TargetConfig
from dspark.models.layers import Linear, RMSNorm


class MTPDrafter(ChainDrafter):
    name = "mtp"

    def __init__(self, target: TargetConfig, config: MTPConfig, embed_weight, lm_head_weight) -> None:
        super().__init__()
        config = config.resolved(target)
        d = target.hidden_size
        self.config = config
        self.target_config = target
        self.shape = LayerShape.of(target, config.intermediate_size)
        self.vocab = SharedVocab(embed_weight, lm_head_weight)
        self.enorm = RMSNorm(d, target.rms_norm_eps)
        self.hnorm = RMSNorm(d, target.rms_norm_eps)
        self.eh_proj = Linear(2 * d, d, bias=False)
        self.layers = nn.ModuleList([DraftDecoderLayer(self.shape)])
        self.norm = RMSNorm(d, target.rms_norm_eps)
        self.block_size = 1
        self.tap_layers = (target.num_hidden_layers - 1,)
        self._check_no_draft_vocab()

    @property
    def layer(self) -> DraftDecoderLayer:
        return self.layers[0]

    def feature(self, tapped_hidden: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return tapped_hidden[..., -1, :].to(self.param_dtype)

    def pair_input(self, prev_hidden, token_embeds):  # noqa: D102
        x = self.eh_proj(torch.cat([self.enorm(token_embeds), self.hnorm(prev_hidden)], dim=-1))
        return self.layer.input_layernorm(x), x

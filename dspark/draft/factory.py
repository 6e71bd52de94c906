"""Build a fresh (randomly initialised) learned drafter for a target:
`build_drafter("dspark" | "dflash" | "eagle3" | "mtp", ...)`.

Defaults for the embedded SmolLM2-135M target (hidden 576, 30 layers, vocab
49152): DSpark with 3 draft layers, 5 tapped layers (1, 7, 14, 21, 27),
block size 8, vanilla Markov head of rank 64 and a confidence head with the
Markov feature: 18,572,417 trainable parameters, 37.1 MB in fp16 without
the shared embedding / LM head (`drafter_size(build_drafter("dspark", ...))`;
DFlash 24.6 MB, rank 256 74.9 MB, 5 layers 51.3 MB, Eagle3 10.2 MB, MTP 8.4 MB).
"""

from __future__ import annotations

import torch
from torch import nn

from dspark.draft.base import TrainableDrafter
from dspark.draft.config import DRAFTER_KINDS, DSparkConfig, Eagle3Config, MTPConfig, dflash_overrides
from dspark.draft.dspark import DSparkDrafter
from dspark.draft.eagle3 import Eagle3Drafter
from dspark.draft.mtp import MTPDrafter
from dspark.errors import UserError
from dspark.models.config import TargetConfig


def drafter_kind(drafter: nn.Module) -> str:
    """'dspark', 'dflash', 'eagle3' or 'mtp'."""
    if isinstance(drafter, DSparkDrafter):
        return drafter.name
    if isinstance(drafter, Eagle3Drafter):
        return "eagle3"
    if isinstance(drafter, MTPDrafter):
        return "mtp"
    raise TypeError(f"not a learned dspark drafter: {type(drafter).__name__}")


def make_drafter(kind: str, target: TargetConfig, embed_weight, lm_head_weight, config: dict) -> TrainableDrafter:
    """Construct (without initialising) the drafter of `kind` from a config dict."""
    if kind not in DRAFTER_KINDS:
        raise UserError(f"unknown drafter kind {kind!r}; choose one of {DRAFTER_KINDS}")
    if kind == "dflash":
        clash = {k: v for k, v in config.items() if k in dflash_overrides() and v != dflash_overrides()[k]}
        if clash:
            raise UserError(f"a dflash drafter has no sequential or confidence head; drop {sorted(clash)} or use dspark")
        config = {**config, **dflash_overrides()}
    if kind in ("dspark", "dflash"):
        return DSparkDrafter(target, DSparkConfig.from_dict(config), embed_weight, lm_head_weight)
    if kind == "eagle3":
        return Eagle3Drafter(target, Eagle3Config.from_dict(config), embed_weight, lm_head_weight)
    return MTPDrafter(target, MTPConfig.from_dict(config), embed_weight, lm_head_weight)


def init_weights(module: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """HF-style initialisation: linear weights and embedding tables ~ N(0, std),
    biases 0, norm weights 1 (drawn from a private generator)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.ndim == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def build_drafter(
    kind: str,
    target_config: TargetConfig,
    target_embed: nn.Embedding | torch.Tensor,
    lm_head_weight: torch.Tensor,
    *,
    seed: int = 0,
    final_norm_weight: torch.Tensor | None = None,
    **config,
) -> TrainableDrafter:
    """A freshly initialised drafter of `kind` for the target; `config` holds
    the kind's config fields (unknown keys are errors).

    `final_norm_weight` starts the drafter's own final `norm` (the one feeding
    the shared LM head) at the given scale instead of at ones. At ones the
    random first hidden states give confident wrong logits (cross-entropy
    several times a uniform guess's); the trainer passes a small multiple of
    the target's final-norm scale so the first logits are near uniform
    (`dspark.train.run.INIT_NORM_SCALE`)."""
    embed = target_embed.weight if isinstance(target_embed, nn.Embedding) else target_embed
    drafter = make_drafter(kind, target_config, embed, lm_head_weight, config)
    init_weights(drafter, seed)
    if final_norm_weight is not None:
        if final_norm_weight.shape != drafter.norm.weight.shape:
            raise UserError(f"final_norm_weight has shape {tuple(final_norm_weight.shape)}, the drafter's norm "
                            f"{tuple(drafter.norm.weight.shape)}; pass the target's final norm weight")
        with torch.no_grad():
            drafter.norm.weight.copy_(final_norm_weight.detach().to(drafter.norm.weight.dtype))
    return drafter.to(embed.device)


def drafter_size(drafter: nn.Module, dtype: torch.dtype = torch.float16) -> tuple[int, int]:
    """(trainable parameters, bytes when saved in `dtype`), embedding / LM head excluded."""
    n = sum(p.numel() for p in drafter.parameters())
    return n, n * torch.tensor([], dtype=dtype).element_size()

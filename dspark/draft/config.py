"""Validated configurations of the learned drafters (DSpark / DFlash, Eagle3,
MTP-1). Each is a frozen dataclass built with `from_dict`, which refuses
unknown keys and out-of-range values with a UserError naming the fix.

DFlash is not a separate class: it is `DSparkConfig` with
`markov_head_type="none"` and `enable_confidence_head=False`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

from dspark.errors import UserError
from dspark.models.config import TargetConfig

MARKOV_HEAD_TYPES = ("none", "vanilla", "gated", "rnn")
DRAFTER_KINDS = ("dspark", "dflash", "eagle3", "mtp")
SMOLLM2_VOCAB = 49152
SMOLLM2_MASK_TOKEN = 16  # `<empty_output>`, a control token chat never uses


def default_mask_token_id(target: TargetConfig) -> int:
    """A token id whose (frozen) target embedding marks the masked block inputs.

    SmolLM2 (vocab 49152): `<empty_output>` (id 16), a control token absent
    from chat. Otherwise the last vocabulary row, which is padding in most
    Llama/Qwen3 checkpoints (Qwen3 pads its vocabulary to 151936)."""
    if target.vocab_size == SMOLLM2_VOCAB:
        return SMOLLM2_MASK_TOKEN
    return target.vocab_size - 1


def spread_layer_ids(num_target_layers: int, count: int) -> tuple[int, ...]:
    """`count` target layers evenly spread from layer 1 to layer L-3 (DFlash's
    choice: skip the embedding-like first layer and the last, most
    next-token-specialised layers). Falls back to all layers of a tiny target."""
    if num_target_layers <= count:
        return tuple(range(num_target_layers))
    start, end = 1, num_target_layers - 3
    if end - start + 1 < count:
        start, end = 0, num_target_layers - 1
    if count == 1:
        return (end,)
    return tuple(start + round(i * (end - start) / (count - 1)) for i in range(count))


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise UserError(message)


def _validate_layer_ids(ids: tuple[int, ...], num_target_layers: int, what: str) -> None:
    _check(len(ids) >= 1, f"{what} must name at least one target layer")
    for a, b in zip(ids, ids[1:]):
        _check(b > a, f"{what} must be strictly increasing, got {list(ids)}")
    _check(
        0 <= ids[0] and ids[-1] < num_target_layers,
        f"{what} {list(ids)} out of range: the target has layers 0..{num_target_layers - 1}",
    )


def _check_draft_vocab_size(size: int, target: TargetConfig) -> None:
    _check(0 <= size <= target.vocab_size,
           f"draft_vocab_size must be in 0..{target.vocab_size} (0 = full vocabulary), got {size}")


def _from_dict(cls, values: dict, what: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    _check(not unknown, f"unknown {what} config keys {unknown}; known keys: {sorted(known)}")
    values = dict(values)
    for key in ("target_layer_ids", "calibration_temperatures"):
        if values.get(key) is not None:
            values[key] = tuple(values[key])
    try:
        return cls(**values)
    except TypeError as exc:  # a required field is missing
        raise UserError(f"bad {what} config: {exc}") from None


@dataclass(frozen=True)
class DSparkConfig:
    """Parallel backbone + optional sequential head + optional confidence head."""

    block_size: int = 8  # G: draft positions per round (anchor + G-1 masks), 1..64
    num_hidden_layers: int = 3  # draft decoder layers, 1..32 (paper: 5)
    target_layer_ids: tuple[int, ...] = ()  # tapped target layers (0-based outputs); () = spread over depth
    mask_token_id: int = -1  # target token whose embedding fills masked inputs; -1 = default_mask_token_id
    intermediate_size: int = 0  # draft SwiGLU width; 0 = the target's
    markov_head_type: str = "vanilla"  # sequential head: none | vanilla | gated | rnn
    markov_rank: int = 64  # r of W1 [V, r] and W2 [V, r]; 0 iff markov_head_type == "none" (paper: 256)
    enable_confidence_head: bool = True  # eq. 7 confidence head c_k
    confidence_head_with_markov: bool = True  # confidence features include W1[x_{k-1}]
    calibration_temperatures: tuple[float, ...] | None = None  # G STS temperatures, each > 0; None = 1
    transition_top_k: int = 0  # restrict the sequential step to the top-K base-logit tokens; 0 = full vocab
    draft_vocab_size: int = 0  # draft only among the K most frequent tokens (draft_vocab.safetensors); 0 = all

    @classmethod
    def from_dict(cls, values: dict) -> "DSparkConfig":
        return _from_dict(cls, values, "dspark drafter")

    def resolved(self, target: TargetConfig) -> "DSparkConfig":
        """Fill the target-dependent defaults, then validate against the target."""
        cfg = self
        if not cfg.target_layer_ids:
            cfg = dataclasses.replace(cfg, target_layer_ids=spread_layer_ids(target.num_hidden_layers, 5))
        if cfg.mask_token_id < 0:
            cfg = dataclasses.replace(cfg, mask_token_id=default_mask_token_id(target))
        if cfg.intermediate_size <= 0:
            cfg = dataclasses.replace(cfg, intermediate_size=target.intermediate_size)
        cfg.validate(target)
        return cfg

    def validate(self, target: TargetConfig) -> None:
        _check(1 <= self.block_size <= 64, f"block_size must be in 1..64, got {self.block_size}")
        _check(1 <= self.num_hidden_layers <= 32, f"num_hidden_layers must be in 1..32, got {self.num_hidden_layers}")
        _validate_layer_ids(self.target_layer_ids, target.num_hidden_layers, "target_layer_ids")
        _check(
            0 <= self.mask_token_id < target.vocab_size,
            f"mask_token_id {self.mask_token_id} is outside the target vocabulary 0..{target.vocab_size - 1}",
        )
        _check(self.intermediate_size >= 1, "intermediate_size must be >= 1 (0 means the target's)")
        _check(
            self.markov_head_type in MARKOV_HEAD_TYPES,
            f"markov_head_type must be one of {MARKOV_HEAD_TYPES}, got {self.markov_head_type!r}",
        )
        has_head = self.markov_head_type != "none"
        _check(
            (self.markov_rank > 0) == has_head and 0 <= self.markov_rank <= 4096,
            f"markov_rank must be in 1..4096 with a sequential head and 0 without one, "
            f"got {self.markov_rank} with markov_head_type={self.markov_head_type!r}",
        )
        _check(
            not (self.enable_confidence_head and self.confidence_head_with_markov and not has_head),
            "confidence_head_with_markov needs a sequential head; set it false or pick a markov_head_type",
        )
        temps = self.calibration_temperatures
        if temps is not None:
            _check(
                len(temps) == self.block_size and all(math.isfinite(t) and t > 0 for t in temps),
                f"calibration_temperatures must be {self.block_size} finite numbers > 0, got {list(temps)}",
            )
        _check(
            0 <= self.transition_top_k <= target.vocab_size,
            f"transition_top_k must be in 0..{target.vocab_size} (0 = full vocabulary), got {self.transition_top_k}",
        )
        _check_draft_vocab_size(self.draft_vocab_size, target)


def dflash_overrides() -> dict:
    """What makes a DSpark config a DFlash config."""
    return {"markov_head_type": "none", "markov_rank": 0, "enable_confidence_head": False,
            "confidence_head_with_markov": False}


@dataclass(frozen=True)
class Eagle3Config:
    """Eagle3: one decoder layer over [emb(x); fused low/mid/high target features]."""

    block_size: int = 7  # G: autoregressive draft steps (TTT horizon), 1..32
    target_layer_ids: tuple[int, ...] = ()  # fused target layers; () = (2, L//2, L-3)
    intermediate_size: int = 0  # SwiGLU width; 0 = the target's
    draft_vocab_size: int = 0  # draft only among the K most frequent tokens (draft_vocab.safetensors); 0 = all

    @classmethod
    def from_dict(cls, values: dict) -> "Eagle3Config":
        return _from_dict(cls, values, "eagle3 drafter")

    def resolved(self, target: TargetConfig) -> "Eagle3Config":
        cfg = self
        if not cfg.target_layer_ids:
            n = target.num_hidden_layers
            ids = (2, n // 2, n - 3) if n >= 8 else spread_layer_ids(n, 3)
            cfg = dataclasses.replace(cfg, target_layer_ids=ids)
        if cfg.intermediate_size <= 0:
            cfg = dataclasses.replace(cfg, intermediate_size=target.intermediate_size)
        _check(1 <= cfg.block_size <= 32, f"block_size must be in 1..32, got {cfg.block_size}")
        _validate_layer_ids(cfg.target_layer_ids, target.num_hidden_layers, "target_layer_ids")
        _check_draft_vocab_size(cfg.draft_vocab_size, target)
        return cfg


@dataclass(frozen=True)
class MTPConfig:
    """MTP-1 (DeepSeek-V3): one decoder layer over [hnorm(h_last); enorm(emb(x))]."""

    intermediate_size: int = 0  # SwiGLU width; 0 = the target's
    block_size: int = 1  # fixed at 1: MTP-1 predicts one token
    draft_vocab_size: int = 0  # draft only among the K most frequent tokens (draft_vocab.safetensors); 0 = all

    @classmethod
    def from_dict(cls, values: dict) -> "MTPConfig":
        return _from_dict(cls, values, "mtp drafter")

    def resolved(self, target: TargetConfig) -> "MTPConfig":
        cfg = self
        if cfg.intermediate_size <= 0:
            cfg = dataclasses.replace(cfg, intermediate_size=target.intermediate_size)
        _check(cfg.block_size == 1, f"an MTP-1 drafter has block_size 1, got {cfg.block_size}")
        _check_draft_vocab_size(cfg.draft_vocab_size, target)
        return cfg

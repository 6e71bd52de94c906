"""Shape of a Llama-family target (Llama, SmolLM2, Qwen3 ...), read from a
Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dspark.errors import CheckpointError

# Model families dspark's lean runtime knows, by HF `model_type`. A family
# differs only in small flags (Qwen3 adds per-head q/k RMSNorm).
FAMILIES = {"llama": {"qk_norm": False}, "qwen3": {"qk_norm": True}}


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # SwiGLU inner width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    model_type: str = "llama"
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None

    @property
    def qk_norm(self) -> bool:
        return FAMILIES[self.model_type]["qk_norm"]

    @classmethod
    def from_hf(cls, cfg: dict) -> "TargetConfig":
        """Build from a Hugging Face config dict; refuse families we do not run."""
        model_type = cfg.get("model_type", "llama")
        if model_type not in FAMILIES:
            raise CheckpointError(
                f"model_type {model_type!r} is not supported; dspark runs {sorted(FAMILIES)} models"
            )
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
        if rope_type not in (None, "default"):
            raise CheckpointError(f"rope scaling {rope_type!r} is not supported yet (only default RoPE)")
        theta = cfg.get("rope_theta")
        if theta is None and isinstance(rope, dict):
            theta = rope.get("rope_theta")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta if theta is not None else 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            model_type=model_type,
            attention_bias=cfg.get("attention_bias", False),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    def to_hf(self) -> dict:
        """The target's fields in Hugging Face spelling (also copied into drafter configs)."""
        d = asdict(self)
        eos = d.pop("eos_token_ids")
        d["eos_token_id"] = list(eos) if len(eos) != 1 else eos[0]
        d["hidden_act"] = "silu"
        return d

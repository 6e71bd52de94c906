"""Tiny random-weight targets for tests: deterministic, fast, and peaked enough
that greedy decoding and acceptance are not trivially uniform."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dspark.models.config import TargetConfig
from dspark.models.llama import TargetModel

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def tiny_config(
    vocab_size: int = 96,
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    family: str = "llama",
    intermediate: int = 128,
    tie_word_embeddings: bool = True,
) -> TargetConfig:
    """A small TargetConfig of the given family ("llama" or "qwen3")."""
    return TargetConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden_size // heads,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=4096,
        tie_word_embeddings=tie_word_embeddings,
        model_type=family,
        eos_token_ids=(1,),
        bos_token_id=0,
    )


def tiny_state_dict(config: TargetConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 weights drawn from a seeded generator.

    Embeddings have std 0.5 and linear layers std 1/sqrt(fan_in), so logits are
    peaked; norm weights are 1 +- 0.1 so that they matter in parity tests.
    """
    gen = torch.Generator().manual_seed(seed)
    template = TargetModel(config).state_dict()
    state = {}
    for name in sorted(template):
        shape = template[name].shape
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("embed_tokens.weight"):
            value = 0.5 * torch.randn(shape, generator=gen)
        elif name.endswith("bias"):
            value = 0.05 * torch.randn(shape, generator=gen)
        else:
            value = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        state[name] = value.contiguous()
    return state


def tiny_target(seed: int = 0, **kw) -> TargetModel:
    """A tiny TargetModel (float32, eval mode); keyword arguments go to `tiny_config`."""
    config = tiny_config(**kw)
    model = TargetModel(config)
    model.load_state_dict(tiny_state_dict(config, seed))
    return model.eval()


def tiny_hf_folder(tmp_path: str | Path, seed: int = 0, **kw) -> Path:
    """Write a Hugging Face folder (config.json + model.safetensors) of a tiny target
    under `tmp_path` and return its path. It has no tokenizer files."""
    config = tiny_config(**kw)
    folder = Path(tmp_path) / f"tiny-{config.model_type}-{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf()
    hf["architectures"] = [_ARCHITECTURES[config.model_type]]
    hf["torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(tiny_state_dict(config, seed), str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder

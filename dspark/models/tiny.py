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


def round_to_block_grid(weight: torch.Tensor, kind: str) -> torch.Tensor:
    """`weight` [out, in] (in a multiple of 32) as a GGUF model dequantized to float32 holds it:
    each block of 32 inputs quantized the way llama.cpp does, then rebuilt in float32.
    kind "q4_1": w = q * d + m, q in 0..15, d = (max - min) / 15 and m = min stored as float16;
    kind "q8_0": w = q * d, q in -127..127, d = max|x| / 127 stored as float16."""
    out, n = weight.shape
    blocks = weight.detach().float().reshape(out, n // 32, 32)
    if kind == "q4_1":
        low, high = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
        step = (high - low) / 15
        codes = torch.where(step > 0, (blocks - low) / step.clamp_min(1e-30), 0).round().clamp(0, 15)
        rebuilt = codes * step.half().float() + low.half().float()
    elif kind == "q8_0":
        step = blocks.abs().amax(-1, keepdim=True) / 127
        codes = torch.where(step > 0, blocks / step.clamp_min(1e-30), 0).round().clamp(-127, 127)
        rebuilt = codes * step.half().float()
    else:
        raise ValueError(f"unknown block grid {kind!r}: use 'q4_1' or 'q8_0'")
    return rebuilt.reshape(out, n)


def tiny_target(seed: int = 0, *, block_quantized: bool = False, **kw) -> TargetModel:
    """A tiny TargetModel (float32, eval mode); keyword arguments go to `tiny_config`.
    block_quantized: put the weights on the grids of the embedded GGUF model (every linear on
    Q4_1's, the embeddings and LM head on Q8_0's), as a quantized model converted to float32."""
    config = tiny_config(**kw)
    model = TargetModel(config)
    state = tiny_state_dict(config, seed)
    if block_quantized:
        for name, value in state.items():
            if value.dim() == 2:
                grid = "q8_0" if name.endswith(("embed_tokens.weight", "lm_head.weight")) else "q4_1"
                state[name] = round_to_block_grid(value, grid)
    model.load_state_dict(state)
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


def random_folder_like(config_json: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """A folder with `config_json` and random weights of its shape (no tokenizer): a stand-in
    for a model whose weights are not at hand when only speed is measured (a step costs the
    same whatever the weights' values), e.g. on a GPU machine that cannot convert the
    embedded GGUF."""
    hf = json.loads(Path(config_json).read_text())
    config = TargetConfig.from_hf(hf)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(tiny_state_dict(config, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m dspark.models.tiny CONFIG_JSON OUT_DIR (random weights of that shape)")
    print(random_folder_like(sys.argv[1], sys.argv[2]))

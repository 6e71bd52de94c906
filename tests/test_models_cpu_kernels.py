"""The target's fast CPU matmuls (dspark.models.cpu_kernels): same function as F.linear up to
float32 rounding, at every row count, and never stale after the weights change."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dspark.models import cpu_kernels
from dspark.models.cpu_kernels import CpuKernel, disable_cpu_kernels, enable_cpu_kernels
from dspark.models.tiny import tiny_state_dict, tiny_target
from dspark.types import RaggedBatch

pytestmark = pytest.mark.skipif(not cpu_kernels.cpu_kernels_available(), reason="torch built without oneDNN")


@pytest.mark.parametrize("one_row_copy", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17, 40])
def test_kernel_matches_f_linear(rows: int, one_row_copy: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 48, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 48, generator=gen)
    kernel = CpuKernel(weight, one_row_copy=one_row_copy)
    torch.testing.assert_close(kernel(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel(x, bias), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert kernel(x.view(1, rows, 48)).shape == (1, rows, 96)


def test_kernel_steps_aside_when_its_weight_changes() -> None:
    weight = torch.randn(64, 32)
    kernel = CpuKernel(weight, one_row_copy=True)
    x = torch.randn(4, 32)
    weight.mul_(-2.0)  # in place: the packed copy is now stale
    torch.testing.assert_close(kernel(x), F.linear(x, weight))
    torch.testing.assert_close(kernel(x[:1]), F.linear(x[:1], weight))


def _forward_logits(model, seq: list[int], verify: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill, one decode step and one verification forward of 5 tokens."""
    cache = model.new_cache(1, 64)
    slot = cache.allocate()
    outs = []
    for chunk in (seq, verify[:1], verify[1:]):
        batch = RaggedBatch(torch.tensor(chunk), [slot], [len(chunk)])
        outs.append(model(batch, cache).logits)
    return outs


@pytest.mark.parametrize("family,tied", [("llama", True), ("llama", False), ("qwen3", False)])
def test_model_with_kernels_matches_model_without(family: str, tied: bool) -> None:
    plain = tiny_target(3, family=family, tie_word_embeddings=tied)
    fast = tiny_target(3, family=family, tie_word_embeddings=tied)
    assert enable_cpu_kernels(fast)
    seq, verify = [5, 9, 2, 7, 7, 1, 30, 4], [11, 3, 8, 2, 6, 1]
    for a, b in zip(_forward_logits(plain, seq, verify), _forward_logits(fast, seq, verify)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_reloaded_weights_are_used_not_the_stale_kernels() -> None:
    model = tiny_target(0)
    enable_cpu_kernels(model)
    other = tiny_target(9)
    model.load_state_dict(tiny_state_dict(other.config, 9))
    seq, verify = [1, 2, 3, 4], [5, 6, 7]
    for a, b in zip(_forward_logits(other, seq, verify), _forward_logits(model, seq, verify)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


def test_state_dict_of_a_model_with_kernels_saves_and_round_trips(tmp_path) -> None:
    model = tiny_target(4)
    enable_cpu_kernels(model)
    state = model.state_dict()
    reference = tiny_target(4).state_dict()
    assert state.keys() == reference.keys()
    for name, value in state.items():
        assert value.is_contiguous(), name  # safetensors refuses strided tensors
        assert torch.equal(value, reference[name]), name
    save_file(state, str(tmp_path / "model.safetensors"))
    assert load_file(str(tmp_path / "model.safetensors")).keys() == reference.keys()


def test_bfloat16_or_switched_off_models_get_no_kernels(monkeypatch) -> None:
    assert not enable_cpu_kernels(tiny_target(0).to(torch.bfloat16))
    monkeypatch.setenv(cpu_kernels.ENV_SWITCH, "0")
    model = tiny_target(0)
    assert not enable_cpu_kernels(model)
    assert "head_kernel" not in model.__dict__


def test_converting_a_model_with_kernels_to_bfloat16_still_runs() -> None:
    model = tiny_target(0)
    enable_cpu_kernels(model)
    reference = tiny_target(0).to(torch.bfloat16)
    model = model.to(torch.bfloat16)
    seq, verify = [1, 2, 3, 4], [5, 6, 7]
    for a, b in zip(_forward_logits(reference, seq, verify), _forward_logits(model, seq, verify)):
        torch.testing.assert_close(b, a, rtol=0.05, atol=0.05)


def test_disable_removes_every_kernel() -> None:
    model = tiny_target(0)
    enable_cpu_kernels(model)
    disable_cpu_kernels(model)
    assert "head_kernel" not in model.__dict__
    assert not any("cpu_kernel" in m.__dict__ for m in model.modules())

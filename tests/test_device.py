"""The runtime on a device other than the CPU.

On a machine without a GPU (CI) two checks run: device names resolve or fail with
a message that names the fix, and the target forward keeps every tensor on the
model's device. The latter runs the model on torch's `meta` device, where an op
that mixes a CPU tensor into device tensors raises, as it would on a GPU.

On a machine with a CUDA GPU the engine itself runs there: the DSpark drafter
and its baselines are greedy token-for-token equal to plain decoding on the GPU,
and the engine's output follows the target distribution (Pearson chi-square,
alpha = 1e-6 per case, 8,192 samples; see tests/test_engine_lossless.py), with
the exact distribution enumerated on the CPU from the same weights. On such a
machine, from the repository root, with a CUDA build of torch and scipy:

    PYTHONPATH=. python3 -m pytest -q tests/test_device.py tests/test_train_run.py

(`dspark train` picks the GPU by itself whenever torch sees one, so the training
tests then run there too; the two-rank test pins itself to the CPU.) All of it passed
on an NVIDIA H200 in session 31 (docs/GPU.md).
"""

from __future__ import annotations

import copy

import pytest
import torch

from dspark.engine.engine import Engine, EngineConfig
from dspark.engine.policy import build_policy
from dspark.errors import UserError
from dspark.models.device import resolve_device, same_device
from dspark.models.tiny import tiny_hf_folder, tiny_target
from dspark.schedule import CostTable
from dspark.types import RaggedBatch, SamplingParams
from test_engine_lossless import LEARNED  # the learned drafters and the policy each is verified under

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA GPU on this machine")


# ---------------------------------------------------------------- device names
def test_resolve_device_names(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device(None) == torch.device("cpu")
    with pytest.raises(UserError, match="--device cpu"):
        resolve_device("cuda")
    with pytest.raises(UserError, match="auto, cpu, cuda"):
        resolve_device("gpu0")
    with pytest.raises(UserError, match="not supported"):
        resolve_device("mps")


def test_cli_names_the_fix_for_a_missing_gpu(capsys, tmp_path, monkeypatch):
    from dspark.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    folder = tiny_hf_folder(tmp_path, seed=1)
    assert main(["generate", "--prompt", "hi", "--target", str(folder), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cpu" in err[0], err


def test_same_device():
    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert not same_device(torch.device("cpu"), torch.device("meta"))


# ------------------------------------------------- the forward on another device
def _meta_copy(target):
    return copy.deepcopy(target).to("meta")


def test_target_forward_keeps_tensors_on_the_model_device():
    """Prefill of two requests of different lengths (mask, scatter rows), then a ragged step
    with 1 and 5 new tokens (two attention parts, their row indices), on the meta device:
    every index, mask and rotary table must have followed the model there."""
    target = _meta_copy(tiny_target(seed=2))
    cache = target.new_cache(3, 32)
    assert cache.device.type == "meta" and cache.keys[0].device.type == "meta"
    slots = [cache.allocate() for _ in range(2)]
    prefill = RaggedBatch(torch.arange(11) % 50, slots, [4, 7])
    out = target.forward(prefill, cache, logits_rows=torch.tensor([3, 10]), tap_layers=(0, 1), want_last_hidden=True)
    assert out.logits.device.type == "meta" and out.logits.shape == (2, target.config.vocab_size)
    assert out.tapped_hidden.shape == (11, 2, target.config.hidden_size)
    step = RaggedBatch(torch.arange(6) % 50, slots, [1, 5])
    out = target.forward(step, cache, logits_rows=None)
    assert out.logits.shape == (6, target.config.vocab_size)
    assert [cache.length(s) for s in slots] == [5, 12]
    third = cache.allocate()  # not a compact slot range with the first: gathered slots
    cache.free(slots[1])
    out = target.forward(RaggedBatch(torch.arange(3), [slots[0], third], [1, 2]), cache)
    assert out.logits.shape == (3, target.config.vocab_size)


def test_forward_refuses_a_cache_on_another_device():
    target = tiny_target(seed=2)
    cache = _meta_copy(target).new_cache(1, 8)
    with pytest.raises(ValueError, match="new_cache"):
        target.forward(RaggedBatch(torch.arange(3), [cache.allocate()], [3]), cache)


def test_engine_places_its_cache_on_the_target_device():
    from dspark.draft.ngram import NoDrafter

    target = _meta_copy(tiny_target(seed=2))
    engine = Engine(target, NoDrafter(1), build_policy("none", block_size=1), EngineConfig(max_running=2, max_seq_len=16))
    assert engine.kv.device.type == "meta"


@pytest.mark.parametrize("kind,cfg", [("dspark", {"block_size": 4, "markov_head_type": "rnn", "markov_rank": 8}),
                                      ("eagle3", {"block_size": 4}), ("mtp", {})])
def test_drafters_follow_the_target_device(kind, cfg):
    """A learned drafter built for a target lives on its device and takes the target's tapped
    hidden states there (the context projection; proposing samples, which meta cannot)."""
    from dspark.draft.factory import build_drafter

    target = _meta_copy(tiny_target(seed=2))
    drafter = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=3, **cfg)
    assert {p.device.type for p in drafter.parameters()} == {"meta"}
    cache = target.new_cache(2, 32)
    slots = [cache.allocate() for _ in range(2)]
    out = target.forward(RaggedBatch(torch.arange(9) % 50, slots, [4, 5]), cache, tap_layers=drafter.tap_layers)
    states = [drafter.new_state() for _ in slots]
    drafter.observe(states, [torch.arange(4), torch.arange(5)], list(out.tapped_hidden.split([4, 5])))
    if kind == "dspark":
        drafter.project_pending(states)
        assert [s.kv.length for s in states] == [4, 5]


# ----------------------------------------------------------------- on a GPU
COST = CostTable({1: 0.010, 512: 0.020, 1024: 0.024, 1536: 0.040, 4096: 0.300})


def _run(target, drafter, policy: str, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    engine = Engine(target, drafter, build_policy(policy, block_size=drafter.block_size, cost=COST, threshold=0.4),
                    EngineConfig(max_running=len(prompts), max_seq_len=64))
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_work():
        engine.step()
    return [engine.pop_finished(i).output_ids for i in ids]


@needs_cuda
@pytest.mark.parametrize("kind,cfg,policy", LEARNED, ids=[f"{k}-{c.get('markov_head_type', '')}" for k, c, _ in LEARNED])
def test_greedy_parity_on_cuda(kind, cfg, policy):
    from dspark.draft.factory import build_drafter
    from dspark.draft.ngram import NoDrafter

    torch.backends.cuda.matmul.allow_tf32 = False
    target = tiny_target(seed=7).to("cuda")
    drafter = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=3, **cfg)
    assert next(drafter.parameters()).device.type == "cuda"
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    plain = _run(target, NoDrafter(1), "none", prompts, params)
    assert _run(target, drafter, policy, prompts, params) == plain


@needs_cuda
@pytest.mark.parametrize("kind,cfg,policy", LEARNED[:3], ids=[f"{k}-{c.get('markov_head_type', '')}" for k, c, _ in LEARNED[:3]])
def test_sampled_output_follows_the_target_on_cuda(kind, cfg, policy):
    from dspark.draft.factory import build_drafter
    from lossless_harness import ALPHA, chi_square
    from test_engine_lossless import VOCAB, _engine_samples, _exact_joint, _flat_target

    torch.backends.cuda.matmul.allow_tf32 = False
    cpu_target = _flat_target()
    target = copy.deepcopy(cpu_target).to("cuda")
    drafter = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=3, **cfg)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True)
    samples = _engine_samples(target, drafter, policy, params, num_samples=8192)
    result = chi_square(samples, _exact_joint(cpu_target, params), VOCAB)
    assert result.p_value > ALPHA, result

"""Drafter folders: round trips (Llama and Qwen3 shapes, every drafter kind),
a synthetic folder written in the DeepSpec layout, and refusal of broken
folders with a message naming the offending tensor or field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dspark.draft import checkpoint
from dspark.draft.checkpoint import load_drafter_folder, save_drafter
from dspark.draft.factory import build_drafter
from dspark.errors import CheckpointError
from dspark.models.tiny import tiny_target
from dspark.types import SamplingParams

V, D = 96, 32


def _target(family="llama", seed=3, **kw):
    shape = dict(vocab_size=V, hidden_size=D, num_layers=4, heads=4, kv_heads=2, family=family)
    return tiny_target(seed=seed, **{**shape, **kw})


KINDS = [
    ("dspark", {"block_size": 4, "num_hidden_layers": 2, "markov_rank": 8, "markov_head_type": "rnn",
                "calibration_temperatures": [1.0, 1.5, 2.0, 0.5], "transition_top_k": 10}),
    ("dspark", {"block_size": 3, "num_hidden_layers": 1, "markov_rank": 4, "markov_head_type": "gated",
                "confidence_head_with_markov": False}),
    ("dflash", {"block_size": 5, "num_hidden_layers": 2, "intermediate_size": 48}),
    ("eagle3", {"block_size": 3}),
    ("mtp", {}),
]


def _propose(d, seed=0):
    state = d.new_state()
    g = torch.Generator().manual_seed(seed)
    d.observe([state], [torch.randint(0, V, (6,), generator=g)], [torch.randn(6, len(d.tap_layers), D, generator=g)])
    return d.propose([state], torch.tensor([4]), [SamplingParams()], [torch.Generator().manual_seed(seed)])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("kind,cfg", KINDS)
def test_round_trip(tmp_path, family, kind, cfg):
    target = _target(family)
    d = build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=1, **cfg)
    save_drafter(d, tmp_path / "fp32", dtype=torch.float32)
    save_drafter(d, tmp_path / "fp16")
    exact = load_drafter_folder(tmp_path / "fp32", target)
    half = load_drafter_folder(tmp_path / "fp16", target)
    assert type(exact) is type(d) and exact.config == d.config
    for name, value in d.state_dict().items():
        assert torch.equal(exact.state_dict()[name], value), name
        assert torch.equal(half.state_dict()[name], value.half().float()), name
    a, b = _propose(d), _propose(exact)
    assert torch.equal(a.draft_tokens, b.draft_tokens) and torch.equal(a.draft_probs, b.draft_probs)
    if a.confidences is not None:
        assert torch.equal(a.confidences, b.confidences)
    cfg_json = json.loads((tmp_path / "fp16" / "config.json").read_text())
    prefix = "Qwen3" if family == "qwen3" else "Llama"
    assert cfg_json["architectures"][0].startswith(prefix) and cfg_json["drafter_type"] == kind
    assert cfg_json["vocab_size"] == V and cfg_json["num_target_layers"] == 4
    if family == "qwen3" and kind != "eagle3":
        assert any(k.endswith("self_attn.k_norm.weight") for k in d.state_dict())


def test_saved_names_and_fields_follow_deepspec(tmp_path):
    target = _target("qwen3")
    d = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight,
                      block_size=4, num_hidden_layers=2, markov_rank=8)
    save_drafter(d, tmp_path, self_contained=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("markov_head.markov_w2.weight").shape == (V, 8)
        assert f.get_tensor("fc.weight").shape == (D, len(d.tap_layers) * D)
        assert f.get_tensor("layers.0.self_attn.q_norm.weight").dtype == torch.float16
    for name in ("embed_tokens.weight", "lm_head.weight", "fc.weight", "hidden_norm.weight", "norm.weight",
                 "layers.1.mlp.down_proj.weight", "layers.1.post_attention_layernorm.weight",
                 "markov_head.markov_w1.weight", "confidence_head.proj.weight", "confidence_head.proj.bias"):
        assert name in names
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key, value in {"block_size": 4, "num_hidden_layers": 2, "markov_rank": 8, "markov_head_type": "vanilla",
                       "enable_confidence_head": True, "confidence_head_with_markov": True,
                       "mask_token_id": V - 1, "model_type": "qwen3"}.items():
        assert cfg[key] == value, key
    assert cfg["target_layer_ids"] == list(d.tap_layers)
    assert load_drafter_folder(tmp_path, target).config == d.config  # self-contained folders load too


def _deepspec_folder(tmp_path, target, *, tensor_rank=8, drop=None, reshape=None, **cfg_overrides):
    """A folder as DeepSpec's Qwen3DSparkModel.save_pretrained writes it
    (bf16, embedding and LM head included), built by hand from its names."""
    tc = target.config
    hd, hq, hkv, inter = tc.head_dim, tc.num_attention_heads, tc.num_key_value_heads, tc.intermediate_size
    shapes = {"embed_tokens.weight": (V, D), "lm_head.weight": (V, D), "fc.weight": (D, 2 * D),
              "hidden_norm.weight": (D,), "norm.weight": (D,),
              "markov_head.markov_w1.weight": (V, tensor_rank), "markov_head.markov_w2.weight": (V, tensor_rank),
              "confidence_head.proj.weight": (1, D + tensor_rank), "confidence_head.proj.bias": (1,)}
    for i in range(2):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (hq * hd, D), p + "self_attn.k_proj.weight": (hkv * hd, D),
                       p + "self_attn.v_proj.weight": (hkv * hd, D), p + "self_attn.o_proj.weight": (D, hq * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (inter, D), p + "mlp.up_proj.weight": (inter, D),
                       p + "mlp.down_proj.weight": (D, inter), p + "input_layernorm.weight": (D,),
                       p + "post_attention_layernorm.weight": (D,)})
    g = torch.Generator().manual_seed(0)
    tensors = {k: (torch.randn(s, generator=g) * 0.1).to(torch.bfloat16) for k, s in shapes.items()}
    tensors["embed_tokens.weight"] = target.embed_tokens.weight.detach().to(torch.bfloat16)
    tensors["lm_head.weight"] = target.lm_head_weight.detach().to(torch.bfloat16)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = torch.zeros(3, 3, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = {**tc.to_hf(), "architectures": ["Qwen3DSparkModel"], "num_target_layers": tc.num_hidden_layers,
           "num_hidden_layers": 2, "block_size": 4, "tie_word_embeddings": False,
           "layer_types": ["full_attention"] * 2, "_attn_implementation": "flex_attention", "mask_token_id": 7,
           "target_layer_ids": [1, 2], "num_anchors": 512, "enable_confidence_head": True,
           "confidence_head_with_markov": True, "markov_rank": tensor_rank, "markov_head_type": "vanilla",
           "torch_dtype": "bfloat16", "attention_dropout": 0.0, "transformers_version": "4.57.0"}
    cfg.update(cfg_overrides)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tensors


def test_synthetic_deepspec_folder_loads(tmp_path):
    target = _target("qwen3")
    tensors = _deepspec_folder(tmp_path, target)
    d = load_drafter_folder(tmp_path, target)
    assert d.name == "dspark" and d.block_size == 4 and d.tap_layers == (1, 2)
    assert d.config.markov_head_type == "vanilla" and d.config.mask_token_id == 7 and d.has_confidence
    sd = d.state_dict()
    for name, value in tensors.items():
        if name not in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(sd[name], value.float()), name
    p = _propose(d)
    assert p.draft_tokens.shape == (1, 4) and p.confidences.shape == (1, 4)


def test_deepspec_dflash_folder_without_heads_loads(tmp_path):
    target = _target("qwen3")
    _deepspec_folder(tmp_path, target)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(markov_rank=0, enable_confidence_head=False)  # DeepSpec omits the head fields then
    del cfg["markov_head_type"], cfg["confidence_head_with_markov"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from safetensors.torch import load_file

    tensors = {k: v for k, v in load_file(str(tmp_path / "model.safetensors")).items()
               if not k.startswith(("markov_head", "confidence_head"))}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    d = load_drafter_folder(tmp_path, target)
    assert d.name == "dflash" and d.markov_head is None and d.confidence_head is None


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        ({"drop": "layers.1.mlp.up_proj.weight"}, r"lacks tensor.*layers\.1\.mlp\.up_proj\.weight"),
        ({"reshape": "markov_head.markov_w2.weight"}, r"markov_head\.markov_w2\.weight has shape \[3, 3\]"),
        ({"vocab_size": V + 4}, r"vocab_size=100.*this target has vocab_size=96"),
        ({"hidden_size": 64}, r"hidden_size=64"),
        ({"num_target_layers": 6}, r"6-layer target"),
        ({"target_layer_ids": [-1, 2]}, r"embedding output \(-1\)"),
        ({"markov_head_type": "vanilla", "markov_rank": 4}, r"markov_head\.markov_w1\.weight has shape"),
        ({"enable_confidence_head": False}, r"unexpected tensor.*confidence_head"),
        ({"block_size": 0}, r"block_size must be in 1\.\.64"),
    ],
)
def test_broken_deepspec_folders_are_refused(tmp_path, kwargs, pattern):
    target = _target("qwen3")
    _deepspec_folder(tmp_path, target, **kwargs)
    with pytest.raises(CheckpointError, match=pattern):
        load_drafter_folder(tmp_path, target)


def test_truncated_weights_are_refused(tmp_path):
    target = _target()
    d = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, block_size=4, markov_rank=8)
    save_drafter(d, tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_drafter_folder(tmp_path, target)
    cfg = json.loads((tmp_path / "config.json").read_text())  # without the weights record: parse error
    del cfg["dspark_weights"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unreadable, probably truncated"):
        load_drafter_folder(tmp_path, target)


def test_other_targets_and_missing_files_are_refused(tmp_path):
    target = _target()
    d = build_drafter("mtp", target.config, target.embed_tokens, target.lm_head_weight)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_drafter_folder(tmp_path, target)
    save_drafter(d, tmp_path, self_contained=True)
    other = _target(seed=9)  # same shapes, different embedding
    with pytest.raises(CheckpointError, match="embed_tokens.weight differs"):
        load_drafter_folder(tmp_path, other)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_drafter_folder(tmp_path, target)


def test_interrupted_save_is_detected(tmp_path, monkeypatch):
    """A crash between writing the weights and the config leaves a folder
    whose weights record no longer matches: loading refuses it."""
    target = _target()
    d = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, block_size=4, markov_rank=8)
    save_drafter(d, tmp_path)
    real = checkpoint._atomic_write

    def crash_on_config(path, data):
        if path.name == "config.json":
            raise KeyboardInterrupt
        real(path, data)

    with torch.no_grad():
        d.fc.weight.add_(1.0)
    monkeypatch.setattr(checkpoint, "_atomic_write", crash_on_config)
    with pytest.raises(KeyboardInterrupt):
        save_drafter(d, tmp_path, dtype=torch.float32)
    with pytest.raises(CheckpointError, match="truncated or from another save|sha256"):
        load_drafter_folder(tmp_path, target)
    assert not list(tmp_path.glob(".*tmp*"))


@pytest.mark.parametrize("name,kind,block,calibrated", [("smollm2-135m-dspark", "dspark", 7, True),
                                                          ("smollm2-135m-mtp1", "mtp", 1, False)])
def test_shipped_drafters_are_complete_and_small(name, kind, block, calibrated):
    """The committed drafters (the DSpark default, calibrated, and the MTP-1 baseline): their kind
    and block, fp16, at most 40 MB, and their weights are the ones config.json records (size and
    sha256)."""
    import hashlib
    import json

    from dspark.draft.registry import SHIPPED_DIR

    folder = SHIPPED_DIR / name
    if not folder.is_dir():
        pytest.skip("no shipped drafter in this checkout")
    config = json.loads((folder / "config.json").read_text())
    weights = folder / "model.safetensors"
    assert config["drafter_type"] == kind and config["block_size"] == block
    assert config["torch_dtype"] == "float16" and weights.stat().st_size <= 40e6
    if calibrated:
        assert len(config["calibration_temperatures"]) == 7
    record = config["dspark_weights"]
    assert record["bytes"] == weights.stat().st_size
    assert record["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    if config.get("draft_vocab_size"):  # its token ranking ships beside it and covers the draft vocabulary
        ranking = checkpoint.read_draft_vocab(folder)
        assert ranking is not None and ranking.numel() >= config["draft_vocab_size"]


def test_draft_vocabulary_round_trip_and_refusals(tmp_path):
    """The ranking travels in draft_vocab.safetensors, the size in config.json; a folder
    asking for a draft vocabulary without its ranking, or with a broken one, is refused."""
    target = _target()
    d = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, seed=1,
                      block_size=4, num_hidden_layers=1, markov_rank=8)
    ranking = torch.randperm(V, generator=torch.Generator().manual_seed(0))
    d.set_draft_vocab(ranking, 20)
    folder = save_drafter(d, tmp_path / "d")
    assert json.loads((folder / "config.json").read_text())["draft_vocab_size"] == 20
    back = load_drafter_folder(folder, target)
    assert torch.equal(back.draft_ranking, ranking) and back.config.draft_vocab_size == 20
    assert torch.equal(back.draft_ids, ranking[:20].sort().values)
    assert _propose(back).draft_probs[0, :, back.draft_ids].sum(-1).allclose(torch.ones(4))

    (folder / checkpoint.DRAFT_VOCAB_NAME).write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="draft-vocab"):
        load_drafter_folder(folder, target)
    (folder / checkpoint.DRAFT_VOCAB_NAME).unlink()
    with pytest.raises(CheckpointError, match="needs the token ranking"):
        load_drafter_folder(folder, target)
    checkpoint.write_draft_vocab(folder, torch.arange(10))
    with pytest.raises(CheckpointError, match="exceeds the 10 ranked tokens"):
        load_drafter_folder(folder, target)


def test_draft_vocab_command_ranks_training_answers(tmp_path):
    """`dspark draft-vocab` counts the assistant tokens of the training split, stores the
    ranking and the size, keeps the weights file, and refuses bad sizes and folders."""
    from train_toys import write_toy_data

    from dspark.cli import main
    from dspark.train.data import SequenceStore
    from dspark.train.draft_vocab import count_answer_tokens

    target = tiny_target(seed=0)  # write_toy_data's target shape
    data = write_toy_data(tmp_path / "data", num=12)
    d = build_drafter("dflash", target.config, target.embed_tokens, target.lm_head_weight, block_size=3)
    folder = save_drafter(d, tmp_path / "d")
    weights = (folder / "model.safetensors").read_bytes()
    assert main(["draft-vocab", str(folder), "--data", str(data), "--size", "16", "--holdout-fraction", "0"]) == 0
    back = load_drafter_folder(folder, target)
    assert back.config.draft_vocab_size == 16 and (folder / "model.safetensors").read_bytes() == weights
    store = SequenceStore(data)
    counts = count_answer_tokens(store, list(range(len(store))), target.config.vocab_size)
    top = back.draft_ranking[:16]
    assert bool((counts[top].min() >= counts[back.draft_ranking[16:]].max()))  # most frequent first
    assert main(["draft-vocab", str(folder), "--data", str(data), "--size", "97"]) == 2  # vocabulary is 96
    assert main(["draft-vocab", str(tmp_path / "nowhere"), "--data", str(data)]) == 2

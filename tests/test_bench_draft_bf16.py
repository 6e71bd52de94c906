"""`python -m dspark.bench.draft_bf16` on a tiny target and an untrained drafter folder: one row per
request count with both paths timed, the drafters loaded with the path off and on as asked."""

import json

import pytest
import torch

from dspark.bench import draft_bf16
from dspark.draft.checkpoint import save_drafter
from dspark.draft.factory import build_drafter
from dspark.models import cpu_kernels
from dspark.models.tiny import tiny_target


def test_rows_time_both_paths_on_the_same_drafter(tmp_path, monkeypatch):
    if not cpu_kernels.cpu_kernels_available():
        pytest.skip(cpu_kernels.cpu_kernels_status())
    target = tiny_target(seed=1, vocab_size=96)
    assert cpu_kernels.enable_cpu_kernels(target, home=tmp_path, tune=False)
    drafter = build_drafter("dspark", target.config, target.embed_tokens, target.lm_head_weight, seed=2,
                            block_size=4, markov_rank=8)
    folder = save_drafter(drafter, tmp_path / "d", dtype=torch.float32)
    loaded = []
    real = draft_bf16._drafter
    monkeypatch.setattr(draft_bf16, "_drafter", lambda spec, t, mode: loaded.append(mode) or real(spec, t, mode))
    result = draft_bf16.time_modes(target, str(folder), repeats=2, requests=(1, 3))
    assert loaded == ["off", "on"]
    assert [r["requests"] for r in result["rows"]] == [1, 3]
    for row in result["rows"]:
        assert all(row[f"{part}_{mode}_ms"] > 0 for part in ("propose", "project") for mode in ("off", "on"))
    table = draft_bf16.format_table(result)
    assert "| 3 |" in table and "project 64 on" in table
    json.dumps(result)  # the JSON the command writes


def test_a_chain_drafter_is_refused(tmp_path):
    target = tiny_target(seed=1, vocab_size=96)
    mtp = build_drafter("mtp", target.config, target.embed_tokens, target.lm_head_weight, seed=2)
    folder = save_drafter(mtp, tmp_path / "m", dtype=torch.float32)
    with pytest.raises(SystemExit, match="DSpark or DFlash drafter folder"):
        draft_bf16.time_modes(target, str(folder), repeats=1, requests=(1,))

"""DSpark's Markov head started from the answers' adjacent-token PMI ([drafter] markov_init =
"pmi", dspark.train.markov_init): the counts, the shrunk PMI, the factorisation, the rows it
writes, the recipe key, and a tiny run that starts there; and from the target's own
adjacent-token PMI (markov_init = "target"): the transitions read from the target, the PMI of
them, and a tiny run that starts there; and from the answers' PMI shrunk toward the target's
(markov_init = "pmi+target")."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dspark.draft.heads import MarkovHead
from dspark.errors import UserError
from dspark.train.config import config_from_dict
from dspark.train.data import SequenceStore, TrainRecord, write_meta, write_shard
from dspark.train.markov_init import (
    answer_opening,
    blended_pmi,
    blended_pmi_init,
    low_rank,
    pair_counts,
    pmi_init,
    shrunk_pmi,
    target_pmi_init,
    target_transitions,
    transition_pmi,
)
from dspark.types import RaggedBatch


def _store(tmp_path, records):
    write_shard(tmp_path, [TrainRecord(f"r{i}", "chat", ids, mask) for i, (ids, mask) in enumerate(records)])
    write_meta(tmp_path, {"target": "tiny", "vocab_size": 16})
    return SequenceStore(tmp_path)


def test_pairs_are_counted_inside_the_answer_among_the_chosen_tokens(tmp_path):
    store = _store(tmp_path, [
        ([9, 1, 2, 1, 2, 3], [0, 1, 1, 1, 1, 1]),  # 9 -> 1 crosses into the answer: not counted
        ([1, 2, 5, 2, 1], [1, 1, 1, 1, 0]),  # 2 -> 1 ends outside the mask; 5 is not a chosen token
    ])
    tokens = torch.tensor([1, 2, 3])  # local indices 0, 1, 2
    counts = pair_counts(store, [0, 1], tokens)
    expected = torch.zeros(3, 3, dtype=torch.float64)
    expected[0, 1] = 3  # (1, 2) twice in the first record, once in the second
    expected[1, 0] = 1  # (2, 1) in the first
    expected[1, 2] = 1  # (2, 3)
    assert torch.equal(counts, expected)
    assert torch.equal(pair_counts(store, [1], tokens)[0, 1], torch.tensor(1.0, dtype=torch.float64))


def test_shrunk_pmi_of_seen_pairs_and_zero_for_the_rest():
    counts = torch.tensor([[4.0, 0.0], [1.0, 5.0]], dtype=torch.float64)
    pmi = shrunk_pmi(counts, shrink=1.0)
    total, left, right = 10.0, [4.0, 6.0], [5.0, 5.0]
    for x, y in ((0, 0), (1, 0), (1, 1)):
        n = float(counts[x, y])
        want = math.log(n * total / (left[x] * right[y])) * n / (n + 1.0)
        assert float(pmi[x, y]) == pytest.approx(want, rel=1e-6)
    assert float(pmi[0, 1]) == 0.0
    with pytest.raises(ValueError, match="no adjacent"):
        shrunk_pmi(torch.zeros(2, 2, dtype=torch.float64))


def test_low_rank_recovers_a_matrix_of_that_rank():
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(40, 3, generator=gen) @ torch.randn(3, 40, generator=gen)
    a, b, s = low_rank(m, 3)
    assert a.shape == (40, 3) and b.shape == (40, 3)
    assert torch.allclose(a @ b.T, m, atol=1e-4)
    a2, b2, s2 = low_rank(m, 2)
    assert float((s2 ** 2).sum()) < float((m ** 2).sum())  # rank 2 keeps less than all


def test_pmi_init_writes_the_factorised_pmi_into_the_chosen_rows(tmp_path):
    """Answers where 1 is always followed by 2 and 3 by 4: the started head boosts 2 after 1
    and 4 after 3, and leaves the rows of tokens outside the chosen ones as they were."""
    records = [([0] + [1, 2, 3, 4] * 6, [0] + [1] * 24) for _ in range(4)]
    store = _store(tmp_path, records)
    torch.manual_seed(0)
    head = MarkovHead(16, 4, 8)
    before = head.markov_w1.weight.detach().clone()
    ranking = torch.tensor([1, 2, 3, 4] + list(range(5, 16)) + [0])
    info = pmi_init(head, store, [0, 1, 2, 3], ranking, 4, shrink=0.0)
    assert info["tokens"] == 4 and info["pairs"] == 4 * 23 and info["energy_kept"] == pytest.approx(1.0, abs=1e-4)

    def bias(x):
        return (head.markov_w2.weight[:5] @ head.markov_w1.weight[x]).detach()

    assert int(bias(1)[1:5].argmax()) + 1 == 2 and int(bias(3)[1:5].argmax()) + 1 == 4
    assert float(bias(1)[2]) == pytest.approx(math.log(92 / 24), rel=1e-3)  # 24 of 92 pairs, every 1 before a 2
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[1:5] = False
    assert torch.equal(head.markov_w1.weight[untouched], before[untouched])


def test_the_recipe_key_and_its_refusals():
    assert config_from_dict({}).drafter.markov_init == "random"
    assert config_from_dict({"drafter": {"markov_init": "pmi"}}).drafter.markov_init == "pmi"
    assert config_from_dict({"drafter": {"markov_init": "target"}}).drafter.markov_init == "target"
    assert config_from_dict({"drafter": {"markov_init": "pmi+target"}}).drafter.markov_init == "pmi+target"
    with pytest.raises(UserError, match="markov_init = 'svd' is unknown"):
        config_from_dict({"drafter": {"markov_init": "svd"}})
    with pytest.raises(UserError, match="needs kind = \"dspark\" with a Markov head"):
        config_from_dict({"drafter": {"kind": "eagle3", "markov_init": "pmi"}})
    with pytest.raises(UserError, match="needs kind = \"dspark\" with a Markov head"):
        config_from_dict({"drafter": {"markov_init": "pmi", "options": {"markov_head_type": "none", "markov_rank": 0}}})


def test_a_run_started_from_the_pmi(tmp_path):
    """A tiny recipe with markov_init = "pmi" trains from the PMI start: after a few small steps
    the Markov rows of the draft vocabulary are far from N(0, 0.02), where the same recipe
    started at random stays; and a run stopped and resumed (which does not recompute the
    start: its checkpoint holds the weights) ends exactly where an uninterrupted one does."""
    from test_train_run import _recipe

    from dspark.draft.checkpoint import load_drafter_folder
    from dspark.models.loading import load_target
    from dspark.models.tiny import tiny_hf_folder
    from dspark.train.run import run_train

    recipe = _recipe(tmp_path, "dspark", steps=4)
    model = load_target(str(tiny_hf_folder(tmp_path))).model

    def recipe_for(init: str, out: str) -> Path:
        cfg = json.loads(recipe.read_text())
        cfg["drafter"].update(markov_init=init, draft_vocab_size=24)
        cfg["run"]["out_dir"] = str(tmp_path / out)
        path = tmp_path / f"{out}.json"
        path.write_text(json.dumps(cfg))
        return path

    drafters = {init: load_drafter_folder(run_train(recipe_for(init, init)), model)
                for init in ("random", "pmi", "target", "pmi+target")}
    spread = {init: float(d.markov_head.markov_w1.weight.detach()[d.draft_ids].float().std())
              for init, d in drafters.items()}
    assert spread["random"] < 0.05 < 0.2 < spread["pmi"], spread
    assert spread["target"] > 0.05, spread  # the tiny target's transitions are milder than the answers'
    assert spread["pmi+target"] > 0.05, spread

    for init in ("pmi", "target", "pmi+target"):
        stopped = recipe_for(init, f"{init}-stopped")
        run_train(stopped, stop_at_step=2)
        resumed = load_drafter_folder(run_train(stopped), model).state_dict()
        for name, value in drafters[init].state_dict().items():
            assert torch.equal(value, resumed[name]), (init, name)


def test_the_answer_opening_is_what_precedes_the_first_answer_token(tmp_path):
    store = _store(tmp_path, [([5, 6], [0, 0]), ([7, 8, 9, 10, 11, 12, 1, 2], [0] * 6 + [1, 1])])
    assert answer_opening(store, [0, 1]) == [9, 10, 11, 12]
    assert answer_opening(store, [1], max_tokens=2) == [11, 12]
    with pytest.raises(ValueError, match="no sequence has an answer token"):
        answer_opening(store, [0])


def test_target_transitions_equal_the_target_reading_each_token_alone():
    """Batched (rows_per_forward smaller than the tokens, so several forwards) against one
    forward per token over the whole vocabulary, its log-softmax cut to the chosen columns."""
    from dspark.models.tiny import tiny_target

    model = tiny_target(seed=3).eval()
    opening, token_ids = [1, 4, 2], torch.tensor([7, 3, 11, 5, 20])
    got = target_transitions(model, opening, token_ids, rows_per_forward=2)
    for row, x in enumerate(token_ids.tolist()):
        cache = model.new_cache(1, 4)
        for buf in cache.keys + cache.values:
            buf.zero_()
        slot = cache.allocate()
        out = model.forward(RaggedBatch(token_ids=torch.tensor(opening + [x]), slots=[slot], query_lens=[4]), cache)
        want = torch.log_softmax(out.logits[-1].float(), -1)[token_ids]
        assert torch.allclose(got[row], want, atol=1e-5), (x, got[row], want)


def test_transition_pmi_subtracts_the_weighted_marginal_and_floors():
    p = torch.tensor([[0.9, 0.1, 1e-9], [0.2, 0.3, 0.5]])
    w = torch.tensor([3.0, 1.0])
    marginal = (0.75 * p[0] + 0.25 * p[1]).double()
    got = transition_pmi(p.log(), w, floor=-3.0)
    want = (p.double().log() - marginal.log()).clamp(min=-3.0).float()
    assert torch.allclose(got, want, atol=1e-6)
    assert float(got[0, 2]) == -3.0 and float(got[0, 0]) > 0 > float(got[0, 1])
    with pytest.raises(ValueError, match="weights are all zero"):
        transition_pmi(p.log(), torch.zeros(2))


def _tiny_start(tmp_path, rank: int):
    """A tiny target, a one-record store whose answer opens with [0, 9], a Markov head of
    `rank` and a copy of its W1, a ranking with token 1 first and 0 last, answer-token counts."""
    from dspark.models.tiny import tiny_target

    model = tiny_target(seed=1).eval()
    store = _store(tmp_path, [([0, 9, 1, 2, 3, 4] * 3, [0, 0] + [1] * 16)])
    torch.manual_seed(0)
    head = MarkovHead(model.config.vocab_size, rank, 8)
    counts = torch.zeros(model.config.vocab_size)
    counts[1:5] = 3.0
    return model, store, head, head.markov_w1.weight.detach().clone(), torch.arange(model.config.vocab_size).roll(-1), counts


def test_target_pmi_init_writes_only_the_chosen_rows(tmp_path):
    model, store, head, before, ranking, counts = _tiny_start(tmp_path, 3)
    info = target_pmi_init(head, model, store, [0], ranking, counts, 6)
    assert info["tokens"] == 6 and info["opening"] == [0, 9] and 0 < info["energy_kept"] <= 1
    chosen = ranking[:6]
    untouched = torch.ones(model.config.vocab_size, dtype=torch.bool)
    untouched[chosen] = False
    assert torch.equal(head.markov_w1.weight[untouched], before[untouched])
    assert not torch.equal(head.markov_w1.weight[chosen], before[chosen])


def test_blended_pmi_shrinks_seen_pairs_toward_the_target_and_fills_unseen_ones():
    counts = torch.tensor([[4.0, 0.0], [1.0, 5.0]], dtype=torch.float64)
    target = torch.tensor([[0.5, -2.0], [1.5, -0.25]])
    got = blended_pmi(counts, target, shrink=2.0)
    total, left, right = 10.0, [4.0, 6.0], [5.0, 5.0]
    for x, y in ((0, 0), (1, 0), (1, 1)):
        n = float(counts[x, y])
        raw = math.log(n * total / (left[x] * right[y]))
        assert float(got[x, y]) == pytest.approx((raw * n + float(target[x, y]) * 2.0) / (n + 2.0), rel=1e-6)
    assert float(got[0, 1]) == pytest.approx(-2.0)  # unseen: the target's value
    many = blended_pmi(counts * 1e6, target, shrink=2.0)  # counts overwhelm the target
    assert float(many[1, 1]) == pytest.approx(math.log(5 * 10 / (6 * 5)), rel=1e-4)
    with pytest.raises(ValueError, match="no adjacent"):
        blended_pmi(torch.zeros(2, 2, dtype=torch.float64), target)
    with pytest.raises(ValueError, match="shrink must be positive"):
        blended_pmi(counts, target, shrink=0.0)


def test_blended_pmi_init_writes_the_blend_into_the_chosen_rows(tmp_path):
    """The rows written are the rank-r factorisation of blended_pmi over the counted pairs and
    the target's transition PMI; rows outside the chosen tokens stay as they were."""
    model, store, head, before, ranking, counts = _tiny_start(tmp_path, 6)
    info = blended_pmi_init(head, model, store, [0], ranking, counts, 6)
    assert info["tokens"] == 6 and info["opening"] == [0, 9] and info["pairs"] == 9
    assert info["energy_kept"] == pytest.approx(1.0, abs=1e-4)  # rank 6 of a 6 x 6 matrix keeps it all
    token_ids = ranking[:6]
    target = transition_pmi(target_transitions(model, [0, 9], token_ids), counts[token_ids], -3.0)
    want = blended_pmi(pair_counts(store, [0], token_ids), target, 2.0)
    w1, w2 = head.markov_w1.weight.detach(), head.markov_w2.weight.detach()
    assert torch.allclose(w1[token_ids] @ w2[token_ids].T, want, atol=1e-4)
    untouched = torch.ones(model.config.vocab_size, dtype=torch.bool)
    untouched[token_ids] = False
    assert torch.equal(w1[untouched], before[untouched])

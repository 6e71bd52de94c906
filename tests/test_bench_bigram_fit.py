"""python -m dspark.bench.bigram_fit: the held-out bigram log-likelihood it prints for each
Markov start, and the held-out pairs it reads."""

from __future__ import annotations

import math

import torch

from dspark.bench.bigram_fit import heldout_pairs, pair_loglik
from dspark.train.data import SequenceStore, TrainRecord, write_meta, write_shard


def test_a_zero_bias_gives_the_unigram_and_the_true_pmi_gives_the_true_conditional():
    unigram = torch.tensor([0.5, 0.3, 0.2])
    cond = torch.tensor([[0.1, 0.8, 0.1], [0.6, 0.2, 0.2], [0.3, 0.3, 0.4]])
    pairs = torch.tensor([[0, 1], [1, 0], [2, 2], [0, 1]])
    log_u = unigram.log()
    zero = pair_loglik(torch.zeros(3, 3), log_u, pairs)
    assert math.isclose(zero, float(log_u[pairs[:, 1]].mean()), rel_tol=1e-6)
    exact = pair_loglik(cond.log() - log_u, log_u, pairs)
    assert math.isclose(exact, float(cond.log()[pairs[:, 0], pairs[:, 1]].mean()), rel_tol=1e-6)
    assert exact > zero  # the conditional predicts these pairs better than the unigram


def test_heldout_pairs_are_the_adjacent_answer_pairs_among_the_tokens(tmp_path):
    write_shard(tmp_path, [TrainRecord("a", "chat", [9, 1, 2, 1, 2, 3], [0, 1, 1, 1, 1, 1])])
    write_meta(tmp_path, {"target": "tiny", "vocab_size": 16})
    pairs = heldout_pairs(SequenceStore(tmp_path), [0], torch.tensor([1, 2, 3]))
    got = sorted(map(tuple, pairs.tolist()))
    assert got == [(0, 1), (0, 1), (1, 0), (1, 2)]  # (1,2) twice, (2,1), (2,3); 9 -> 1 is outside the answer

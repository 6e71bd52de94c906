"""How well each start of DSpark's Markov head predicts held-out answers, as a bigram model
on its own (docs/TRAINING.md, "The Markov head started from the target's own transitions"):

    dspark bench bigram-fit [--train data/prepared-t1] [--heldout data/prepared-t1-4000]
        [--last 300] [--max-len 640] [--size 8192] [--rank 256] [--shrinks 2,5,20]
        [--json docs/figures/bigram_fit.json]

The Markov head adds B(x, y) to the logits of the token after x. A start for B that says
more about the answers predicts them better through p(y | x) proportional to
u(y) exp(B(x, y)), with u the answers' unigram distribution (add-half smoothed) over the
`size` most frequent answer tokens of the training folder. This prints the mean log-likelihood
of held-out adjacent answer pairs (nats per pair; higher is better; both tokens among the
`size` and inside the loss mask) under B = 0 (the unigram alone) and under each start of
dspark.train.markov_init, in full and cut to rank `rank` (what the head can hold):

- "pmi": the training answers' PMI, shrunk toward 0 by n / (n + 5) (markov_init = "pmi");
- "target": the frozen target's own transition PMI, floored at -3 (markov_init = "target");
- "pmi+target s": the answers' PMI shrunk toward the target's, weights n and s
  (markov_init = "pmi+target" uses s = 2).

Held-out pairs come from the last `last` sequences of the held-out folder whose ids are not
in the training folder. Reading the target's transitions runs the embedded target over `size`
short sequences (about a minute on two cores).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dspark.errors import UserError
from dspark.train.data import SequenceStore
from dspark.train.draft_vocab import count_answer_tokens, rank_tokens
from dspark.train.markov_init import (
    answer_opening,
    blended_pmi,
    low_rank,
    pair_counts,
    shrunk_pmi,
    target_transitions,
    transition_pmi,
)


def pair_loglik(bias: torch.Tensor, log_unigram: torch.Tensor, pairs: torch.Tensor) -> float:
    """Mean log p(y | x) over `pairs` [P, 2] (local indices) with p(y | x) proportional to
    exp(log_unigram[y] + bias[x, y])."""
    logits = bias.double() + log_unigram.double()
    log_z = torch.logsumexp(logits, 1)
    return float((logits[pairs[:, 0], pairs[:, 1]] - log_z[pairs[:, 0]]).mean())


def heldout_pairs(store: SequenceStore, indices: list[int], token_ids: torch.Tensor) -> torch.Tensor:
    """Adjacent answer pairs of `indices`, both among `token_ids` -> local indices [P, 2]."""
    counts = pair_counts(store, indices, token_ids)
    nonzero = counts.nonzero()
    return nonzero.repeat_interleave(counts[nonzero[:, 0], nonzero[:, 1]].long(), 0)


def at_rank(matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """The rank-`rank` approximation the Markov head would be started from."""
    a, b, _ = low_rank(matrix, rank)
    return a @ b.T


@dataclass
class BigramFitSettings:
    """What `dspark bench bigram-fit` reads and scores (its options, documented above)."""

    train: str = "data/prepared-t1"
    heldout: str = "data/prepared-t1-4000"
    last: int = 300
    holdout_fraction: float = 0.02  # the recipes' [data] holdout_fraction
    max_len: int = 640  # the recipes' [data] max_seq_len (training pairs counted)
    size: int = 8192
    rank: int = 256
    shrinks: tuple[float, ...] = (2.0, 5.0, 20.0)
    floor: float = -3.0
    json: str = ""


def run_bigram_fit(args: BigramFitSettings) -> dict:
    """Print the table of the module docstring (and write it as JSON to `args.json`); return it."""
    from dspark.models.loading import load_target

    started = time.perf_counter()
    store, other = SequenceStore(args.train), SequenceStore(args.heldout)
    train, _ = store.split(args.holdout_fraction)
    seen_ids = set(store.ids)
    fresh = [i for i in range(len(other)) if other.ids[i] not in seen_ids]
    if len(fresh) < args.last:
        raise UserError(f"{args.heldout} has only {len(fresh)} sequences not in {args.train}; lower --last")
    fresh = fresh[-args.last:]
    target = load_target(None)
    counts = count_answer_tokens(store, train, target.config.vocab_size)
    token_ids = rank_tokens(counts)[: args.size]
    log_unigram = torch.log(counts[token_ids].double() + 0.5)
    log_unigram -= torch.logsumexp(log_unigram, 0)
    pairs = heldout_pairs(other, fresh, token_ids)
    train_pairs = pair_counts(store, train, token_ids, args.max_len)
    print(f"{len(train)} training answers ({int(train_pairs.sum())} adjacent pairs), {len(fresh)} held-out answers "
          f"({pairs.shape[0]} pairs), {args.size} tokens, rank {args.rank}")

    model = target.model.eval()
    target_pmi = transition_pmi(target_transitions(model, answer_opening(store, train), token_ids),
                                counts[token_ids].float(), args.floor)
    starts = {"pmi": shrunk_pmi(train_pairs, 5.0), "target": target_pmi}
    for s in args.shrinks:
        starts[f"pmi+target {s:g}"] = blended_pmi(train_pairs, target_pmi, s)
    unigram = float(log_unigram[pairs[:, 1]].mean())
    rows = [{"start": "unigram (B = 0)", "full": unigram, "rank": unigram}]
    for name, matrix in starts.items():
        rows.append({"start": name, "full": pair_loglik(matrix, log_unigram, pairs),
                     "rank": pair_loglik(at_rank(matrix, args.rank), log_unigram, pairs)})
    print(f"\n| start of B | held-out log p(y | x), full | at rank {args.rank} |\n|---|---|---|")
    for row in rows:
        print(f"| {row['start']} | {row['full']:.3f} | {row['rank']:.3f} |")
    result = {**asdict(args), "heldout_pairs": int(pairs.shape[0]), "train_pairs": int(train_pairs.sum()),
              "rows": rows, "seconds": round(time.perf_counter() - started, 1)}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return result

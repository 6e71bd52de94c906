"""The draft vocabulary of a learned drafter: the target's tokens ranked
by how often the target itself produced them in the training answers.

With `draft_vocab_size = K` a drafter computes its LM head (and DSpark's
Markov transition) over the first K ranked tokens only (see
`dspark.draft.vocab`). Drafting stays lossless; the ranking only
decides how much of the target's choice the drafter can still propose.
Tokens never seen in the answers are ranked after the seen ones by token id,
which in a BPE vocabulary roughly follows merge order (frequent merges first).

    dspark draft-vocab FOLDER --data data/prepared --size 8192
"""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.errors import UserError
from dspark.train.data import SequenceStore


def count_answer_tokens(store: SequenceStore, indices: list[int], vocab_size: int) -> torch.Tensor:
    """How often each token id occurs in the loss-masked (assistant) tokens -> int64 [V]."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in indices:
        ids, mask = store.get(i)
        answer = ids[mask.bool()]
        if answer.numel() and int(answer.max()) >= vocab_size:
            raise UserError(f"the prepared data holds token id {int(answer.max())}, outside a {vocab_size}-token "
                            "vocabulary; prepare the data with this drafter's target")
        counts += torch.bincount(answer, minlength=vocab_size)
    return counts


def rank_tokens(counts: torch.Tensor) -> torch.Tensor:
    """Token ids by count, most frequent first; ties (and unseen tokens) by ascending id."""
    return torch.argsort(-counts, stable=True)


def coverage(counts: torch.Tensor, ranking: torch.Tensor, size: int) -> float:
    """Fraction of the counted tokens that fall among the first `size` ranked tokens."""
    total = int(counts.sum())
    return float(counts[ranking[:size]].sum()) / total if total else float("nan")


def build_draft_vocab(
    drafter_dir: str | Path, data_dir: str | Path, *, size: int, holdout_fraction: float = 0.02, write: bool = True
) -> dict:
    """Rank the target's tokens on the training split of `data_dir`, store the ranking in the
    drafter folder and set its config's draft_vocab_size to `size` (0 keeps the whole
    vocabulary). The weights file is not touched. -> a report with coverages."""
    from dspark.draft.checkpoint import drafter_folder_config, update_config, write_draft_vocab

    folder = Path(drafter_dir)
    vocab = int(drafter_folder_config(folder)["vocab_size"])
    if not 0 <= size <= vocab:
        raise UserError(f"--size must be in 0..{vocab} (0 = the whole vocabulary), got {size}")
    store = SequenceStore(data_dir)
    train, heldout = store.split(holdout_fraction)
    if not train:
        raise UserError(f"{data_dir} has no training sequences to count; run `dspark prepare` first")
    counts = count_answer_tokens(store, train, vocab)
    ranking = rank_tokens(counts)
    held = count_answer_tokens(store, heldout, vocab) if heldout else None
    report = {
        "drafter": str(folder),
        "size": size,
        "answer_tokens": int(counts.sum()),
        "distinct_tokens": int((counts > 0).sum()),
        "train_coverage": coverage(counts, ranking, size or vocab),
        "heldout_coverage": None if held is None else coverage(held, ranking, size or vocab),
        "heldout_tokens": 0 if held is None else int(held.sum()),
    }
    if write:
        write_draft_vocab(folder, ranking, counts)
        update_config(folder, {"draft_vocab_size": size})
    return report


def format_report(report: dict) -> str:
    held = report["heldout_coverage"]
    held_text = "n/a" if held is None else f"{100 * held:.1f}% of {report['heldout_tokens']} held-out answer tokens"
    return (f"dspark draft-vocab: {report['drafter']}: K = {report['size'] or 'all'} tokens cover "
            f"{100 * report['train_coverage']:.1f}% of {report['answer_tokens']} training answer tokens "
            f"({report['distinct_tokens']} distinct) and {held_text}")

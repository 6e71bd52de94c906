"""Start DSpark's Markov transition from the answers' bigram statistics instead of noise.

The Markov head adds B(x_{k-1}, y) = W2[y] . W1[x_{k-1}] to the logits of draft position k
(paper eq. 5). The backbone's logits at position k cannot see x_{k-1}, the token sampled just
before; if they were the marginal over it, the bias that turns them into the conditional is
log p(y | x_{k-1}) - log p(y): the pointwise mutual information (PMI) of adjacent tokens.
Trained from a random start, W1 and W2 have to find those statistics through the loss,
one row at a time; at this project's budgets (a few epochs of a few thousand answers,
docs/TRAINING.md) they are far from done when training stops.

`pmi_init` counts the adjacent pairs of the training answers (both tokens in the loss mask)
among the `size` most frequent answer tokens, shrinks each pair's PMI towards 0 by its count
(n / (n + shrink): a pair seen once says little), leaves unseen pairs at 0, and writes the
best rank-r factorisation of that matrix (truncated SVD, U S V^T) into the head:
W1 rows = U sqrt(S), W2 rows = V sqrt(S). Rows of tokens outside the `size` keep their
initialisation. The layout is the paper's and DeepSpec's; only the starting point changes.

    [drafter]
    markov_init = "pmi"   # default "random"
"""

from __future__ import annotations

import math

import torch

from dspark.train.data import SequenceStore

MAX_PMI_TOKENS = 16384  # the pair matrix is dense: 16384^2 float32 is 1 GiB


def pair_counts(store: SequenceStore, indices: list[int], token_ids: torch.Tensor, max_len: int | None = None
                ) -> torch.Tensor:
    """Counts of adjacent answer-token pairs (x, y), both among `token_ids` and both inside the
    loss mask -> float64 [K, K], rows x (the earlier token), columns y."""
    k = int(token_ids.numel())
    local = torch.full((int(token_ids.max()) + 1,), -1, dtype=torch.int64)
    local[token_ids] = torch.arange(k)
    flat = torch.zeros(k * k, dtype=torch.float64)
    for i in indices:
        ids, mask = store.get(i, max_len)
        lid = torch.full_like(ids, -1)  # each token's index among token_ids, -1 for the others
        inside = ids < local.numel()
        lid[inside] = local[ids[inside]]
        keep = mask[:-1].bool() & mask[1:].bool() & (lid[:-1] >= 0) & (lid[1:] >= 0)
        pairs = lid[:-1][keep] * k + lid[1:][keep]
        flat.index_add_(0, pairs, torch.ones(pairs.numel(), dtype=torch.float64))
    return flat.view(k, k)


def shrunk_pmi(counts: torch.Tensor, shrink: float = 5.0) -> torch.Tensor:
    """PMI of each seen pair, times n / (n + shrink); 0 for unseen pairs -> float32 [K, K]."""
    total = counts.sum()
    if total <= 0:
        raise ValueError("no adjacent answer-token pairs to count; is the loss mask empty?")
    left, right = counts.sum(1, keepdim=True), counts.sum(0, keepdim=True)
    seen = counts > 0
    pmi = torch.log(counts.clamp(min=1) * total / (left * right).clamp(min=1))
    return torch.where(seen, pmi * counts / (counts + shrink), torch.zeros_like(pmi)).float()


def low_rank(matrix: torch.Tensor, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, B, S) with A @ B.T the best rank-`rank` approximation of `matrix` (a randomised SVD
    from a private seed): A = U sqrt(S), B = V sqrt(S), each [K, rank]; S its singular values."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        u, s, v = torch.svd_lowrank(matrix, q=min(rank + 16, min(matrix.shape)), niter=4)
    s = s[:rank]
    return u[:, :rank] * s.sqrt(), v[:, :rank] * s.sqrt(), s


@torch.no_grad()
def pmi_init(head, store: SequenceStore, indices: list[int], ranking: torch.Tensor, size: int, *,
             shrink: float = 5.0, seed: int = 0, max_len: int | None = None) -> dict:
    """Write the rank-r factorisation of the answers' shrunk PMI among the first `size`
    ranked tokens into `head`'s W1 and W2 rows (see the module docstring). Returns what it
    did, for the log: tokens, pairs counted, and the share of the PMI matrix's energy
    (squared Frobenius norm) the rank-r factorisation keeps."""
    size = min(size, int(ranking.numel()), MAX_PMI_TOKENS)
    if size < 2:
        raise ValueError(f"pmi_init needs at least 2 tokens, got size {size}")
    token_ids = ranking[:size]
    counts = pair_counts(store, indices, token_ids, max_len)
    pmi = shrunk_pmi(counts, shrink)
    a, b, singular = low_rank(pmi, head.rank, seed)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    rows = token_ids.to(w1.device)
    w1[rows] = a.to(w1.dtype).to(w1.device)
    w2[rows] = b.to(w2.dtype).to(w2.device)
    energy = float(pmi.double().pow(2).sum())
    kept = float(singular.double().pow(2).sum())
    return {"tokens": size, "pairs": int(counts.sum()), "energy_kept": kept / energy if energy else math.nan}

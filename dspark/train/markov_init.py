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

`target_pmi_init` starts it instead from the PMI of adjacent tokens as the frozen target
itself predicts them: for each of the `size` tokens x it runs the target on the tokens
that open an answer followed by x, reads log p_T(y | x) over the same tokens, and takes
log p_T(y | x) - log p_T(y), with p_T(y) the mixture of those rows weighted by how often
each x occurs in the answers. Every pair gets a value, not only the pairs the answers
happen to contain; values below `floor` are raised to it (an impossible pair says no
more than an unlikely one, and a few huge negatives would take over the factorisation).

`blended_pmi_init` ("pmi+target") uses both: each pair's counted PMI is shrunk toward the
target's value instead of toward 0 (raw n / (n + shrink) + target shrink / (n + shrink)), and
an unseen pair takes the target's value. On held-out answers a bigram model made from it
predicts the next answer token better than either source alone (docs/TRAINING.md, "The
Markov head started from the target's own transitions").

    [drafter]
    markov_init = "pmi"   # default "random"; "target" or "pmi+target" (see above)
"""

from __future__ import annotations

import math

import torch

from dspark.train.data import SequenceStore
from dspark.types import RaggedBatch

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


def _counted_pmi(counts: torch.Tensor) -> torch.Tensor:
    """log(n_xy N / (n_x n_y)) of each seen pair, 0 for unseen pairs -> float64 [K, K]."""
    total = counts.sum()
    if total <= 0:
        raise ValueError("no adjacent answer-token pairs to count; is the loss mask empty?")
    left, right = counts.sum(1, keepdim=True), counts.sum(0, keepdim=True)
    pmi = torch.log(counts.clamp(min=1) * total / (left * right).clamp(min=1))
    return torch.where(counts > 0, pmi, torch.zeros_like(pmi))


def shrunk_pmi(counts: torch.Tensor, shrink: float = 5.0) -> torch.Tensor:
    """PMI of each seen pair, times n / (n + shrink); 0 for unseen pairs -> float32 [K, K]."""
    pmi = _counted_pmi(counts)
    return torch.where(counts > 0, pmi * counts / (counts + shrink), torch.zeros_like(pmi)).float()


def blended_pmi(counts: torch.Tensor, target: torch.Tensor, shrink: float = 2.0) -> torch.Tensor:
    """Each pair's counted PMI shrunk toward `target`'s value by its count n (weights n and
    `shrink`); unseen pairs take `target`'s value -> float32 [K, K]."""
    if shrink <= 0:
        raise ValueError(f"shrink must be positive, got {shrink}")
    return ((_counted_pmi(counts) * counts + target.double() * shrink) / (counts + shrink)).float()


def low_rank(matrix: torch.Tensor, rank: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(A, B, S) with A @ B.T the best rank-`rank` approximation of `matrix` (a randomised SVD
    from a private seed): A = U sqrt(S), B = V sqrt(S), each [K, rank]; S its singular values."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        u, s, v = torch.svd_lowrank(matrix, q=min(rank + 16, min(matrix.shape)), niter=4)
    s = s[:rank]
    return u[:, :rank] * s.sqrt(), v[:, :rank] * s.sqrt(), s


def answer_opening(store: SequenceStore, indices: list[int], max_tokens: int = 4) -> list[int]:
    """The last `max_tokens` tokens before the first answer token of the first sequence that has
    one (the chat template's assistant header): the context `target_transitions` reads x in."""
    for i in indices:
        ids, mask = store.get(i)
        inside = mask.nonzero()
        if inside.numel():
            first = int(inside[0])
            return ids[max(0, first - max_tokens) : first].tolist()
    raise ValueError("no sequence has an answer token; is the loss mask empty?")


@torch.no_grad()
def target_transitions(model, opening: list[int], token_ids: torch.Tensor, rows_per_forward: int = 256
                       ) -> torch.Tensor:
    """log p_T(y | opening + [x]) for x and y among `token_ids`, from the target `model`
    (dspark.models.llama.TargetModel) -> float32 [K, K], rows x, columns y."""
    from dspark.train.features import CachePool

    k, length = int(token_ids.numel()), len(opening) + 1
    device = model.embed_tokens.weight.device
    pool, out = CachePool(model), torch.empty(k, k)
    columns = token_ids.to(device)
    for start in range(0, k, rows_per_forward):
        xs = token_ids[start : start + rows_per_forward]
        n = int(xs.numel())
        ids = torch.cat([torch.tensor(opening, dtype=torch.int64).expand(n, -1), xs.view(n, 1)], 1)
        cache = pool.get(n, length)
        slots = [cache.allocate() for _ in range(n)]
        try:
            result = model.forward(RaggedBatch(token_ids=ids.flatten().to(device), slots=slots, query_lens=[length] * n),
                                   cache, logits_rows=torch.arange(n, device=device) * length + length - 1)
        finally:
            for slot in slots:
                cache.free(slot)
        out[start : start + n] = torch.log_softmax(result.logits.float(), -1).index_select(1, columns).cpu()
    return out


def transition_pmi(log_cond: torch.Tensor, weights: torch.Tensor, floor: float = -3.0) -> torch.Tensor:
    """log p(y | x) [K, K] and how often each x occurs [K] -> log p(y | x) - log p(y), floored,
    with p(y) = sum_x w(x) p(y | x) / sum_x w(x)."""
    w = weights.double().clamp(min=0)
    if float(w.sum()) <= 0:
        raise ValueError("the token weights are all zero; is the loss mask empty?")
    marginal = torch.logsumexp(log_cond.double() + (w / w.sum()).log().unsqueeze(1), 0)  # [K]
    return (log_cond.double() - marginal).clamp(min=floor).float()


def _write_rows(head, token_ids: torch.Tensor, matrix: torch.Tensor, seed: int) -> float:
    """The rank-r factorisation of `matrix` into `head`'s W1 and W2 rows of `token_ids`;
    returns the share of the matrix's energy it keeps."""
    a, b, singular = low_rank(matrix, head.rank, seed)
    w1, w2 = head.markov_w1.weight, head.markov_w2.weight
    rows = token_ids.to(w1.device)
    w1[rows] = a.to(w1.dtype).to(w1.device)
    w2[rows] = b.to(w2.dtype).to(w2.device)
    energy = float(matrix.double().pow(2).sum())
    return float(singular.double().pow(2).sum()) / energy if energy else math.nan


def _target_pmi(model, store: SequenceStore, indices: list[int], ranking: torch.Tensor, counts: torch.Tensor,
                size: int, floor: float, caller: str) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """(the first `size` ranked tokens, the answer opening, the target's transition PMI among them)."""
    size = min(size, int(ranking.numel()), MAX_PMI_TOKENS)
    if size < 2:
        raise ValueError(f"{caller} needs at least 2 tokens, got size {size}")
    token_ids = ranking[:size]
    opening = answer_opening(store, indices)
    return token_ids, opening, transition_pmi(target_transitions(model, opening, token_ids),
                                              counts[token_ids].float(), floor)


@torch.no_grad()
def target_pmi_init(head, model, store: SequenceStore, indices: list[int], ranking: torch.Tensor,
                    counts: torch.Tensor, size: int, *, floor: float = -3.0, seed: int = 0) -> dict:
    """Write the rank-r factorisation of the target's own adjacent-token PMI among the first
    `size` ranked tokens into `head`'s W1 and W2 rows (see the module docstring). `counts`:
    how often each vocabulary token occurs in the training answers. Returns what it did."""
    token_ids, opening, pmi = _target_pmi(model, store, indices, ranking, counts, size, floor, "target_pmi_init")
    kept = _write_rows(head, token_ids, pmi, seed)
    return {"tokens": int(token_ids.numel()), "opening": opening, "energy_kept": kept}


@torch.no_grad()
def blended_pmi_init(head, model, store: SequenceStore, indices: list[int], ranking: torch.Tensor,
                     counts: torch.Tensor, size: int, *, shrink: float = 2.0, floor: float = -3.0, seed: int = 0,
                     max_len: int | None = None) -> dict:
    """Write the rank-r factorisation of the answers' PMI shrunk toward the target's own
    (`blended_pmi`) among the first `size` ranked tokens into `head`'s W1 and W2 rows.
    `counts`: how often each vocabulary token occurs in the training answers."""
    token_ids, opening, target = _target_pmi(model, store, indices, ranking, counts, size, floor, "blended_pmi_init")
    pairs = pair_counts(store, indices, token_ids, max_len)
    kept = _write_rows(head, token_ids, blended_pmi(pairs, target, shrink), seed)
    return {"tokens": int(token_ids.numel()), "pairs": int(pairs.sum()), "opening": opening, "energy_kept": kept}


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
    kept = _write_rows(head, token_ids, shrunk_pmi(counts, shrink), seed)
    return {"tokens": size, "pairs": int(counts.sum()), "energy_kept": kept}

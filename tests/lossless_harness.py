"""A synthetic, enumerable world for testing lossless speculative decoding.

The target is a fixed random n-gram model over a small vocabulary (8-16
tokens), so the exact distribution of a continuation of n tokens after a fixed
prefix can be enumerated (V ** n cells). Drafters disagree with it on purpose:
`TableDrafter` samples from its own random n-gram table and reports the exact
probabilities it sampled from; `PointMassDrafter` proposes its own table's
argmax (draft_probs None, like prompt lookup). `run_speculative` runs whole
speculative decoding rounds (draft G tokens, choose a verify length, verify,
commit) for many independent sequences at once, vectorised, until each has n
committed tokens; `chi_square` compares the sampled continuations with the
enumerated target distribution.

How a verify-length policy plugs in: pass `choose_len(state: RoundState)`,
returning a [S] int64 tensor (or one int for all sequences) of verify lengths
in 0..G. `RoundState` holds what a real scheduler sees (draft tokens, the
confidences c_k, the committed tokens, a generator for randomised policies)
and, for negative tests only, `peek_target_probs`. S independent sequences
are one big batch; a policy that schedules batches of R requests jointly can
view the S sequences as S // R batches. A stateful policy (one that learns
from realised acceptances) gets them through `observe(state, lens, result)`,
called after every verification.

Typical use (a policy's losslessness test):

    result = lossless_check(my_policy, params=SamplingParams(temperature=0.7))
    assert result.p_value > ALPHA, result
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch
from scipy import stats

from dspark.types import DraftProposal, SamplingParams, VerifyResult
from dspark.verify.reference import reference_target_probs
from dspark.verify.rejection import verify_with_uniforms
from dspark.verify.sampling import SamplingTensors, target_probs

ALPHA = 1e-6  # significance level of every losslessness test: the false-failure probability per test


@dataclass
class NgramTable:
    """Next-token logits as a function of the last `order - 1` tokens."""

    logits: torch.Tensor  # [V ** (order - 1), V] float32
    order: int  # 1 = unigram (no context), 2 = bigram, 3 = trigram

    @property
    def vocab(self) -> int:
        return int(self.logits.shape[-1])

    @property
    def history(self) -> int:
        return self.order - 1

    def next_logits(self, tail: torch.Tensor) -> torch.Tensor:
        """tail [..., >= history] int64 (last tokens, oldest first) -> [..., V]."""
        ids = torch.zeros(tail.shape[:-1], dtype=torch.int64)
        for j in range(self.history):
            ids = ids * self.vocab + tail[..., tail.shape[-1] - self.history + j]
        return self.logits[ids]

    @classmethod
    def random(cls, vocab: int, order: int, seed: int, scale: float = 2.0) -> "NgramTable":
        gen = torch.Generator().manual_seed(seed)
        return cls(torch.randn(vocab ** (order - 1), vocab, generator=gen) * scale, order)

    @classmethod
    def constant(cls, probs: list[float]) -> "NgramTable":
        """A unigram table with the given next-token distribution everywhere."""
        return cls(torch.tensor(probs, dtype=torch.float32).log()[None, :], order=1)


@dataclass
class World:
    """The target, the fixed prefix every sequence continues, and the block size G."""

    target: NgramTable
    prefix: tuple[int, ...]
    block_size: int

    @property
    def vocab(self) -> int:
        return self.target.vocab


def random_world(vocab: int = 8, order: int = 3, block_size: int = 4, seed: int = 0) -> World:
    prefix = tuple(int(t) % vocab for t in (3, 1, 4))
    return World(NgramTable.random(vocab, order, seed), prefix, block_size)


class TableDrafter:
    """Samples draft tokens autoregressively from its own n-gram table, at its
    own temperature and top-k, and reports exactly the distributions used."""

    def __init__(self, table: NgramTable, temperature: float = 1.0, top_k: int = 0) -> None:
        self.table, self.temperature, self.top_k = table, temperature, top_k

    def propose(self, tail: torch.Tensor, block_size: int, gen: torch.Generator) -> DraftProposal:
        """tail [S, h] committed tokens (oldest first) -> proposal of G tokens each."""
        tokens, probs = [], []
        context = tail
        for _ in range(block_size):
            logits = self.table.next_logits(context)  # [S, V]
            p = target_probs(logits, self.temperature, self.top_k, 1.0)
            token = _draw(p, gen)
            tokens.append(token)
            probs.append(p)
            context = torch.cat([context, token[:, None]], dim=1)
        num = tail.shape[0]
        return DraftProposal(
            draft_tokens=torch.stack(tokens, 1),
            num_drafted=torch.full((num,), block_size, dtype=torch.int64),
            draft_probs=torch.stack(probs, 1),
        )


def _draw(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One token per row of probs [S, V]: the number of cumulative masses at or
    below u * total (independent of dspark.verify.sample; faster than
    torch.multinomial here)."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    point = torch.rand(probs.shape[0], 1, generator=gen, dtype=torch.float64) * cdf[:, -1:]
    token = (cdf <= point).sum(-1)
    return torch.minimum(token, (probs > 0).long().cumsum(-1).argmax(-1))  # never past the last positive token


class PointMassDrafter:
    """Proposes its own table's argmax continuation (deterministic, point masses)."""

    def __init__(self, table: NgramTable) -> None:
        self.table = table

    def propose(self, tail: torch.Tensor, block_size: int, gen: torch.Generator) -> DraftProposal:
        tokens = []
        context = tail
        for _ in range(block_size):
            token = self.table.next_logits(context).argmax(-1)
            tokens.append(token)
            context = torch.cat([context, token[:, None]], dim=1)
        num = tail.shape[0]
        return DraftProposal(
            draft_tokens=torch.stack(tokens, 1),
            num_drafted=torch.full((num,), block_size, dtype=torch.int64),
        )


@dataclass
class RoundState:
    """What a verify-length policy sees in one round, for S sequences."""

    round_index: int
    committed: torch.Tensor  # [S, L] int64, prefix + committed tokens, valid up to num_committed (read only)
    num_committed: torch.Tensor  # [S] int64
    active: torch.Tensor  # [S] bool: still short of num_tokens (finished ones run on, uncommitted)
    draft_tokens: torch.Tensor  # [S, G] int64
    draft_probs: torch.Tensor | None  # [S, G, V] float32, None for point-mass drafts
    # c_k = sum_x min(p_draft_k, p_target_k): the true probability that draft k is
    # accepted given 1..k-1 were. It depends on draft tokens 1..k-1 only, like a
    # calibrated confidence head with a Markov feature.
    confidences: torch.Tensor  # [S, G] float32
    generator: torch.Generator  # for randomised policies
    # Oracle: the target distributions at positions 0..G. A lossless policy must
    # not read this; negative tests use it (and draft tokens) to peek.
    peek_target_probs: torch.Tensor  # [S, G + 1, V] float32

    @property
    def num_sequences(self) -> int:
        return int(self.draft_tokens.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.draft_tokens.shape[1])


ChooseLen = Callable[[RoundState], "torch.Tensor | int"]
# Called after each verification with the round's state, verify lengths [S] and result,
# e.g. to feed a stateful policy's commit(); decisions may depend on past rounds freely.
Observe = Callable[[RoundState, torch.Tensor, VerifyResult], None]
VerifyFn = Callable[[DraftProposal, torch.Tensor, torch.Tensor, SamplingTensors, torch.Tensor], VerifyResult]


def random_lengths(state: RoundState) -> torch.Tensor:
    """Uniform verify lengths in 0..G, independent of the drafts (lossless)."""
    return torch.randint(0, state.block_size + 1, (state.num_sequences,), generator=state.generator)


def fixed_length(length: int) -> ChooseLen:
    return lambda state: length


def _confidences(proposal: DraftProposal, tprobs: torch.Tensor) -> torch.Tensor:
    """c_k from the draft and target distributions at position k; [S, G]."""
    target = tprobs[:, :-1]  # [S, G, V]
    if proposal.draft_probs is None:
        return target.gather(-1, proposal.draft_tokens[..., None]).squeeze(-1)
    return torch.minimum(proposal.draft_probs, target).sum(-1)


def _lengths(choose_len: ChooseLen, state: RoundState) -> torch.Tensor:
    lens = choose_len(state)
    lens = torch.full((state.num_sequences,), lens, dtype=torch.int64) if isinstance(lens, int) else lens.long()
    if lens.shape != (state.num_sequences,) or bool((lens < 0).any()) or bool((lens > state.block_size).any()):
        raise ValueError(f"choose_len must return [S] lengths in 0..{state.block_size}")
    return lens


def run_speculative(
    world: World,
    drafter: TableDrafter | PointMassDrafter,
    choose_len: ChooseLen,
    sampling: SamplingTensors,  # S entries, one per sequence
    num_tokens: int,
    seed: int,
    verify_fn: VerifyFn = verify_with_uniforms,
    observe: Observe | None = None,
) -> torch.Tensor:  # [S, num_tokens] int64: the first num_tokens committed tokens
    """Speculative decoding of S independent sequences after world.prefix."""
    num_seqs = int(sampling.temperature.shape[0])
    block, prefix_len = world.block_size, len(world.prefix)
    hist = max(world.target.history, drafter.table.history, 1)  # context columns the models read
    width = prefix_len + num_tokens + block + 2  # the last column absorbs masked writes
    committed = torch.zeros(num_seqs, width, dtype=torch.int64)
    committed[:, :prefix_len] = torch.tensor(world.prefix)
    num_committed = torch.full((num_seqs,), prefix_len, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    round_index = 0
    while bool((num_committed < prefix_len + num_tokens).any()):
        active = num_committed < prefix_len + num_tokens
        tail = committed.gather(1, num_committed[:, None] - hist + torch.arange(hist))  # [S, hist]
        proposal = drafter.propose(tail, block, gen)
        extended = torch.cat([tail, proposal.draft_tokens], dim=1)  # [S, hist + G]
        logits = torch.stack(
            [world.target.next_logits(extended[:, : hist + k]) for k in range(block + 1)], dim=1
        )  # [S, G + 1, V]
        tprobs = target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        state = RoundState(
            round_index, committed, num_committed, active, proposal.draft_tokens, proposal.draft_probs,
            _confidences(proposal, tprobs), gen, tprobs,
        )
        lens = _lengths(choose_len, state)
        uniforms = torch.rand(num_seqs, block + 1, generator=gen, dtype=torch.float64)
        result = verify_fn(proposal, logits, lens, sampling, uniforms)
        if observe is not None:
            observe(state, lens, result)
        slots = torch.arange(block + 1)[None, :]
        write = (slots <= result.num_accepted[:, None]) & active[:, None]
        columns = torch.where(write, num_committed[:, None] + slots, width - 1)
        committed.scatter_(1, columns, result.output_tokens)
        num_committed = torch.where(active, num_committed + result.num_accepted + 1, num_committed)
        round_index += 1
    return committed[:, prefix_len : prefix_len + num_tokens]


def plain_greedy(world: World, num_tokens: int) -> list[int]:
    """Greedy decoding with the target alone (first index on ties)."""
    tokens = list(world.prefix)
    for _ in range(num_tokens):
        tail = torch.tensor(tokens[-max(world.target.history, 1) :])[None, :]
        tokens.append(int(world.target.next_logits(tail)[0].argmax()))
    return tokens[len(world.prefix) :]


def exact_joint(world: World, params: SamplingParams, num_tokens: int) -> torch.Tensor:
    """P(continuation = y_1..y_n) for all V ** n continuations, by enumeration
    with the reference sampling transform; index sum_i y_i V ** (n - i)."""
    vocab, hist = world.vocab, world.target.history
    cache: dict[tuple[int, ...], list[float]] = {}
    joint = torch.zeros(vocab**num_tokens, dtype=torch.float64)
    for index, cont in enumerate(itertools.product(range(vocab), repeat=num_tokens)):
        tokens, prob = list(world.prefix), 1.0
        for token in cont:
            key = tuple(tokens[len(tokens) - hist :]) if hist else ()
            if key not in cache:
                cache[key] = reference_target_probs(world.target.next_logits(torch.tensor(key or (0,))), params)
            prob *= cache[key][token]
            if prob == 0.0:
                break
            tokens.append(token)
        joint[index] = prob
    return joint


def encode(samples: torch.Tensor, vocab: int) -> torch.Tensor:
    """[S, n] continuations -> [S] cell indices (first token most significant)."""
    index = torch.zeros(samples.shape[0], dtype=torch.int64)
    for j in range(samples.shape[1]):
        index = index * vocab + samples[:, j]
    return index


@dataclass
class ChiSquare:
    """Pearson chi-square goodness of fit of sampled continuations."""

    statistic: float
    dof: int
    p_value: float
    num_samples: int
    impossible_observed: int  # samples in cells of target probability 0 (any one fails the test)


def chi_square(samples: torch.Tensor, expected: torch.Tensor, vocab: int, min_expected: float = 5.0) -> ChiSquare:
    """Goodness of fit of samples [S, n] to the exact joint `expected` [V ** n].

    Cells of probability 0 are dropped, but any sample in them gives p = 0.
    Cells with expected count < min_expected are pooled into one cell (merged
    with the smallest regular cell if the pool is itself still too small), so
    the chi-square approximation holds.
    """
    num = int(samples.shape[0])
    observed = torch.bincount(encode(samples, vocab), minlength=expected.numel()).double()
    impossible = int(observed[expected == 0].sum())
    exp_counts = expected[expected > 0] * num
    obs = observed[expected > 0]
    small = exp_counts < min_expected
    big_exp, big_obs = exp_counts[~small], obs[~small]
    pool_exp, pool_obs = float(exp_counts[small].sum()), float(obs[small].sum())
    if 0 < pool_exp < min_expected and big_exp.numel() > 1:
        j = int(big_exp.argmin())
        big_exp[j] += pool_exp
        big_obs[j] += pool_obs
    elif pool_exp > 0:
        big_exp = torch.cat([big_exp, torch.tensor([pool_exp], dtype=torch.float64)])
        big_obs = torch.cat([big_obs, torch.tensor([pool_obs], dtype=torch.float64)])
    statistic = float(((big_obs - big_exp) ** 2 / big_exp).sum())
    dof = int(big_exp.numel()) - 1
    p_value = 0.0 if impossible else float(stats.chi2.sf(statistic, dof))
    return ChiSquare(statistic, dof, p_value, num, impossible)


def lossless_check(
    choose_len: ChooseLen = random_lengths,
    params: SamplingParams = SamplingParams(),
    drafter: str = "table",  # "table" (sampled drafts) or "point" (point-mass drafts)
    num_samples: int = 100_000,
    num_tokens: int = 3,
    seed: int = 0,
    world: World | None = None,
    verify_fn: VerifyFn = verify_with_uniforms,
    observe: Observe | None = None,
) -> ChiSquare:
    """Run speculative decoding under `choose_len` on a random world (V=8,
    trigram target, G=4, disagreeing bigram drafter unless `world` is given)
    and test the continuations against the exact target distribution."""
    world = world or random_world(seed=seed)
    draft_table = NgramTable.random(world.vocab, 2, seed + 1000, scale=2.5)
    chosen = TableDrafter(draft_table) if drafter == "table" else PointMassDrafter(draft_table)
    sampling = SamplingTensors.uniform(num_samples, params.temperature, params.top_k, params.top_p)
    samples = run_speculative(world, chosen, choose_len, sampling, num_tokens, seed, verify_fn, observe)
    return chi_square(samples, exact_joint(world, params, num_tokens), world.vocab)

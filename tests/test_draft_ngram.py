"""The prompt-lookup drafter's confidences: running hit rates of its own lookups, scored
against the committed stream (dspark/draft/ngram.py)."""

from __future__ import annotations

import random

import pytest
import torch

from dspark.draft.ngram import NgramDrafter
from dspark.types import SamplingParams

G = 4


def _feed(drafter, stream: list[int], prompt_len: int, propose_at: set[int] | None = None):
    """Commit `stream` one token per step after a prompt of `prompt_len` tokens, proposing at
    the steps in `propose_at` (None: every step) -> (state, the last proposal)."""
    state = drafter.new_state()
    drafter.observe([state], [torch.tensor(stream[:prompt_len])], None)
    last = None
    for at in range(prompt_len, len(stream)):
        if propose_at is None or at in propose_at or at == len(stream) - 1:
            last = drafter.propose([state], torch.tensor([stream[at]]), [SamplingParams()], [None])
        if at < len(stream) - 1:
            drafter.observe([state], [torch.tensor([stream[at]])], None)
    return state, last


def _noisy_copies(seed: int, length: int, noise: float) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(40) for _ in range(25)]
    return [t if rng.random() > noise else rng.randrange(40) for t in (base * (length // 25 + 1))[:length]]


def test_counts_equal_a_direct_recount_of_the_lookups():
    """Without decay, hits / reached at every (match length, position) is exactly the frequency
    with which the lookup made at each generated position continued the stream, recounted here
    from scratch; a fresh drafter's shared counts are that request's."""
    drafter = NgramDrafter(block_size=G, memory=1e12, shared_memory=1e12)
    stream, prompt_len = _noisy_copies(0, 160, 0.25), 30
    state, proposal = _feed(drafter, stream, prompt_len)
    hits, reached = [[0] * G for _ in range(3)], [[0] * G for _ in range(3)]
    last = len(stream) - 1  # the anchor of the last proposal: its continuation is not known yet
    for at in range(prompt_len, last):
        n, follow = drafter.match(stream[: at + 1])
        if not follow:
            continue
        known = stream[at + 1: min(at + 1 + len(follow), last + 1)]
        matched = 0
        while matched < len(known) and known[matched] == follow[matched]:
            matched += 1
        if matched == len(known) and len(known) < len(follow):
            continue  # still waiting for tokens after the anchor
        for k in range(min(matched + 1, len(follow))):
            reached[n - 1][k] += 1
            hits[n - 1][k] += k < matched
    assert all(reached[n][0] > 10 and 0 < hits[n][0] < reached[n][0] for n in range(3))
    assert hits[2][0] / reached[2][0] > hits[0][0] / reached[0][0]  # longer matches predict better
    for mine, want in ((state.reached, reached), (state.hits, hits), (drafter.shared_reached, reached),
                       (drafter.shared_hits, hits)):
        assert [r for row in mine for r in row] == pytest.approx([r for row in want for r in row])
    a, b, w = *drafter.prior, drafter.shrink
    n, _ = drafter.match(stream)
    shared = [(h + a) / (r + a + b) for h, r in zip(hits[n - 1], reached[n - 1])]
    want = [(h + w * g) / (r + w) for h, r, g in zip(hits[n - 1], reached[n - 1], shared)]
    assert drafter.confidences(state, n) == pytest.approx(want)
    assert proposal.confidences[0].tolist() == pytest.approx(want)


def test_counts_do_not_depend_on_which_steps_drafted():
    """The gate may skip drafting a request for many steps: the skipped positions are looked up
    and scored when it drafts again, so its confidences are those of drafting every step."""
    stream = _noisy_copies(1, 140, 0.2)
    every, last_every = _feed(NgramDrafter(block_size=G), stream, 30)
    some, last_some = _feed(NgramDrafter(block_size=G), stream, 30, propose_at={30, 31, 55, 56, 57, 90, 120})
    for mine, want in ((some.hits, every.hits), (some.reached, every.reached)):
        assert [x for row in mine for x in row] == pytest.approx([x for row in want for x in row])
    assert torch.equal(last_some.confidences, last_every.confidences)
    assert torch.equal(last_some.draft_tokens, last_every.draft_tokens)


def test_confidences_follow_how_well_lookups_predict():
    _, copying = _feed(NgramDrafter(block_size=G), _noisy_copies(2, 150, 0.0), 30)
    _, noisy = _feed(NgramDrafter(block_size=G), _noisy_copies(2, 150, 0.6), 30)
    assert copying.confidences[0].min() > 0.9 and int(copying.num_drafted[0]) == G
    assert noisy.confidences[0, 0] < 0.4
    fresh = NgramDrafter(block_size=G)
    state = fresh.new_state()
    fresh.observe([state], [torch.tensor([5, 6, 7])], None)
    first = fresh.propose([state], torch.tensor([6]), [SamplingParams()], [None])
    assert first.draft_tokens[0, :2].tolist() == [7, 6] and int(first.num_drafted[0]) == 2
    assert first.confidences[0].tolist() == pytest.approx([1 / 3] * G)  # the Beta(1, 2) prior
    none = fresh.propose([fresh.new_state()], torch.tensor([5]), [SamplingParams()], [None])
    assert int(none.num_drafted[0]) == 0 and none.confidences[0].tolist() == [0.0] * G


def test_a_new_request_starts_from_what_earlier_requests_showed():
    """The shared counts carry what the drafter has seen into a request with no history."""
    drafter = NgramDrafter(block_size=G)
    _feed(drafter, _noisy_copies(3, 200, 0.0), 30)  # an earlier request that copied perfectly
    state = drafter.new_state()
    drafter.observe([state], [torch.tensor([9, 8, 7, 6, 9, 8])], None)
    proposal = drafter.propose([state], torch.tensor([7]), [SamplingParams()], [None])  # a 3-gram match
    assert proposal.draft_tokens[0].tolist() == [6, 9, 8, 7]
    assert proposal.confidences[0].min() > 0.8
    assert NgramDrafter(block_size=G).confidences(state, 3) == pytest.approx([1 / 3] * G)  # without them


def test_prompt_tokens_are_not_scored_and_truncation_forgets():
    drafter = NgramDrafter(block_size=G)
    state = drafter.new_state()
    drafter.observe([state], [torch.tensor([1, 2, 3] * 200)], None)  # a long, perfectly copyable prompt
    drafter.propose([state], torch.tensor([1]), [SamplingParams()], [None])
    assert state.reached == [[0.0] * G] * 3  # only the anchor's lookup is queued, nothing is scored yet
    drafter.observe([state], [torch.tensor([1, 2, 3, 1])], None)
    drafter.propose([state], torch.tensor([2]), [SamplingParams()], [None])
    assert state.reached[2][0] > 0 and state.hits[2][0] == state.reached[2][0]
    drafter.truncate(state, 600)
    assert state.scored == 600 and all(at < 600 for at, _ in state.pending)


def test_bad_estimator_settings_are_refused():
    with pytest.raises(ValueError, match="prior_hits > 0"):
        NgramDrafter(prior_hits=0)
    with pytest.raises(ValueError, match="memory >= 1"):
        NgramDrafter(memory=0.5)
    with pytest.raises(ValueError, match="shrink > 0"):
        NgramDrafter(shrink=0)

"""Lossless verification of draft tokens by rejection sampling (paper 2.1).

For request r with verify length l (the scheduler's choice, 0..num_drafted),
draft tokens x_1..x_l, draft distributions p_draft_k and target distributions
p_target_k (target logits after the request's sampling transform):

    for k = 1..l: accept x_k with probability min(1, p_target_k(x_k) / p_draft_k(x_k));
                  at the first rejection, commit a *recovered* token drawn from
                  normalize(max(0, p_target_k - p_draft_k)) and stop;
    if all l are accepted, commit a *bonus* token drawn from p_target_{l+1}.

Point-mass drafts (`draft_probs is None`, e.g. prompt lookup) are the special
case p_draft_k = one-hot(x_k): accept with probability p_target_k(x_k), and the
residual is p_target_k with x_k removed. Temperature 0 makes p_target a one-hot
on the argmax, so the same rule accepts exactly while x_k == argmax and commits
the argmax; greedy requests consume no randomness.

Zero residual mass: sum_x max(0, p_target - p_draft) equals the total variation
distance between the two distributions, which is also the rejection
probability. So a rejection with zero residual mass has probability zero in
exact arithmetic; it can only come from float rounding (or a drafter that
broke its contract by reporting p_draft(x_k) = 0 for the token it drew). Then
the recovered token is drawn from p_target, which changes the output
distribution by at most that O(rounding) probability.

Randomness, in a fixed order so a seed reproduces: each non-greedy request r
draws `torch.rand(G + 1, dtype=float64, generator=generators[r])` once per
round (after its drafter's draws); entry k - 1 is the acceptance uniform of
position k (accept iff u < acceptance probability) and entry G is the uniform
of the recovered/bonus token, sampled by inverse CDF (`sampling.sample`).
`verify_with_uniforms` takes those uniforms explicitly, which is what the
reference (`reference.py`) and the tests use to check decisions one by one.
"""

from __future__ import annotations

import torch

from dspark.types import DraftProposal, SamplingParams, VerifyResult
from dspark.verify.sampling import SamplingTensors, sample, target_probs

GREEDY_UNIFORM = 0.5  # stands in for the uniforms of greedy requests (never drawn)


def verify(
    proposal: DraftProposal,
    target_logits: torch.Tensor,  # [R, G + 1, V]; row k valid for k = 0..verify_lens[r]
    verify_lens: torch.Tensor,  # [R] int64, 0..num_drafted[r]
    params: list[SamplingParams],  # R entries
    generators: list[torch.Generator],  # R entries, one per request
    draw_block_size: int | None = None,
) -> VerifyResult:
    """Verify each request's first verify_lens[r] draft tokens against the target.

    draw_block_size: the drafter's block size when `proposal` was cut to the step's longest
    verify length (the engine does, so that a step that verifies nothing does not pad its
    logits to G + 1 rows). Each request still draws uniforms for the whole block, so its
    generator advances the same way whatever else shares the step."""
    num_requests = proposal.num_requests
    if len(params) != num_requests or len(generators) != num_requests:
        raise ValueError(
            f"verify needs one SamplingParams and one generator per request: got {len(params)} "
            f"and {len(generators)} for {num_requests} requests"
        )
    sampling = SamplingTensors.from_params(params, device=target_logits.device)
    if all(p.greedy for p in params):
        return verify_greedy(proposal, target_logits, verify_lens)
    greedy = [p.greedy for p in params]
    g = proposal.block_size
    full = g if draw_block_size is None else draw_block_size
    if full < g:
        raise ValueError(f"draw_block_size {full} is smaller than the proposal's block size {g}")
    uniforms = draw_uniforms(generators, greedy, full, target_logits.device)
    if full > g:  # acceptance uniforms of the verified positions, then the final-token uniform
        uniforms = torch.cat([uniforms[:, :g], uniforms[:, -1:]], dim=1)
    return verify_with_uniforms(proposal, target_logits, verify_lens, sampling, uniforms)


def draw_uniforms(
    generators: list[torch.Generator],  # R entries
    greedy: list[bool],  # R entries; greedy requests draw nothing
    block_size: int,  # G
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # [R, G + 1] float64
    """Each non-greedy request's uniforms for one round, in request order."""
    rows = []
    for gen, is_greedy in zip(generators, greedy, strict=True):
        if is_greedy:
            rows.append(torch.full((block_size + 1,), GREEDY_UNIFORM, dtype=torch.float64, device=device))
        else:
            u = torch.rand(block_size + 1, generator=gen, dtype=torch.float64, device=gen.device)
            rows.append(u.to(device))
    if not rows:
        return torch.empty(0, block_size + 1, dtype=torch.float64, device=device)
    return torch.stack(rows)


def verify_greedy(
    proposal: DraftProposal,
    target_logits: torch.Tensor,  # [R, G + 1, V]
    verify_lens: torch.Tensor,  # [R] int64
) -> VerifyResult:
    """Exact greedy verification: accept while the draft token is the target
    argmax (first index on ties), then commit the argmax. No randomness."""
    lens = _check_inputs(proposal, target_logits, verify_lens)
    draft_tokens = proposal.draft_tokens.to(target_logits.device)
    argmax = target_logits.argmax(-1)  # [R, G + 1]
    valid_draft = _positions(proposal.block_size, target_logits.device) < lens[:, None]  # [R, G]
    matches = (draft_tokens == argmax[:, :-1]) & valid_draft
    num_accepted = matches.long().cumprod(1).sum(1)
    final_tokens = argmax.gather(1, num_accepted[:, None]).squeeze(1)
    return _result(draft_tokens, num_accepted, final_tokens)


def verify_with_uniforms(
    proposal: DraftProposal,
    target_logits: torch.Tensor,  # [R, G + 1, V]
    verify_lens: torch.Tensor,  # [R] int64
    sampling: SamplingTensors,  # R entries
    uniforms: torch.Tensor,  # [R, G + 1] in [0, 1): G acceptance uniforms, then the final-token uniform
) -> VerifyResult:
    """The verification rule on explicit uniforms, vectorised over R x G."""
    lens = _check_inputs(proposal, target_logits, verify_lens)
    device = target_logits.device
    num_requests, block_size = proposal.draft_tokens.shape
    if uniforms.shape != (num_requests, block_size + 1):
        raise ValueError(f"uniforms must be [R, G + 1] = [{num_requests}, {block_size + 1}], got {tuple(uniforms.shape)}")
    uniforms = uniforms.to(device)
    draft_tokens = proposal.draft_tokens.to(device)

    # Target distributions only for the rows that are verified (k <= l).
    counts = lens + 1
    offsets = torch.cumsum(counts, 0) - counts  # [R] first flattened row of each request
    valid_rows = _positions(block_size + 1, device) <= lens[:, None]  # [R, G + 1]
    per_row = sampling.repeat_interleave(counts.to(sampling.temperature.device))
    verified_logits = target_logits.flatten(0, 1) if bool(valid_rows.all()) else target_logits[valid_rows]
    flat_probs = target_probs(
        verified_logits, per_row.temperature.to(device), per_row.top_k.to(device), per_row.top_p.to(device)
    )  # [M, V]

    valid_draft = _positions(block_size, device) < lens[:, None]  # [R, G]
    req, pos = valid_draft.nonzero(as_tuple=True)
    target_at_draft = torch.zeros(num_requests, block_size, dtype=torch.float32, device=device)
    target_at_draft[req, pos] = flat_probs[offsets[req] + pos, draft_tokens[req, pos]]
    if proposal.draft_probs is None:
        draft_at_draft = torch.ones_like(target_at_draft)
    else:
        draft_probs = proposal.draft_probs.to(device)
        draft_at_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1).float()
    # p_draft = 0 for a drawn token breaks the drafter's contract: inf -> accept if p_target > 0, nan -> reject.
    accept_prob = (target_at_draft / draft_at_draft).clamp(max=1.0)
    accepted = (uniforms[:, :block_size] < accept_prob) & valid_draft
    num_accepted = accepted.long().cumprod(1).sum(1)  # [R]

    final_probs = flat_probs[offsets + num_accepted]  # [R, V] p_target at the first unaccepted position
    rejected = num_accepted < lens
    residual = _residual(proposal, draft_tokens, final_probs, num_accepted, rejected)
    final_tokens = sample(residual, uniforms[:, block_size])
    return _result(draft_tokens, num_accepted, final_tokens)


def _residual(
    proposal: DraftProposal,
    draft_tokens: torch.Tensor,  # [R, G]
    final_probs: torch.Tensor,  # [R, V]
    num_accepted: torch.Tensor,  # [R]
    rejected: torch.Tensor,  # [R] bool
) -> torch.Tensor:  # [R, V] unnormalised weights to sample the recovered/bonus token from
    """max(0, p_target - p_draft) at the rejected position; p_target elsewhere
    (bonus) and where the residual has no mass (see the module docstring)."""
    if proposal.block_size == 0:
        return final_probs
    pos = num_accepted.clamp(max=proposal.block_size - 1)[:, None]  # [R, 1]
    if proposal.draft_probs is None:
        residual = final_probs.scatter(1, draft_tokens.gather(1, pos), 0.0)
    else:
        rows = torch.arange(final_probs.shape[0], device=final_probs.device)
        draft_row = proposal.draft_probs.to(final_probs.device)[rows, pos.squeeze(1)].float()  # [R, V]
        residual = (final_probs - draft_row).clamp(min=0.0)
    use = rejected & (residual.sum(-1) > 0)
    return torch.where(use[:, None], residual, final_probs)


def _result(
    draft_tokens: torch.Tensor,  # [R, G]
    num_accepted: torch.Tensor,  # [R]
    final_tokens: torch.Tensor,  # [R]
) -> VerifyResult:
    """Accepted drafts, then the recovered/bonus token, -1 padded to G + 1."""
    num_requests, block_size = draft_tokens.shape
    slots = _positions(block_size + 1, draft_tokens.device)  # [G + 1]
    padded = torch.cat([draft_tokens, draft_tokens.new_zeros(num_requests, 1)], dim=1)
    out = torch.where(slots < num_accepted[:, None], padded, torch.full_like(padded, -1))
    out = torch.where(slots == num_accepted[:, None], final_tokens[:, None], out)
    return VerifyResult(num_accepted=num_accepted, output_tokens=out)


def _positions(n: int, device: torch.device | str) -> torch.Tensor:
    return torch.arange(n, device=device)[None, :]


def _check_inputs(
    proposal: DraftProposal,
    target_logits: torch.Tensor,  # [R, G + 1, V]
    verify_lens: torch.Tensor,  # [R]
) -> torch.Tensor:  # [R] int64 verify lengths on the logits' device
    num_requests, block_size = proposal.draft_tokens.shape
    if target_logits.dim() != 3 or tuple(target_logits.shape[:2]) != (num_requests, block_size + 1):
        raise ValueError(
            f"target_logits must be [R, G + 1, V] with R={num_requests}, G={block_size}; "
            f"got {tuple(target_logits.shape)}"
        )
    vocab = target_logits.shape[-1]
    if proposal.draft_probs is not None and tuple(proposal.draft_probs.shape) != (num_requests, block_size, vocab):
        raise ValueError(
            f"draft_probs must be [R, G, V] = [{num_requests}, {block_size}, {vocab}], "
            f"got {tuple(proposal.draft_probs.shape)}"
        )
    if tuple(verify_lens.shape) != (num_requests,):
        raise ValueError(f"verify_lens must be [R] = [{num_requests}], got {tuple(verify_lens.shape)}")
    lens_cpu = verify_lens.cpu().long()
    drafted = proposal.num_drafted.cpu().long()
    if bool((lens_cpu < 0).any()) or bool((lens_cpu > drafted).any()) or bool((drafted > block_size).any()):
        raise ValueError(
            f"verify lengths must satisfy 0 <= verify_len <= num_drafted <= G={block_size}; "
            f"got verify_lens={lens_cpu.tolist()} num_drafted={drafted.tolist()}"
        )
    return verify_lens.to(device=target_logits.device, dtype=torch.int64)

"""Lay one step out as a single ragged target forward (paper section 5.3).

Each running request contributes one *segment* of consecutive tokens: a
prefill chunk, or a decoding round's anchor plus its scheduled draft prefix.
Segments that end in sampling (decode rounds, and the last prefill chunk of a
request that has no output yet) are *verify entries*: the verifier sees their
logits as rows of a padded [E, W, V] tensor, W = 1 + the step's longest
verify length (at most G + 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dspark.draft.base import spread_proposal
from dspark.engine.batcher import StepPlan
from dspark.engine.request import Request
from dspark.types import DraftProposal, RaggedBatch


@dataclass
class Segment:
    kind: str  # "prefill" | "decode"
    request: Request
    start_pos: int  # position of the segment's first token (cache length before the step)
    length: int  # tokens in the ragged batch
    row_start: int  # index of the first token in the flattened batch
    entry_index: int | None  # row of the verify tensors, or None (prefill that samples nothing)
    verify_len: int = 0


@dataclass
class StepBatch:
    """E verify entries, G block size, N flattened tokens, M logits rows."""

    ragged: RaggedBatch
    segments: list[Segment]
    entries: list[Segment]
    proposal: DraftProposal  # [E, G] rows aligned with entries
    verify_lens: torch.Tensor  # [E] int64
    logits_rows: torch.Tensor  # [M] int64 rows of the flattened batch whose logits we need
    block_size: int

    @property
    def verify_width(self) -> int:
        """W = 1 + the longest verify length of this step (1 when nothing is verified)."""
        return 1 + (int(self.verify_lens.max()) if self.verify_lens.numel() else 0)

    def verify_proposal(self) -> DraftProposal:
        """The proposal cut to W - 1 draft positions (views, no copies): the verifier then
        works on [E, W, V] instead of [E, G + 1, V] (a gated step that verifies nothing
        would otherwise pad and scan G + 1 vocabulary rows per request)."""
        w, p = self.verify_width - 1, self.proposal
        if w >= p.block_size:
            return p
        return DraftProposal(
            draft_tokens=p.draft_tokens[:, :w],
            num_drafted=p.num_drafted.clamp(max=w),
            draft_probs=None if p.draft_probs is None else p.draft_probs[:, :w],
            confidences=None if p.confidences is None else p.confidences[:, :w],
        )

    def scatter_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """[M, V] logits -> [E, W, V], zero padded past each verify length (a view, no copy,
        when every entry has W rows, as in every step that verifies nothing)."""
        width = self.verify_width
        if logits.shape[0] == len(self.entries) * width:  # each entry has at most W rows: all have W
            return logits.view(len(self.entries), width, logits.shape[-1])
        out = logits.new_zeros(len(self.entries), width, logits.shape[-1])
        row = 0
        for e, seg in enumerate(self.entries):
            n = seg.verify_len + 1
            out[e, :n] = logits[row : row + n]
            row += n
        return out


def build_step_batch(
    plan: StepPlan, proposal: DraftProposal, verify_lens: list[int], block_size: int
) -> StepBatch:
    tokens: list[int] = []
    segments: list[Segment] = []
    logits_rows: list[int] = []
    entry_rows: list[tuple[str, int]] = []  # ("empty", -) or ("draft", decode index)
    for req, chunk in plan.prefill:
        start = req.num_computed
        samples = start + chunk == req.prefill_target and not req.output_ids
        seg = Segment("prefill", req, start, chunk, len(tokens), len(entry_rows) if samples else None)
        tokens.extend(req.all_ids[start : start + chunk])
        if samples:
            logits_rows.append(len(tokens) - 1)
            entry_rows.append(("empty", -1))
        segments.append(seg)
    drafted = proposal.draft_tokens.tolist() if plan.decode else []  # one copy (from a GPU: one sync)
    for i, req in enumerate(plan.decode):
        l = verify_lens[i]
        seg = Segment("decode", req, req.num_computed, l + 1, len(tokens), len(entry_rows), l)
        tokens.append(req.anchor)
        tokens.extend(drafted[i][:l])
        logits_rows.extend(range(seg.row_start, seg.row_start + l + 1))
        entry_rows.append(("draft", i))
        segments.append(seg)
    ragged = RaggedBatch(
        token_ids=torch.tensor(tokens, dtype=torch.int64),
        slots=[s.request.slot for s in segments],
        query_lens=[s.length for s in segments],
    )
    entries = [s for s in segments if s.entry_index is not None]
    return StepBatch(
        ragged=ragged,
        segments=segments,
        entries=entries,
        proposal=_entry_proposal(proposal, entry_rows, block_size),
        verify_lens=torch.tensor([s.verify_len for s in entries], dtype=torch.int64),
        logits_rows=torch.tensor(logits_rows, dtype=torch.int64),
        block_size=block_size,
    )


def _entry_proposal(proposal: DraftProposal, entry_rows: list[tuple[str, int]], block_size: int) -> DraftProposal:
    """The decode proposal re-indexed by verify entry; first-token entries get empty rows.
    Decode entries come after the prefill ones, in decode order, so decode row i lands on
    the i-th "draft" entry."""
    if all(kind == "draft" for kind, _ in entry_rows):
        return proposal
    rows = [e for e, (kind, _) in enumerate(entry_rows) if kind == "draft"]
    assert [i for kind, i in entry_rows if kind == "draft"] == list(range(len(rows))), "decode rows out of order"
    return spread_proposal(proposal, rows, len(entry_rows))

"""The continuous-batching speculative engine.

`Engine.step()` reads as the four stages of dspark:

    draft  ->  schedule  ->  verify  ->  commit

Requests join (`add_request`) and leave (finish, `abort`) between any two
steps. Prefill is chunked and rides in the same ragged target forward as the
decoding requests' verification.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from dataclasses import dataclass

import torch

from dspark.draft.base import Drafter, empty_proposal, spread_proposal
from dspark.engine.batcher import Batcher, BatchLimits, StepPlan
from dspark.engine.forward import StepBatch, build_step_batch
from dspark.engine.request import Request, Status
from dspark.errors import UserError
from dspark.schedule import ScheduleOutcome, ScheduleRequest, StepTiming, VerifyPolicy, expected_accepted
from dspark.types import DraftProposal, SamplingParams, VerifyResult
from dspark.verify import verify


@dataclass(frozen=True)
class EngineConfig:
    max_running: int = 32  # requests decoding at once (KV slots)
    max_seq_len: int = 2048  # prompt + output tokens per request
    kv_budget_tokens: int = 65536  # KV tokens across all requests
    max_prefill_tokens: int = 512  # prompt tokens computed per step

    def __post_init__(self) -> None:
        for name in ("max_running", "max_seq_len", "kv_budget_tokens", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise UserError(f"engine setting {name} must be >= 1, got {getattr(self, name)}")


@dataclass
class StepOutput:
    """What one request got from one step (for streaming)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class Engine:
    def __init__(
        self,
        target,
        drafter: Drafter,
        policy: VerifyPolicy,
        config: EngineConfig = EngineConfig(),
        *,
        tokenizer=None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        from dspark.models.kv_cache import KVCache

        self.target = target
        self.drafter = drafter
        self.policy = policy
        self.config = config
        self.tokenizer = tokenizer
        self.eos_ids = set(target.config.eos_token_ids)
        max_seq = min(config.max_seq_len, target.config.max_position_embeddings)
        self.max_seq_len = max_seq
        weight = next(target.parameters())
        self.kv = KVCache(target.config, config.max_running, max_seq, kv_dtype or weight.dtype, device=weight.device)
        limits = BatchLimits(
            max_running=config.max_running,
            kv_budget_tokens=config.kv_budget_tokens,
            max_prefill_tokens=config.max_prefill_tokens,
            step_reserve=drafter.block_size + 1,
        )
        self.batcher = Batcher(limits, self.kv)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_full_drafts = 0  # steps with decoding requests where every one of them drafted
        self.num_partial_drafts = 0  # ... where the policy drafted only some of them
        self.num_draft_skips = 0  # ... where it drafted none (a plain decode step)
        self._projected_rows = 0  # pending context rows of the requests drafted in the last step
        self._proposed = False  # whether the last step ran the drafter's propose
        self.step_seconds = 0.0
        # the last step's kind (STEP_KINDS) and target positions forwarded, for the serving metrics
        self.last_step_kind: str | None = None
        self.last_step_positions = 0
        # the last step's target forward (up to its logits' first host read), in seconds: a step's time
        # outside it is batching, drafting, scheduling, verification and commit (on a GPU a step that
        # samples nothing, a prompt's middle chunk, reads no logits: its time is the forward's launch)
        self.last_forward_seconds = 0.0

    # ------------------------------------------------------------------ API
    def add_request(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        if not prompt_ids:
            raise UserError("the prompt is empty: give at least one token of text")
        if len(prompt_ids) + 1 > self.max_seq_len:
            raise UserError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.max_seq_len}: "
                "shorten the prompt or raise max_seq_len"
            )
        vocab = self.target.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise UserError(f"prompt token ids must be in [0, {vocab})")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.requests:
            raise UserError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        req = Request(
            request_id=rid,
            prompt_ids=list(prompt_ids),
            params=params,
            generator=torch.Generator().manual_seed(seed),
            block_size=self.drafter.block_size,
        )
        self.requests[rid] = req
        self.batcher.add(req)
        return rid

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._finish(req, "abort")

    def has_work(self) -> bool:
        return self.batcher.has_work()

    def pop_finished(self, request_id: str) -> Request:
        return self.requests.pop(request_id)

    # ----------------------------------------------------------------- step
    def step(self) -> list[StepOutput]:
        start = time.perf_counter()
        plan = self.batcher.plan(self.drafter.new_state, self._release)
        if plan.empty:
            return []
        self._proposed = False
        drafts, rows = self._draft(plan.decode)
        verify_lens = self._schedule(plan.decode, drafts, rows)
        proposal = _lay_out(drafts, rows, len(plan.decode), max(verify_lens, default=0))
        batch = build_step_batch(plan, proposal, verify_lens, self.drafter.block_size)
        result, hidden = self._verify(batch)
        outputs = self._commit(plan, batch, result, hidden)
        seconds = time.perf_counter() - start
        self.num_steps += 1
        self.step_seconds += seconds
        self.last_step_kind = "prefill" if plan.prefill else ("drafted" if self._proposed else "plain")
        self.last_step_positions = sum(n for _, n in plan.prefill) + len(plan.decode) + sum(verify_lens)
        self._report_timing(plan, drafts, verify_lens, seconds)
        return outputs

    def _report_timing(self, plan: StepPlan, drafts: DraftProposal, verify_lens: list[int], seconds: float) -> None:
        """Tell a policy that prices steps (`observe_step`) what a decode-only step cost
        (`drafts`: the step's proposal before `_lay_out`, its rows the requests that drafted)."""
        observe = getattr(self.policy, "observe_step", None)
        if observe is None or plan.prefill or not plan.decode:
            return
        # a plain step (nobody proposed) reads no tensor: most steps at high load are plain
        drafted = int((drafts.num_drafted > 0).sum()) if self._proposed else 0
        projected = self._projected_rows if drafted else 0
        observe(StepTiming(len(plan.decode), drafted, len(plan.decode) + sum(verify_lens), seconds, projected))

    # --------------------------------------------------------------- stages
    def _draft(self, decoding: list[Request]) -> tuple[DraftProposal, list[int] | None]:
        """The proposal for the requests the policy drafts, and their indices in `decoding`
        (None: the proposal covers every request, or none drafted and it is empty)."""
        if not decoding:
            return DraftProposal(
                draft_tokens=torch.zeros(0, self.drafter.block_size, dtype=torch.int64),
                num_drafted=torch.zeros(0, dtype=torch.int64),
            ), None
        rows = self._rows_to_draft(decoding)
        if not rows:
            self.num_draft_skips += 1  # a plain decode step: the policy saw no gain in drafting
            return empty_proposal(len(decoding), self.drafter.block_size), None
        drafting = [decoding[i] for i in rows]
        self._proposed = True
        anchors = torch.tensor([r.anchor for r in drafting], dtype=torch.int64)
        proposal = self.drafter.propose(
            [r.draft_state for r in drafting], anchors, [r.params for r in drafting],
            [r.generator for r in drafting],
        )
        # never draft past the request's token or context limit (one tensor op, no host read)
        room = torch.tensor([max(min(r.remaining_tokens - 1, self.max_seq_len - len(r.all_ids)), 0) for r in drafting],
                            dtype=proposal.num_drafted.dtype, device=proposal.num_drafted.device)
        proposal.num_drafted = torch.minimum(proposal.num_drafted, room)
        if len(rows) < len(decoding):
            self.num_partial_drafts += 1  # the others decode plainly this step
            return proposal, rows
        self.num_full_drafts += 1
        return proposal, None

    def _rows_to_draft(self, decoding: list[Request]) -> list[int]:
        """Indices of the requests the policy drafts this step (all when it has no say). A policy's
        `choose_drafts(request_ids, pending_rows)` also learns the context rows each request's
        propose would process first (`Drafter.pending_rows`), so it can price them."""
        pending = [self.drafter.pending_rows(r.draft_state) for r in decoding]
        choose = getattr(self.policy, "choose_drafts", None)
        if choose is None:
            self._projected_rows = sum(pending)
            return list(range(len(decoding)))
        chosen = list(choose([r.request_id for r in decoding], pending))
        if len(chosen) != len(decoding):
            raise RuntimeError(f"policy {self.policy.name!r} chose drafts for {len(chosen)} of {len(decoding)} requests")
        rows = [i for i, draft in enumerate(chosen) if draft]
        self._projected_rows = sum(pending[i] for i in rows)
        return rows

    def _schedule(self, decoding: list[Request], drafts: DraftProposal, rows: list[int] | None) -> list[int]:
        """Verify lengths for `decoding` from the proposal of its requests `rows` (None: all)."""
        if not decoding:
            return []
        drafted, confidences = [0] * len(decoding), [None] * len(decoding)
        # nobody proposed (a plain step): no tensor to read
        conf = None if drafts.confidences is None or not self._proposed else drafts.confidences.tolist()
        num = drafts.num_drafted.tolist() if self._proposed else []
        where = range(len(num)) if rows is None else rows  # decoding index of each proposal row
        for k, i in enumerate(where):
            drafted[i] = num[k]
            # None for a request that did not draft this step: unknown, not "no tokens survive"
            confidences[i] = None if conf is None or num[k] == 0 else conf[k][: num[k]]
        requests = [
            ScheduleRequest(request_id=req.request_id, num_drafted=drafted[i], confidences=confidences[i])
            for i, req in enumerate(decoding)
        ]
        lens = self.policy.decide(requests)
        return [max(0, min(int(l), s.num_drafted)) for l, s in zip(lens, requests)]

    def _verify(self, batch: StepBatch) -> tuple[VerifyResult | None, torch.Tensor | None]:
        start = time.perf_counter()
        out = self.target.forward(
            batch.ragged, self.kv, logits_rows=batch.logits_rows, tap_layers=self.drafter.tap_layers
        )
        if not batch.entries:
            self.last_forward_seconds = time.perf_counter() - start
            return None, out.tapped_hidden
        # one float32 sum instead of an elementwise isfinite (3.3 ms a step at 16 requests on a
        # 49k vocabulary, 0.1 ms for the sum): it is NaN or infinite iff a logit is, or iff the
        # logits are so large (>1e33) that they overflow float32, which is no less broken
        finite = bool(torch.isfinite(out.logits.sum(dtype=torch.float32)))  # a host read: the forward is done
        self.last_forward_seconds = time.perf_counter() - start
        if not finite:
            raise RuntimeError("the target produced non-finite logits; check the model weights and dtype")
        target_logits = batch.scatter_logits(out.logits)  # [E, W, V]
        entries = batch.entries
        result = verify(
            batch.verify_proposal(), target_logits, batch.verify_lens,
            [e.request.params for e in entries], [e.request.generator for e in entries],
            draw_block_size=batch.proposal.block_size,
        )
        return result, out.tapped_hidden

    def _commit(self, plan: StepPlan, batch: StepBatch, result, hidden) -> list[StepOutput]:
        states, tokens, taps, outcomes = [], [], [], []
        to_append: list[tuple[Request, list[int]]] = []
        # the verifier's outcome and the drafts' confidences read once for the whole step
        accepted, committed_rows = result.on_host() if result is not None else ([], [])
        predictions = self._predictions(batch)
        for seg in batch.segments:
            req = seg.request
            if seg.kind == "prefill":
                observed = req.all_ids[seg.start_pos : seg.start_pos + seg.length]
                req.num_computed += seg.length
                if seg.entry_index is not None:  # prompt done: its last row sampled a first token
                    to_append.append((req, committed_rows[seg.entry_index]))
            else:
                e = seg.entry_index
                num_accepted, committed = accepted[e], committed_rows[e]
                kept = num_accepted + 1  # the anchor and the accepted drafts keep their KV
                self.kv.truncate(req.slot, seg.start_pos + kept)
                req.num_computed = seg.start_pos + kept
                observed = [req.anchor] + committed[:num_accepted]
                req.stats.record(seg.verify_len, num_accepted, predictions(e, seg.verify_len))
                outcomes.append(ScheduleOutcome(req.request_id, seg.verify_len, num_accepted))
                to_append.append((req, committed))
            states.append(req.draft_state)
            tokens.append(torch.tensor(observed, dtype=torch.int64))
            if hidden is not None:
                taps.append(hidden[seg.row_start : seg.row_start + len(observed)])
        self.drafter.observe(states, tokens, taps if hidden is not None else None)
        if outcomes:
            self.policy.commit(outcomes)
        return [self._append(req, committed) for req, committed in to_append]

    @staticmethod
    def _predictions(batch: StepBatch):
        """entry, verify_len -> the accepted drafts the confidences predicted (None: nothing
        drafted, no prediction to compare), from one host copy of the step's confidences."""
        conf = batch.proposal.confidences
        if conf is None:
            return lambda entry, verify_len: None
        conf, drafted = conf.tolist(), batch.proposal.num_drafted.tolist()
        return lambda entry, verify_len: expected_accepted(conf[entry], verify_len) if drafted[entry] else None

    # ------------------------------------------------------------- helpers
    def _append(self, req: Request, committed: list[int]) -> StepOutput:
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        new: list[int] = []
        reason = None
        for tok in committed:
            if tok in self.eos_ids and not req.params.ignore_eos:
                reason = "stop"
                break
            new.append(tok)
            if len(req.output_ids) + len(new) >= req.params.max_new_tokens:
                reason = "length"
                break
        req.output_ids.extend(new)
        if reason is None and req.params.stop and self._hit_stop(req):
            reason = "stop"
        if reason is None and len(req.all_ids) >= self.max_seq_len:
            reason = "length"
        if reason is not None:
            self._finish(req, reason)
        return StepOutput(req.request_id, new, req.finished, req.finish_reason)

    def _hit_stop(self, req: Request) -> bool:
        if self.tokenizer is None:
            return False
        longest = max(len(s) for s in req.params.stop)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 8) :], skip_special_tokens=True)
        return any(s in tail for s in req.params.stop)

    def _release(self, req: Request) -> None:
        if req.slot is not None:
            self.kv.free(req.slot)
            req.slot = None
        if req.draft_state is not None:
            self.drafter.release(req.draft_state)
            req.draft_state = None
        req.num_computed = 0

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        self.batcher.finish(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()


def _lay_out(drafts: DraftProposal, rows: list[int] | None, num_requests: int, width: int) -> DraftProposal:
    """The step's proposal over all `num_requests` decoding requests, from the proposal of the
    requests `rows` (None: it already covers all of them), with `draft_probs` cut to the step's
    longest verify length `width` first: a draft distribution past it is never read, and
    spreading [R', G, V] float32 over the batch (88 MB at 64 requests on a 49k vocabulary) made
    a step that drafted a quarter of its requests 30 ms slower (docs/LOAD.md, run AA)."""
    if drafts.draft_probs is not None and width < drafts.block_size:
        drafts = dataclasses.replace(drafts, draft_probs=drafts.draft_probs[:, :width])
    return drafts if rows is None else spread_proposal(drafts, rows, num_requests)

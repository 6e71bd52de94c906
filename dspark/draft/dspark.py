"""The DSpark drafter (paper section 3.1 and 3.2.1): the parallel backbone,
an optional sequential head over its base logits and an optional confidence
head. DFlash is this class with no sequential head and no confidence head.

One round for R requests: the backbone runs once over [anchor, mask x G-1]
per request (one pass, G hidden states h_k), the LM head gives base logits
U_k, the sequential loop samples x_1..x_G left to right from
p_k = softmax((U_k + B_k) / T), and the confidence head scores each x_k
given x_{k-1} (eq. 7), calibrated per position by STS temperatures.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from dspark.draft.backbone import ParallelBackbone, SharedVocab, block_train_mask
from dspark.draft.base import DraftTrainOutput, TrainableDrafter, empty_proposal
from dspark.draft.blocks import ContextKV
from dspark.draft.config import DSparkConfig
from dspark.draft.heads import ConfidenceHead, build_markov_head
from dspark.draft.sampling import draw_uniforms, sample_parallel, sample_sequential
from dspark.draft.vocab import DraftVocabMixin
from dspark.models.config import TargetConfig
from dspark.types import DraftProposal, SamplingParams


# observed rows a request may hold unprojected before observe projects them anyway. A pending
# row (the tapped hidden states, 5 x 576 float32 = 11.5 KB for the shipped drafter, a quarter of
# the target's float32 keys and values of a token) takes more memory than its projection (3
# layers' keys and values, 4.6 KB), so the cap bounds that extra (7 MB a request at 1024 rows).
# It is high enough that a request the draft gate never drafts (most requests at high load on a
# CPU) usually finishes without being projected at all. History (docs/LOAD.md): at 64 clients a
# 64-row cap spent about 1 % of the step time projecting for requests that never drafted (run
# AA); a 256-row cap still projected every prompt of bench serve past 256 tokens as it was
# prefilled (run AE); no per-request cap (one memory budget across requests) moved that cost into
# the gate's probes, which then projected a quarter of the batch's whole contexts in one decode
# step (run AE, reverted). With probes capped at four requests (`DraftGate.max_probe`) the
# drafter's propose and observe at 64 requests took 2.0 s in 300 steps with a 256-row cap and
# 0.8 s with this one (3.0 s with a 256-row cap and probes of 16; run AI).
MAX_PENDING_ROWS = 1024


@dataclass
class DSparkState:
    """One request's drafter state: projected context keys/values per draft layer, and the
    tapped hidden states of committed tokens not projected yet (see `DSparkDrafter.observe`)."""

    kv: ContextKV
    pending: list[torch.Tensor] = dataclasses.field(default_factory=list)  # [n, T, D] chunks
    num_pending: int = 0  # rows in `pending` (kept, not summed: observe asks at every step)

    def clear_pending(self) -> None:
        self.pending.clear()
        self.num_pending = 0

    @property
    def num_context(self) -> int:
        return self.kv.length + self.num_pending


@dataclass
class DraftBlock:
    """The backbone's output for one round (before sampling)."""

    hidden: torch.Tensor  # [R, G, D] final-normed h_k
    base_logits: torch.Tensor  # [R, G, K] float32 U_k over the draft vocabulary (K = V without one)


class DSparkDrafter(DraftVocabMixin, ParallelBackbone, TrainableDrafter):
    """Semi-autoregressive drafter; see the module docstring."""

    def __init__(
        self,
        target: TargetConfig,
        config: DSparkConfig,
        embed_weight: torch.Tensor,  # [V, D] the target's, shared and frozen
        lm_head_weight: torch.Tensor,  # [V, D] the target's, shared and frozen
    ) -> None:
        config = config.resolved(target)
        super().__init__(target, config.num_hidden_layers, config.intermediate_size, len(config.target_layer_ids))
        self.config = config
        self.target_config = target
        self.vocab = SharedVocab(embed_weight, lm_head_weight)
        self.markov_head = build_markov_head(
            config.markov_head_type, target.vocab_size, config.markov_rank, target.hidden_size
        )
        self.confidence_head = None
        if config.enable_confidence_head:
            extra = config.markov_rank if config.confidence_head_with_markov else 0
            self.confidence_head = ConfidenceHead(target.hidden_size, extra)
        self.name = "dspark" if self.markov_head is not None or self.confidence_head is not None else "dflash"
        self.block_size = config.block_size
        self.tap_layers = tuple(config.target_layer_ids)
        self.has_confidence = self.confidence_head is not None
        temps = config.calibration_temperatures or (1.0,) * config.block_size
        self.register_buffer("calibration", torch.tensor(temps, dtype=torch.float32), persistent=False)
        self.draft_w2: torch.Tensor | None = None  # [K, r] W2 rows of the draft vocabulary, if one is set
        self._check_no_draft_vocab()

    # ------------------------------------------------------------ protocol
    def new_state(self) -> DSparkState:
        return DSparkState(self.new_context_kv())

    def observe(self, states, token_ids, tapped_hidden) -> None:
        """Take the committed tokens' tapped hidden states. They are projected into context
        keys/values lazily, for all pending requests at once, when a request is drafted for
        next (or holds MAX_PENDING_ROWS): steps on which the scheduler skips drafting then
        cost no drafter work, and one batched projection replaces many one-row ones."""
        if tapped_hidden is None:
            raise ValueError(f"{self.name} needs the target's hidden states of layers {self.tap_layers}")
        if len(tapped_hidden) != len(token_ids) or len(states) != len(token_ids):
            raise ValueError("observe needs one state, one token tensor and one hidden-state tensor per request")
        # this runs for every request at every step, most of them steps nobody drafts in: kept lean
        full, device, taps = [], self.device, len(self.tap_layers)
        for state, hidden, tokens in zip(states, tapped_hidden, token_ids):
            n = hidden.shape[0]
            if n != tokens.shape[0]:
                raise ValueError("observe needs one hidden-state row per committed token")
            if not n:
                continue
            if hidden.dim() != 3 or hidden.shape[1] != taps:
                raise ValueError(f"expected hidden states of {taps} tapped layers, got {tuple(hidden.shape)}")
            # a copy, not a view of the step's batch, and no autograd graph
            hidden = hidden.detach()
            state.pending.append(hidden.clone() if hidden.device == device else hidden.to(device, copy=True))
            state.num_pending += n
            if state.num_pending >= MAX_PENDING_ROWS:
                full.append(state)
        if full:
            self.project_pending(full)

    @torch.no_grad()
    def project_pending(self, states: list[DSparkState]) -> None:
        """Project the pending hidden states of `states` into their context keys/values."""
        states = [s for s in states if s.pending]
        if not states:
            return
        chunks = [torch.cat(s.pending) for s in states]
        lengths = [int(c.shape[0]) for c in chunks]
        positions = torch.cat(
            [torch.arange(s.kv.length, s.kv.length + n, device=self.device) for s, n in zip(states, lengths)]
        )
        keys, values = self.context_kv(self.context_features(torch.cat(chunks)), positions)  # [L, N, Hkv, hd]
        for state, k, v in zip(states, keys.split(lengths, dim=1), values.split(lengths, dim=1)):
            state.kv.append(k, v)
            state.clear_pending()

    @torch.no_grad()
    def propose(
        self,
        states: list[DSparkState],
        anchors: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> DraftProposal:
        """Draft G tokens after each anchor (one backbone pass + the sequential loop)."""
        if not states:
            return empty_proposal(0, self.block_size)
        anchors = anchors.to(self.device)
        block = self.draft_block(states, anchors)  # projects pending context first
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device)
        uniforms = draw_uniforms(generators, self.block_size, self.device)
        tokens, probs = self.sample(block, anchors, temperatures, uniforms)
        return DraftProposal(
            draft_tokens=tokens,
            num_drafted=torch.full((len(states),), self.block_size, dtype=torch.int64),
            draft_probs=probs,
            confidences=self.confidences(block.hidden, anchors, tokens),
        )

    def pending_rows(self, state: DSparkState) -> int:  # noqa: D102
        return state.num_pending

    def truncate(self, state: DSparkState, num_context: int) -> None:  # noqa: D102
        self.project_pending([state])
        state.kv.truncate(num_context)

    def release(self, state: DSparkState) -> None:  # noqa: D102
        state.kv = self.new_context_kv()
        state.clear_pending()

    def _draft_vocab_changed(self) -> None:
        """The Markov transition's W2 rows of the draft vocabulary (see DraftVocabMixin)."""
        rows = None
        if self.draft_ids is not None and self.markov_head is not None:
            rows = self.markov_head.markov_w2.weight.detach()[self.draft_ids].contiguous()
        self.draft_w2 = rows

    # ------------------------------------------------------------ stages
    def draft_block(self, states: list[DSparkState], anchors: torch.Tensor) -> DraftBlock:
        """Parallel stage: one backbone pass over [anchor, mask x G-1] per request."""
        self.project_pending(states)
        ids = torch.full((len(states), self.block_size), self.config.mask_token_id, dtype=torch.int64)
        ids[:, 0] = anchors.cpu()
        embeds = self.vocab.embed(ids.to(self.device), self.param_dtype)
        hidden = self.block_hidden(embeds, [s.kv for s in states])
        return DraftBlock(hidden=hidden, base_logits=self.head_logits(hidden))

    def sample(
        self, block: DraftBlock, anchors: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequential stage -> draft tokens [R, G] int64, draft probs [R, G, V] float32."""
        vocab = {"vocab_ids": self.draft_ids, "vocab_size": self.target_config.vocab_size}
        if self.markov_head is None:
            return sample_parallel(block.base_logits, temperatures, uniforms, **vocab)
        return sample_sequential(
            self.markov_head, block.base_logits, block.hidden, anchors, temperatures, uniforms,
            top_k=self.config.transition_top_k, w2_rows=self.draft_w2, **vocab,
        )

    def confidence_logits(self, hidden: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor | None:
        """Raw eq. 7 logits [..., G] for hidden [..., G, D] and previous tokens [..., G]."""
        if self.confidence_head is None:
            return None
        prev = None
        if self.config.confidence_head_with_markov:
            prev = self.markov_head.prev_embedding(prev_ids)
        return self.confidence_head(hidden, prev)

    def calibrate(self, confidence_logits: torch.Tensor) -> torch.Tensor:
        """Sequential temperature scaling: logits [..., G] -> c_k = sigmoid(logit_k / T_k)."""
        g = confidence_logits.shape[-1]
        return torch.sigmoid(confidence_logits / self.calibration[:g].to(confidence_logits.device))

    def confidences(self, hidden: torch.Tensor, anchors: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor | None:
        """Calibrated c_k [R, G] float32 for the sampled tokens (x_{k-1} = anchor, x_1..x_{G-1})."""
        prev_ids = torch.cat([anchors[:, None], tokens[:, :-1]], dim=1)
        logits = self.confidence_logits(hidden, prev_ids)
        return None if logits is None else self.calibrate(logits)

    def set_calibration(self, temperatures: list[float]) -> None:
        """Install STS temperatures (one per block position) into the drafter and its config."""
        config = dataclasses.replace(self.config, calibration_temperatures=tuple(float(t) for t in temperatures))
        config.validate(self.target_config)
        self.config = config
        self.calibration = torch.tensor(config.calibration_temperatures, dtype=torch.float32, device=self.device)

    # ------------------------------------------------------------ training
    def forward_train(
        self, tapped_hidden: torch.Tensor, token_ids: torch.Tensor, anchors: torch.Tensor
    ) -> DraftTrainOutput:
        """Teacher-forced blocks: logits [B, A, G, V], confidence logits [B, A, G]."""
        b, s = token_ids.shape
        g = self.block_size
        if anchors.numel() and int((anchors + g).max()) >= s:
            raise ValueError(f"every anchor p needs p + {g} < sequence length {s}")
        offsets = torch.arange(g, device=anchors.device)
        block_pos = anchors[..., None] + offsets  # [B, A, G]
        ids = torch.full_like(block_pos, self.config.mask_token_id)
        ids[..., 0] = token_ids.gather(1, anchors)
        features = self.context_features(tapped_hidden)  # [B, S, D]
        mask = block_train_mask(anchors, s, g)
        embeds = self.vocab.embed(ids.flatten(1), self.param_dtype)
        hidden = self.train_hidden(features, embeds, block_pos.flatten(1), mask).unflatten(1, (-1, g))
        logits = self.vocab.logits(hidden, self.draft_lm_head)  # [B, A, G, V], or [B, A, G, K] over a draft vocabulary
        prev_ids = token_ids.gather(1, block_pos.flatten(1)).view_as(block_pos)  # x_{k-1}: tokens p..p+G-1
        if self.markov_head is not None:
            w2 = self.markov_head.markov_w2.weight
            w2_rows = None if self.draft_ids is None else w2[self.draft_ids.to(w2.device)]  # differentiable rows
            logits = logits + self.markov_head.bias(self.markov_head.block_latents(prev_ids, hidden), w2_rows)
        return DraftTrainOutput(logits=logits, confidence_logits=self.confidence_logits(hidden, prev_ids),
                                vocab_ids=self.draft_ids)

"""Lean Llama-family target model for speculative serving (Llama, SmolLM2, Qwen3).

One forward runs a *ragged batch*: R requests' new tokens flattened into N rows
(see `dspark.types.RaggedBatch`). Each request continues its own KV-cache slot.
Attention for all requests runs as one padded scaled-dot-product attention
over views of the cache (no copy of cached keys when the batch's slots are a
compact range), with an additive mask that hides other positions.

Parameter names follow Hugging Face (`model.layers.0.self_attn.q_proj.weight`,
...), so HF state dicts load directly. Inside, the q/k/v projections and the
gate/up projections are fused into single matrices (fewer, larger matmuls);
state-dict hooks split and join them so the fusion is invisible outside.

Shape symbols as in `dspark.types`; also H query heads, Hkv key/value heads,
hd head dim, S the padded span of cache slots a forward touches, Q the padded
query length (query heads of one kv head times the longest query), L the
longest attended length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dspark.models.config import TargetConfig
from dspark.models.device import same_device
from dspark.models.kv_cache import KVCache
from dspark.models.layers import RMSNorm, linear, project, rope_cos_sin
from dspark.types import RaggedBatch, TargetOutput


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """RMSNorm as one fused op (same float32 result as `RMSNorm.forward`)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


@dataclass
class AttentionPart:
    """Some requests of a ragged batch whose attention runs as one padded call: each query
    is padded to the part's longest (see `query_parts`)."""

    rows: torch.Tensor | None  # [n] the part's rows among the batch's N tokens; None: all N, in order
    span_start: int  # first cache slot of the span S attention reads
    span: int  # S: slots in the span (>= the part's requests)
    max_query: int  # longest query length among the part's requests
    attended: int  # L: cached + new length of the part's longest request
    mask: torch.Tensor | None  # [S, 1, Q, L] additive mask (0 / -inf), None when not needed
    scatter_rows: torch.Tensor | None  # [n] row in the padded [S * max_query] layout; None when dense
    gather_slots: torch.Tensor | None  # [S] cache slots to gather when they are not a compact range


@dataclass
class AttentionPlan:
    """Everything the layers of one forward share about the ragged batch."""

    write_index: torch.Tensor  # [N * Hkv] flat cache positions of the new keys
    cos: torch.Tensor  # [N, 1, hd] rotary cos at each token's position
    signed_sin: torch.Tensor  # [N, 1, hd] rotary sin, first half negated (see _rope)
    parts: list[AttentionPart]  # the requests grouped by query length, one attention call each


def _fuse_rows(state: dict, prefix: str, names: tuple[str, ...], fused: str) -> None:
    """Load hook: replace HF per-projection tensors with one row-concatenated tensor."""
    for suffix in ("weight", "bias"):
        keys = [f"{prefix}{n}.{suffix}" for n in names]
        if all(k in state for k in keys):
            state[f"{prefix}{fused}.{suffix}"] = torch.cat([state.pop(k) for k in keys], dim=0)


def _split_rows(state: dict, prefix: str, names: tuple[str, ...], sizes: list[int], fused: str) -> None:
    """State-dict hook: replace a fused tensor with HF per-projection tensors."""
    for suffix in ("weight", "bias"):
        key = f"{prefix}{fused}.{suffix}"
        if key in state:
            for n, part in zip(names, state.pop(key).split(sizes, dim=0)):
                state[f"{prefix}{n}.{suffix}"] = part.clone()


class FusedLinear(nn.Module):
    """Row-concatenation of several HF linear layers; `weight` is [sum(out), in]."""

    def __init__(self, in_features: int, out_features: list[int], names: tuple[str, ...], bias: bool) -> None:
        super().__init__()
        self.sizes, self.names = list(out_features), names
        self.weight = nn.Parameter(torch.empty(sum(out_features), in_features))
        self.bias = nn.Parameter(torch.zeros(sum(out_features))) if bias else None


class Attention(nn.Module):
    """Grouped-query attention with rotary positions (and Qwen3's q/k norm)."""

    _names = ("q_proj", "k_proj", "v_proj")

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        sizes = [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim]
        self.qkv_proj = FusedLinear(c.hidden_size, sizes, self._names, c.attention_bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.register_load_state_dict_pre_hook(self._load_hook)
        self.register_state_dict_post_hook(self._save_hook)

    @staticmethod
    def _load_hook(module, state, prefix, *args) -> None:
        _fuse_rows(state, prefix, Attention._names, "qkv_proj")

    @staticmethod
    def _save_hook(module, state, prefix, *args) -> None:
        _split_rows(state, prefix, Attention._names, module.qkv_proj.sizes, "qkv_proj")

    def forward(self, x: torch.Tensor, plan: AttentionPlan, cache: KVCache, layer: int) -> torch.Tensor:
        """x [N, D] -> attention output [N, D]; writes the new keys/values into `cache`."""
        n, h, hkv, hd = x.shape[0], self.heads, self.kv_heads, self.head_dim
        qkv = project(self.qkv_proj, x).view(n, h + 2 * hkv, hd)
        qk = qkv[:, : h + hkv]
        if self.q_norm is not None:
            qk = torch.cat([_norm(self.q_norm, qk[:, :h]), _norm(self.k_norm, qk[:, h:])], dim=1)
        qk = _rope(qk, plan)  # [N, H + Hkv, hd]
        cache.write(layer, plan.write_index, qk[:, h:].reshape(-1, hd), qkv[:, h + hkv :].reshape(-1, hd))
        out = _ragged_attention(qk[:, :h], cache, layer, plan, hkv)  # [N, H * hd]
        return project(self.o_proj, out)


def _rope(x: torch.Tensor, plan: AttentionPlan) -> torch.Tensor:
    """HF rotary embedding x * cos + rotate_half(x) * sin, with rotate_half(x) * sin computed
    as roll(x, half) * signed_sin: the same products, in fewer ops. x [N, heads, hd]."""
    return x * plan.cos + x.roll(x.shape[-1] // 2, dims=-1) * plan.signed_sin


def _ragged_attention(q: torch.Tensor, cache: KVCache, layer: int, plan: AttentionPlan, hkv: int) -> torch.Tensor:
    """q [N, H, hd] (rotated) -> [N, H * hd], attending to each request's cache (already holding
    the new keys), one call per part of the plan."""
    if len(plan.parts) == 1 and plan.parts[0].rows is None:
        return _part_attention(q, cache, layer, plan.parts[0], hkv)
    n, h, hd = q.shape
    out = q.new_empty(n, h * hd)
    for part in plan.parts:
        out.index_copy_(0, part.rows, _part_attention(q.index_select(0, part.rows), cache, layer, part, hkv))
    return out


def _part_attention(q: torch.Tensor, cache: KVCache, layer: int, part: AttentionPart, hkv: int) -> torch.Tensor:
    """One part's attention. Queries are laid out [S, Hkv, Q, hd] with Q = (H / Hkv) *
    max_query rows per kv head, so no key/value head is repeated."""
    n, h, hd = q.shape
    s, mq, group = part.span, part.max_query, h // hkv
    if part.gather_slots is None:
        keys = cache.keys[layer][part.span_start : part.span_start + s, :, : part.attended]
        values = cache.values[layer][part.span_start : part.span_start + s, :, : part.attended]
    else:
        keys = cache.keys[layer][:, :, : part.attended].index_select(0, part.gather_slots)
        values = cache.values[layer][:, :, : part.attended].index_select(0, part.gather_slots)
    if part.scatter_rows is None and mq == 1:  # one new token per request: no padding, no copies
        out = F.scaled_dot_product_attention(q.view(s, hkv, group, hd), keys, values, attn_mask=part.mask)
        return out.reshape(n, h * hd)
    if part.scatter_rows is None:
        padded = q.view(s, mq, hkv, group, hd)
    else:
        padded = q.new_zeros(s * mq, h, hd).index_copy_(0, part.scatter_rows, q).view(s, mq, hkv, group, hd)
    queries = padded.permute(0, 2, 3, 1, 4).reshape(s, hkv, group * mq, hd)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=part.mask)  # [S, Hkv, Q, hd]
    out = out.view(s, hkv, group, mq, hd).permute(0, 3, 1, 2, 4).reshape(s * mq, h * hd)
    return out if part.scatter_rows is None else out.index_select(0, part.scatter_rows)


class MLP(nn.Module):
    """SwiGLU with the gate and up projections fused: down(silu(gate(x)) * up(x))."""

    _names = ("gate_proj", "up_proj")

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.inner = inner
        self.gate_up_proj = FusedLinear(hidden, [inner, inner], self._names, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=False)
        self.register_load_state_dict_pre_hook(self._load_hook)
        self.register_state_dict_post_hook(self._save_hook)

    @staticmethod
    def _load_hook(module, state, prefix, *args) -> None:
        _fuse_rows(state, prefix, MLP._names, "gate_up_proj")

    @staticmethod
    def _save_hook(module, state, prefix, *args) -> None:
        _split_rows(state, prefix, MLP._names, module.gate_up_proj.sizes, "gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = project(self.gate_up_proj, x)
        gate, up = gate_up[..., : self.inner], gate_up[..., self.inner :]
        return project(self.down_proj, F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, plan: AttentionPlan, cache: KVCache, layer: int) -> torch.Tensor:
        x = x + self.self_attn(_norm(self.input_layernorm, x), plan, cache, layer)
        return x + self.mlp(_norm(self.post_attention_layernorm, x))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        # uninitialised like every weight here (a state dict fills them); passing the tensor also
        # skips nn.Embedding's normal_() init, which on the meta device imports torch._dynamo (~2 s)
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size, _weight=torch.empty(config.vocab_size, config.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class TargetModel(nn.Module):
    """The target LLM: one ragged forward per speculative round.

    Built from a config its weights are uninitialised: fill them with `load_state_dict`
    (HF names), as `dspark.models.loading` and `dspark.models.tiny` do.
    """

    def __init__(self, config: TargetConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.register_load_state_dict_pre_hook(self._drop_tied_head)

    def _drop_tied_head(self, module, state, prefix, *args) -> None:
        if self.config.tie_word_embeddings:
            state.pop(f"{prefix}lm_head.weight", None)  # tied checkpoints may store a copy

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, D]: the LM head (the token embedding matrix when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def compute_logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """LM head: last_hidden [..., D] (final-normed) -> logits [..., V] float32."""
        h = last_hidden.to(self.dtype)
        vocab = self.lm_head_weight.shape[0]
        kernel = self.__dict__.get("head_kernel")
        rows = h.reshape(-1, h.shape[-1])
        logits = kernel(rows) if kernel is not None else linear(rows, self.lm_head_weight)
        return logits.float().reshape(*h.shape[:-1], vocab)

    def new_cache(self, max_slots: int, max_seq_len: int) -> KVCache:
        """A KV cache shaped for this model, in the model's dtype, on its device."""
        return KVCache(self.config, max_slots, max_seq_len, dtype=self.dtype, device=self.device)

    @torch.no_grad()
    def forward(
        self,
        batch: RaggedBatch,
        cache: KVCache,
        logits_rows: torch.Tensor | None = None,
        tap_layers: tuple[int, ...] = (),
        want_last_hidden: bool = False,
    ) -> TargetOutput:
        """Run R requests' new tokens; append their keys/values to `cache`.

        logits_rows: [M] int64 indices into the N rows whose logits to return (None: all rows).
        tap_layers: decoder-layer indices i whose output hidden states to return ([N, T, D], in
            the order given). This is HF's `hidden_states[i + 1]`, except for the last layer,
            where HF returns the final-normed state (our `last_hidden`) instead.
        want_last_hidden: also return the final-normed hidden states [N, D] (the LM head input).
        Runs without autograd; callers may wrap it in `torch.inference_mode()` for speed.
        """
        bad = [i for i in tap_layers if not 0 <= i < self.config.num_hidden_layers]
        if bad:
            raise ValueError(f"tap_layers {bad} out of range for {self.config.num_hidden_layers} decoder layers")
        device = self.device
        if not same_device(cache.device, device):
            raise ValueError(f"the KV cache is on {cache.device} but the model on {device}; build it with new_cache()")
        plan = make_plan(batch, cache, self.config, self.dtype)
        hidden = self.model.embed_tokens(batch.token_ids.to(device))  # [N, D]
        if logits_rows is not None:
            logits_rows = logits_rows.to(device)
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            hidden = layer(hidden, plan, cache, i)
            if i in tap_layers:
                taps[i] = hidden
        cache.commit(batch.slots, batch.query_lens)
        tapped = torch.stack([taps[i] for i in tap_layers], dim=1) if tap_layers else None  # [N, T, D]
        last = _norm(self.model.norm, hidden) if want_last_hidden else None  # [N, D]
        if logits_rows is None:
            normed = last if last is not None else _norm(self.model.norm, hidden)
        elif last is not None:
            normed = last.index_select(0, logits_rows)
        else:
            normed = _norm(self.model.norm, hidden.index_select(0, logits_rows))
        logits = self.compute_logits(normed)  # [M, V]
        return TargetOutput(logits=logits, tapped_hidden=tapped, last_hidden=last)


def make_plan(batch: RaggedBatch, cache: KVCache, config: TargetConfig, dtype: torch.dtype) -> AttentionPlan:
    """Positions, cache write indices and the attention layout of one ragged forward, built
    on the CPU from the batch's Python lists and moved to the cache's device."""
    slots, qlens = batch.slots, batch.query_lens
    starts = cache.reserve(slots, qlens)
    positions = torch.cat([torch.arange(s, s + q) for s, q in zip(starts, qlens)])
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta, dtype)
    half = config.head_dim // 2
    signed_sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)
    write_index = cache.flat_index(slots, starts, qlens)
    group = config.num_attention_heads // config.num_key_value_heads
    groups = attention_groups(qlens, starts, slots, group, cache.device.type)
    offsets = [0]
    for q in qlens:
        offsets.append(offsets[-1] + q)
    parts = []
    for members in groups:
        rows = None
        if len(groups) > 1:
            rows = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in members])
        parts.append(_make_part(rows, [slots[i] for i in members], [starts[i] for i in members],
                                [qlens[i] for i in members], cache, group, dtype))
    plan = AttentionPlan(write_index=write_index, cos=cos[:, None], signed_sin=signed_sin[:, None], parts=parts)
    return _plan_to(plan, cache.device)


def _plan_to(plan: AttentionPlan, device: torch.device) -> AttentionPlan:
    """The plan with its tensors on `device` (a no-op on the CPU, where it was built)."""
    if device.type == "cpu":
        return plan

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    parts = [dataclasses.replace(p, rows=move(p.rows), mask=move(p.mask), scatter_rows=move(p.scatter_rows),
                                 gather_slots=move(p.gather_slots)) for p in plan.parts]
    return AttentionPlan(write_index=move(plan.write_index), cos=move(plan.cos), signed_sin=move(plan.signed_sin),
                         parts=parts)


def query_parts(qlens: list[int]) -> list[list[int]]:
    """The batch's requests (indices, in order) grouped for attention by query length: one
    new token, 2, 3-4, 5-8, 9-16 and so on. A padded attention call costs as if every request
    had the longest query, so one request verifying 8 tokens, or one prefill chunk of 100,
    beside 15 decoding requests would pad all 16 to its length; per group the padding is
    under 2x. Groups are listed by their first request."""
    buckets: dict[int, list[int]] = {}
    for i, q in enumerate(qlens):
        buckets.setdefault((q - 1).bit_length(), []).append(i)
    return list(buckets.values())


# One padded attention call on a GPU while its padded scores stay under this many elements
# (32 MiB of float32 mask), e.g. 64 requests x 3 query heads per kv head x 8 rows x 2048 keys.
ONE_CALL_ELEMENTS = 1 << 23


# What one more attention call costs on the CPU, in cached positions of one request read (a
# position of one request is 3 kv heads x 64 x 2 float32 of keys and values, 1.5 KiB, for the
# embedded model): the call's fixed ops (slicing, mask, SDPA dispatch, scattering its rows back)
# take some 20-40 us a layer, about what reading 100-200 positions takes.
PART_OVERHEAD_POSITIONS = 128


def split_by_context(members: list[int], starts: list[int], qlens: list[int], slots: list[int],
                     overhead: int | None = None) -> list[list[int]]:
    """`members` (requests of one query-length group) split into parts of similar context length.
    A part reads every slot of its span up to its longest request's context, so one part of
    requests at 150 and 700 cached tokens reads 1400 positions for 850 used: decoding four
    requests of the evaluation prompts read 1.76-1.96x the positions they attend to
    (docs/LOAD.md, session 46). Requests sorted by context are cut into runs minimising the
    positions read plus `overhead` a part (default `PART_OVERHEAD_POSITIONS`), by dynamic
    programming over the sorted order in O(n^2); a part whose slots are not a compact range is
    gathered, i.e. copied (`_make_part`), and counted three times."""
    if len(members) < 2:
        return [members]
    overhead = PART_OVERHEAD_POSITIONS if overhead is None else overhead
    order = sorted(members, key=lambda i: (starts[i] + qlens[i], i))
    n = len(order)
    best = [0] + [0] * n  # best[b]: least cost of order[:b]
    cut = [0] * (n + 1)
    for b in range(1, n + 1):
        longest = starts[order[b - 1]] + qlens[order[b - 1]]
        lo = hi = slots[order[b - 1]]
        best[b] = -1
        for a in range(b - 1, -1, -1):  # the part order[a:b], widened one request at a time
            lo, hi = min(lo, slots[order[a]]), max(hi, slots[order[a]])
            span, count = hi - lo + 1, b - a
            cost = best[a] + overhead + (span if span <= 2 * count else 3 * count) * longest
            if best[b] < 0 or cost < best[b]:
                best[b], cut[b] = cost, a
    parts, b = [], n
    while b > 0:
        parts.append(sorted(order[cut[b]:b]))
        b = cut[b]
    return sorted(parts)


def attention_groups(qlens: list[int], starts: list[int], slots: list[int], heads_per_kv: int,
                     device_type: str) -> list[list[int]]:
    """How a forward's requests share attention calls. On the CPU, by query length
    (`query_parts`), padded rows cost compute there, and within a query length by context length
    (`split_by_context`), padded positions cost reading. On a GPU, one call for all while the
    padded scores stay small (`ONE_CALL_ELEMENTS`): a small model's step there costs what its
    kernel launches cost, and each part adds some 27 ops per layer (`python -m dspark.bench.ops`
    counts them), so a step in which a few requests verify drafts would cost half as much again
    as a plain one; a long prefill chunk beside them still gets its own call."""
    groups = query_parts(qlens)
    if device_type == "cpu":
        return sorted(part for group in groups for part in split_by_context(group, starts, qlens, slots))
    if len(groups) == 1:
        return groups
    span = max(slots) - min(slots) + 1
    padded = span * heads_per_kv * max(qlens) * max(s + q for s, q in zip(starts, qlens))
    return [list(range(len(qlens)))] if padded <= ONE_CALL_ELEMENTS else groups


def _make_part(rows: torch.Tensor | None, slots: list[int], starts: list[int], qlens: list[int], cache: KVCache,
               group: int, dtype: torch.dtype) -> AttentionPart:
    lo, hi = min(slots), max(slots) + 1
    compact = hi - lo <= 2 * len(slots)
    span_slots = list(range(lo, hi)) if compact else sorted(slots)
    row_of = {slot: b for b, slot in enumerate(span_slots)}
    max_query = max(qlens)
    attended = max(s + q for s, q in zip(starts, qlens))
    cache.make_readable(slots, attended)
    dense = span_slots == slots and all(q == max_query for q in qlens)
    scatter = None
    if not dense:
        scatter = torch.cat([torch.arange(q) + row_of[slot] * max_query for slot, q in zip(slots, qlens)])
    mask = _make_mask(span_slots, row_of, slots, starts, max_query, attended, group, dtype, cache.device)
    return AttentionPart(rows=rows, span_start=lo if compact else 0, span=len(span_slots), max_query=max_query,
                         attended=attended, mask=mask, scatter_rows=scatter,
                         gather_slots=None if compact else torch.tensor(span_slots))


def _make_mask(
    span_slots: list[int], row_of: dict[int, int], slots: list[int], starts: list[int],
    max_query: int, attended: int, group: int, dtype: torch.dtype, device: torch.device,
) -> torch.Tensor | None:
    """Additive mask [S, 1, group * max_query, L]: query row (g, i) of a request that had
    `start` cached tokens sees keys j <= start + i. Slots in the span that are not in the
    batch see everything (their rows are discarded), which keeps softmax finite. Built on
    `device` from two [S] vectors: on a GPU the [S, Q, L] comparison runs there instead of
    being computed on the host and copied over in every step."""
    limits = [attended - 1] * len(span_slots)
    in_batch = [False] * len(span_slots)
    for slot, start in zip(slots, starts):
        limits[row_of[slot]] = start
        in_batch[row_of[slot]] = True
    if max_query == 1 and all(in_batch) and all(x == attended - 1 for x in limits):
        return None  # one new token per request, all with the same length: nothing to hide
    limit = torch.tensor(limits, dtype=torch.long, device=device)
    query_pos = torch.arange(max_query, device=device).repeat(group)  # [Q], row (g, i) -> i
    key_pos = torch.arange(attended, device=device)
    visible = key_pos[None, None, :] <= (limit[:, None, None] + query_pos[None, :, None])  # [S, Q, L]
    visible |= ~torch.tensor(in_batch, device=device)[:, None, None]
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))
    return mask[:, None]

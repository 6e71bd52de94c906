"""Autoregressive single-layer drafters over (feature, token) pairs: the
shared machinery of Eagle3 and MTP-1 (paper section 2.2, "autoregressive
drafters").

Pair j combines the feature of position j-1 (zeros for j = 0) with the
embedding of token j and predicts token j+1; one decoder layer attends
causally over earlier pairs. Context pairs use the target's features. When
drafting after anchor x_0 at position n, step 0 is pair (f_{n-1}, x_0); step
k > 0 is pair (o_{k-1}, x_k), where o_{k-1} is the drafter's own output
hidden of the previous step (Eagle3's training-time test unroll uses the same
recursion, teacher-forcing the tokens).

The key/value of a context pair depends only on that pair, so `observe`
projects each newly committed pair once; the per-request state also keeps the
target features, so a truncated request knows f_{n-1} again.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from dspark.draft.backbone import SharedVocab, attend_in_one_call, padded_context
from dspark.draft.base import DraftTrainOutput, TrainableDrafter, empty_proposal
from dspark.draft.blocks import ContextKV, LayerShape, RowBuffer, attend
from dspark.draft.sampling import draw_uniforms, inverse_cdf, temperature_probs, to_vocab
from dspark.draft.vocab import DraftVocabMixin
from dspark.types import DraftProposal, SamplingParams


@dataclass
class ChainState:
    kv: ContextKV  # keys/values of context pairs 0..n-1 (one layer)
    features: RowBuffer  # [n, D] target feature f_j of each context position

    @property
    def num_context(self) -> int:
        return self.kv.length


class ChainDrafter(DraftVocabMixin, nn.Module, TrainableDrafter):
    """Subclasses define `layer` (with self_attn, mlp, post_attention_layernorm),
    `norm`, `feature()` and `pair_input()`."""

    shape: LayerShape
    vocab: SharedVocab

    @abstractmethod
    def feature(self, tapped_hidden: torch.Tensor) -> torch.Tensor:
        """tapped_hidden [..., T, D] -> per-position feature f [..., D]."""

    @abstractmethod
    def pair_input(self, prev_hidden: torch.Tensor, token_embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """prev_hidden, token_embeds [..., D] -> (attention input [..., attn_in], residual [..., D])."""

    @property
    def param_dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    # ------------------------------------------------------------ layer
    def _pair_kv(self, prev_hidden, tokens, positions):
        attn_in, residual = self.pair_input(prev_hidden, self.vocab.embed(tokens, self.param_dtype))
        cos, sin = self.shape.rope(positions, attn_in.dtype)
        k, v = self.layer.self_attn.keys_values(attn_in, cos, sin)
        return attn_in, residual, cos, sin, k, v

    def _step(self, prev_hidden, tokens, positions, attend_fn) -> torch.Tensor:
        """Pairs [..., S] -> output hidden [..., S, D]; attend_fn(q, k, v) attends."""
        attn_in, residual, cos, sin, k, v = self._pair_kv(prev_hidden, tokens, positions)
        q = self.layer.self_attn.queries(attn_in, cos, sin)
        x = residual + self.layer.self_attn.output(attend_fn(q, k, v))
        return x + self.layer.mlp(self.layer.post_attention_layernorm(x))

    # ------------------------------------------------------------ protocol
    def new_state(self) -> ChainState:
        s = self.shape
        kv = ContextKV(1, s.num_kv_heads, s.head_dim, self.param_dtype, self.device)
        return ChainState(kv, RowBuffer((s.hidden_size,), self.param_dtype, self.device))

    def _pending(self, state: ChainState) -> torch.Tensor:
        last = state.features.last()
        return last if last is not None else torch.zeros(self.shape.hidden_size, dtype=self.param_dtype, device=self.device)

    @torch.no_grad()
    def observe(self, states, token_ids, tapped_hidden) -> None:  # noqa: D102
        if tapped_hidden is None:
            raise ValueError(f"{self.name} needs the target's hidden states of layers {self.tap_layers}")
        lengths = [int(t.shape[0]) for t in token_ids]
        if lengths != [int(h.shape[0]) for h in tapped_hidden]:
            raise ValueError("observe needs one hidden-state row per committed token")
        if sum(lengths) == 0:
            return
        feats = self.feature(torch.cat(list(tapped_hidden)).to(self.device))  # [N, D]
        per_request = feats.split(lengths)
        prev = torch.cat([torch.cat([self._pending(s)[None], f[:-1]]) for s, f in zip(states, per_request)])
        positions = torch.cat([torch.arange(s.num_context, s.num_context + n) for s, n in zip(states, lengths)])
        tokens = torch.cat(list(token_ids)).to(self.device)
        *_, k, v = self._pair_kv(prev, tokens, positions.to(self.device))
        for state, f, ks, vs in zip(states, per_request, k.split(lengths), v.split(lengths)):
            if f.shape[0]:
                state.kv.append(ks[None], vs[None])
                state.features.append(f)

    @torch.no_grad()
    def propose(
        self,
        states: list[ChainState],
        anchors: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator],
    ) -> DraftProposal:
        """Draft G tokens after each anchor, one decoder-layer step per token."""
        r, g = len(states), self.block_size
        if r == 0:
            return empty_proposal(0, g)
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device)
        any_greedy = any(p.temperature == 0 for p in params)  # known on the host: no read per step
        uniforms = draw_uniforms(generators, g, self.device)
        starts = torch.tensor([s.num_context for s in states], device=self.device)
        for s in states:
            s.kv.reserve(s.num_context + g)
        hidden = torch.stack([self._pending(s) for s in states])[:, None]  # [R, 1, D]
        tokens = anchors.to(self.device)
        draft_tokens = torch.empty(r, g, dtype=torch.int64, device=self.device)
        k_vocab = self.vocab.vocab_size if self.draft_ids is None else self.draft_ids.numel()
        probs = torch.empty(r, g, k_vocab, dtype=torch.float32, device=self.device)
        padded = None
        if attend_in_one_call(self.device.type, r):  # on a GPU: one padded call per step, not one per request
            context, seen = padded_context([s.kv for s in states], g)  # [R, 1, 2, S, Hkv, hd], [R, G, S + G]
            steps_kv = context.new_empty(2, r, g, *context.shape[4:])  # the block's keys, values so far
            padded = context[:, 0], seen[:, :1], context.shape[3]
        for k in range(g):

            def attend_fn(q, kk, vv, k=k):
                if padded is not None:
                    context, seen, s = padded
                    steps_kv[0, :, k], steps_kv[1, :, k] = kk[:, 0], vv[:, 0]
                    keys = torch.cat([context[:, 0], steps_kv[0, :, : k + 1]], dim=1)
                    values = torch.cat([context[:, 1], steps_kv[1, :, : k + 1]], dim=1)
                    return attend(q, keys, values, seen[..., : s + k + 1])
                outs = []
                for i, state in enumerate(states):
                    end = state.num_context + k + 1
                    keys, values = state.kv.view(0, end)
                    keys[end - 1], values[end - 1] = kk[i, 0], vv[i, 0]  # scratch slot of step k
                    outs.append(attend(q[i : i + 1], keys[None], values[None]))
                return torch.cat(outs)

            hidden = self._step(hidden, tokens[:, None], (starts + k)[:, None], attend_fn)
            p_k = temperature_probs(self.head_logits(self.norm(hidden[:, 0])), temperatures, any_greedy)
            local = inverse_cdf(p_k, uniforms[:, k])
            tokens = self.draft_token_ids(local)
            draft_tokens[:, k], probs[:, k] = local, p_k
        draft_tokens, probs = to_vocab(draft_tokens, probs, self.draft_ids, self.vocab.vocab_size)
        return DraftProposal(
            draft_tokens=draft_tokens,
            num_drafted=torch.full((r,), g, dtype=torch.int64),
            draft_probs=probs,
        )

    def truncate(self, state: ChainState, num_context: int) -> None:  # noqa: D102
        state.kv.truncate(num_context)
        state.features.truncate(num_context)

    def release(self, state: ChainState) -> None:  # noqa: D102
        fresh = self.new_state()
        state.kv, state.features = fresh.kv, fresh.features

    # ------------------------------------------------------------ training
    def forward_train(
        self, tapped_hidden: torch.Tensor, token_ids: torch.Tensor, anchors: torch.Tensor
    ) -> DraftTrainOutput:
        """Step 0 over every pair (causal), then the training-time-test unroll
        of steps 1..G-1 for each anchor, feeding the drafter's own hidden."""
        b, s = token_ids.shape
        g = self.block_size
        if anchors.numel() and int((anchors + g).max()) >= s:
            raise ValueError(f"every anchor p needs p + {g} < sequence length {s}")
        feats = self.feature(tapped_hidden.to(self.param_dtype))  # [B, S, D]
        prev = torch.cat([torch.zeros_like(feats[:, :1]), feats[:, :-1]], dim=1)
        positions = torch.arange(s, device=token_ids.device).expand(b, s)
        causal = torch.ones(s, s, dtype=torch.bool, device=token_ids.device).tril().expand(b, s, s)
        ctx = {}

        def attend_all(q, k, v):
            ctx["k"], ctx["v"] = k, v
            return attend(q, k, v, causal)

        out = self._step(prev, token_ids, positions, attend_all)  # [B, S, D]
        hidden = out.gather(1, anchors[..., None].expand(-1, -1, out.shape[-1]))  # [B, A, D]
        outputs = [hidden]
        chain_k, chain_v = [], []
        for k in range(1, g):
            pos = anchors + k
            mask = _chain_mask(anchors, s, k)

            def attend_chain(q, kk, vv, mask=mask):
                chain_k.append(kk)
                chain_v.append(vv)
                keys = torch.cat([ctx["k"], *chain_k], dim=1)
                values = torch.cat([ctx["v"], *chain_v], dim=1)
                return attend(q, keys, values, mask)

            hidden = self._step(hidden, token_ids.gather(1, pos), pos, attend_chain)
            outputs.append(hidden)
        hidden = self.norm(torch.stack(outputs, dim=2))
        return DraftTrainOutput(logits=self.vocab.logits(hidden, self.draft_lm_head), confidence_logits=None,
                                vocab_ids=self.draft_ids)


def _chain_mask(anchors: torch.Tensor, seq_len: int, step: int) -> torch.Tensor:
    """Step `step` queries [B, A] see step-0 pairs at positions <= their anchor
    and their own chain's steps 1..step -> [B, A, S + A * step] bool."""
    b, a = anchors.shape
    ctx = torch.arange(seq_len, device=anchors.device)[None, None, :] <= anchors[..., None]
    chain_owner = torch.arange(a * step, device=anchors.device) % a
    own = (chain_owner[None, :] == torch.arange(a, device=anchors.device)[:, None]).expand(b, -1, -1)
    return torch.cat([ctx, own], dim=-1)

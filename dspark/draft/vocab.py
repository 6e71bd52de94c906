"""Draft vocabularies: a learned drafter may draft among the K most frequent
target tokens only (Eagle3's reduced draft vocabulary, applied at inference).

The LM head (and DSpark's Markov transition) then costs K/V of the whole
vocabulary's. Drafting stays lossless whatever the K tokens: the verifier
receives the probabilities the tokens were drawn from, zero outside the draft
vocabulary; acceptance drops only where the target picks a token outside it.
The ranking comes from `dspark draft-vocab` (`dspark.train.draft_vocab`).
"""

from __future__ import annotations

import dataclasses

import torch

from dspark.errors import UserError

NO_RANKING = ("draft_vocab_size = {size} needs the token ranking in the drafter folder's draft_vocab.safetensors; "
              "build it with `dspark draft-vocab FOLDER --data DIR`, or set draft_vocab_size to 0")


class DraftVocabMixin:
    """For drafters with `config.draft_vocab_size`, `target_config`, `vocab: SharedVocab`, `device`."""

    draft_ranking: torch.Tensor | None = None  # token ids, most frequent first
    draft_ids: torch.Tensor | None = None  # [K] the draft vocabulary (sorted), None: the whole vocabulary
    draft_lm_head: torch.Tensor | None = None  # [K, D] its LM-head rows

    def _check_no_draft_vocab(self) -> None:
        """Constructors call this: a config asking for a draft vocabulary needs its ranking."""
        if self.config.draft_vocab_size:
            raise UserError(NO_RANKING.format(size=self.config.draft_vocab_size))

    def set_draft_vocab(self, ranking: torch.Tensor | None, size: int | None = None) -> None:
        """Draft only among the `size` first tokens of `ranking` (token ids, most frequent
        first; size None: config.draft_vocab_size; 0: the whole vocabulary). Call it after
        moving the drafter to its device and dtype."""
        v = self.target_config.vocab_size
        size = self.config.draft_vocab_size if size is None else int(size)
        if ranking is not None:
            ranking = torch.as_tensor(ranking, dtype=torch.int64).flatten().cpu()
            if ranking.numel() and (int(ranking.min()) < 0 or int(ranking.max()) >= v):
                raise UserError(f"draft vocabulary ranking holds token ids outside 0..{v - 1}; rebuild it")
            if ranking.unique().numel() != ranking.numel():
                raise UserError("draft vocabulary ranking repeats token ids; rebuild it")
        if size and ranking is None:
            raise UserError(NO_RANKING.format(size=size))
        if ranking is not None and size > ranking.numel():
            raise UserError(f"draft_vocab_size {size} exceeds the {ranking.numel()} ranked tokens; pick a smaller size")
        config = dataclasses.replace(self.config, draft_vocab_size=size)
        config.resolved(self.target_config)  # validates
        self.config, self.draft_ranking = config, ranking
        if size == 0 or size >= v:
            self.draft_ids = self.draft_lm_head = None
        else:
            self.draft_ids = ranking[:size].sort().values.to(self.device)
            head = self.vocab.lm_head_weight
            self.draft_lm_head = head[self.draft_ids.to(head.device)].contiguous()
        self._draft_vocab_changed()
        self.refresh_head_kernel()

    def refresh_head_kernel(self) -> None:
        """Rebuild the CPU kernel of the LM head in use, if this drafter has CPU kernels
        (`dspark.models.cpu_kernels.enable_drafter_cpu_kernels`)."""
        if "cpu_kernels_target" not in self.__dict__:
            return
        from dspark.models.cpu_kernels import CpuKernel, rowgemm

        self.__dict__.pop("head_kernel", None)
        kernels = rowgemm()[0]
        if kernels is None:
            return
        if self.draft_lm_head is not None:
            bf16_rows = self.__dict__.get("cpu_kernels_bf16_rows")  # the drafter's bfloat16 path, if it has one
            self.head_kernel = CpuKernel(self.draft_lm_head, kernels, bf16_from_rows=bf16_rows)
        else:
            target = self.cpu_kernels_target  # drafting over the whole vocabulary: the target's head
            shared = None if target is None else target.__dict__.get("head_kernel")
            if shared is not None and shared.weight.data_ptr() == self.vocab.lm_head_weight.data_ptr():
                self.head_kernel = shared

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., D] -> float32 logits over the draft vocabulary (all V tokens without one)."""
        kernel = self.__dict__.get("head_kernel")
        if kernel is not None:
            return kernel(hidden)  # float32
        return self.vocab.logits(hidden, self.draft_lm_head)

    def _draft_vocab_changed(self) -> None:
        """Hook for drafters with more vocabulary-sized weights (DSpark's Markov W2)."""

    def draft_token_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Indices into the draft vocabulary -> the target's token ids."""
        return local if self.draft_ids is None else self.draft_ids[local]

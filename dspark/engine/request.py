"""Per-request state the engine keeps, as a plain Python object."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from dspark.types import SamplingParams, SpecStats


class Status(enum.Enum):
    WAITING = "waiting"  # queued, no KV slot
    RUNNING = "running"  # holds a KV slot (prefilling or decoding)
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request.

    The KV cache holds the first `num_computed` tokens of `all_ids`. While
    decoding, every token but the last (the anchor) is computed.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    block_size: int
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    slot: int | None = None
    num_computed: int = 0
    draft_state: object = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    stats: SpecStats = field(init=False)

    def __post_init__(self) -> None:
        self.stats = SpecStats(block_size=max(self.block_size, 1))

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_target(self) -> int:
        """How many tokens must be computed before the request decodes."""
        total = len(self.prompt_ids) + len(self.output_ids)
        return total if not self.output_ids else total - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def anchor(self) -> int:
        return self.output_ids[-1]

    @property
    def remaining_tokens(self) -> int:
        return self.params.max_new_tokens - len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

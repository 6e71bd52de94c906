"""Which requests run in the next step: admission under a KV budget,
preemption by recomputation, and chunked prefill. Plain Python over Request
objects; the engine asks `plan()` once per step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dspark.engine.request import Request, Status


@dataclass
class StepPlan:
    """The requests of one step."""

    prefill: list[tuple[Request, int]] = field(default_factory=list)  # (request, chunk length)
    decode: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass
class BatchLimits:
    max_running: int  # requests holding a KV slot at once
    kv_budget_tokens: int  # KV tokens across all requests (admission + preemption)
    max_prefill_tokens: int  # prompt tokens computed per step (chunked prefill)
    step_reserve: int  # KV tokens a decoding request may add in one step (G + 1)


class Batcher:
    """FCFS admission with a token budget; preempts the newest running request
    when the running set would outgrow the budget."""

    def __init__(self, limits: BatchLimits, kv) -> None:
        self.limits = limits
        self.kv = kv  # KVCache: allocate(), free(slot), num_free_slots
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _kv_tokens(self) -> int:
        return sum(r.num_computed for r in self.running)

    def _fits(self, extra: int) -> bool:
        return self._kv_tokens() + extra <= self.limits.kv_budget_tokens

    def _admit(self, new_slot_state) -> None:
        while self.waiting and len(self.running) < self.limits.max_running and self.kv.num_free_slots > 0:
            req = self.waiting[0]
            need = req.prefill_target + self.limits.step_reserve
            # the running set's next step must still fit beside the newcomer
            reserve = self.limits.step_reserve * len(self.running)
            if self.running and not self._fits(need + reserve):
                break
            self.waiting.popleft()
            req.slot = self.kv.allocate()
            req.status = Status.RUNNING
            req.num_computed = 0
            req.draft_state = new_slot_state()
            self.running.append(req)

    def _preempt_until_fits(self, plan: StepPlan, release) -> None:
        while len(self.running) > 1:
            need = sum(self.limits.step_reserve for r in self.running if not r.is_prefilling)
            if self._fits(need):
                return
            victim = self.running.pop()  # newest admitted
            release(victim)
            victim.status = Status.WAITING
            victim.num_preemptions += 1
            self.waiting.appendleft(victim)
            plan.preempted.append(victim)

    def plan(self, new_slot_state, release) -> StepPlan:
        """Admit, preempt if needed, then split running requests into prefill
        chunks (token budget per step, oldest first) and decoders."""
        plan = StepPlan()
        self._admit(new_slot_state)
        self._preempt_until_fits(plan, release)
        budget = self.limits.max_prefill_tokens
        for req in self.running:
            if req.is_prefilling:
                if budget <= 0:
                    continue
                chunk = min(budget, req.prefill_target - req.num_computed)
                plan.prefill.append((req, chunk))
                budget -= chunk
            else:
                plan.decode.append(req)
        return plan

    def finish(self, request: Request) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

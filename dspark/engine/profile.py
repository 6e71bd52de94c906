"""Profile the engine's step-time curve SPS(B) on this machine (paper 3.2.2, 5.2).

The prefix schedulers pick verify lengths by maximising tau * SPS(B), where B
is the number of tokens the target verifies in one step. SPS(B) is measured
once per (model, drafter, hardware, dtype, settings) and cached on disk (a
`ForwardGrid` and a `CostTable`) under `<dspark home>/profiles/`; a later start with the same
`CostKey` reuses the file, any difference re-profiles.

Steps are measured on synthetic requests with a realistic cached context
(`context_len` tokens of English text, or seeded pseudo-text when no
tokenizer is at hand) in a scratch KV cache. The target forward is measured
over a grid of request counts R and budgets B, F(R, B): B split over R
requests, each verifying 1 + l_r tokens (l_r <= G, as even as possible),
because a step's time depends on how many contexts it reads as well as on
how many tokens it verifies (`ForwardGrid`). Drafting is measured apart, one
batched `propose` for R requests, D(R). The forward returns logits for all B
rows and the drafter's tapped layers, as the engine asks. `warmup` untimed
steps at the largest budget come first (they touch every buffer once); each
point is then the median of `repeats` timed steps, taken in `repeats` passes
over all the points (`measure_in_passes`: a burst of load from another job
spoils one timing of many points, not every timing of a few), and lookups read
isotonic fits (time never falls with more tokens or more drafting requests,
`ForwardGrid`, `SplitCost`). After every step the
scratch slots roll back to the context, and everything is released at the
end. Verification sampling and Python bookkeeping of a real step are not
included.
"""

from __future__ import annotations

import math
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from dspark.errors import UserError
from dspark.models.cpu_kernels import MAX_ROWS, ROW_GROUP, blocks_in_use, has_cpu_kernels
from dspark.models.device import hardware_id, synchronize
from dspark.schedule import CostKey, CostTable, budget_grid, profile_points, settings_fingerprint
from dspark.schedule.cost import ForwardGrid, SplitCost, measure_in_passes
from dspark.types import RaggedBatch, SamplingParams

# Filler for the synthetic context (tiled to context_len tokens when a tokenizer is given).
PASSAGE = (
    "The river town woke slowly. Bakers opened their shutters first, then the ferry crew "
    "checked the ropes and the engine, and by seven the market square was full of carts. "
    "A teacher walked her class to the library, where the old clock had stopped again at "
    "twenty past nine. Somebody always promised to fix it. In the afternoon the wind turned, "
    "clouds came in from the hills, and the fishermen pulled their boats higher onto the "
    "shingle. def count_words(text):\n    counts = {}\n    for word in text.split():\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n"
)


@dataclass(frozen=True)
class ProfileSettings:
    """How SPS(B) is measured. Every field is part of the cache key."""

    context_len: int = 256  # cached tokens per synthetic request (1..8192)
    max_requests: int = 16  # most synthetic requests R in one step (1..256)
    max_budget: int | None = None  # largest B measured; None: max_requests * (1 + G)
    repeats: int = 3  # timed steps per point, one per pass over all the points, median taken (1..50)
    warmup: int = 2  # untimed steps at the largest budget before any timing (0..10)
    dense_until: int = 8  # measure every B up to this, then a geometric grid (>= 1)
    ratio: float = 1.3  # geometric grid ratio past dense_until (1 < ratio <= 4)
    rows_dense_until: int = 4  # forward measured at every request count R up to this, then ...
    rows_ratio: float = 1.5  # ... a geometric grid of R with this ratio (1 < ratio <= 4), up to max_requests

    def __post_init__(self) -> None:
        checks = [
            ("context_len", 1 <= self.context_len <= 8192, "1..8192"),
            ("max_requests", 1 <= self.max_requests <= 256, "1..256"),
            ("max_budget", self.max_budget is None or self.max_budget >= 1, ">= 1 or None"),
            ("repeats", 1 <= self.repeats <= 50, "1..50"),
            ("warmup", 0 <= self.warmup <= 10, "0..10"),
            ("dense_until", self.dense_until >= 1, ">= 1"),
            ("ratio", 1.0 < self.ratio <= 4.0, "in (1, 4]"),
            ("rows_dense_until", self.rows_dense_until >= 1, ">= 1"),
            ("rows_ratio", 1.0 < self.rows_ratio <= 4.0, "in (1, 4]"),
        ]
        for name, ok, allowed in checks:
            if not ok:
                raise UserError(f"profile setting {name}={getattr(self, name)!r} is out of range; use {allowed}")

    def budgets(self, block_size: int, row_group: int | None = None, row_group_until: int | None = None) -> list[int]:
        """The budgets B to measure for a drafter of block size G (and both sides of each
        multiple of the matmul kernel's `row_group` up to `row_group_until`, see `budget_grid`)."""
        largest = self.max_requests * (1 + block_size)
        top = largest if self.max_budget is None else min(self.max_budget, largest)
        return budget_grid(top, dense_until=self.dense_until, ratio=self.ratio, row_group=row_group,
                           row_group_until=row_group_until)


    def request_rows(self, block_size: int) -> list[int]:
        """The request counts R at which the target forward F(R, B) is measured (each one
        can verify at least one token per request within the largest budget)."""
        rows = budget_grid(self.max_requests, dense_until=self.rows_dense_until, ratio=self.rows_ratio)
        return [r for r in rows if r <= self.budgets(block_size)[-1]]

    def row_budgets(self, requests: int, block_size: int, budgets: Sequence[int]) -> list[int]:
        """The budgets B measured for `requests` requests: those of `budgets` that R requests
        can verify (R <= B <= R (1 + G)), and both ends of that range."""
        top = min(requests * (1 + block_size), max(budgets))
        return sorted({b for b in budgets if requests <= b <= top} | {requests, top})


def spread_budget(budget: int, requests: int, block_size: int) -> list[int]:
    """Query lengths 1 + l_r of exactly `requests` requests verifying `budget` tokens, as
    even as possible (each in 1..1 + G)."""
    if not requests <= budget <= requests * (1 + block_size):
        raise ValueError(f"{requests} requests verify {requests}..{requests * (1 + block_size)} tokens, not {budget}")
    base, extra = divmod(budget, requests)
    return [base + 1] * extra + [base] * (requests - extra)


def split_budget(budget: int, block_size: int, max_requests: int) -> list[int]:
    """Query lengths 1 + l_r of the fewest requests that verify `budget` tokens,
    as even as possible (each in 1..1 + G)."""
    per_request = 1 + block_size
    if not 1 <= budget <= max_requests * per_request:
        raise ValueError(f"budget {budget} needs 1..{max_requests * per_request} tokens")
    return spread_budget(budget, math.ceil(budget / per_request), block_size)


# pending context rows P(n) is measured at (`StepBench.project_seconds`): below the drafters'
# pending cap (dspark.draft.dspark.MAX_PENDING_ROWS), so observing them does not project them
PROJECT_ROWS = (1, 16, 64, 256, 768)

# --------------------------------------------------------------- cache key
# bumped when a change to the runtime or the drafters changes step times, so that profiles
# cached by an older dspark are measured again instead of reused
RUNTIME_REVISION = 9  # 5: attention in parts by query length; budgets on both sides of row-group edges;
#                       6: the forward measured over (requests, tokens); 7: repeats taken in passes;
#                       8: the block-quantized kernel takes 2-8 rows one panel at a time;
#                       9: the kernel's block shapes tuned per machine and model


def profile_key(
    model_id: str, drafter_id: str, dtype: torch.dtype, device: torch.device | str,
    settings: ProfileSettings, extra: dict | None = None,
) -> CostKey:
    """The `CostKey` a profile is cached under."""
    dtype_name = str(dtype).removeprefix("torch.")
    fingerprint = settings_fingerprint({"profile": asdict(settings), **(extra or {})})
    return CostKey(
        model=f"{model_id}|{dtype_name}", drafter=drafter_id, hardware=hardware_id(device), settings=fingerprint
    )


def profile_path(key: CostKey, home: str | Path | None = None) -> Path:
    """Where the table for `key` is cached: `<home>/profiles/<model>-<hash>.json`."""
    from dspark.models.embedded import dspark_home

    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(key.model.split("|")[0]).name)[:40] or "model"
    return dspark_home(home) / "profiles" / f"{slug}-{settings_fingerprint(asdict(key))}.json"


@dataclass
class ProfileOutcome:
    table: CostTable
    path: Path | None  # the cache file (None: not cached)
    reused: bool  # True: read from the cache, nothing measured
    cost: SplitCost | None = None  # target forward F(B) and drafting D(R) apart (profile_engine)


def load_or_profile(
    key: CostKey,
    measure: Callable[[int], float],
    budgets: Sequence[int],
    *,
    path: Path | None,
    refresh: bool = False,
    progress: bool = True,
    desc: str = "profiling SPS(B)",
    passes: int = 1,
) -> ProfileOutcome:
    """Reuse the table cached at `path` if it was measured for `key`; otherwise call
    `measure(B)` (seconds per step) at every budget, once per pass (median over the
    passes), and cache the new table."""
    if path is not None and not refresh:
        try:
            cached = CostTable.try_load(path, key)  # None if missing or measured for another key
        except UserError as err:  # malformed file: say so, measure again
            print(f"[dspark] {err}", file=sys.stderr)
            cached = None
        if cached is not None:
            return ProfileOutcome(cached, path, reused=True)
    table = profile_points(measure, budgets, key=key, progress=progress, desc=desc, passes=passes)
    if path is not None:
        table.save(path)
    return ProfileOutcome(table, path, reused=False)


# ------------------------------------------------------------ measuring
def synthetic_context(length: int, vocab_size: int, tokenizer=None, seed: int = 0) -> list[int]:
    """`length` context tokens: PASSAGE tiled through `tokenizer`, or seeded
    pseudo-text (a random 48-token phrase, repeated with random edits) without one."""
    if tokenizer is not None:
        ids = [int(t) for t in tokenizer.encode(PASSAGE, add_special_tokens=False)]
        ids = [t for t in ids if 0 <= t < vocab_size]
        if ids:
            return (ids * (length // len(ids) + 1))[:length]
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, vocab_size, (48,), generator=gen)
    tiled = phrase.repeat(length // 48 + 1)[:length].clone()
    edits = torch.rand(length, generator=gen) < 0.15
    tiled[edits] = torch.randint(0, vocab_size, (int(edits.sum()),), generator=gen)
    return [int(t) for t in tiled]


class StepBench:
    """A scratch KV cache and drafter states holding `max_requests` copies of one
    context, for timing synthetic steps (see the module docstring)."""

    def __init__(self, target, drafter, settings: ProfileSettings, context_ids: list[int]) -> None:
        from dspark.models.kv_cache import KVCache

        if len(context_ids) < settings.context_len:
            raise ValueError(f"need {settings.context_len} context tokens, got {len(context_ids)}")
        self.target, self.drafter, self.settings = target, drafter, settings
        self.context_len = settings.context_len
        count, block = settings.max_requests, drafter.block_size
        weight = next(target.parameters())
        self.device = weight.device
        self.cache = KVCache(target.config, count, self.context_len + block + 1, weight.dtype, device=weight.device)
        self.slots = [self.cache.allocate() for _ in range(count)]
        context = torch.tensor(context_ids[: self.context_len], dtype=torch.int64)  # [L]
        anchor, taps = self._prefill(context)
        self.context, self.taps = context, taps
        self.states = [drafter.new_state() for _ in range(count)]
        drafter.observe(self.states, [context] * count, None if taps is None else [taps] * count)
        self.anchors = torch.full((count,), anchor, dtype=torch.int64)  # [R]
        self.params = [SamplingParams(temperature=0.0)] * count
        self.generators = [torch.Generator().manual_seed(i) for i in range(count)]

    @torch.no_grad()
    def _prefill(self, context: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """Run the context once into the first slot, copy its KV to the others."""
        first = self.slots[0]
        out = self.target.forward(
            RaggedBatch(context, [first], [len(context)]), self.cache,
            logits_rows=torch.tensor([len(context) - 1]), tap_layers=self.drafter.tap_layers,
        )
        for slot in self.slots[1:]:
            for keys, values in zip(self.cache.keys, self.cache.values):
                keys[slot].copy_(keys[first])
                values[slot].copy_(values[first])
            self.cache.commit([slot], [len(context)])
        return int(out.logits[0].argmax()), out.tapped_hidden  # tapped: [L, T, D] or None

    def _propose(self, count: int):
        return self.drafter.propose(self.states[:count], self.anchors[:count], self.params[:count],
                                    self.generators[:count])

    @torch.no_grad()
    def propose_seconds(self, count: int) -> float:
        """Time one batched propose for `count` requests (the drafting part of a step)."""
        synchronize(self.device)
        start = time.perf_counter()
        self._propose(count)
        synchronize(self.device)
        return time.perf_counter() - start

    @torch.no_grad()
    def step_seconds(self, query_lens: list[int], include_propose: bool = True) -> float:
        """Time one synthetic step: propose for len(query_lens) requests, verify their tokens.
        `include_propose=False` times the target forward alone (the propose still runs, untimed)."""
        count = len(query_lens)
        synchronize(self.device)
        start = time.perf_counter()
        proposal = self._propose(count)
        if not include_propose:
            synchronize(self.device)
            start = time.perf_counter()
        tokens: list[int] = []
        for r, q in enumerate(query_lens):
            tokens.append(int(self.anchors[r]))
            tokens.extend(int(t) for t in proposal.draft_tokens[r, : q - 1])  # q - 1 <= G
        batch = RaggedBatch(torch.tensor(tokens, dtype=torch.int64), self.slots[:count], list(query_lens))
        self.target.forward(
            batch, self.cache, logits_rows=torch.arange(len(tokens)), tap_layers=self.drafter.tap_layers
        )
        synchronize(self.device)
        seconds = time.perf_counter() - start
        for slot in self.slots[:count]:
            self.cache.truncate(slot, self.context_len)  # roll back to the context
        return seconds

    def warm_up(self, budget: int) -> None:
        """`settings.warmup` untimed steps verifying `budget` tokens."""
        lens = split_budget(budget, self.drafter.block_size, self.settings.max_requests)
        for _ in range(self.settings.warmup):
            self.step_seconds(lens)

    def measure(self, budget: int, include_propose: bool = True, requests: int | None = None,
                repeats: int | None = None) -> float:
        """Median seconds of `repeats` (default: settings.repeats) steps verifying `budget` tokens
        (or of their target forward alone), spread over `requests` requests (None: the fewest
        that can verify them)."""
        block = self.drafter.block_size
        lens = (split_budget(budget, block, self.settings.max_requests) if requests is None
                else spread_budget(budget, requests, block))
        count = self.settings.repeats if repeats is None else repeats
        return statistics.median(self.step_seconds(lens, include_propose) for _ in range(count))

    @torch.no_grad()
    def project_seconds(self, rows: int) -> float:
        """Time processing `rows` pending context rows of one fresh request (`project_pending`
        of a drafter that defers its context, see `Drafter.pending_rows`): the context's tokens
        and taps tiled to `rows`, observed, then projected."""
        repeat = -(-rows // self.context_len)
        tokens = self.context.repeat(repeat)[:rows]
        taps = None if self.taps is None else torch.cat([self.taps] * repeat)[:rows]
        state = self.drafter.new_state()
        try:
            self.drafter.observe([state], [tokens], None if taps is None else [taps])
            if self.drafter.pending_rows(state) != rows:
                raise RuntimeError(f"{self.drafter.name} holds {self.drafter.pending_rows(state)} pending rows "
                                   f"after observing {rows}; profile P(n) below its pending cap")
            synchronize(self.device)
            start = time.perf_counter()
            self.drafter.project_pending([state])
            synchronize(self.device)
            return time.perf_counter() - start
        finally:
            self.drafter.release(state)

    def measure_propose(self, count: int) -> float:
        """Median seconds of one batched propose for `count` requests."""
        return statistics.median(self.propose_seconds(count) for _ in range(self.settings.repeats))

    def close(self) -> None:
        """Release the drafter states and the scratch cache."""
        for state in self.states:
            self.drafter.release(state)
        for slot in self.slots:
            self.cache.free(slot)
        self.states, self.slots, self.cache = [], [], None

    def __enter__(self) -> "StepBench":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def profile_engine(
    target,
    drafter,
    *,
    model_id: str,
    drafter_id: str | None = None,
    settings: ProfileSettings = ProfileSettings(),
    tokenizer=None,
    home: str | Path | None = None,
    cache: bool = True,
    refresh: bool = False,
    progress: bool = True,
) -> ProfileOutcome:
    """SPS(B) for `target` + `drafter` on this machine: cached, or measured now.

    Two parts are measured (and cached) apart: the target forward F(R, B)
    (a `ForwardGrid`: at each request count R of `settings.request_rows`,
    over the budgets R of them can verify) and one batched propose D(R) for
    R = 1..max_requests. `outcome.cost` is that `SplitCost`; `outcome.table`
    is the single curve F(R, B) + D(R) at the fewest requests that verify B
    tokens, R = ceil(B / (1 + G)) (what `dspark profile` prints and plots).

    `model_id` and `drafter_id` name what is loaded (a path, a name); they go
    into the cache key with the dtype, the hardware and `settings`.
    """
    device = next(target.parameters()).device
    dtype = next(target.parameters()).dtype
    drafter_id = drafter_id or drafter.name
    extra = {"block_size": drafter.block_size, "tap_layers": list(drafter.tap_layers),
             "context": "passage" if tokenizer is not None else "pseudo-text", "runtime": RUNTIME_REVISION,
             "cpu_kernels": has_cpu_kernels(target)}
    if extra["cpu_kernels"]:  # the kernel's block shapes (tuned per machine, or DSPARK_KERNEL_BLOCKS) set step times
        extra["kernel_blocks"] = blocks_in_use()[0]
    config = getattr(drafter, "config", None)
    for field in ("draft_vocab_size", "transition_top_k"):  # drafter settings that change D(R)
        if hasattr(config, field):
            extra[field] = getattr(config, field)
    name = f"{drafter_id}|G={drafter.block_size}"
    key = profile_key(model_id, name, dtype, device, settings, extra)
    forward_key = profile_key(model_id, f"{name}|forward", dtype, device, settings, extra)
    bf16_rows = drafter.__dict__.get("cpu_kernels_bf16_rows")  # its bfloat16 path (cpu_kernels) sets D(R) alone
    draft_name = f"{name}|draft" if bf16_rows is None else f"{name}|draft|bf16>={bf16_rows}"
    draft_key = profile_key(model_id, draft_name, dtype, device, settings, extra)
    kernel = has_cpu_kernels(target)  # its row groups make step time jump at multiples of ROW_GROUP
    budgets = settings.budgets(drafter.block_size, row_group=ROW_GROUP if kernel else None, row_group_until=MAX_ROWS)
    counts = budget_grid(settings.max_requests, dense_until=settings.dense_until, ratio=settings.ratio)
    bench: StepBench | None = None

    def ready() -> StepBench:
        nonlocal bench
        if bench is None:  # built lazily: a cache hit never touches the model
            context = synthetic_context(settings.context_len, target.config.vocab_size, tokenizer)
            bench = StepBench(target, drafter, settings, context)
            bench.warm_up(max(budgets))
        return bench

    def path_of(k: CostKey) -> Path | None:
        return profile_path(k, home) if cache else None

    rows = {r: settings.row_budgets(r, drafter.block_size, budgets) for r in settings.request_rows(drafter.block_size)}
    try:
        forward, forward_reused = load_or_profile_grid(
            forward_key, lambda r, b: ready().measure(b, include_propose=False, requests=r, repeats=1), rows,
            path=path_of(forward_key), refresh=refresh, progress=progress, passes=settings.repeats)
        draft = load_or_profile(draft_key, lambda r: ready().propose_seconds(r), counts,
                                path=path_of(draft_key), refresh=refresh, progress=progress,
                                desc="profiling D(R)", passes=settings.repeats)
        project = None
        if hasattr(drafter, "project_pending"):  # it defers its context: P(n) apart (SplitCost)
            project_key = profile_key(model_id, draft_name.replace("|draft", "|project", 1), dtype, device,
                                      settings, extra)
            project = load_or_profile(project_key, lambda n: ready().project_seconds(n), PROJECT_ROWS,
                                      path=path_of(project_key), refresh=refresh, progress=progress,
                                      desc="profiling P(n)", passes=settings.repeats)
    finally:
        if bench is not None:
            bench.close()
    split = SplitCost(forward, draft.table, None if project is None else project.table)
    per_request = 1 + drafter.block_size
    fewest = {b: math.ceil(b / per_request) for b in budgets}
    table = CostTable({b: split.seconds(b, fewest[b]) for b in budgets}, key=key)
    reused = forward_reused and draft.reused and (project is None or project.reused)
    return ProfileOutcome(table, path_of(forward_key), reused=reused, cost=split)


def load_or_profile_grid(
    key: CostKey,
    measure: Callable[[int, int], float],
    rows: Mapping[int, Sequence[int]],
    *,
    path: Path | None,
    refresh: bool = False,
    progress: bool = True,
    passes: int = 1,
) -> tuple[ForwardGrid, bool]:
    """Reuse the F(R, B) grid cached at `path` if it was measured for `key` (returns it and
    True); otherwise call `measure(R, B)` (seconds) at every budget B of every row R in
    `rows`, once per pass (median over the passes), cache the new grid and return it and
    False."""
    if path is not None and not refresh:
        try:
            cached = ForwardGrid.try_load(path, key)
        except UserError as err:  # malformed file: say so, measure again
            print(f"[dspark] {err}", file=sys.stderr)
            cached = None
        if cached is not None:
            return cached, True
    if not rows or not all(rows.values()):
        raise ValueError("the forward grid needs at least one request count, each with at least one budget")
    measured: dict[int, dict[int, float]] = {r: {} for r in rows}
    pairs = [(r, b) for r, budgets in rows.items() for b in budgets]
    timed = measure_in_passes(lambda rb: measure(*rb), pairs, passes, progress=progress, desc="profiling F(R, B)")
    for (r, b), seconds in timed.items():
        measured[r][b] = seconds
    grid = ForwardGrid({r: CostTable(points) for r, points in measured.items()}, key=key)
    if path is not None:
        grid.save(path)
    return grid, False


def format_table(table: CostTable) -> str:
    """The measured points as an aligned text table."""
    lines = [f"{'B':>5} {'ms/step':>9} {'steps/s':>9} {'tokens/s':>9}"]
    for budget, seconds in table.points():
        lines.append(f"{budget:>5} {1e3 * seconds:>9.2f} {1.0 / seconds:>9.2f} {budget / seconds:>9.1f}")
    return "\n".join(lines)


def format_split(cost: SplitCost) -> str:
    """The measured parts: the forward F(R, B) as a table of budgets B (rows) by request
    counts R (columns, '-' where R requests cannot verify B tokens), then D(R)."""
    forward = cost.forward
    grid = forward.rows if isinstance(forward, ForwardGrid) else {1: forward}
    budgets = sorted({b for table in grid.values() for b in table.budgets})
    head = "F ms" if len(grid) == 1 else "F(R, B) ms, R ="
    lines = [f"{'B':>5}  {head}", f"{'':>5}  " + " ".join(f"{r:>8}" for r in grid)]
    for b in budgets:
        cells = [f"{1e3 * dict(t.points())[b]:>8.2f}" if b in t.budgets else f"{'-':>8}" for t in grid.values()]
        lines.append(f"{b:>5}  " + " ".join(cells))
    lines.append(f"\n{'R':>5}  D ms")
    lines.extend(f"{r:>5}  {1e3 * s:>7.2f}" for r, s in cost.draft.points())
    if cost.project is not None:
        lines.append(f"\n{'n':>5}  P ms (pending context rows processed before a propose)")
        lines.extend(f"{n:>5}  {1e3 * s:>7.2f}" for n, s in cost.project.points())
    return "\n".join(lines)


def run_profile(
    target_path: str | None = None,
    drafter_spec: str = "default",
    *,
    home: str | Path | None = None,
    dtype: str = "float32",
    cpu_kernels: bool = True,
    device: str = "cpu",
    block_size: int | None = None,
    settings: ProfileSettings = ProfileSettings(),
    out_png: str | Path | None = None,
    refresh: bool = False,
) -> CostTable:
    """`dspark profile`: load the target and drafter, get SPS(B) (cached or measured),
    print the table and write a plot (default: next to the cached table)."""
    from dspark.draft.registry import load_drafter
    from dspark.models import load_target

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise UserError(f"unknown dtype {dtype!r}; use float32 or bfloat16")
    loaded = load_target(target_path, home=home, dtype=torch_dtype, cpu_kernels=cpu_kernels, device=device)
    drafter = load_drafter(drafter_spec, loaded.model, block_size=block_size, embedded=target_path is None)
    start = time.perf_counter()
    outcome = profile_engine(
        loaded.model, drafter, model_id=f"{loaded.name}@{loaded.path}", drafter_id=f"{drafter_spec}:{drafter.name}",
        settings=settings, tokenizer=loaded.tokenizer, home=home, refresh=refresh,
    )
    table = outcome.table
    how = f"reused {outcome.path}" if outcome.reused else f"measured in {time.perf_counter() - start:.1f} s"
    print(f"SPS(B) for {loaded.name} + {drafter.name} (G={drafter.block_size}), {how}")
    print(f"key: {table.key}")
    print(format_table(table))
    print("\ntarget forward alone F(R, B) for R requests verifying B tokens, and one batched propose D(R):")
    print(format_split(outcome.cost))
    png = Path(out_png) if out_png is not None else (outcome.path.with_suffix(".png") if outcome.path else None)
    if png is not None:
        table.plot(png)
        grid_png = png.with_name(png.stem + "-forward.png")
        outcome.cost.forward.plot(grid_png)
        print(f"plots: {png}, {grid_png}")
    return table

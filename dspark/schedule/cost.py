"""The SPS cost table: steps per second of the engine against the verify budget.

B is the number of tokens the target verifies in one step, B = sum over the
requests of (1 + l_r). The engine measures the seconds one step takes at a few
budgets; `CostTable` turns those points into an O(1) lookup `sps(B)`:

- between measured budgets, time per step is interpolated linearly;
- below the first measured budget, time is the first point's time (flat);
- beyond the last measured budget, time is extrapolated linearly with the slope
  of the last measured segment (or, where that slope is not positive, the mean
  slope over the whole range, floored at zero).

The raw points are always kept. `monotone()` returns a copy whose lookup uses
an isotonic (non-decreasing) fit of time against B, which smooths measurement
noise; the raw, jagged curve stays available because the asynchronous
scheduler (paper section 5.2) searches it globally and can exploit its cliffs.

A table carries a `CostKey` (model, drafter, hardware, settings fingerprint) so
the engine can cache it on disk: `CostTable.load` refuses a file measured for
another key.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark.errors import UserError

_FORMAT = "dspark-cost-table"
_GRID_FORMAT = "dspark-forward-grid"
_VERSION = 1


def _save_json(path: str | Path, data: dict) -> None:
    """Write `data` as JSON to `path` through a temporary file: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


class CostKeyMismatch(UserError):
    """A cached cost table was measured for another model, drafter, machine or setting."""


@dataclass(frozen=True)
class CostKey:
    """What a cost table was measured for; a cached table is reused only on an exact match."""

    model: str  # target model identity (name or path plus dtype)
    drafter: str  # drafter identity (kind plus block size)
    hardware: str  # device description (e.g. "cpu:2 cores" or a GPU name)
    settings: str  # fingerprint of the engine settings that change step time


def settings_fingerprint(settings: Mapping[str, object]) -> str:
    """A short stable hash of JSON-serialisable settings, for `CostKey.settings`."""
    text = json.dumps(settings, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def budget_grid(max_budget: int, dense_until: int = 16, ratio: float = 1.25, row_group: int | None = None,
                row_group_until: int | None = None) -> list[int]:
    """Budgets worth measuring up to `max_budget`: every B up to `dense_until`
    (small budgets are where step time is most jagged), then a geometric grid.

    `row_group`: the matmul kernel multiplies rows in groups of this many, so step time jumps
    where B passes a multiple of it (dspark's CPU kernel: 8; a 17th row costs a whole new
    group). Both sides of every such boundary are measured too, k * row_group and
    k * row_group + 1, so interpolation does not smear the jump over the geometric grid's gap
    and the scheduler sees that verifying one token past a boundary costs as much as eight.
    `row_group_until`: the largest row count the kernel serves (None: any)."""
    if max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {max_budget}")
    if ratio <= 1.0:
        raise ValueError(f"ratio must be > 1, got {ratio}")
    if row_group is not None and row_group < 1:
        raise ValueError(f"row_group must be >= 1, got {row_group}")
    grid = list(range(1, min(dense_until, max_budget) + 1))
    b = float(grid[-1])
    while grid[-1] < max_budget:
        b *= ratio
        grid.append(min(max_budget, max(grid[-1] + 1, round(b))))
    if row_group:
        edges = range(row_group, min(max_budget, row_group_until or max_budget) + 1, row_group)
        grid = sorted(set(grid) | set(edges) | {e + 1 for e in edges if e + 1 <= max_budget})
    return grid


def _isotonic(values: Sequence[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []  # each block: [mean, count]
    for v in values:
        blocks.append([float(v), 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean, count = blocks.pop()
            prev = blocks[-1]
            prev[0] = (prev[0] * prev[1] + mean * count) / (prev[1] + count)
            prev[1] += count
    fitted: list[float] = []
    for mean, count in blocks:
        fitted.extend([mean] * int(count))
    return fitted


class CostTable:
    """Seconds per step (and steps per second) of the engine as a function of B.

    `points` maps measured budgets B >= 1 to seconds per step (> 0). Lookups
    for B <= the largest measured budget read a dense precomputed list; larger
    B use a linear formula, so every lookup is O(1).
    """

    def __init__(
        self,
        points: Mapping[int, float] | Sequence[tuple[int, float]],
        key: CostKey | None = None,
        monotone: bool = False,
    ) -> None:
        items = list(points.items()) if isinstance(points, Mapping) else list(points)
        if not items:
            raise ValueError("a cost table needs at least one measured point")
        budgets = [int(b) for b, _ in items]
        if len(set(budgets)) != len(budgets):
            raise ValueError(f"duplicate budgets in cost table points: {sorted(budgets)}")
        for b, s in items:
            if int(b) != b or b < 1:
                raise ValueError(f"budgets must be integers >= 1, got {b}")
            if not (math.isfinite(s) and s > 0):
                raise ValueError(f"seconds per step must be finite and > 0, got {s} at B={b}")
        ordered = sorted((int(b), float(s)) for b, s in items)
        self.key = key
        self.is_monotone = monotone
        self.budgets: list[int] = [b for b, _ in ordered]
        self.raw_seconds: list[float] = [s for _, s in ordered]
        self.seconds: list[float] = _isotonic(self.raw_seconds) if monotone else list(self.raw_seconds)
        self._dense = self._densify()  # seconds per step for B = 0..max budget (index 0 unused)
        self._tail_slope = self._extrapolation_slope()

    @classmethod
    def from_sps(cls, sps: Mapping[int, float], key: CostKey | None = None) -> "CostTable":
        """Build from steps per second instead of seconds per step (tests, the paper's examples)."""
        return cls({b: 1.0 / v for b, v in sps.items()}, key=key)

    def monotone(self) -> "CostTable":
        """A copy whose lookup uses the isotonic (non-decreasing time) fit of the raw points."""
        return CostTable(self.points(), key=self.key, monotone=True)

    def points(self) -> list[tuple[int, float]]:
        """The raw measured points (B, seconds per step), sorted by B."""
        return list(zip(self.budgets, self.raw_seconds))

    @property
    def max_budget(self) -> int:
        return self.budgets[-1]

    def _densify(self) -> list[float]:
        dense = [self.seconds[0]] * (self.budgets[-1] + 1)
        for (b0, s0), (b1, s1) in zip(zip(self.budgets, self.seconds), zip(self.budgets[1:], self.seconds[1:])):
            for b in range(b0, b1 + 1):
                dense[b] = s0 + (s1 - s0) * (b - b0) / (b1 - b0)
        return dense

    def _extrapolation_slope(self) -> float:
        if len(self.budgets) < 2:
            return 0.0
        last = (self.seconds[-1] - self.seconds[-2]) / (self.budgets[-1] - self.budgets[-2])
        if last > 0:
            return last
        mean = (self.seconds[-1] - self.seconds[0]) / (self.budgets[-1] - self.budgets[0])
        return max(0.0, mean)

    def seconds_per_step(self, budget: int) -> float:
        """Seconds one step takes when it verifies `budget` tokens in total."""
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        if budget < len(self._dense):
            return self._dense[budget]
        return self.seconds[-1] + self._tail_slope * (budget - self.budgets[-1])

    def sps(self, budget: int) -> float:
        """Steps per second at a verify budget of `budget` tokens."""
        return 1.0 / self.seconds_per_step(budget)

    def to_json(self) -> dict:
        return {
            "format": _FORMAT,
            "version": _VERSION,
            "key": asdict(self.key) if self.key is not None else None,
            "monotone": self.is_monotone,
            "points": [[b, s] for b, s in self.points()],
        }

    def save(self, path: str | Path) -> None:
        _save_json(path, self.to_json())

    @classmethod
    def from_json(cls, data: dict, source: str = "cost table") -> "CostTable":
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise UserError(f"{source} is not a dspark cost table; delete it to re-profile")
        if data.get("version") != _VERSION:
            raise UserError(f"{source} has cost table version {data.get('version')}, expected {_VERSION}; delete it to re-profile")
        try:
            key = CostKey(**data["key"]) if data["key"] is not None else None
            points = [(int(b), float(s)) for b, s in data["points"]]
            return cls(points, key=key, monotone=bool(data["monotone"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{source} is malformed ({exc}); delete it to re-profile") from exc

    @classmethod
    def load(cls, path: str | Path, key: CostKey | None) -> "CostTable":
        """Read a saved table; raise `CostKeyMismatch` if it was measured for another key."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise UserError(f"cost table {path} does not exist; profile the engine to create it") from exc
        except json.JSONDecodeError as exc:
            raise UserError(f"cost table {path} is not valid JSON ({exc}); delete it to re-profile") from exc
        table = cls.from_json(data, source=f"cost table {path}")
        if table.key != key:
            raise CostKeyMismatch(
                f"cost table {path} was measured for {table.key}, not {key}; "
                "delete it or point the engine at another file to re-profile"
            )
        return table

    @classmethod
    def try_load(cls, path: str | Path, key: CostKey | None) -> "CostTable | None":
        """`load`, but None when the file is missing or was measured for another key."""
        if not Path(path).exists():
            return None
        try:
            return cls.load(path, key)
        except CostKeyMismatch:
            return None

    def plot(self, path: str | Path, title: str | None = None) -> None:
        """Write a PNG: steps per second and milliseconds per step against B."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        grid = list(range(1, self.max_budget + 1))
        fig = Figure(figsize=(10, 4))
        FigureCanvasAgg(fig)
        ax_sps, ax_ms = fig.subplots(1, 2)
        ax_sps.plot(grid, [self.sps(b) for b in grid], label="lookup")
        ax_sps.plot(self.budgets, [1.0 / s for s in self.raw_seconds], "o", ms=3, label="measured")
        ax_sps.set(xlabel="B (tokens verified per step)", ylabel="steps per second", title="SPS(B)")
        ax_ms.plot(grid, [1e3 * self.seconds_per_step(b) for b in grid], label="lookup")
        ax_ms.plot(self.budgets, [1e3 * s for s in self.raw_seconds], "o", ms=3, label="measured")
        ax_ms.set(xlabel="B (tokens verified per step)", ylabel="ms per step", title="time per step")
        for ax in (ax_sps, ax_ms):
            ax.grid(alpha=0.3)
            ax.legend()
        if title or self.key is not None:
            fig.suptitle(title or f"{self.key.model} / {self.key.drafter} / {self.key.hardware}", fontsize=9)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(str(path), dpi=110)


def profile_points(
    measure: Callable[[int], float],
    budgets: Sequence[int],
    key: CostKey | None = None,
    monotone: bool = False,
    progress: bool = True,
    desc: str = "profiling SPS(B)",
    passes: int = 1,
) -> CostTable:
    """Measure seconds per step at each budget with `measure(B)` and build a table.

    `measure` runs one engine step (or, with passes=1, as many as it likes) that
    verifies B tokens in total and returns its time in seconds. `passes` > 1
    measures every budget once per pass and keeps the median (`measure_in_passes`).
    """
    points = measure_in_passes(lambda b: measure(int(b)), [int(b) for b in budgets], passes,
                               progress=progress, desc=desc, what="budget")
    return CostTable(points, key=key, monotone=monotone)


def measure_in_passes(measure: Callable, points: Sequence, passes: int = 1, *, progress: bool = True,
                      desc: str = "profiling", what: str = "point") -> dict:
    """{point: median seconds of `measure(point)` over `passes` sweeps of all the points}.

    One sweep per pass, forward then backward in turn, instead of all the repeats of
    one point back to back: a burst of load on a shared machine (another job for a
    few seconds) then spoils one of each point's timings, which the median drops,
    rather than all the timings of a few neighbouring points. Measured on this CPU
    (session 20's profile, taken back to back while a training job ran): a plain
    decode step of 16 requests came out at 153 ms and the same step verifying one
    more token at 125 ms, so every drafted step looked cheaper than not drafting."""
    import statistics

    from tqdm.auto import tqdm

    if not points:
        raise ValueError(f"measuring needs at least one {what}")
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    order = list(points)
    timings: dict = {p: [] for p in order}
    with tqdm(total=passes * len(order), desc=desc, unit="point", disable=not progress) as bar:
        for k in range(passes):
            for p in order if k % 2 == 0 else reversed(order):
                seconds = float(measure(p))
                if not (math.isfinite(seconds) and seconds > 0):
                    raise ValueError(f"measure({p}) returned {seconds}; it must return seconds per step (> 0)")
                timings[p].append(seconds)
                bar.update()
    return {p: statistics.median(t) for p, t in timings.items()}


class ForwardGrid:
    """The target forward measured over requests and tokens: F(R, B).

    A step of R requests verifying B tokens (R <= B <= R (1 + G)) reads R
    requests' contexts and runs attention in R ragged parts, so its time
    depends on R as well as on B. On this CPU a plain decode step of 16
    requests (B = 16) took 168 ms, 16 tokens split over 2 requests 147 ms
    (docs/LOAD.md, run N). A curve over B alone, measured on the
    fewest requests, therefore makes a plain step of many requests look cheap
    and each extra verified token look dear.

    `rows` maps measured request counts R to a `CostTable` over B (its budgets
    from R to R (1 + G)). Lookups read each row's isotonic fit (time never
    falls as B grows: verifying one more token cannot make a forward faster),
    so a noisy dip cannot make a drafted step look cheaper than a plain one;
    the fit keeps the real upward cliffs (a new row group of the CPU kernel)
    and `points()`, the file and the plot keep the raw measurements. A lookup
    for an unmeasured R interpolates linearly between the two nearest
    measured rows, at the same B; below the smallest
    row it reads that row. Past the largest measured row R_max it scales that
    row at the same tokens per request: F(R, B) = (R / R_max) F(R_max, B R_max / R)
    (read between budgets linearly), as if the step were R / R_max steps of
    R_max requests with the same mix. Within a row, `CostTable`'s own rules
    (and below a row's first budget, its first slope backwards).

    Why scale and not extrapolate in R at fixed B: the profile measures up to
    16 requests while a server holds 32 and the load benchmark 64. The old
    rule, the last two rows' slope in R at the same B, multiplied the noise
    of a difference of two rows by R - R_max: at 64 requests it priced 16
    extra verified tokens at 14 ms on a 400 ms step (0.9 ms a token against
    6 ms for a plain one), the gate drafted in 80 % of the steps and lost 26
    % throughput to no speculation (docs/LOAD.md, run X2). Scaling is exact
    for a cost proportional to the batch; where bigger batches are cheaper
    per row it overprices plain and drafted steps alike, which the gate's
    measured cost ratios correct, and it keeps a verified token's price
    relative to a plain step's what it was measured to be at R_max.
    """

    def __init__(self, rows: Mapping[int, CostTable], key: CostKey | None = None) -> None:
        if not rows:
            raise ValueError("a forward grid needs at least one measured request count")
        for r in rows:
            if int(r) != r or r < 1:
                raise ValueError(f"request counts must be integers >= 1, got {r}")
        self.rows: dict[int, CostTable] = {int(r): rows[r] for r in sorted(rows)}  # as measured
        self._fits = {r: t if t.is_monotone else t.monotone() for r, t in self.rows.items()}  # what lookups read
        self.counts: list[int] = list(self.rows)
        self.key = key

    def seconds_per_step(self, budget: int, requests: int) -> float:
        """Seconds of the target forward for `requests` requests verifying `budget` tokens."""
        if requests < 1:
            raise ValueError(f"requests must be >= 1, got {requests}")
        counts, row = self.counts, self._row_seconds
        if requests <= counts[0]:
            return row(counts[0], budget)
        if requests >= counts[-1]:
            top = counts[-1]
            scaled = budget * top / requests  # the same tokens per request in the measured row
            low = math.floor(scaled)
            s0 = row(top, max(1, low))
            s1 = row(top, low + 1) if scaled > low else s0
            return requests / top * (s0 + (s1 - s0) * (scaled - low))
        i = bisect.bisect_left(counts, requests)
        r0, r1 = counts[i - 1], counts[i]
        s0, s1 = row(r0, budget), row(r1, budget)
        return s0 + (s1 - s0) * (requests - r0) / (r1 - r0)

    def _row_seconds(self, requests: int, budget: int) -> float:
        """Row `requests` at `budget`; below the row's first budget (its R: fewer tokens than
        requests, asked only while interpolating from a smaller row) the row's first slope
        continues backwards (floored at zero, and at half the first point)."""
        table = self._fits[requests]
        first = table.budgets[0]
        if budget >= first or len(table.budgets) == 1:
            return table.seconds_per_step(budget)
        s0 = table.seconds_per_step(first)
        slope = max(0.0, (table.seconds_per_step(table.budgets[1]) - s0) / (table.budgets[1] - first))
        return max(0.5 * s0, s0 - slope * (first - budget))

    def points(self) -> list[tuple[int, int, float]]:
        """Every measured point as (R, B, seconds), sorted by R then B."""
        return [(r, b, s) for r, table in self.rows.items() for b, s in table.points()]

    def to_json(self) -> dict:
        return {"format": _GRID_FORMAT, "version": _VERSION, "key": asdict(self.key) if self.key else None,
                "rows": {str(r): [[b, s] for b, s in t.points()] for r, t in self.rows.items()}}

    def save(self, path: str | Path) -> None:
        _save_json(path, self.to_json())

    @classmethod
    def from_json(cls, data: dict, source: str = "forward grid") -> "ForwardGrid":
        if not isinstance(data, dict) or data.get("format") != _GRID_FORMAT or data.get("version") != _VERSION:
            raise UserError(f"{source} is not a dspark forward grid of version {_VERSION}; delete it to re-profile")
        try:
            key = CostKey(**data["key"]) if data["key"] is not None else None
            rows = {int(r): CostTable([(int(b), float(s)) for b, s in pts]) for r, pts in data["rows"].items()}
            return cls(rows, key=key)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UserError(f"{source} is malformed ({exc}); delete it to re-profile") from exc

    @classmethod
    def try_load(cls, path: str | Path, key: CostKey | None) -> "ForwardGrid | None":
        """The grid saved at `path` if it was measured for `key`; None when missing or measured
        for another key; `UserError` when the file is not a readable grid."""
        path = Path(path)
        if not path.exists():
            return None
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise UserError(f"forward grid {path} is not valid JSON ({exc}); delete it to re-profile") from exc
        grid = cls.from_json(data, source=f"forward grid {path}")
        return grid if grid.key == key else None

    def plot(self, path: str | Path, title: str | None = None) -> None:
        """Write a PNG: ms per forward against B, one line per measured request count."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.5, 4.2))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for r, table in self.rows.items():
            ax.plot(table.budgets, [1e3 * s for s in table.raw_seconds], "o-", ms=2.5, lw=1, label=f"R={r}")
        ax.set(xlabel="B (tokens verified per step)", ylabel="ms per target forward",
               title=title or "F(R, B): target forward by requests R and tokens B")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(str(path), dpi=110)


MEMO_ENTRIES = 1 << 16  # (B, R) prices a SplitCost remembers (under 10 MB of dict)


class SplitCost:
    """Step time split into its two parts: seconds = F(B) + D(R).

    F (`forward`) is the target forward that verifies B tokens: a `CostTable`
    over B, or a `ForwardGrid` F(R, B) that also sees how many requests share
    the step. D (`draft`) is one batched `propose` for R requests (its table's
    "budget" axis is R). A step of R requests of which R' drafted, verifying B
    tokens, takes F(R, B) + D(R'); a step whose drafting was skipped takes
    F(R, R) (each request decodes one token).

    Why split: drafting costs per *request*, verification per *token*. On a
    GPU D is a few percent of a step and a single curve over B is enough; on
    a CPU drafting is 20-40 % of a round (docs/DRAFTING.md), R requests with
    l = 0 still pay D(R), and only this split lets the scheduler see that
    skipping the draft altogether is sometimes the faster step.

    `given_requests(R', R)` is the single curve SPS(B) = 1 / (F(R, B) + D(R'))
    that Algorithm 1 walks for a batch of R requests, R' of which drafted.

    P (`project`, optional) is what a drafter that processes context lazily
    (`Drafter.pending_rows`) pays first in a propose: P(n) seconds for n pending
    rows (its table's "budget" axis is n). D(R) is measured with no row pending.
    The draft gate adds P of the rows its chosen requests hold (docs/LOAD.md,
    run BH: at four clients with think time a chosen request held 100 rows on
    average, and projecting them was half of the propose).
    """

    def __init__(self, forward: "CostTable | ForwardGrid", draft: CostTable, project: CostTable | None = None) -> None:
        self.forward, self.draft, self.project = forward, draft, project  # as measured
        # lookups of D and P read their isotonic fits: more requests or rows are never cheaper
        self._draft_fit = draft if draft.is_monotone else draft.monotone()
        self._project_fit = None if project is None else project if project.is_monotone else project.monotone()
        self.key = forward.key
        # the draft gate prices every prefix of a step's admission path (R x G lookups a step);
        # the tables never change, so each (B, R) is read once
        self._forward_memo: dict[tuple[int, int], float] = {}

    def draft_seconds(self, requests: int) -> float:
        """D(R): one batched propose for `requests` requests (0 for none)."""
        return self._draft_fit.seconds_per_step(requests) if requests > 0 else 0.0

    def project_seconds(self, rows: int) -> float:
        """P(n): processing `rows` pending context rows before a propose (0 for none, or when no
        P was measured)."""
        return self._project_fit.seconds_per_step(rows) if rows > 0 and self._project_fit is not None else 0.0

    def forward_seconds(self, budget: int, requests: int) -> float:
        """F(R, B): the target forward of `requests` requests verifying `budget` tokens."""
        key = (budget, requests)
        seconds = self._forward_memo.get(key)
        if seconds is None:
            if isinstance(self.forward, ForwardGrid):
                seconds = self.forward.seconds_per_step(budget, requests)
            else:
                seconds = self.forward.seconds_per_step(budget)
            if len(self._forward_memo) < MEMO_ENTRIES:
                self._forward_memo[key] = seconds
        return seconds

    def seconds(self, budget: int, requests: int, drafted: int | None = None) -> float:
        """Seconds of one step of `requests` requests verifying `budget` tokens, of which
        `drafted` requests drafted (None: all of them; 0 or False: a plain step)."""
        count = requests if drafted is None else int(drafted)
        return self.forward_seconds(budget, requests) + self.draft_seconds(count)

    def given_requests(self, drafted: int, requests: int | None = None) -> "_DraftedCurve":
        """The SPS(B) curve of a step of `requests` requests (default: `drafted`), `drafted` of
        which drafted."""
        return _DraftedCurve(self, drafted, drafted if requests is None else requests)

    def points(self) -> list[tuple]:
        """The forward's measured points, (B, seconds) or (R, B, seconds) for a grid."""
        return self.forward.points()

    def to_json(self) -> dict:
        return {"forward": self.forward.to_json(), "draft": self.draft.to_json()}


class _DraftedCurve:
    """SPS(B) of a drafted step of a fixed number of requests (duck-types `CostTable.sps`)."""

    def __init__(self, cost: SplitCost, drafted: int, requests: int) -> None:
        self._cost, self._requests = cost, max(1, requests)
        self._draft = cost.draft_seconds(max(1, drafted))

    def seconds_per_step(self, budget: int) -> float:
        return self._cost.forward_seconds(budget, self._requests) + self._draft

    def sps(self, budget: int) -> float:
        return 1.0 / self.seconds_per_step(budget)


def curve_for(cost: "CostTable | SplitCost", drafted: int, requests: int | None = None):
    """The SPS(B) curve a scheduler walks for a step of `requests` requests (default:
    `drafted`), `drafted` of which drafted."""
    return cost.given_requests(drafted, requests) if isinstance(cost, SplitCost) else cost

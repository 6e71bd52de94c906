"""Which prompts two offline pages scored on the same answers, told by one drafter scored on both.

    python -m dspark.eval.same_answers docs/offline/A.json:LABEL runs/offline/B.json:LABEL2 [...]

`dspark eval offline` pages written before answer hashes existed cannot say
which answers they scored. Scoring is deterministic, so one drafter (the same
weights under each page's label) scored on both pages tells: where its counts
agree to 1e-9 the answers were the same, where they differ they were not. Give
the pages in a chain (A and B share one drafter, B and C another, ...) to
link pages that share none; a prompt counts as differing along the chain if it
differs at any link (conservative: it is left out). The output ends with the ids to pass to `dspark eval offline
--exclude` so an `--against` pairing uses only the shared answers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dspark.errors import UserError

USAGE = "usage: python -m dspark.eval.same_answers PAGE.json:LABEL PAGE.json:LABEL [PAGE.json:LABEL PAGE.json:LABEL ...]"


def _side(spec: str) -> tuple[str, dict]:
    path, sep, label = spec.rpartition(":")
    if not sep or not path.endswith(".json"):
        raise UserError(f"{spec!r}: give PAGE.json:LABEL (a drafter's label on an offline page's JSON)")
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{spec!r}: {path} does not exist") from None
    except ValueError as err:
        raise UserError(f"{spec!r}: {path} is not JSON ({err})") from None
    found = [d for d in data.get("drafters", []) if d.get("label") == label]
    if not found:
        labels = ", ".join(d.get("label", "?") for d in data.get("drafters", []))
        raise UserError(f"{spec!r}: no drafter labelled {label!r} in {path}; it holds {labels or 'none'}")
    return path, found[0]["per_prompt"]


def compare(a: str, b: str, tol: float = 1e-9) -> tuple[list[str], list[str]]:
    """(prompt ids scored on both, ids whose counts differ): "set/id" as `--exclude` takes them."""
    _, x = _side(a)
    _, y = _side(b)
    both, differ = [], []
    for name, rows in x.items():
        for pid, c in rows.items():
            other = y.get(name, {}).get(pid)
            if other is None:
                continue
            both.append(f"{name}/{pid}")
            if c["blocks"] != other["blocks"] or abs(c["tau_sum"] - other["tau_sum"]) > tol:
                differ.append(f"{name}/{pid}")
    return both, differ


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) < 2 or len(args) % 2:
            raise UserError(USAGE)
        union: set[str] = set()
        for a, b in zip(args[::2], args[1::2]):
            both, differ = compare(a, b)
            if not both:
                raise UserError(f"{a} and {b} share no prompt; pick pages scored on the same benchmarks")
            print(f"{a}  vs  {b}: {len(both)} prompts on both, {len(differ)} scored differently"
                  + (f" ({', '.join(differ)})" if differ else ""))
            union.update(differ)
        print(f"answers that differ along the chain: {len(union)}")
        if union:
            print("--exclude " + ",".join(sorted(union)))
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

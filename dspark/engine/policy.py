"""Build a verify-length policy from the settings a user gives."""

from __future__ import annotations

from dspark.schedule import CostTable, VerifyPolicy, make_policy


def build_policy(
    name: str, *, block_size: int, cost: CostTable | None = None, threshold: float = 0.5
) -> VerifyPolicy:
    """`fixed` verifies block_size tokens; `threshold` uses `threshold`; the
    DSpark schedulers need the engine's cost table."""
    options = {"fixed": {"k": block_size}, "threshold": {"threshold": threshold}}.get(name, {})
    return make_policy(name, cost, **options)

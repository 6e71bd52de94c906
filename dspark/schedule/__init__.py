"""Schedule stage: pure-Python verify-length policies and the SPS cost table.

No model code and no torch here: the engine hands in `ScheduleRequest`s
(ids, drafted counts, confidences as plain floats), gets verify lengths back
from `policy.decide`, and reports outcomes with `policy.commit`.
"""

from dspark.schedule.base import (
    ScheduleOutcome,
    ScheduleRequest,
    StepTiming,
    VerifyPolicy,
    expected_accepted,
    survival,
)
from dspark.schedule.cost import CostKey, CostKeyMismatch, CostTable, budget_grid, profile_points, settings_fingerprint
from dspark.schedule.policies import (
    POLICY_NAMES,
    AsyncPrefixScheduler,
    FixedLength,
    NoSpeculation,
    PrefixScheduler,
    RetrospectivePrefixScheduler,
    StaticThreshold,
    make_policy,
)

__all__ = [
    "AsyncPrefixScheduler",
    "CostKey",
    "CostKeyMismatch",
    "CostTable",
    "FixedLength",
    "NoSpeculation",
    "POLICY_NAMES",
    "PrefixScheduler",
    "RetrospectivePrefixScheduler",
    "ScheduleOutcome",
    "ScheduleRequest",
    "StaticThreshold",
    "StepTiming",
    "VerifyPolicy",
    "budget_grid",
    "expected_accepted",
    "make_policy",
    "profile_points",
    "settings_fingerprint",
    "survival",
]

"""Verify stage: lossless rejection sampling of draft tokens against the target.

`verify` is the engine's entry point; `verify_greedy` is its all-greedy fast
path; `verify_with_uniforms` is the same rule on explicit uniforms (tests,
simulations); `reference` holds the slow one-request-at-a-time version.
"""

from dspark.verify.rejection import draw_uniforms, verify, verify_greedy, verify_with_uniforms
from dspark.verify.sampling import SamplingTensors, sample, target_probs

__all__ = [
    "SamplingTensors",
    "draw_uniforms",
    "sample",
    "target_probs",
    "verify",
    "verify_greedy",
    "verify_with_uniforms",
]

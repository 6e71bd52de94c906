"""The arms of the load benchmark: each is a (drafter, verify policy) pair run
in this process, or a running `dspark serve` started with one.

The paper's comparison (sections 5.3-5.4, Figs 7-8) has six arms:

    nospec        no speculation                  drafter none,   policy none
    mtp1          MTP-1                           an MTP drafter, fixed k=1
    dspark-k7     DSpark verifying its whole block a DSpark drafter (G=7), fixed k=7
    threshold     static confidence threshold     the DSpark drafter, threshold
    dspark        DSpark causal scheduler (Alg 1) the DSpark drafter, dspark
    dspark-async  DSpark asynchronous (5.2)       the DSpark drafter, dspark-async

An arm whose drafter does not exist yet carries `pending` (why) and is
reported, never run with something else in its place.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dspark.errors import UserError
from dspark.schedule import POLICY_NAMES

SERVING_POLICIES = tuple(p for p in POLICY_NAMES if p != "retrospective")


@dataclass(frozen=True)
class Arm:
    """One configuration under test."""

    name: str
    drafter: str = "none"  # in process: none | ngram | default | mtp1 | a drafter folder
    policy: str = "none"  # none | fixed | threshold | dspark | dspark-async ("" for a URL arm)
    k: int | None = None  # fixed: verify length (None: the drafter's block size)
    threshold: float = 0.5  # threshold policy: survival threshold in [0, 1]
    block_size: int | None = None  # block size of the model-free drafters (none, ngram)
    url: str | None = None  # HTTP: a running server started with this drafter and policy
    pending: str | None = None  # why the arm cannot run yet; reported, never run
    drafter_bf16: str | None = None  # a learned drafter's bfloat16 path on the CPU: auto | on | off (None: the environment's)
    gate_pending: str | None = None  # the schedulers' gate prices pending context rows: on | off (None: on)
    gate_choices: str | None = None  # the schedulers' gate corrects for choosing on stale curves: on | off (None: off)
    probe_max: int | None = None  # the schedulers' gate: longest probe interval in steps (None: the gate's, 128)

    def __post_init__(self) -> None:
        if not self.name or "=" in self.name or "," in self.name:
            raise UserError(f"bad arm name {self.name!r}: use letters, digits and dashes")
        if self.url is None and self.policy not in SERVING_POLICIES:
            raise UserError(f"arm {self.name}: unknown policy {self.policy!r}; use one of {', '.join(SERVING_POLICIES)}")
        if self.drafter_bf16 not in (None, "auto", "on", "off"):
            raise UserError(f"arm {self.name}: bf16={self.drafter_bf16} is unknown; use bf16=auto, bf16=on or bf16=off")
        for option, value in (("pending", self.gate_pending), ("choices", self.gate_choices)):
            if value not in (None, "on", "off"):
                raise UserError(f"arm {self.name}: {option}={value} is unknown; use {option}=on or {option}=off")
            if value is not None and self.policy not in ("dspark", "dspark-async"):
                raise UserError(f"arm {self.name}: {option}= is an option of the dspark and dspark-async policies, "
                                f"not {self.policy or 'a URL arm'}")
        if self.probe_max is not None and self.policy not in ("dspark", "dspark-async"):
            raise UserError(f"arm {self.name}: probe_max= is an option of the dspark and dspark-async policies, "
                            f"not {self.policy or 'a URL arm'}")

    @property
    def policy_options(self) -> dict:
        if self.policy == "fixed":
            return {"k": self.k}
        if self.policy == "threshold":
            return {"threshold": self.threshold}
        gate = {"pending": self.gate_pending, "choices": self.gate_choices, "probe_max": self.probe_max}
        return {k: v for k, v in gate.items() if v is not None}

    def as_dict(self) -> dict:
        return asdict(self)


def paper_arms(dspark_drafter: str | None, mtp_drafter: str | None, *, threshold: float = 0.5,
               block: int = 7) -> list[Arm]:
    """The six arms of the paper's serving comparison. `dspark_drafter` and
    `mtp_drafter` are drafter folders; None marks their arms pending."""
    no_dspark = None if dspark_drafter else "no trained DSpark drafter yet: pass its folder"
    no_mtp = None if mtp_drafter else "no trained MTP-1 drafter yet: pass its folder"
    d = dspark_drafter or "<dspark drafter>"
    return [
        Arm("nospec", "none", "none"),
        Arm("mtp1", mtp_drafter or "<mtp drafter>", "fixed", k=1, pending=no_mtp),
        Arm(f"dspark-k{block}", d, "fixed", k=block, pending=no_dspark),
        Arm("threshold", d, "threshold", threshold=threshold, pending=no_dspark),
        Arm("dspark", d, "dspark", pending=no_dspark),
        Arm("dspark-async", d, "dspark-async", pending=no_dspark),
    ]


def parse_arm(spec: str) -> Arm:
    """`NAME=URL` (a running server) or `NAME=DRAFTER:POLICY[:OPTION]`, OPTION
    being k for `fixed` and the threshold for `threshold`; e.g.
    `nospec=none:none`, `ngram7=ngram:fixed:7`, `b=http://127.0.0.1:8001`. A learned drafter's
    arm may end in `:bf16=on` or `:bf16=off` (its bfloat16 path on the CPU, dspark.models.cpu_kernels),
    e.g. `exact=default:dspark:bf16=off`; a scheduler's arm in `:pending=off` (its draft gate ignores
    the context rows a draft must process first, as before docs/LOAD.md run BH), e.g.
    `old=default:dspark:pending=off`, and in `:choices=on` (its draft gate also scales the curves
    it chooses on by how its own choices fared; off by default, docs/LOAD.md run BP), and in
    `:probe_max=N` (the longest interval, in steps, its gate's probes back off to while they find
    nothing worth drafting; 128 by default, docs/LOAD.md session 47)."""
    name, sep, value = spec.partition("=")
    if sep and ":probe_max=" in value and not value.startswith(("http://", "https://")):
        value, _, steps = value.rpartition(":probe_max=")
        if not steps.isdigit():
            raise UserError(f"arm {spec!r}: probe_max takes a whole number of steps, got {steps!r}")
        return Arm(**{**parse_arm(f"{name}={value}").as_dict(), "probe_max": int(steps)})
    if sep and ":choices=" in value and not value.startswith(("http://", "https://")):
        value, _, choices = value.rpartition(":choices=")
        return Arm(**{**parse_arm(f"{name}={value}").as_dict(), "gate_choices": choices})
    if sep and ":pending=" in value and not value.startswith(("http://", "https://")):
        value, _, pending = value.rpartition(":pending=")
        return Arm(**{**parse_arm(f"{name}={value}").as_dict(), "gate_pending": pending})
    if sep and ":bf16=" in value and not value.startswith(("http://", "https://")):
        value, _, bf16 = value.rpartition(":bf16=")
        return Arm(**{**_parse_plain_arm(f"{name}={value}").as_dict(), "drafter_bf16": bf16})
    return _parse_plain_arm(spec)


def _parse_plain_arm(spec: str) -> Arm:
    name, sep, value = spec.partition("=")
    if not sep or not name or not value:
        raise UserError(f"bad arm {spec!r}: use NAME=DRAFTER:POLICY[:OPTION] or NAME=http://127.0.0.1:PORT")
    if value.startswith(("http://", "https://")):
        from dspark.bench.clients import loopback_url

        return Arm(name, drafter="", policy="", url=loopback_url(value))  # as the server was started
    parts = value.split(":")
    if len(parts) >= 2 and parts[-1] in SERVING_POLICIES:
        return Arm(name, ":".join(parts[:-1]), parts[-1])
    if len(parts) >= 3 and parts[-2] in SERVING_POLICIES:
        return _with_option(name, ":".join(parts[:-2]), parts[-2], parts[-1], spec)
    raise UserError(f"bad arm {spec!r}: use NAME=DRAFTER:POLICY[:OPTION] with POLICY one of "
                    f"{', '.join(SERVING_POLICIES)}")


def _with_option(name: str, drafter: str, policy: str, option: str, spec: str) -> Arm:
    try:
        if policy == "fixed":
            return Arm(name, drafter, policy, k=int(option))
        if policy == "threshold":
            return Arm(name, drafter, policy, threshold=float(option))
    except ValueError:
        raise UserError(f"bad option {option!r} in arm {spec!r}: k is an integer, a threshold a number") from None
    raise UserError(f"arm {spec!r}: policy {policy!r} takes no option")

"""The training recipe: one validated schema, loaded from a TOML (or JSON)
file in `configs/`. Every knob has a comment and a bound; unknown keys are
errors, so a typo never silently falls back to a default.

Sections: [run], [data], [target], [drafter], [features], [optim], [loss],
[log]. `[drafter.options]` is passed as keyword arguments to
`dspark.draft.build_drafter`, which validates its own options.
"""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from dspark.errors import UserError


@dataclass(frozen=True)
class RunConfig:
    out_dir: str = "runs/train"  # checkpoints, log.jsonl and the final drafter go here
    seed: int = 0  # seeds data order, anchor sampling and drafter initialisation


@dataclass(frozen=True)
class DataConfig:
    dir: str = "data/prepared"  # output folder of `dspark prepare` (shards + meta.json)
    max_seq_len: int = 640  # sequences are cut to this many tokens (prompt + answer)
    holdout_fraction: float = 0.02  # share of records kept out of training for calibration/validation


@dataclass(frozen=True)
class TargetSection:
    path: str = ""  # target checkpoint folder or GGUF; "" = the embedded SmolLM2-135M-Instruct


@dataclass(frozen=True)
class DrafterSection:
    kind: str = "dspark"  # dspark | dflash | eagle3 | mtp
    block_size: int = 7  # G: draft tokens per block
    options: dict = field(default_factory=dict)  # extra keyword arguments of build_drafter
    # target layers whose weights start the draft decoder layers, one per draft layer, in order
    # (dspark and dflash only: their layers have the target's shape); () = random initialisation
    init_from_target_layers: tuple = ()
    # train over the K most frequent answer tokens only (Eagle3's reduced draft vocabulary):
    # the drafter's LM head and DSpark's Markov transition cost K/V of the whole vocabulary's,
    # the loss is the exact TV of the restricted draft distribution, and the drafter ships with
    # draft_vocab_size = K. 0 = the whole vocabulary.
    draft_vocab_size: int = 0
    # where DSpark's Markov transition starts: "random" (N(0, 0.02), as every other weight) or
    # "pmi" (the rank-r factorisation of the training answers' adjacent-token PMI among the
    # draft vocabulary's tokens, or the 8192 most frequent; dspark.train.markov_init) or
    # "target" (the same, from the adjacent-token PMI the frozen target itself predicts) or
    # "pmi+target" (the answers' PMI shrunk toward the target's instead of toward 0)
    markov_init: str = "random"
    # start every trained weight from a saved drafter folder of the same kind and shape instead
    # ("default" / "mtp1": the shipped ones): fine-tuning or continuing a drafter on a fresh
    # schedule. Its calibration is not carried over (calibrate the result). "" = a fresh start
    init_from: str = ""


@dataclass(frozen=True)
class FeaturesConfig:
    mode: str = "online"  # online: run the frozen target each step; cache: read a precomputed cache
    cache_dir: str = ""  # cache folder (mode = cache); "" = <out_dir>/feature_cache
    cache_max_gb: float = 8.0  # refuse to write a cache larger than this
    # target layers the cache stores; () = the drafter's own taps. A superset (e.g. the union of
    # every recipe's taps) lets several recipes share one cache; each reads only its own layers.
    cache_tap_layers: tuple = ()


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 6e-4  # peak learning rate of AdamW
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 50  # linear warmup from 0 to lr
    total_steps: int = 1000  # optimizer steps of the whole run (the compute budget)
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    global_batch: int = 16  # sequences per step, summed over all data-parallel ranks
    anchors_per_seq: int = 8  # A: blocks sampled per sequence per step
    precision: str = "auto"  # forward under bf16 autocast: "auto" on a GPU only, "bf16" everywhere, "fp32" nowhere


@dataclass(frozen=True)
class LossConfig:
    a_ce: float = 0.1  # weight of the cross-entropy term
    a_tv: float = 0.9  # weight of the total-variation (distribution matching) term
    a_conf: float = 1.0  # weight of the confidence BCE term
    decay: float = 0.0  # position weights w_k = exp(-(k-1)/decay); 0 means decay = G


@dataclass(frozen=True)
class LogConfig:
    log_every: int = 10  # write a log.jsonl record every this many steps
    ckpt_every: int = 100  # checkpoint every this many steps (and at the end)
    keep_checkpoints: int = 2  # older checkpoints are deleted
    snapshot_every: int = 0  # also keep the drafter of every this many steps in snapshots/ (0 = off)
    progress: bool = True  # show a tqdm bar


@dataclass(frozen=True)
class TrainConfig:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    target: TargetSection = field(default_factory=TargetSection)
    drafter: DrafterSection = field(default_factory=DrafterSection)
    features: FeaturesConfig = field(default_factory=FeaturesConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict:
        return asdict(self)


DRAFTER_KINDS = ("dspark", "dflash", "eagle3", "mtp")
FEATURE_MODES = ("online", "cache")
MARKOV_INITS = ("random", "pmi", "target", "pmi+target")
PRECISIONS = ("auto", "bf16", "fp32")

# (section, field) -> (low, high, inclusive-low); None = unbounded on that side.
_BOUNDS: dict[tuple[str, str], tuple[float | None, float | None]] = {
    ("run", "seed"): (0, None),
    ("data", "max_seq_len"): (16, 1 << 16),
    ("data", "holdout_fraction"): (0.0, 0.5),
    ("drafter", "block_size"): (1, 64),
    ("drafter", "draft_vocab_size"): (0, None),
    ("features", "cache_max_gb"): (0.0, 4096.0),
    ("optim", "lr"): (0.0, 1.0),
    ("optim", "min_lr_ratio"): (0.0, 1.0),
    ("optim", "weight_decay"): (0.0, 1.0),
    ("optim", "beta1"): (0.0, 0.9999),
    ("optim", "beta2"): (0.0, 0.99999),
    ("optim", "eps"): (0.0, 1.0),
    ("optim", "warmup_steps"): (0, None),
    ("optim", "total_steps"): (1, None),
    ("optim", "grad_clip"): (0.0, None),
    ("optim", "global_batch"): (1, 4096),
    ("optim", "anchors_per_seq"): (1, 1024),
    ("loss", "a_ce"): (0.0, None),
    ("loss", "a_tv"): (0.0, None),
    ("loss", "a_conf"): (0.0, None),
    ("loss", "decay"): (0.0, None),
    ("log", "log_every"): (1, None),
    ("log", "ckpt_every"): (1, None),
    ("log", "keep_checkpoints"): (1, 1000),
    ("log", "snapshot_every"): (0, None),
}


def bounds(section: str, name: str) -> tuple:
    """The [low, high] a recipe's `[section] name` must lie in (None: unbounded)."""
    return _BOUNDS[section, name]


def validate(cfg: TrainConfig) -> None:
    """Check every bound and choice; raise UserError naming the key."""
    for (section, name), (low, high) in _BOUNDS.items():
        value = getattr(getattr(cfg, section), name)
        if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
            raise UserError(f"[{section}] {name} = {value} is out of range [{low}, {high if high is not None else 'inf'}]")
    if cfg.optim.precision not in PRECISIONS:
        raise UserError(f"[optim] precision = {cfg.optim.precision!r} is unknown; use one of {', '.join(PRECISIONS)} "
                        "(auto: bf16 autocast on a GPU, float32 on the CPU)")
    if cfg.drafter.kind not in DRAFTER_KINDS:
        raise UserError(f"[drafter] kind = {cfg.drafter.kind!r} is unknown; use one of {', '.join(DRAFTER_KINDS)}")
    if cfg.features.mode not in FEATURE_MODES:
        raise UserError(f"[features] mode = {cfg.features.mode!r} is unknown; use one of {', '.join(FEATURE_MODES)}")
    if cfg.loss.a_ce + cfg.loss.a_tv + cfg.loss.a_conf <= 0:
        raise UserError("[loss] a_ce + a_tv + a_conf must be > 0; at least one loss term needs a weight")
    clash = sorted({"block_size", "seed", "draft_vocab_size"} & set(cfg.drafter.options))
    if clash:
        raise UserError(f"[drafter.options] may not set {', '.join(clash)}; use [drafter] block_size and "
                        "draft_vocab_size, and [run] seed")
    if cfg.drafter.init_from_target_layers and cfg.drafter.kind not in ("dspark", "dflash"):
        raise UserError(f"[drafter] init_from_target_layers works for dspark and dflash drafters only (their "
                        f"decoder layers have the target's shape); remove it for kind = {cfg.drafter.kind!r}")
    if cfg.drafter.markov_init not in MARKOV_INITS:
        raise UserError(f"[drafter] markov_init = {cfg.drafter.markov_init!r} is unknown; use one of "
                        f"{', '.join(MARKOV_INITS)}")
    if cfg.drafter.markov_init != "random" and (
            cfg.drafter.kind != "dspark" or cfg.drafter.options.get("markov_head_type", "vanilla") == "none"):
        raise UserError(f"[drafter] markov_init = {cfg.drafter.markov_init!r} starts DSpark's Markov head; "
                        "it needs kind = \"dspark\" with a Markov head (markov_head_type other than \"none\")")
    if cfg.drafter.init_from and (cfg.drafter.markov_init != "random" or cfg.drafter.init_from_target_layers):
        raise UserError("[drafter] init_from starts every trained weight from a saved drafter; remove markov_init "
                        "and init_from_target_layers, which would be overwritten")
    if cfg.drafter.block_size + 2 > cfg.data.max_seq_len:
        raise UserError("[data] max_seq_len must exceed [drafter] block_size + 1")


def _build(cls: type, raw: Any, where: str) -> Any:
    """Build dataclass `cls` from a dict, refusing unknown keys and wrong types."""
    if not isinstance(raw, dict):
        raise UserError(f"{where} must be a table, got {type(raw).__name__}")
    hints = get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise UserError(f"unknown key(s) {', '.join(unknown)} in {where}; known keys: {', '.join(known)}")
    kwargs = {}
    for name, value in raw.items():
        kind = hints[name]
        label = f"{where}.{name}" if where != "config" else name
        if is_dataclass(kind):
            kwargs[name] = _build(kind, value, f"[{name}]")
        else:
            kwargs[name] = _coerce(kind, value, label)
    return cls(**kwargs)


def _coerce(kind: Any, value: Any, label: str) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is dict and isinstance(value, dict):
        return dict(value)
    if kind is tuple and isinstance(value, (list, tuple)) and all(type(v) is int and v >= 0 for v in value):
        return tuple(value)
    if kind in (int, float, str, bool) and type(value) is kind:
        return value
    what = "a list of layer indices (integers >= 0)" if kind is tuple else f"of type {getattr(kind, '__name__', kind)}"
    raise UserError(f"{label} must be {what}, got {value!r}")


def config_from_dict(raw: dict) -> TrainConfig:
    return _build(TrainConfig, raw, "config")


def load_config(path: str | Path) -> TrainConfig:
    """Read and validate a training recipe (.toml or .json)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"training config {path} does not exist; pass a file from configs/")
    try:
        if path.suffix == ".json":
            raw = json.loads(path.read_text())
        else:
            raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot parse training config {path}: {exc}") from None
    if not raw:
        raise UserError(f"training config {path} sets nothing (no [run], [data], [drafter] ... tables); "
                        "start from a recipe in configs/")
    return config_from_dict(raw)

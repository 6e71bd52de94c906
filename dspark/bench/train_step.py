"""Wall-clock of one drafter training step, over the whole vocabulary and over draft vocabularies,
in float32 and under bf16 autocast, and at several anchor counts per sequence.

    dspark bench train-step configs/dspark-960-t1-r256-5l-v8k.toml --sizes 0,8192 --repeats 8
    dspark bench train-step configs/dspark-960-t1-r256-5l-v8k.toml --sizes 8192 --precisions fp32,bf16
    dspark bench train-step configs/dspark-960-t1-r256-5l-v8k.toml --sizes 8192 --anchors 16,32,64

For a recipe, builds its untrained drafter once per arm: a draft-vocabulary size K (0 = the whole
vocabulary; `[drafter] draft_vocab_size` otherwise) and an `[optim] precision`, on the recipe's
data and feature source, and times the trainer's step (features, forward, the three-term loss,
backward, clipping, AdamW) on the same global batches. The arms take turns on every batch, so the
machine's noise falls on all of them alike. The features' part of each step (a read of the feature cache, or the online target
forward) is timed inside the step; the rest is the drafter's share, the part a draft vocabulary
can make cheaper. A recipe in cache mode builds its feature cache first if it is not on disk.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from dspark.errors import UserError
from dspark.train.config import load_config


class _TimedFeatures:
    """A feature source that remembers how long its last call took."""

    def __init__(self, features) -> None:
        self.features, self.last = features, 0.0

    def __call__(self, batch, indices):
        t0 = time.perf_counter()
        out = self.features(batch, indices)
        self.last = time.perf_counter() - t0
        return out


def time_train_steps(config_path: str | Path, sizes: list[int], repeats: int = 8, warmup: int = 2,
                     progress: bool = True, precisions: list[str] | None = None,
                     anchors: list[int] | None = None) -> dict:
    """Median step, feature and drafter-share milliseconds per arm: every draft-vocabulary size in
    `sizes` at every precision in `precisions` and every anchor count in `anchors` (defaults: the
    recipe's own). Arms with more anchors train on the same sequences, with more blocks cut from each."""
    import dataclasses

    from tqdm import tqdm

    from dspark.models.loading import load_target
    from dspark.train.config import PRECISIONS, bounds
    from dspark.train.data import SequenceStore
    from dspark.train.draft_vocab import count_answer_tokens, rank_tokens
    from dspark.train.run import _check_data, _features, build_recipe_drafter, drafter_io
    from dspark.train.trainer import DistInfo, Trainer

    if not sizes or repeats < 1 or warmup < 0:
        raise UserError("give at least one draft vocabulary size (--sizes), --repeats >= 1 and --warmup >= 0")
    if any(size < 0 for size in sizes):
        raise UserError(f"--sizes {sizes}: draft vocabulary sizes are >= 0 (0 = the whole vocabulary)")
    cfg = load_config(config_path)
    precisions = list(precisions or [cfg.optim.precision])
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise UserError(f"--precisions {','.join(unknown)}: use {', '.join(PRECISIONS)}")
    anchors = list(anchors or [cfg.optim.anchors_per_seq])
    low, high = bounds("optim", "anchors_per_seq")
    if any(not low <= a <= high for a in anchors):
        raise UserError(f"--anchors {','.join(map(str, anchors))}: anchors per sequence are in [{low}, {high}]")
    info = DistInfo()
    target = load_target(cfg.target.path or None, cpu_kernels=True)
    model = target.model.eval()
    store = SequenceStore(cfg.data.dir)
    _check_data(store, target)
    train, heldout = store.split(cfg.data.holdout_fraction)
    ranking = rank_tokens(count_answer_tokens(store, train, target.config.vocab_size))
    pad_id = target.config.eos_token_ids[0] if target.config.eos_token_ids else 0
    arms = [(size, precision, a) for size in sizes for precision in precisions for a in anchors]
    trainers, timers, source = {}, {}, None
    for arm in arms:
        size, precision, a = arm
        arm_cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, precision=precision, anchors_per_seq=a))
        drafter = build_recipe_drafter(arm_cfg, target, model, ranking, info.device, draft_vocab_size=size)
        if source is None:  # one feature source for all: the same tapped layers
            source = _features(arm_cfg, model, drafter, store, train + heldout, target.name, info)
        timers[arm] = _TimedFeatures(source)
        trainers[arm] = Trainer(arm_cfg, drafter, timers[arm], store, train, drafter_io(a, model), info, None, pad_id)
    times = {arm: {"step": [], "features": []} for arm in arms}
    for step in tqdm(range(warmup + repeats), desc="train steps", disable=not progress):
        order = arms[step % len(arms):] + arms[: step % len(arms)]  # who goes first rotates
        for arm in order:
            trainer = trainers[arm]
            trainer.step = step  # every arm trains on this step's global batch
            t0 = time.perf_counter()
            trainer.train_step()
            if step >= warmup:
                times[arm]["step"].append(time.perf_counter() - t0)
                times[arm]["features"].append(timers[arm].last)
    rows = []
    for size, precision, a in arms:
        step_ms = [1e3 * t for t in times[size, precision, a]["step"]]
        feat_ms = [1e3 * t for t in times[size, precision, a]["features"]]
        share = [s - f for s, f in zip(step_ms, feat_ms)]
        rows.append({"draft_vocab_size": size, "precision": precision, "anchors_per_seq": a,
                     "step_ms": statistics.median(step_ms),
                     "features_ms": statistics.median(feat_ms), "drafter_ms": statistics.median(share)})
    base = rows[0]
    for row in rows:
        row["step_speedup"] = base["step_ms"] / row["step_ms"]
        row["drafter_speedup"] = base["drafter_ms"] / row["drafter_ms"]
    return {"config": str(config_path), "kind": cfg.drafter.kind, "global_batch": cfg.optim.global_batch,
            "anchors_per_seq": cfg.optim.anchors_per_seq, "block_size": cfg.drafter.block_size,
            "feature_mode": cfg.features.mode, "threads": torch.get_num_threads(), "repeats": repeats,
            "warmup": warmup, "rows": rows}


def format_table(result: dict) -> str:
    first = result["rows"][0]
    recipe_anchors = result["anchors_per_seq"]
    base = (f"{'whole' if first['draft_vocab_size'] == 0 else first['draft_vocab_size']}, {first.get('precision', 'auto')}, "
            f"{first.get('anchors_per_seq', recipe_anchors)}")
    lines = [f"{result['config']} ({result['kind']}, {result['global_batch']} sequences, G={result['block_size']}, "
             f"features {result['feature_mode']}, {result['threads']} thread(s), median of {result['repeats']})",
             f"| draft vocabulary | precision | anchors per sequence | step ms | features ms | drafter ms | "
             f"step vs ({base}) | drafter vs ({base}) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        name = "whole" if r["draft_vocab_size"] == 0 else str(r["draft_vocab_size"])
        lines.append(f"| {name} | {r.get('precision', 'auto')} | {r.get('anchors_per_seq', recipe_anchors)} | "
                     f"{r['step_ms']:.0f} | {r['features_ms']:.0f} | {r['drafter_ms']:.0f} | "
                     f"{r['step_speedup']:.2f}x | {r['drafter_speedup']:.2f}x |")
    return "\n".join(lines)


def run_train_step_bench(config_path: str | Path, sizes: list[int], repeats: int = 8, warmup: int = 2,
                         out: str | Path | None = None, precisions: list[str] | None = None,
                         anchors: list[int] | None = None) -> dict:
    """`dspark bench train-step`: time, print the table, and write the JSON to `out` if given."""
    result = time_train_steps(config_path, list(sizes), repeats=repeats, warmup=warmup, precisions=precisions,
                              anchors=anchors)
    print(format_table(result))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result

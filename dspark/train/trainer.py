"""The drafter training loop (paper 3.3): AdamW with linear warmup and cosine
decay, gradient clipping, periodic exact checkpoints, and data parallelism.

Only the drafter's own parameters train; the target, its embedding and its LM
head are frozen (the drafter holds them by reference). Every random choice is
a function of (seed, step) - the data order of an epoch, the anchors of a
sequence - so a resumed run repeats exactly what an uninterrupted one does.

Data parallelism (`torchrun`, gloo on CPU, nccl on GPU) splits each global
batch of sequences across ranks. Each rank divides its loss sums by the
global weight normalizer and gradients are summed across ranks, so N ranks
compute the same update as one process on the whole global batch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from dspark.draft.base import TrainableDrafter
from dspark.errors import UserError
from dspark.train import checkpoint as ckpt
from dspark.train.anchors import make_batch, sample_seed
from dspark.train.config import TrainConfig, config_from_dict
from dspark.train.data import SequenceStore
from dspark.train.losses import AcceptanceStats, LossWeights, draft_loss, weight_normalizer

LOG_FILE = "log.jsonl"


@dataclass
class DrafterIO:
    """How checkpoints write a drafter folder and read weights back into a drafter."""

    save: Callable[[TrainableDrafter, Path], None]
    load_weights: Callable[[TrainableDrafter, Path], None]


def autocast_bf16(precision: str, device: torch.device) -> bool:
    """Whether the drafter's forward runs under bf16 autocast ([optim] precision): "auto" on a GPU
    only, "bf16" on any device, "fp32" never. Weights, gradients and AdamW stay float32 either way."""
    return precision == "bf16" or (precision == "auto" and device.type == "cuda")


@dataclass
class DistInfo:
    """This process's place in a data-parallel run (rank 0 of 1 when alone)."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def lr_at(step: int, lr: float, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to lr * min_ratio."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def epoch_order(num: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled order of training sequences in an epoch."""
    return torch.randperm(num, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def freeze_shared(drafter: torch.nn.Module, target: torch.nn.Module) -> None:
    """Freeze the target, and any drafter parameter that is the target's embedding or LM head."""
    target.requires_grad_(False)
    frozen = {p.data_ptr() for p in target.parameters()}
    for p in drafter.parameters():
        if p.data_ptr() in frozen:
            p.requires_grad_(False)


class Trainer:
    """Fits a TrainableDrafter on a SequenceStore with a feature source."""

    def __init__(
        self,
        cfg: TrainConfig,
        drafter: TrainableDrafter,
        features: Callable,  # (AnchorBatch, sequence indices) -> TargetFeatures
        store: SequenceStore,
        train_indices: list[int],
        io: DrafterIO,
        dist_info: DistInfo | None = None,
        heldout_indices: list[int] | None = None,
        pad_id: int = 0,
    ) -> None:
        self.cfg, self.drafter, self.features, self.store, self.io = cfg, drafter, features, store, io
        self.train_indices, self.heldout_indices = list(train_indices), list(heldout_indices or [])
        self.dist = dist_info or DistInfo()
        self.pad_id = pad_id
        self.out_dir = Path(cfg.run.out_dir)
        self.block_size = int(drafter.block_size)
        self.weights = LossWeights(cfg.loss.a_ce, cfg.loss.a_tv, cfg.loss.a_conf, cfg.loss.decay)
        opt = cfg.optim
        if opt.global_batch % self.dist.world:
            raise UserError(f"[optim] global_batch = {opt.global_batch} must be divisible by the {self.dist.world} ranks")
        if len(self.train_indices) < opt.global_batch:
            raise UserError(
                f"only {len(self.train_indices)} training sequences for a global batch of {opt.global_batch}; "
                "prepare more data or lower [optim] global_batch"
            )
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        if not self.params:
            raise UserError("the drafter has no trainable parameters")
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": opt.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(
            [g for g in groups if g["params"]], lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps
        )
        self.step = 0
        self._order: tuple[int, torch.Tensor] | None = None
        self._reset_window()

    # ------------------------------------------------------------ data
    def _global_batch(self, step: int) -> tuple[int, list[int]]:
        """(epoch, global batch of sequence indices) of a step."""
        gb = self.cfg.optim.global_batch
        per_epoch = len(self.train_indices) // gb
        epoch, k = divmod(step, per_epoch)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(len(self.train_indices), self.cfg.run.seed, epoch))
        positions = self._order[1][k * gb : (k + 1) * gb].tolist()
        return epoch, [self.train_indices[p] for p in positions]

    def _local(self, items: list[int]) -> list[int]:
        per = len(items) // self.dist.world
        return items[self.dist.rank * per : (self.dist.rank + 1) * per]

    def _loss(self, indices: list[int], epoch: int):
        """Forward one local batch; loss terms use the all-ranks normalizer."""
        seqs = [self.store.get(i, self.cfg.data.max_seq_len) for i in indices]
        seeds = [sample_seed(self.cfg.run.seed, epoch, i) for i in indices]
        batch = make_batch(seqs, seeds, self.cfg.optim.anchors_per_seq, self.block_size, self.pad_id)
        feats = self.features(batch, indices)
        dev = self.dist.device
        valid = batch.valid.to(dev)
        normalizer = self.dist.sum(weight_normalizer(valid, self.block_size, self.weights.decay))
        with self._autocast():
            out = self.drafter.forward_train(feats.tapped_hidden.to(dev), batch.token_ids.to(dev), batch.anchors.to(dev))
        loss = draft_loss(out.logits, feats.target_logits.to(dev), batch.labels.to(dev), valid,
                          out.confidence_logits, self.weights, normalizer, out.vocab_ids)
        return loss, valid

    def _autocast(self):
        if autocast_bf16(self.cfg.optim.precision, self.dist.device):
            return torch.autocast(self.dist.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------ optimisation
    def train_step(self) -> None:
        epoch, global_batch = self._global_batch(self.step)
        self.drafter.train()
        loss, valid = self._loss(self._local(global_batch), epoch)
        loss.total.backward()
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.dist.sum(p.grad)
        clip = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        o = self.cfg.optim
        lr = lr_at(self.step, o.lr, o.warmup_steps, o.total_steps, o.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._accumulate(loss, valid, float(grad_norm), lr)

    def _reset_window(self) -> None:
        self.window = {"steps": 0, "loss": 0.0, "ce": 0.0, "tv": 0.0, "conf": 0.0, "grad_norm": 0.0, "lr": 0.0}
        self.window_stats = AcceptanceStats(self.block_size)
        self.window_start = time.perf_counter()

    def _accumulate(self, loss, valid, grad_norm: float, lr: float) -> None:
        terms = self.dist.sum(torch.stack([loss.total.detach(), loss.ce, loss.tv, loss.conf]).double().cpu())
        w = self.window
        w["steps"] += 1
        for name, value in zip(("loss", "ce", "tv", "conf"), terms.tolist()):
            w[name] += value
        w["grad_norm"], w["lr"] = grad_norm, lr
        self.window_stats.update(loss, valid)

    def _log_record(self) -> dict:
        w, n = self.window, max(1, self.window["steps"])
        stats = AcceptanceStats.from_vector(self.block_size, self.dist.sum(self.window_stats.as_vector()))
        seconds = time.perf_counter() - self.window_start
        record = {"step": self.step, "lr": w["lr"], "grad_norm": round(w["grad_norm"], 5)}
        record.update({k: round(w[k] / n, 6) for k in ("loss", "ce", "tv", "conf")})
        record.update(stats.summary())
        record["seqs_per_s"] = round(n * self.cfg.optim.global_batch / max(seconds, 1e-9), 3)
        return record

    # ------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        folder = ckpt.checkpoint_dir(self.out_dir, self.step)
        if self.dist.rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
            self.io.save(self.drafter, folder / "drafter")
            facts = {"step": self.step, "world": self.dist.world, "config": self.cfg.to_dict(),
                     "window": self.window, "window_stats": self.window_stats.as_vector().tolist()}
            ckpt.save_trainer_state(folder, self.optimizer, facts)
        self.dist.barrier()
        ckpt.save_rng(folder, self.dist.rank)
        self.dist.barrier()
        if self.dist.rank == 0:
            ckpt.mark_latest(self.out_dir, folder, self.cfg.log.keep_checkpoints)
        self.dist.barrier()
        return folder

    def save_snapshot(self) -> Path:
        """Keep the drafter of this step in snapshots/ (written aside, then renamed into place)."""
        final = ckpt.snapshot_dir(self.out_dir, self.step)
        if self.dist.rank == 0:
            tmp = final.with_name(final.name + ".tmp")
            for old in (tmp, final):
                shutil.rmtree(old, ignore_errors=True)
            tmp.parent.mkdir(parents=True, exist_ok=True)
            self.io.save(self.drafter, tmp)
            os.replace(tmp, final)
        self.dist.barrier()
        return final

    def resume(self) -> bool:
        """Continue from the newest checkpoint, if any."""
        folder = ckpt.latest_checkpoint(self.out_dir)
        if folder is None:
            return False
        self.io.load_weights(self.drafter, folder / "drafter")
        facts = ckpt.load_trainer_state(folder, self.optimizer)
        # read the saved recipe through today's schema: a key added since takes its default
        now, saved = self.cfg.to_dict(), config_from_dict(facts["config"]).to_dict()
        # raising optim.total_steps extends a run (the LR then follows the longer schedule); any
        # other change would make the resumed run differ from the one its checkpoints came from
        saved_optim = {**saved.get("optim", {}), "total_steps": now["optim"]["total_steps"]}
        changed = [k for k in ("data", "target", "drafter", "loss") if saved.get(k) != now[k]]
        changed += ["optim"] if saved_optim != now["optim"] else []
        if changed or saved["run"]["seed"] != now["run"]["seed"]:
            raise UserError(f"{folder} was trained with other settings ({', '.join(changed) or 'run.seed'}); "
                            "restore them, or set a new [run] out_dir to start over")
        if int(facts["step"]) > now["optim"]["total_steps"]:
            raise UserError(f"{folder} is at step {facts['step']}, past optim.total_steps = "
                            f"{now['optim']['total_steps']}; raise total_steps or set a new [run] out_dir")
        if saved["optim"]["total_steps"] != now["optim"]["total_steps"] and self.dist.rank == 0:
            verb = "extending" if now["optim"]["total_steps"] > saved["optim"]["total_steps"] else "shortening"
            print(f"dspark train: {verb} the run from {saved['optim']['total_steps']} to "
                  f"{now['optim']['total_steps']} steps; the learning rate follows the new schedule")
        self.step = int(facts["step"])
        if not ckpt.load_rng(folder, self.dist.rank) or facts["world"] != self.dist.world:
            print(f"dspark train: resuming on {self.dist.world} ranks from a {facts['world']}-rank checkpoint; "
                  "the data order is unchanged, RNG streams are reseeded")
            torch.manual_seed(self.cfg.run.seed + self.step + self.dist.rank)
        self.window = facts["window"]
        self.window_stats = AcceptanceStats.from_vector(self.block_size, torch.tensor(facts["window_stats"]))
        self.window_start = time.perf_counter()
        if self.dist.rank == 0:
            _truncate_log(self.out_dir / LOG_FILE, self.step)
        return True

    # ------------------------------------------------------------ the run
    def fit(self, resume: bool = True, stop_at_step: int | None = None) -> dict:
        """Train to `total_steps` (or stop early at `stop_at_step`); return a summary."""
        from tqdm import tqdm

        if resume and self.resume() and self.dist.rank == 0:
            print(f"dspark train: resumed at step {self.step} from {self.out_dir}")
        total = self.cfg.optim.total_steps
        first = self.step
        end = total if stop_at_step is None else min(stop_at_step, total)
        show = self.cfg.log.progress and self.dist.rank == 0
        bar = tqdm(total=total, initial=self.step, desc=f"train {self.drafter.name}", disable=not show)
        start = time.perf_counter()
        while self.step < end:
            self.train_step()
            bar.update(1)
            if self.step % self.cfg.log.log_every == 0 or self.step == total:
                record = self._log_record()
                self._reset_window()
                if self.dist.rank == 0:
                    _append_log(self.out_dir / LOG_FILE, record)
                bar.set_postfix(loss=record["loss"], tau=record["expected_accept_len"])
            # the snapshot first: a run killed between the two resumes before this step and redoes both
            if self.cfg.log.snapshot_every and self.step % self.cfg.log.snapshot_every == 0:
                self.save_snapshot()
            if self.step % self.cfg.log.ckpt_every == 0 or self.step == total:
                self.save_checkpoint()
        bar.close()
        # seconds cover the steps this call ran: from start_step (a resumed run's checkpoint) to step
        return {"step": self.step, "start_step": first, "total_steps": total,
                "seconds": round(time.perf_counter() - start, 2)}

    @torch.no_grad()
    def evaluate(self, indices: list[int]) -> dict:
        """Loss terms and acceptance statistics on sequences `indices` (no update)."""
        self.drafter.eval()
        stats = AcceptanceStats(self.block_size)
        sums = torch.zeros(4, dtype=torch.float64)
        gb = self.cfg.optim.global_batch
        for start in range(0, len(indices), gb):
            chunk = self._local(indices[start : start + gb])
            if not chunk:
                continue
            loss, valid = self._loss(chunk, epoch=-1)
            sums += torch.stack([loss.total, loss.ce, loss.tv, loss.conf]).double().cpu()
            stats.update(loss, valid)
        batches = max(1, math.ceil(len(indices) / gb))
        sums = self.dist.sum(sums) / batches
        stats = AcceptanceStats.from_vector(self.block_size, self.dist.sum(stats.as_vector()))
        out = {k: round(float(v), 6) for k, v in zip(("loss", "ce", "tv", "conf"), sums)}
        out.update(stats.summary())
        return out


def _append_log(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_log(path: Path, step: int) -> None:
    """Drop log records written after the checkpoint a run resumes from."""
    if not path.is_file():
        return
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    keep = [line for line in lines if json.loads(line).get("step", 0) <= step]
    path.write_text("".join(line + "\n" for line in keep))

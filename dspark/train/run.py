"""Library entry points of `dspark train` and `dspark calibrate` (the CLI
parses arguments and calls these; they print progress and a summary).

    run_train(config_path, resume=True) -> folder of the trained drafter
    evaluate_drafter(config_path, drafter_dir, features) -> held-out losses and acceptance of any drafter folder
    run_calibrate(drafter_dir, data_dir, ...) -> STS temperatures and metrics

Data-parallel training: launch the same call under `torchrun`; every rank
reads WORLD_SIZE / RANK / LOCAL_RANK from torchrun's environment.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from dspark.errors import UserError
from dspark.models.device import cpu_has_native_bf16, resolve_device
from dspark.train import checkpoint as ckpt
from dspark.train.anchors import make_batch, sample_seed
from dspark.train.calibrate import DEFAULT_BINS, plot_reliability, position_metrics, sts_fit
from dspark.train.config import TrainConfig, load_config
from dspark.train.data import SequenceStore
from dspark.train.draft_vocab import count_answer_tokens, rank_tokens
from dspark.train.features import CACHE_META, CachedFeatures, OnlineFeatures, build_feature_cache
from dspark.train.trainer import DistInfo, DrafterIO, Trainer, autocast_bf16, freeze_shared

MAX_EVAL_SEQUENCES = 256  # held-out sequences evaluated at the end of training


def init_distributed(device: str | torch.device = "auto") -> DistInfo:
    """DistInfo from torchrun's environment (a single process without it).

    device: `auto` (the GPU of this rank's LOCAL_RANK when torch sees one, else the CPU), `cpu`,
    `cuda` (likewise per rank) or `cuda:N` (one process only). Ranks on GPUs talk through NCCL,
    ranks on the CPU through gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = resolve_device(device)
    if chosen.type == "cuda":
        named = None if device in (None, "auto") else torch.device(device).index  # cuda:N, not cuda
        if named is not None and world > 1:
            raise UserError(f"--device {device} names one GPU, but torchrun started {world} ranks; "
                            "pass --device cuda (rank r uses GPU r) or --device cpu")
        index = named if named is not None else local
        if index >= torch.cuda.device_count():
            raise UserError(f"rank {local} needs GPU {index}, but torch sees {torch.cuda.device_count()}; "
                            "start at most one rank per GPU (torchrun --nproc_per_node), or pass --device cpu")
        chosen = torch.device("cuda", index)
    if world > 1 and not dist.is_initialized():
        if chosen.type == "cuda":
            torch.cuda.set_device(chosen)
        dist.init_process_group("nccl" if chosen.type == "cuda" else "gloo")
    rank = dist.get_rank() if world > 1 else 0
    return DistInfo(rank=rank, world=world, device=chosen)


def drafter_io(num_anchors: int, target_model) -> DrafterIO:
    """Checkpoints hold float32 drafter folders (exact resume)."""
    from dspark.draft.checkpoint import load_drafter_folder, save_drafter

    def save(drafter, folder: Path) -> None:
        save_drafter(drafter, folder, dtype=torch.float32, extra_config={"num_anchors": num_anchors})

    def load_weights(drafter, folder: Path) -> None:
        loaded = load_drafter_folder(folder, target_model)
        drafter.load_state_dict(loaded.state_dict())

    return DrafterIO(save=save, load_weights=load_weights)


def _check_data(store: SequenceStore, target) -> None:
    meta = store.meta
    if meta and (meta.get("target") != target.name or meta.get("vocab_size") != target.config.vocab_size):
        raise UserError(f"the data was prepared with target {meta.get('target')!r} (vocab {meta.get('vocab_size')}), "
                        f"not {target.name!r}; rerun prepare with this target")


# The drafter's final norm starts at this fraction of the target's final-norm scale, so its first
# logits through the shared LM head are near uniform. Measured at initialisation on 4 prepared
# SmolLM2 sequences (block 7, 16 anchors): cross-entropy 48.3 with the norm at ones, 58.1 at the
# target's scale, 12.7 at 0.1 x the target's (a uniform guess: 10.8).
INIT_NORM_SCALE = 0.1


def _features(cfg: TrainConfig, model, drafter, store, indices, target_name: str, info: DistInfo):
    if cfg.features.mode == "online":
        return OnlineFeatures(model, drafter.tap_layers)
    folder = Path(cfg.features.cache_dir or Path(cfg.run.out_dir) / "feature_cache")
    stored = tuple(cfg.features.cache_tap_layers) or tuple(drafter.tap_layers)
    missing = sorted(set(drafter.tap_layers) - set(stored))
    if missing:
        raise UserError(f"[features] cache_tap_layers {list(stored)} lacks the drafter's tapped layers {missing}; "
                        "add them (or leave cache_tap_layers empty)")
    if info.rank == 0:
        build_feature_cache(model, store, indices, stored, folder, max_seq_len=cfg.data.max_seq_len,
                            max_gb=cfg.features.cache_max_gb, target_name=target_name, progress=cfg.log.progress)
    info.barrier()
    return CachedFeatures(model, folder, drafter.tap_layers)


def init_from_target_layers(drafter, model, layer_ids) -> None:
    """Start draft decoder layer i from a copy of target layer layer_ids[i]
    (attention, MLP and both norms). The copies are the drafter's own
    parameters: training changes them, the target stays as it was."""
    layers = getattr(drafter, "layers", None)
    target_layers = model.model.layers
    if layers is None:
        raise UserError("init_from_target_layers needs a drafter with decoder layers (dspark or dflash)")
    if len(layer_ids) != len(layers):
        raise UserError(f"init_from_target_layers names {len(layer_ids)} target layer(s) for a drafter with "
                        f"{len(layers)} decoder layer(s); give one target layer per draft layer")
    bad = [i for i in layer_ids if not 0 <= i < len(target_layers)]
    if bad:
        raise UserError(f"init_from_target_layers {bad} out of range: the target has layers 0..{len(target_layers) - 1}")
    for draft_layer, i in zip(layers, layer_ids):
        source = target_layers[i].state_dict()
        mine = draft_layer.state_dict()
        if set(source) != set(mine) or any(source[k].shape != mine[k].shape for k in mine):
            raise UserError(f"draft layer and target layer {i} differ in shape ({len(mine)} vs {len(source)} tensors); "
                            "init_from_target_layers needs [drafter.options] intermediate_size = 0 (the target's)")
        draft_layer.load_state_dict(source)  # copies into the drafter's own tensors


def restrict_to_draft_vocab(drafter, ranking: torch.Tensor, size: int) -> None:
    """Train over the `size` most frequent answer tokens only. DSpark's Markov transition
    starts at zero for every other token and stays there (no gradient reaches it, and weight
    decay keeps zero at zero): a checkpoint read over the whole vocabulary, as the DeepSpec
    layout is, adds no transition bias to tokens the drafter was never trained to propose."""
    if not hasattr(drafter, "set_draft_vocab"):
        raise UserError("[drafter] draft_vocab_size needs a learned drafter (dspark, dflash, eagle3 or mtp)")
    vocab = int(ranking.numel())
    if size >= vocab:
        raise UserError(f"[drafter] draft_vocab_size = {size} is not below the target's {vocab} tokens; "
                        "set 0 to train over the whole vocabulary")
    drafter.set_draft_vocab(ranking, size)
    head = getattr(drafter, "markov_head", None)
    if head is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[ranking[:size]] = True
        with torch.no_grad():
            head.markov_w2.weight[~keep.to(head.markov_w2.weight.device)] = 0.0


def build_recipe_drafter(cfg: TrainConfig, target, model, ranking: torch.Tensor, device: torch.device,
                         draft_vocab_size: int | None = None):
    """The untrained drafter a recipe describes, on `device`, its shared tensors frozen; over a
    draft vocabulary of the recipe's size (or `draft_vocab_size`, 0 = the whole vocabulary)."""
    from dspark.draft.factory import build_drafter

    options = {**cfg.drafter.options, "block_size": cfg.drafter.block_size}
    drafter = build_drafter(cfg.drafter.kind, target.config, model.embed_tokens, model.lm_head_weight,
                            seed=cfg.run.seed, final_norm_weight=INIT_NORM_SCALE * model.model.norm.weight,
                            **options).to(device)
    if cfg.drafter.init_from_target_layers:
        init_from_target_layers(drafter, model, cfg.drafter.init_from_target_layers)
    freeze_shared(drafter, model)
    size = cfg.drafter.draft_vocab_size if draft_vocab_size is None else draft_vocab_size
    if size:
        restrict_to_draft_vocab(drafter, ranking, size)
    return drafter


# config.json keys that do not change what a drafter's weights mean (a new run sets them itself)
NOT_ARCHITECTURE = frozenset({"calibration_temperatures", "draft_vocab_size", "num_anchors", "torch_dtype",
                              "transition_top_k"})


def start_from_drafter(drafter, spec: str, model, ranking: torch.Tensor, size: int) -> str:
    """[drafter] init_from: copy a saved drafter's trained weights into the recipe's freshly built
    `drafter` (same kind, same shapes; the target's shared tensors are checked, not copied) and
    say what was copied. A DSpark Markov transition keeps zero rows outside this recipe's draft
    vocabulary (`restrict_to_draft_vocab`), whatever the source drafted among."""
    from dspark.draft import checkpoint as dck
    from dspark.draft.registry import SHIPPED, shipped_default

    folder = shipped_default(spec) if spec in SHIPPED else Path(spec).expanduser()
    if folder is None or not folder.is_dir():
        raise UserError(f"[drafter] init_from = {spec!r} is not a drafter folder; give the folder a training run "
                        "wrote (OUT_DIR/drafter), or default / mtp1 for the shipped ones")
    cfg = dck.read_config(folder)
    dck.kind_of(cfg, folder)
    ours = dck.drafter_config_dict(drafter)
    differ = [key for key in sorted(ours) if key not in NOT_ARCHITECTURE and cfg.get(key) != ours[key]]
    if differ:
        shown = "; ".join(f"{key}: {cfg.get(key)!r} there, {ours[key]!r} here" for key in differ[:4])
        raise UserError(f"[drafter] init_from = {spec!r} describes another drafter than this recipe ({shown}); "
                        "make [drafter] and [drafter.options] match its config.json")
    tensors = dck.trained_tensors(folder, cfg, model.embed_tokens.weight, model.lm_head_weight)
    drafter.load_state_dict(dck.match_tensors(drafter, tensors, folder))  # copies into our dtype and device
    line = f"every trained weight started from {folder} ({len(tensors)} tensors)"
    if size and getattr(drafter, "markov_head", None) is not None:
        restrict_to_draft_vocab(drafter, ranking, size)  # zero rows outside this recipe's tokens again
        source = dck.read_draft_vocab(folder)
        if source is not None and cfg.get("draft_vocab_size"):
            shared = len(set(ranking[:size].tolist()) & set(source[: int(cfg["draft_vocab_size"])].tolist()))
            line += f"; {shared} of this recipe's {size} draft tokens were the source's"
    return line


def _start_markov(cfg, drafter, model, store, train, ranking, counts, verbose: bool) -> None:
    """Write the recipe's Markov start ([drafter] markov_init, dspark.train.markov_init) into
    the drafter's Markov head, and say what it did."""
    from dspark.train import markov_init as mi

    size, head, how = cfg.drafter.draft_vocab_size or 8192, drafter.markov_head, cfg.drafter.markov_init
    if how == "pmi":
        started = mi.pmi_init(head, store, train, ranking, size, seed=cfg.run.seed, max_len=cfg.data.max_seq_len)
        source = f"the answers' PMI ({started['pairs']} adjacent pairs)"
    elif how == "target":
        started = mi.target_pmi_init(head, model, store, train, ranking, counts, size, seed=cfg.run.seed)
        source = f"the target's own adjacent-token PMI (read after the answer opening {started['opening']})"
    else:
        started = mi.blended_pmi_init(head, model, store, train, ranking, counts, size, seed=cfg.run.seed,
                                      max_len=cfg.data.max_seq_len)
        source = (f"the answers' PMI ({started['pairs']} adjacent pairs) shrunk toward the target's own "
                  f"(read after the answer opening {started['opening']})")
    if verbose:
        print(f"dspark train: Markov head started from {source} among {started['tokens']} tokens, "
              f"rank {head.rank} keeps {100 * started['energy_kept']:.0f} % of it")


def _precision_line(precision: str, device: torch.device) -> str:
    """What [optim] precision means on this device, and a warning where bf16 will be slow."""
    if not autocast_bf16(precision, device):
        return f"forward in float32 ([optim] precision = {precision!r})"
    line = f"forward under bf16 autocast, weights and AdamW in float32 ([optim] precision = {precision!r})"
    if device.type == "cpu" and not cpu_has_native_bf16():
        line += ("; this CPU has no bf16 matrix instructions (AMX or AVX512-BF16), so bf16 may run slower "
                 "than float32: set precision = \"fp32\"")
    return line


def run_train(config_path: str | Path, *, resume: bool = True, stop_at_step: int | None = None,
              device: str | torch.device = "auto") -> Path:
    """Train the drafter a recipe describes; return the folder of the final drafter.
    device: where the target and drafter run (`init_distributed`)."""
    from dspark.draft.checkpoint import save_drafter
    from dspark.models.loading import load_target

    cfg = load_config(config_path)
    info = init_distributed(device)
    target = load_target(cfg.target.path or None, cpu_kernels=info.device.type == "cpu")
    model = target.model.to(info.device).eval()
    store = SequenceStore(cfg.data.dir)
    _check_data(store, target)
    train, heldout = store.split(cfg.data.holdout_fraction)
    counts = count_answer_tokens(store, train, target.config.vocab_size)
    ranking = rank_tokens(counts)
    drafter = build_recipe_drafter(cfg, target, model, ranking, info.device)
    resuming = resume and ckpt.latest_checkpoint(Path(cfg.run.out_dir)) is not None
    if cfg.drafter.markov_init != "random" and not resuming:  # every rank computes the same start
        _start_markov(cfg, drafter, model, store, train, ranking, counts, info.rank == 0)
    if cfg.drafter.init_from and not resuming:  # every rank reads the same file
        started = start_from_drafter(drafter, cfg.drafter.init_from, model, ranking, cfg.drafter.draft_vocab_size)
        if info.rank == 0:
            print(f"dspark train: {started}")
    out_dir = Path(cfg.run.out_dir)
    if info.rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
        n = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
        print(f"dspark train: {cfg.drafter.kind} drafter, {n / 1e6:.2f}M trainable parameters, G={drafter.block_size}; "
              f"{len(train)} training / {len(heldout)} held-out sequences; {info.world} rank(s) on {info.device}")
        print(f"dspark train: {_precision_line(cfg.optim.precision, info.device)}")
    features = _features(cfg, model, drafter, store, train + heldout, target.name, info)
    pad_id = target.config.eos_token_ids[0] if target.config.eos_token_ids else 0
    trainer = Trainer(cfg, drafter, features, store, train, drafter_io(cfg.optim.anchors_per_seq, model), info,
                      heldout, pad_id)
    summary = trainer.fit(resume=resume, stop_at_step=stop_at_step)
    if trainer.step < cfg.optim.total_steps:  # stopped early on purpose: no final drafter yet
        if trainer.step % cfg.log.ckpt_every:  # keep the steps since the last periodic checkpoint
            trainer.save_checkpoint()
        _leave(info)
        return out_dir
    summary["heldout"] = trainer.evaluate(heldout[:MAX_EVAL_SEQUENCES]) if heldout else None
    final = out_dir / "drafter"
    if info.rank == 0:
        # ship the token ranking; `dspark draft-vocab FOLDER --size K` turns the draft vocabulary on (or changes it)
        drafter.set_draft_vocab(ranking, cfg.drafter.draft_vocab_size)
        save_drafter(drafter, final, extra_config={"num_anchors": cfg.optim.anchors_per_seq})
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        held = summary["heldout"] or {}
        print(f"dspark train: done at step {summary['step']} in {summary['seconds']} s; held-out loss "
              f"{held.get('loss')}, expected acceptance length {held.get('expected_accept_len')}; drafter in {final}")
    _leave(info)
    return final


EVAL_FEATURES = ("online", "cache")


def _heldout_cache(cfg: TrainConfig, model, drafter, target_name: str, indices: list[int]) -> CachedFeatures:
    """The recipe's feature cache, checked to hold these held-out sequences of this target, as written by
    training (which caches the held-out split too); a clear error otherwise."""
    folder = Path(cfg.features.cache_dir or Path(cfg.run.out_dir) / "feature_cache")
    meta_path = folder / CACHE_META
    if not meta_path.is_file():
        raise UserError(f"no feature cache in {folder} for {cfg.run.out_dir}; train the recipe with "
                        "[features] mode = \"cache\" first, or evaluate with features online")
    meta = json.loads(meta_path.read_text())
    if meta.get("target") != target_name or meta.get("max_seq_len") != cfg.data.max_seq_len:
        raise UserError(f"feature cache {folder} was built for target {meta.get('target')!r} at max_seq_len "
                        f"{meta.get('max_seq_len')}, not {target_name!r} at {cfg.data.max_seq_len}; "
                        "evaluate with features online")
    features = CachedFeatures(model, folder, drafter.tap_layers)
    missing = [i for i in indices if i not in features.where]
    if missing:
        raise UserError(f"feature cache {folder} lacks {len(missing)} of the {len(indices)} held-out sequences "
                        "(an unfinished build, or other data); resume the recipe's training to finish it, "
                        "or evaluate with features online")
    return features


def evaluate_drafter(config_path: str | Path, drafter_dir: str | Path, features: str = "online") -> dict:
    """The end-of-training held-out evaluation for any drafter folder: a recipe's held-out
    split of its data, its losses and anchors. Compares drafters trained elsewhere (other
    data, other budgets) on the same held-out sequences. The target's features are computed
    online (features="online"), or read from the recipe's feature cache (features="cache": the
    end-of-training evaluation's own source, and minutes faster per drafter on a CPU; the two
    agree to float16 rounding of the tapped states)."""
    from dspark.draft.checkpoint import load_drafter_folder
    from dspark.models.loading import load_target

    if features not in EVAL_FEATURES:
        raise UserError(f"features must be one of {', '.join(EVAL_FEATURES)}, got {features!r}")
    cfg = load_config(config_path)
    target = load_target(cfg.target.path or None, cpu_kernels=False)
    store = SequenceStore(cfg.data.dir)
    _check_data(store, target)
    train, heldout = store.split(cfg.data.holdout_fraction)
    if not heldout:
        raise UserError(f"no held-out sequences in {cfg.data.dir} at holdout_fraction={cfg.data.holdout_fraction}")
    drafter = load_drafter_folder(drafter_dir, target.model)
    freeze_shared(drafter, target.model)
    pad_id = target.config.eos_token_ids[0] if target.config.eos_token_ids else 0
    chosen = heldout[:MAX_EVAL_SEQUENCES]
    source = (_heldout_cache(cfg, target.model, drafter, target.name, chosen) if features == "cache"
              else OnlineFeatures(target.model, drafter.tap_layers))
    trainer = Trainer(cfg, drafter, source, store, train,
                      drafter_io(cfg.optim.anchors_per_seq, target.model), DistInfo(), heldout, pad_id)
    result = trainer.evaluate(chosen)
    return {"drafter": str(drafter_dir), "config": str(config_path), "heldout_sequences": len(chosen),
            "features": features, **result}


def _leave(info: DistInfo) -> None:
    info.barrier()
    if info.world > 1 and dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------ calibration
@torch.no_grad()
def collect_confidence(drafter, features, store: SequenceStore, indices: list[int], *, anchors_per_seq: int,
                       max_seq_len: int, labels: str, seed: int, batch_size: int = 8):
    """Confidence logits [n, G] and acceptance labels [n, G] of full blocks on `indices`.

    labels="realised": per position, draw x ~ p_draft and accept it with
    probability min(1, p_target(x) / p_draft(x)), the speculative-sampling
    test at temperature 1 (blocks are teacher-forced on the data's tokens).
    labels="soft": the analytic acceptance probability c*_k instead."""
    gen = torch.Generator().manual_seed(seed)
    logits_out, labels_out = [], []
    for start in range(0, len(indices), batch_size):
        chunk = indices[start : start + batch_size]
        seqs = [store.get(i, max_seq_len) for i in chunk]
        batch = make_batch(seqs, [sample_seed(seed, -2, i) for i in chunk], anchors_per_seq, drafter.block_size)
        feats = features(batch, chunk)
        dev = next(drafter.parameters()).device
        out = drafter.forward_train(feats.tapped_hidden.to(dev), batch.token_ids.to(dev), batch.anchors.to(dev))
        if out.confidence_logits is None:
            raise UserError("this drafter has no confidence head; only DSpark drafters can be calibrated")
        full = batch.valid.all(-1).to(dev)  # [B, A]
        vocab = feats.target_logits.shape[-1]
        draft_probs = torch.softmax(out.full_logits(vocab)[full].float(), -1).cpu()  # [n, G, V], 0 outside a draft vocabulary
        target_probs = torch.softmax(feats.target_logits.to(dev)[full].float(), -1).cpu()
        if labels == "soft":
            accepted = 1.0 - 0.5 * (draft_probs - target_probs).abs().sum(-1)
        else:
            flat = draft_probs.reshape(-1, draft_probs.shape[-1])
            drawn = torch.multinomial(flat, 1, generator=gen).view(draft_probs.shape[:2])  # [n, G]
            p_d = draft_probs.gather(-1, drawn[..., None]).squeeze(-1)
            p_t = target_probs.gather(-1, drawn[..., None]).squeeze(-1)
            u = torch.rand(p_d.shape, generator=gen)
            accepted = (u * p_d < p_t).double()  # u < p_t / p_d, accept surely when p_t >= p_d
        logits_out.append(out.confidence_logits[full].float().cpu())
        labels_out.append(accepted.double())
    if not logits_out or sum(x.shape[0] for x in logits_out) == 0:
        raise UserError("no complete held-out blocks to calibrate on; prepare more data or raise holdout_fraction")
    return torch.cat(logits_out), torch.cat(labels_out)


def run_calibrate(
    drafter_dir: str | Path,
    data_dir: str | Path,
    *,
    target_path: str | Path | None = None,
    holdout_fraction: float = 0.02,
    max_sequences: int = 512,
    anchors_per_seq: int = 16,
    max_seq_len: int = 640,
    labels: str = "realised",
    bins: int = DEFAULT_BINS,
    seed: int = 0,
    out_dir: str | Path | None = None,
    write: bool = False,
) -> dict:
    """Fit STS temperatures on held-out data; report ECE / AUC / Brier per
    position before and after, draw the reliability diagram. `write=True`
    also stores the temperatures in the drafter folder's config."""
    from dspark.draft.checkpoint import load_drafter_folder, save_drafter
    from dspark.models.loading import load_target

    if not 1 <= anchors_per_seq <= 1024:
        raise UserError(f"anchors_per_seq = {anchors_per_seq} is out of range [1, 1024]")
    if labels not in ("realised", "soft"):
        raise UserError(f"labels must be 'realised' or 'soft', got {labels!r}")
    target = load_target(target_path)
    drafter = load_drafter_folder(drafter_dir, target.model).eval()
    store = SequenceStore(data_dir)
    _check_data(store, target)
    _, heldout = store.split(holdout_fraction)
    if not heldout:
        raise UserError(f"no held-out sequences in {data_dir} at holdout_fraction={holdout_fraction}")
    features = OnlineFeatures(target.model, drafter.tap_layers)
    conf_logits, accepted = collect_confidence(drafter, features, store, heldout[:max_sequences],
                                               anchors_per_seq=anchors_per_seq, max_seq_len=max_seq_len,
                                               labels=labels, seed=seed)
    temps = sts_fit(conf_logits, accepted, bins)
    before, after = position_metrics(conf_logits, accepted, None, bins), position_metrics(conf_logits, accepted, temps, bins)
    out = Path(out_dir or drafter_dir)
    plot = plot_reliability(conf_logits, accepted, temps, out / "reliability.png", bins)
    report = {"temperatures": [round(float(t), 5) for t in temps], "labels": labels, "num_blocks": int(conf_logits.shape[0]),
              "bins": bins, "before": [vars(m) for m in before], "after": [vars(m) for m in after], "plot": str(plot)}
    (out / "calibration.json").write_text(json.dumps(report, indent=2) + "\n")
    if write:
        dtype = getattr(torch, json.loads((Path(drafter_dir) / "config.json").read_text()).get("torch_dtype", "float16"))
        drafter.set_calibration(report["temperatures"])
        save_drafter(drafter, drafter_dir, dtype=dtype)
    print(format_calibration(report))
    return report


def format_calibration(report: dict) -> str:
    lines = [f"dspark calibrate: {report['num_blocks']} held-out blocks, {report['labels']} acceptance labels",
             "pos   T      ECE before -> after   AUC before -> after   Brier before -> after"]
    for k, (t, b, a) in enumerate(zip(report["temperatures"], report["before"], report["after"])):
        auc_b = "n/a" if b["auc"] is None else f"{b['auc']:.3f}"
        auc_a = "n/a" if a["auc"] is None else f"{a['auc']:.3f}"
        lines.append(f"{k + 1:<5} {t:<6.3f} {100 * b['ece']:6.2f}% -> {100 * a['ece']:5.2f}%     "
                     f"{auc_b} -> {auc_a}        {b['brier']:.4f} -> {a['brier']:.4f}")
    lines.append(f"reliability diagram: {report['plot']}")
    return "\n".join(lines)

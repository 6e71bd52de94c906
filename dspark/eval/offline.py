"""Expected acceptance length on the target's own answers to the benchmark prompts.

    dspark eval offline --drafter A,B --bench all --limit 12 --max-new-tokens 128 --temperature 1

`dspark eval` measures realised acceptance: every round's accepted count
depends on the draws, and the drafter's own samples steer the answer, so a
run of a few dozen answers carries sampling noise. This measures what
training measures on its held-out data instead, on the benchmark prompts:

1. the target answers every prompt once, sampled with the given settings
   (the evaluation's temperature by default), through dspark's batched
   runtime; the answers are cached in `--answers` and reused by every later
   run with the same settings (a run with a higher --limit generates only
   the missing prompts);
2. every drafter is teacher-forced on those answers at every anchor of the
   assistant span, exactly as `forward_train` is trained (a drafter with a
   draft vocabulary drafts only inside it, as at inference); per block,
   tau = 1 + sum_k prod_{i<=k} c*_i with c*_k = 1 - TV(p_draft, p_target) at
   temperature 1, averaged over the blocks whose G positions all lie in the
   answer.

All drafters see the same answers and nothing is drawn, so their difference
is their distributions, not luck; paired bootstrap intervals over prompts
give what is left (which prompts were chosen). `--against PAGE.json[:LABEL]`
pairs with drafters an earlier run scored, read back from its JSON (their
checkpoints need not exist); every page records a hash of each answer so the
read-back is refused unless the answers are the same. A `heldout` set (the
held-out prompts of the shipped training file, as the training recipes split
them) answered with the same settings separates a shift in prompts from a
shift in the answers' sampling temperature.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from dspark.errors import UserError
from dspark.eval.benchmarks import BENCHMARKS, DISPLAY_NAMES, load_suites
from dspark.eval.noise import Interval, macro_from_counts, paired_ratio_from_counts
from dspark.types import SamplingParams

HELDOUT = "heldout"  # the held-out prompts of the shipped training file
HELDOUT_FRACTION = 0.02  # the recipes' [data] holdout_fraction
HELDOUT_POOL = 960  # the recipes train on the first 960 prompts of the file
ANSWERS_META = "answers_meta.json"


@dataclass
class Counts:
    """One drafter's sums over one prompt's full blocks."""

    blocks: int = 0
    tau_sum: float = 0.0
    accept_sum: list[float] = field(default_factory=list)  # per position, sum of c*_k over full blocks


@dataclass
class DrafterScore:
    label: str
    spec: str
    kind: str
    block_size: int
    per_prompt: dict[str, dict[str, Counts]]  # set name -> prompt id -> counts
    note: str = ""  # stored scores (--against): the page they came from and whether its answers were checked

    def tau(self, name: str) -> float | None:
        rows = self.per_prompt.get(name, {}).values()
        blocks = sum(c.blocks for c in rows)
        return sum(c.tau_sum for c in rows) / blocks if blocks else None

    def acceptance(self, name: str | None = None) -> list[float]:
        """Mean c*_k per position over the full blocks of one set (None: every benchmark set)."""
        names = [name] if name else [n for n in self.per_prompt if n in BENCHMARKS]
        rows = [c for n in names for c in self.per_prompt.get(n, {}).values() if c.blocks]
        blocks = sum(c.blocks for c in rows)
        if not blocks:
            return []
        return [sum(c.accept_sum[k] for c in rows) / blocks for k in range(self.block_size)]

    def counts(self) -> dict[str, tuple[list[str], torch.Tensor, torch.Tensor]]:
        """Benchmark -> (prompt ids, blocks [n], tau sums [n]), the shape `dspark.eval.noise` resamples."""
        out = {}
        for name, rows in self.per_prompt.items():
            if name not in BENCHMARKS:
                continue
            ids = sorted(rows)
            out[name] = (ids, torch.tensor([float(rows[i].blocks) for i in ids], dtype=torch.float64),
                         torch.tensor([rows[i].tau_sum for i in ids], dtype=torch.float64))
        return out

    def macro(self) -> float | None:
        counts = self.counts()
        return macro_from_counts(counts) if counts else None


# ------------------------------------------------------------------ answers
def _prompt_sets(bench: str, limit: int | None, heldout: bool) -> dict[str, list]:
    """Set name -> prepare-style prompts (ids prefixed with the set name)."""
    from dspark.train.data import is_heldout
    from dspark.train.prepare import DEFAULT_PROMPTS, Prompt, read_prompts, user_turns

    sets = {}
    for name, prompts in load_suites(bench, limit).items():
        sets[name] = [Prompt(f"{name}/{p.id}", p.domain, p.source, p.turns) for p in prompts]
    if heldout:
        pool = [p for p in read_prompts(DEFAULT_PROMPTS, HELDOUT_POOL) if is_heldout(p.id, HELDOUT_FRACTION)]
        pool = pool if limit is None else pool[:limit]
        # the training answers' format: math prompts carry the evaluation sets' suffix
        sets[HELDOUT] = [Prompt(f"{HELDOUT}/{p.id}", p.domain, p.source, user_turns(p, True)) for p in pool]
    return sets


def answers_folder(root: str | Path, params: SamplingParams) -> Path:
    """One folder per sampling setting, so answers drawn differently never mix."""
    top_p = "1" if params.top_p in (None, 0.0, 1.0) else f"{params.top_p:g}"
    return Path(root) / f"t{params.temperature:g}-p{top_p}-n{params.max_new_tokens}-s{params.seed}"


def ensure_answers(target, sets: dict[str, list], folder: Path, params: SamplingParams, *, batch: int = 16,
                   progress: bool = True):
    """The cached answers of every prompt of `sets` (generating the missing ones); a SequenceStore."""
    from tqdm import tqdm

    from dspark.engine.generate import generate_many
    from dspark.train.data import SequenceStore, completed_ids, write_meta, write_shard
    from dspark.train.prepare import ChatFormatter, check_meta, generate_answers

    folder.mkdir(parents=True, exist_ok=True)
    meta = {"target": target.name, "vocab_size": target.config.vocab_size,
            "sampling": {k: v for k, v in asdict(params).items() if k != "stop"}}
    check_meta(folder, meta)  # answers of another target or other sampling settings never mix
    write_meta(folder, meta)
    done = completed_ids(folder)
    eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else None
    fmt = ChatFormatter(target.tokenizer)
    todo = {name: [p for p in prompts if p.id not in done] for name, prompts in sets.items()}
    total = sum(len(v) for v in todo.values())
    bar = tqdm(total=total, desc="target answers", unit="prompt", disable=not progress or total == 0)
    for name, prompts in todo.items():
        if not prompts:
            continue
        # a seed per set name and prompt position: a higher --limit or another --bench leaves the
        # answers already drawn as they were (request i of a call uses seed + i)
        set_params = params if params.seed is None else SamplingParams(
            **{**asdict(params), "seed": params.seed + 100_003 * (zlib.crc32(name.encode()) % 10_007)
               + len(sets[name]) - len(prompts)})
        records = generate_answers(prompts, fmt, generate_many, target.model, set_params, math_suffix=False,
                                   eos_id=eos, batch=batch, progress=False)
        write_shard(folder, records)
        bar.update(len(prompts))
    bar.close()
    return SequenceStore(folder)


# ------------------------------------------------------------------ scoring
@torch.no_grad()
def score_drafter(drafter, model, store, indices: list[int], *, max_seq_len: int = 2048, batch_size: int = 2,
                  progress: bool = True, desc: str = "score") -> dict[int, Counts]:
    """Counts per sequence index: every anchor of the assistant span, teacher-forced."""
    from tqdm import tqdm

    from dspark.train.anchors import make_batch
    from dspark.train.features import OnlineFeatures

    if not hasattr(drafter, "forward_train"):
        raise UserError(f"drafter {drafter.name!r} is not a trained drafter; offline scoring needs one "
                        "(a drafter folder)")
    g = int(drafter.block_size)
    features = OnlineFeatures(model, drafter.tap_layers)
    dev = next(drafter.parameters()).device
    out: dict[int, Counts] = {}
    for start in tqdm(range(0, len(indices), batch_size), desc=desc, disable=not progress):
        chunk = indices[start : start + batch_size]
        seqs = [store.get(i, max_seq_len) for i in chunk]
        most = max(int(mask[1:].sum()) for _, mask in seqs)
        batch = make_batch(seqs, [0] * len(chunk), max(1, most), g)  # all candidates: every anchor
        feats = features(batch, chunk)
        res = drafter.forward_train(feats.tapped_hidden.to(dev), batch.token_ids.to(dev), batch.anchors.to(dev))
        target_logits = feats.target_logits.to(dev).float()
        logits = res.full_logits(target_logits.shape[-1]).float()  # -inf outside a draft vocabulary, as at inference
        full = batch.valid.all(-1)  # [B, A]
        for b, index in enumerate(chunk):
            rows = full[b].nonzero().flatten()
            counts = Counts(accept_sum=[0.0] * g)
            for part in rows.split(64):
                accept = 1.0 - 0.5 * (torch.softmax(logits[b, part], -1) - torch.softmax(target_logits[b, part], -1)).abs().sum(-1)
                accept = accept.clamp(0.0, 1.0).double().cpu()  # [n, G]
                counts.blocks += int(part.numel())
                counts.tau_sum += float((1.0 + accept.cumprod(1).sum(1)).sum())
                counts.accept_sum = [a + float(s) for a, s in zip(counts.accept_sum, accept.sum(0))]
            out[index] = counts
    return out


class ScoreCache:
    """A drafter's counts per answer id, kept next to the answers (`scores/`), so a later run with
    more drafters or prompts scores only what is new. Keyed by the drafter folder and its weights
    file's size and time: retrained weights are scored afresh."""

    def __init__(self, answers: Path, spec: str) -> None:
        import hashlib

        from dspark.draft.registry import shipped_default

        resolved = Path(shipped_default() if spec == "default" else spec).expanduser().resolve()
        weights = resolved / "model.safetensors"
        stat = weights.stat() if weights.is_file() else None
        self.stamp = [str(resolved), stat.st_size if stat else 0, stat.st_mtime if stat else 0.0]
        name = hashlib.sha256(json.dumps(self.stamp).encode()).hexdigest()[:16]
        self.path = answers / "scores" / f"{name}.json"
        self.counts: dict[str, Counts] = {}
        if self.path.is_file():
            data = json.loads(self.path.read_text())
            if data.get("stamp") == self.stamp:
                self.counts = {rid: Counts(**c) for rid, c in data["counts"].items()}

    def add(self, counts: dict[str, Counts]) -> None:
        import os

        self.counts.update(counts)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"stamp": self.stamp, "counts": {k: asdict(c) for k, c in self.counts.items()}}) + "\n")
        os.replace(tmp, self.path)


@dataclass
class OfflineRun:
    settings: dict
    command: str
    drafters: list[DrafterScore]
    prompts: dict[str, int]  # set name -> prompts scored
    digests: dict[str, str] = field(default_factory=dict)  # "set/prompt id" -> hash of the target's answer tokens

    def to_dict(self) -> dict:
        return {"settings": self.settings, "command": self.command, "prompts": self.prompts,
                "answer_digests": self.digests,
                "drafters": [{"label": d.label, "spec": d.spec, "kind": d.kind, "block_size": d.block_size,
                              **({"note": d.note} if d.note else {}),
                              "per_prompt": {n: {i: asdict(c) for i, c in rows.items()} for n, rows in d.per_prompt.items()}}
                             for d in self.drafters]}

    @classmethod
    def from_dict(cls, data: dict) -> "OfflineRun":
        drafters = [DrafterScore(d["label"], d["spec"], d["kind"], d["block_size"],
                                 {n: {i: Counts(**c) for i, c in rows.items()} for n, rows in d["per_prompt"].items()},
                                 d.get("note", ""))
                    for d in data["drafters"]]
        return cls(data["settings"], data["command"], drafters, data["prompts"], data.get("answer_digests", {}))


def answer_digests(store, ids: list[str]) -> dict[str, str]:
    """Prompt id -> a short hash of the target's answer (prompt and answer token ids), written into every page
    so that scores read back from it (`--against`) are known to be of the same answers."""
    import hashlib

    where = {rid: i for i, rid in enumerate(store.ids)}
    return {rid: hashlib.sha256(store.get(where[rid])[0].to(torch.int32).numpy().tobytes()).hexdigest()[:16]
            for rid in ids}


def excluded_ids(exclude: list[str] | None, sets: dict[str, list]) -> set[str]:
    """`--exclude SET/ID,...`: prompts left out of scoring (say, answers that differ from a stored page's);
    an id naming no prompt of this run, or leaving a set empty, is refused."""
    ids = {i.strip() for item in exclude or [] for i in item.split(",") if i.strip()}
    known = {p.id for prompts in sets.values() for p in prompts}
    unknown = sorted(ids - known)
    if unknown:
        raise UserError(f"--exclude: {', '.join(unknown[:3])} {'is not a prompt' if len(unknown) == 1 else 'are not prompts'} "
                        "of this run; give SET/ID as the pages name them (e.g. gsm8k/gsm8k-0003, heldout/alpaca-16878)")
    for name, prompts in sets.items():
        if prompts and all(p.id in ids for p in prompts):
            raise UserError(f"--exclude leaves no prompt of {name}; leave it out with --bench instead")
    return ids


def against_page(spec: str) -> tuple[Path, str]:
    """(page JSON, label or "") of an `--against` value, refused before any model work if it is not one."""
    path, _, label = (spec, "", "") if Path(spec).is_file() else spec.partition(":")
    page = Path(path)
    if not page.is_file():
        raise UserError(f"--against {spec!r}: no such file; give PAGE.json or PAGE.json:LABEL of an earlier run")
    if page.suffix != ".json":
        raise UserError(f"--against {spec!r}: give the .json of an earlier `dspark eval offline` run "
                        "(PAGE.json or PAGE.json:LABEL), not its .md page")
    return page, label


SAME_SETTINGS = ("target", "temperature", "top_p", "max_new_tokens", "seed")


def stored_scores(spec: str, settings: dict, wanted: dict[str, list[str]], digests: dict[str, str]) -> list[DrafterScore]:
    """`--against PAGE.json[:LABEL]`: drafters scored by an earlier `dspark eval offline` run, read from its JSON
    instead of being scored again (their checkpoints may be gone), so they pair with this run's drafters.

    Refused unless the page was scored with the same target and sampling settings and holds every prompt of
    this run; where the page has answer digests, each prompt's must equal this run's (the same answers).
    Pages written before digests existed are read with their answers unchecked, and the page says so."""
    page, label = against_page(spec)
    try:
        stored = OfflineRun.from_dict(json.loads(page.read_text()))
    except (ValueError, KeyError, TypeError) as err:
        raise UserError(f"--against {spec!r}: {page} is not an offline run's JSON ({err!r})") from None
    for key in SAME_SETTINGS:
        if stored.settings.get(key) != settings.get(key):
            raise UserError(f"--against {spec!r}: that page was scored with {key} = {stored.settings.get(key)!r}, this "
                            f"run with {settings.get(key)!r}; pair only runs of the same answers (rerun with its settings)")
    labels = [d.label for d in stored.drafters]
    chosen = [d for d in stored.drafters if not label or d.label == label]
    if not chosen:
        raise UserError(f"--against {spec!r}: no drafter labelled {label!r} in {page}; it holds {', '.join(labels)}")
    checked = bool(stored.digests)
    if checked:
        differ = sorted(rid for rid, h in digests.items() if stored.digests.get(rid) != h)  # other or absent
        if differ:
            raise UserError(f"--against {spec!r}: {len(differ)} of this run's {len(digests)} answers are not "
                            f"the ones {page} scored (e.g. {differ[0]}); the answers were regenerated "
                            "differently: score those drafters again, or pair on the rest with --exclude "
                            + ",".join(differ))
    note = (f"stored scores from `{page}`, " + ("the same answers (digests checked)" if checked
            else "answers not checked (the page predates answer digests)"))
    out = []
    for d in chosen:
        rows = {}
        for name, ids in wanted.items():
            have = d.per_prompt.get(name, {})
            short = [rid.split("/", 1)[1] for rid in ids]
            missing = [f"{name}/{i}" for i in short if i not in have]
            if missing:
                raise UserError(f"--against {spec!r}: {d.label} in {page} has no score for {len(missing)} of this run's "
                                f"prompts (e.g. {missing[0]}); use the page's --limit and --bench (and --no-heldout "
                                "if it has no held-out set), or score the drafter again")
            rows[name] = {i: have[i] for i in short}
        out.append(DrafterScore(d.label if d.label.endswith("(stored)") else f"{d.label} (stored)",
                                f"{page}:{d.label}", d.kind, d.block_size, rows, note))
    return out


def run_offline(
    drafters: str, bench: str = "all", *, limit: int | None = 12, temperature: float = 1.0, top_p: float = 1.0,
    max_new_tokens: int = 128, seed: int = 0, heldout: bool = True, target: str | None = None,
    home: str | None = None, device: str = "cpu", answers_root: str | Path = "runs/bench-answers",
    results_dir: str | Path = "runs/offline", progress: bool = True, against: list[str] | None = None,
    exclude: list[str] | None = None,
) -> tuple[OfflineRun, Path]:
    """`dspark eval offline`: score drafters on cached target answers; writes JSON, a page and a figure."""
    from dspark.draft.registry import load_drafter
    from dspark.eval.harness import drafter_label
    from dspark.models import load_target

    if not 0.0 < temperature:
        raise UserError(f"--temperature must be > 0 for offline scoring (the answers are sampled), got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"--top-p must be in (0, 1], got {top_p}")
    if max_new_tokens < 8:
        raise UserError(f"--max-new-tokens must be >= 8 so answers hold whole blocks, got {max_new_tokens}")
    specs = [s.strip() for s in drafters.split(",") if s.strip()]
    for spec in against or []:  # a missing page is refused before any model work
        against_page(spec)
    if not specs or any(s in ("none", "ngram") for s in specs):
        raise UserError("--drafter takes one or more drafter folders (or 'default'), comma-separated; "
                        "none and ngram have no distribution to score")
    sets = _prompt_sets(bench, limit, heldout)  # every benchmark file validated before any model work
    excluded = excluded_ids(exclude, sets)
    loaded = load_target(target, home=home, cpu_kernels=False, device=device)
    built = [(drafter_label(s), s, load_drafter(s, loaded.model, embedded=target is None)) for s in specs]
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=max_new_tokens)
    folder = answers_folder(answers_root, params)
    store = ensure_answers(loaded, sets, folder, params, progress=progress)
    where = {rid: i for i, rid in enumerate(store.ids)}
    # left-out prompts are still answered (the others' seeds stay as they were), just not scored
    wanted = {name: [p.id for p in prompts if p.id not in excluded] for name, prompts in sets.items()}
    scores = []
    for label, spec, drafter in built:
        drafter.eval()
        cache = ScoreCache(folder, spec)
        missing = [where[pid] for ids in wanted.values() for pid in ids if pid not in cache.counts]
        if missing:
            fresh = score_drafter(drafter, loaded.model, store, missing, progress=progress, desc=f"score {label}")
            cache.add({store.ids[i]: c for i, c in fresh.items()})
        per_prompt = {name: {pid.split("/", 1)[1]: cache.counts[pid] for pid in ids} for name, ids in wanted.items()}
        scores.append(DrafterScore(label, spec, drafter.name, int(drafter.block_size), per_prompt))
    settings = {"benchmarks": [n for n in sets if n != HELDOUT], "heldout": heldout, "limit": limit,
                "temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens, "seed": seed,
                "target": loaded.name, "answers": str(folder), **({"excluded": sorted(excluded)} if excluded else {})}
    digests = answer_digests(store, [pid for ids in wanted.values() for pid in ids])
    for spec in against or []:
        scores += stored_scores(spec, settings, wanted, digests)
    command = (f"dspark eval offline --drafter {','.join(specs)} --bench {bench}"
               + (f" --limit {limit}" if limit is not None else "")
               + f" --temperature {temperature:g} --top-p {top_p:g} --max-new-tokens {max_new_tokens} --seed {seed}"
               + ("" if heldout else " --no-heldout") + "".join(f" --against {a}" for a in against or [])
               + (f" --exclude {','.join(sorted(excluded))}" if excluded else "")
               + f" --results {results_dir}")
    run = OfflineRun(settings, command, scores, {n: len(v) for n, v in wanted.items()}, digests)
    return run, write_offline(run, results_dir)


# ------------------------------------------------------------------ report
def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ratio(iv: Interval | None) -> str:
    return "-" if iv is None else f"{iv.point:.3f}x ({iv.low:.3f}-{iv.high:.3f})"


def offline_table(run: OfflineRun) -> str:
    """Markdown: expected tau per set and drafter, macro over the benchmarks' domains, and the first
    drafter's paired ratio over each other's with a 95 % bootstrap interval over prompts."""
    benches = run.settings["benchmarks"]
    names = benches + ([HELDOUT] if run.settings.get("heldout") else [])
    head = ["drafter", *(DISPLAY_NAMES.get(n, "held-out (train prompts)") for n in names), "macro"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for d in run.drafters:
        lines.append("| " + " | ".join([d.label, *(_fmt(d.tau(n)) for n in names), _fmt(d.macro())]) + " |")
    first = run.drafters[0]
    if len(run.drafters) > 1:
        lines += ["", f"Paired ratios of {first.label}'s macro tau (95 % bootstrap over prompts, 2000 resamples):", ""]
        for d in run.drafters[1:]:
            iv = paired_ratio_from_counts(first.counts(), d.counts())
            held = (first.tau(HELDOUT) / d.tau(HELDOUT)) if run.settings.get("heldout") and d.tau(HELDOUT) else None
            lines.append(f"- / {d.label}: benchmarks {_ratio(iv)}" + ("" if held is None else f"; held-out {held:.3f}x"))
    lines += ["", "Acceptance by position (mean c*_k over the benchmarks' full blocks):", ""]
    for d in run.drafters:
        lines.append(f"- {d.label}: " + " ".join(f"{a:.3f}" for a in d.acceptance()))
    return "\n".join(lines)


def plot_offline(run: OfflineRun, path: Path) -> Path:
    """Grouped bars: expected tau per set, one bar per drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dspark.train.plots import save_figure

    names = run.settings["benchmarks"] + ([HELDOUT] if run.settings.get("heldout") else [])
    groups = [DISPLAY_NAMES.get(n, "held-out") for n in names] + ["macro"]
    width = 0.8 / len(run.drafters)
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(groups) * (1 + 0.15 * len(run.drafters))), 3.8))
    for j, d in enumerate(run.drafters):
        values = [d.tau(n) or math.nan for n in names] + [d.macro() or math.nan]
        ax.bar([i + (j - (len(run.drafters) - 1) / 2) * width for i in range(len(groups))], values, width, label=d.label)
    ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
    lows = [d.tau(n) for d in run.drafters for n in names if d.tau(n)]
    ax.set_ylim(max(1.0, min(lows) - 0.1) if lows else 1.0, None)
    s = run.settings
    ax.set(ylabel="expected tau", title=f"expected acceptance length on the target's answers "
                                        f"(T={s['temperature']:g}, top-p {s['top_p']:g}, {s['max_new_tokens']} tokens)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def write_offline(run: OfflineRun, results_dir: str | Path) -> Path:
    """<results>/<stem>.json, .md and .png; the stem names the sampling settings and the drafters."""
    import hashlib
    import os

    folder = Path(results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    s = run.settings
    named = ",".join(d.spec for d in run.drafters) + ("|" + ",".join(s["excluded"]) if s.get("excluded") else "")
    key = hashlib.sha256(named.encode()).hexdigest()[:8]  # prompts left out: another page
    stem = f"offline-t{s['temperature']:g}-p{s['top_p']:g}-n{s['max_new_tokens']}-l{s['limit']}-{key}"
    data = folder / f"{stem}.json"
    tmp = data.with_suffix(".tmp")
    tmp.write_text(json.dumps(run.to_dict(), indent=1) + "\n")
    os.replace(tmp, data)
    png = plot_offline(run, folder / f"{stem}.png")
    prompts = ", ".join(f"{DISPLAY_NAMES.get(n, 'held-out')} {k}" for n, k in run.prompts.items())
    if s.get("excluded"):
        prompts += f"; left out with --exclude: {', '.join(s['excluded'])}"
    page = folder / f"{stem}.md"
    page.write_text(
        "# Expected acceptance length on the target's own answers\n\n"
        f"Generated by `{run.command}`; do not edit by hand.\n\n"
        f"The target ({s['target']}) answered each prompt once at temperature {s['temperature']:g}, top-p "
        f"{s['top_p']:g}, at most {s['max_new_tokens']} new tokens, seed {s['seed']} (prompts: {prompts}). Every "
        "drafter is teacher-forced on those answers at every anchor of the answer; tau is 1 + sum over positions "
        "of the cumulative product of c* = 1 - TV(p_draft, p_target), averaged over the blocks that lie wholly "
        "in an answer. Macro is the mean of the math, code and chat means over the benchmarks (the held-out "
        "column, answers to training-distribution prompts, is not in it).\n\n"
        + "\n".join(f"- {d.label}: `{d.spec}` ({d.kind}, G = {d.block_size}" + (f"; {d.note}" if d.note else "") + ")"
                    for d in run.drafters)
        + "\n\n" + offline_table(run)
        + f"\n\n![expected tau per benchmark]({png.name})\n"
    )
    return page

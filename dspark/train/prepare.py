"""`dspark prepare`: turn chat prompts into training sequences whose answers
the target itself generated (paper 4.1: prompts only, responses regenerated
by the target with its recommended sampling).

Input: JSON Lines, one prompt a line: {"id", "domain", "source", "turns"}.
Each user turn is answered by the target in turn; a later turn sees the
model's own earlier answers. The training sequence is the chat-template
token ids of the last turn's prompt plus its answer; the loss mask is 1 on
every assistant token (the generated answers and their end-of-turn token).

Sampling: temperature 0.7, top-p 0.9 by default. SmolLM2's card suggests
0.2 with top-p 0.9; the drafters are evaluated at temperature 1.0 (paper
4.1), so the training answers use the most diverse setting that keeps this
small model fluent (temperature 1.0 without top-p degrades its text).

Math prompts get the evaluation sets' suffix ("Please reason step by
step ... \\boxed{}") so training answers have the evaluated format.

Output: shards (see `dspark.train.data`), written every `shard_size`
prompts; a rerun skips prompts already in a shard, so an interrupted run
resumes where it stopped. Before generating anything, training prompts are
checked against the evaluation prompts: any exact match after whitespace
normalisation is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from dspark.errors import UserError
from dspark.train.data import TrainRecord, completed_ids, read_meta, write_meta, write_shard
from dspark.types import SamplingParams

PACKAGE_DATA = Path(__file__).resolve().parent.parent / "data"
DEFAULT_PROMPTS = PACKAGE_DATA / "train" / "prompts.jsonl"
DEFAULT_EVAL_DIR = PACKAGE_DATA / "eval"
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
DEFAULT_TEMPERATURE = 0.7
DEFAULT_TOP_P = 0.9
DEFAULT_MAX_NEW_TOKENS = 256
DOMAINS = ("math", "code", "chat")


@dataclass(frozen=True)
class Prompt:
    id: str
    domain: str  # math | code | chat
    source: str
    turns: tuple[str, ...]  # user messages in order


def _bad(path: Path, line: int, what: str) -> UserError:
    return UserError(f"{path}:{line}: {what}; each line must be a JSON object "
                     '{"id": str, "domain": "math"|"code"|"chat", "source": str, "turns": [str, ...]}')


def parse_prompt(text: str, path: Path, line: int) -> Prompt:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _bad(path, line, f"not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise _bad(path, line, "not a JSON object")
    for key in ("id", "domain", "source"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise _bad(path, line, f"missing or empty string field {key!r}")
    if obj["domain"] not in DOMAINS:
        raise _bad(path, line, f"unknown domain {obj['domain']!r}")
    turns = obj.get("turns")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise _bad(path, line, "'turns' must be a non-empty list of non-empty strings")
    return Prompt(obj["id"], obj["domain"], obj["source"], tuple(turns))


def read_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """Validated prompts of a JSON Lines file (the first `limit` if given)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist")
    prompts, seen = [], set()
    with path.open(encoding="utf-8") as f:
        for line_no, text in enumerate(f, start=1):
            if not text.strip():
                continue
            prompt = parse_prompt(text, path, line_no)
            if prompt.id in seen:
                raise _bad(path, line_no, f"duplicate id {prompt.id!r}")
            seen.add(prompt.id)
            prompts.append(prompt)
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise UserError(f"prompt file {path} holds no prompts")
    return prompts


def normalize(text: str) -> str:
    """Whitespace-normalised text: runs of whitespace become one space, ends stripped."""
    return " ".join(text.split())


def check_overlap(prompts: list[Prompt], eval_dir: str | Path) -> int:
    """Refuse training prompts that equal an evaluation prompt (any turn, after
    whitespace normalisation). Returns the number of evaluation texts checked."""
    eval_dir = Path(eval_dir)
    files = sorted(eval_dir.glob("*.jsonl"))
    if not files:
        raise UserError(f"no evaluation prompts (*.jsonl) in {eval_dir}; pass the folder of the benchmark files")
    reference: dict[str, str] = {}
    for file in files:
        with file.open(encoding="utf-8") as f:  # iterating splits on "\n" only, not on U+2028 inside strings
            for line_no, text in enumerate(f, start=1):
                if not text.strip():
                    continue
                try:
                    turns = json.loads(text)["turns"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise UserError(f"{file}:{line_no}: evaluation prompt line is not a JSON object with 'turns'") from None
                for turn in turns:
                    reference.setdefault(normalize(turn), f"{file.name}:{line_no}")
    clashes = [(p.id, reference[normalize(t)]) for p in prompts for t in p.turns if normalize(t) in reference]
    if clashes:
        shown = ", ".join(f"{pid} = {where}" for pid, where in clashes[:5])
        raise UserError(f"{len(clashes)} training prompt(s) equal evaluation prompts ({shown}); "
                        "remove them from the training file")
    return len(reference)


class ChatFormatter:
    """Chat-template token ids of a conversation. Prompts go through
    `dspark.models.chat.encode_chat`, exactly as generation and evaluation
    encode them; a conversation ending in an assistant turn (to find that
    turn's span) is rendered by the same template without the opened turn."""

    def __init__(self, tokenizer) -> None:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise UserError("the target has no tokenizer with a chat template; prepare needs one")
        self.tokenizer = tokenizer

    def encode(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        from dspark.models.chat import encode_chat, encode_text

        if add_generation_prompt:
            return encode_chat(self.tokenizer, messages)
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
        return encode_text(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _messages(turns: tuple[str, ...], answers: list[str]) -> list[dict]:
    out = []
    for i, turn in enumerate(turns):
        out.append({"role": "user", "content": turn})
        if i < len(answers):
            out.append({"role": "assistant", "content": answers[i]})
    return out


def user_turns(prompt: Prompt, math_suffix: bool) -> tuple[str, ...]:
    if math_suffix and prompt.domain == "math":
        return tuple(t if t.rstrip().endswith("\\boxed{}.") else t + MATH_SUFFIX for t in prompt.turns)
    return prompt.turns


def _span_mask(final: list[int], spans: list[tuple[list[int], list[int]]]) -> list[int]:
    """Loss mask of `final`: 1 on each (prompt prefix, prefix through the answer)
    span whose token ids are a prefix of `final` (template re-tokenisation of an
    earlier answer could differ; such a span is left unmasked)."""
    mask = [0] * len(final)
    for before, through in spans:
        if final[: len(before)] == before and final[: len(through)] == through:
            for i in range(len(before), len(through)):
                mask[i] = 1
    return mask


def generate_answers(
    prompts: list[Prompt], fmt: ChatFormatter, generate_fn: Callable, model, params: SamplingParams,
    *, math_suffix: bool, eos_id: int | None, batch: int, progress: bool,
) -> list[TrainRecord]:
    """Answer every turn of every prompt with the target; one record per prompt."""
    turns = {p.id: user_turns(p, math_suffix) for p in prompts}
    texts: dict[str, list[str]] = {p.id: [] for p in prompts}
    spans: dict[str, list[tuple[list[int], list[int]]]] = {p.id: [] for p in prompts}
    last: dict[str, tuple[list[int], list[int]]] = {}
    for turn in range(max(len(t) for t in turns.values())):
        active = [p for p in prompts if len(turns[p.id]) > turn]
        prompt_ids = [fmt.encode(_messages(turns[p.id][: turn + 1], texts[p.id]), True) for p in active]
        turn_params = params if params.seed is None else _replace_seed(params, params.seed + 7919 * turn)
        outputs = generate_fn(model, prompt_ids, turn_params, max_batch=batch, progress=progress)
        for p, ids, out in zip(active, prompt_ids, outputs):
            out = list(out)
            finished = len(out) < params.max_new_tokens  # the engine stops early only at end-of-sequence
            answer = out + ([eos_id] if finished and eos_id is not None else [])
            texts[p.id].append(fmt.decode(out))
            if turn + 1 < len(turns[p.id]):  # an earlier turn: locate its span in the final sequence later
                through = fmt.encode(_messages(turns[p.id][: turn + 1], texts[p.id]), False)
                spans[p.id].append((ids, through))
            last[p.id] = (ids, answer)
    records = []
    for p in prompts:
        ids, answer = last[p.id]
        final = ids + answer
        mask = _span_mask(final, spans[p.id])
        mask[len(ids):] = [1] * len(answer)
        records.append(TrainRecord(p.id, p.domain, final, mask))
    return records


def _replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def check_meta(out_dir: Path, meta: dict) -> None:
    """Refuse to mix settings in one folder (a different `limit` is fine: it only
    says how many prompts of the same file to cover)."""
    meta = {k: v for k, v in meta.items() if k != "limit"}
    old = read_meta(out_dir)
    if old and {k: old.get(k) for k in meta} != meta:
        changed = sorted(k for k in meta if old.get(k) != meta[k])
        raise UserError(f"{out_dir} was prepared with other settings ({', '.join(changed)}); "
                        "use a new output folder or the same settings to resume")


def prepare(
    prompts_jsonl: str | Path,
    out_dir: str | Path,
    target,  # LoadedTarget: model, tokenizer, config, name
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    params: SamplingParams | None = None,
    limit: int | None = None,
    eval_dir_for_overlap_check: str | Path | None = None,
    batch: int = 16,
    shard_size: int = 64,
    math_suffix: bool = True,
    progress: bool = True,
    generate_fn: Callable | None = None,  # default dspark.engine.generate.generate_many
) -> dict:
    """Generate training sequences for the prompts of a JSON Lines file; resumable."""
    from tqdm import tqdm

    params = params or SamplingParams(temperature=DEFAULT_TEMPERATURE, top_p=DEFAULT_TOP_P, seed=0)
    params = _replace_max_new(params, max_new_tokens)
    prompts = read_prompts(prompts_jsonl, limit)
    suffixed = [Prompt(p.id, p.domain, p.source, user_turns(p, math_suffix)) for p in prompts]
    checked = check_overlap(prompts + suffixed, eval_dir_for_overlap_check or DEFAULT_EVAL_DIR)
    if generate_fn is None:
        from dspark.engine.generate import generate_many as generate_fn
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = target.config.eos_token_ids[0] if target.config.eos_token_ids else None
    meta = {"target": target.name, "vocab_size": target.config.vocab_size, "eos_token_id": eos,
            "sampling": {k: v for k, v in asdict(params).items() if k != "stop"},
            "math_suffix": math_suffix, "prompts_sha256": _sha256(Path(prompts_jsonl)), "limit": limit}
    check_meta(out_dir, meta)
    write_meta(out_dir, meta)
    done = completed_ids(out_dir)
    todo = [(i, p) for i, p in enumerate(prompts) if p.id not in done]
    fmt = ChatFormatter(target.tokenizer)
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="prepare", unit="prompt", disable=not progress)
    for start in range(0, len(todo), shard_size):
        chunk = todo[start : start + shard_size]
        chunk_params = _replace_seed(params, params.seed + 100_003 * chunk[0][0]) if params.seed is not None else params
        records = generate_answers([p for _, p in chunk], fmt, generate_fn, target.model, chunk_params,
                                   math_suffix=math_suffix, eos_id=eos, batch=batch, progress=False)
        write_shard(out_dir, records)
        bar.update(len(chunk))
    bar.close()
    return summarize(out_dir, len(prompts), checked)


def _replace_max_new(params: SamplingParams, max_new_tokens: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, max_new_tokens=max_new_tokens)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def summarize(out_dir: Path, num_prompts: int, eval_texts: int) -> dict:
    """Counts of a data folder: sequences, tokens, assistant tokens, per domain."""
    from dspark.train.data import SequenceStore

    store = SequenceStore(out_dir)
    per_domain: dict[str, int] = {}
    for d in store.domains:
        per_domain[d] = per_domain.get(d, 0) + 1
    return {"out_dir": str(out_dir), "prompts": num_prompts, "sequences": len(store),
            "tokens": int(store.token_ids.numel()), "assistant_tokens": int(store.loss_mask.sum()),
            "per_domain": per_domain, "eval_texts_checked": eval_texts}


def run_prepare(
    prompts: str | Path | None = None,
    out_dir: str | Path = "data/prepared",
    target_path: str | Path | None = None,
    *,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    seed: int = 0,
    limit: int | None = None,
    eval_dir: str | Path | None = None,
    batch: int = 16,
    shard_size: int = 64,
    math_suffix: bool = True,
    device: str = "cpu",
) -> dict:
    """CLI entry: load the target (on `device`), prepare the data, print a summary."""
    from dspark.models.loading import load_target

    target = load_target(target_path, device=device)
    params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed, max_new_tokens=max_new_tokens)
    summary = prepare(prompts or DEFAULT_PROMPTS, out_dir, target, max_new_tokens=max_new_tokens, params=params,
                      limit=limit, eval_dir_for_overlap_check=eval_dir, batch=batch, shard_size=shard_size,
                      math_suffix=math_suffix)
    print(f"dspark prepare: {summary['sequences']} sequences ({summary['tokens']} tokens, "
          f"{summary['assistant_tokens']} assistant tokens) in {summary['out_dir']}; per domain {summary['per_domain']}")
    return summary

"""The paper's nine benchmark prompt sets (section 4.1), three per domain, and a
loader that validates every line before any model work starts.

Files live in `dspark/data/eval/<name>.jsonl`, one JSON object per line:
`{"id": str, "domain": "math"|"code"|"chat", "source": str, "turns": [str, ...]}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dspark.errors import UserError

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "eval"

# benchmark name -> domain, in the paper's Table 1 column order
BENCHMARKS: dict[str, str] = {
    "gsm8k": "math",
    "math500": "math",
    "aime25": "math",
    "mbpp": "code",
    "humaneval": "code",
    "livecodebench": "code",
    "mt-bench": "chat",
    "alpaca": "chat",
    "arena-hard-v2": "chat",
}
DOMAINS: tuple[str, ...] = ("math", "code", "chat")
# column headers as printed in the paper
DISPLAY_NAMES: dict[str, str] = {
    "gsm8k": "GSM8K",
    "math500": "MATH500",
    "aime25": "AIME25",
    "mbpp": "MBPP",
    "humaneval": "HumanEval",
    "livecodebench": "LCB",
    "mt-bench": "MT-Bench",
    "alpaca": "Alpaca",
    "arena-hard-v2": "Arena-Hard",
}


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: the user turns of one conversation."""

    id: str
    benchmark: str
    domain: str  # math | code | chat
    source: str  # <owner>/<repo>:<path> the record was taken from
    turns: tuple[str, ...]  # user messages in order (>= 1)


def resolve_benchmarks(spec: str) -> list[str]:
    """Benchmark names from `all`, a domain (`math|code|chat`) or a comma list of
    names and domains, in Table 1 order without duplicates."""
    wanted: set[str] = set()
    for part in (p.strip() for p in spec.split(",")):
        if part == "all":
            wanted.update(BENCHMARKS)
        elif part in DOMAINS:
            wanted.update(name for name, domain in BENCHMARKS.items() if domain == part)
        elif part in BENCHMARKS:
            wanted.add(part)
        else:
            choices = ", ".join(["all", *DOMAINS, *BENCHMARKS])
            raise UserError(f"unknown benchmark {part!r} in --bench {spec!r}; choose from: {choices}")
    return [name for name in BENCHMARKS if name in wanted]


def load_benchmark(name: str, data_dir: str | Path | None = None) -> list[Prompt]:
    """All prompts of one benchmark, every line validated (UserError naming the
    file, the line and the fix on the first bad one)."""
    if name not in BENCHMARKS:
        raise UserError(f"unknown benchmark {name!r}; choose from: {', '.join(BENCHMARKS)}")
    path = Path(data_dir or DATA_DIR) / f"{name}.jsonl"
    if not path.is_file():
        raise UserError(f"benchmark file {path} is missing; reinstall dspark or restore the file")
    prompts: list[Prompt] = []
    seen: set[str] = set()
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            prompt = _parse_line(line, path, number, name)
            if prompt.id in seen:
                raise UserError(f"{path}:{number}: duplicate id {prompt.id!r}; give every record a unique id")
            seen.add(prompt.id)
            prompts.append(prompt)
    if not prompts:
        raise UserError(f"benchmark file {path} is empty; it needs one JSON object per line")
    return prompts


def _parse_line(line: str, path: Path, number: int, name: str) -> Prompt:
    where = f"{path}:{number}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: malformed JSON ({exc.msg}); each line must be one JSON object") from None
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with id, domain, source and turns")
    missing = [key for key in ("id", "domain", "source", "turns") if key not in record]
    if missing:
        raise UserError(f"{where}: missing field(s) {', '.join(missing)}; each record needs id, domain, source, turns")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise UserError(f"{where}: 'turns' must be a non-empty list of non-empty strings (the user messages)")
    if not isinstance(record["id"], str) or not record["id"]:
        raise UserError(f"{where}: 'id' must be a non-empty string")
    if record["domain"] != BENCHMARKS[name]:
        raise UserError(
            f"{where}: domain {record['domain']!r} does not match benchmark {name!r} "
            f"(domain {BENCHMARKS[name]!r}); fix the record's domain"
        )
    return Prompt(
        id=record["id"], benchmark=name, domain=record["domain"], source=str(record["source"]), turns=tuple(turns)
    )


def load_suites(
    spec: str, limit: int | None = None, data_dir: str | Path | None = None
) -> dict[str, list[Prompt]]:
    """Benchmark name -> its first `limit` prompts (all when None), for `spec`
    as in `resolve_benchmarks`. Every line of every file is validated, not
    only the first `limit`."""
    if limit is not None and limit < 1:
        raise UserError(f"--limit must be >= 1, got {limit}")
    suites = {}
    for name in resolve_benchmarks(spec):
        prompts = load_benchmark(name, data_dir)
        suites[name] = prompts if limit is None else prompts[:limit]
    return suites

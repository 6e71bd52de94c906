"""`prepare`: prompt validation, the evaluation-overlap check, chat formatting
with loss masks, sharded resumable output (generation is faked here)."""

import json
import re
from pathlib import Path

import pytest

from dspark.errors import UserError
from dspark.models.tiny import tiny_config
from dspark.train.data import SequenceStore, read_shard, shard_paths
from dspark.train.prepare import MATH_SUFFIX, check_overlap, prepare, read_prompts
from dspark.types import SamplingParams

SPECIALS = ["<|im_start|>", "<|im_end|>"]


class FakeTokenizer:
    """ChatML over bytes: ids 0/1 are <|im_start|>/<|im_end|>, byte b is id b + 2."""

    chat_template = "chatml"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text

    def encode(self, text, add_special_tokens=False):
        ids = []
        for piece in re.split(r"(<\|im_start\|>|<\|im_end\|>)", text):
            if piece in SPECIALS:
                ids.append(SPECIALS.index(piece))
            else:
                ids.extend(b + 2 for b in piece.encode())
        return ids

    def decode(self, ids, skip_special_tokens=True):
        pieces = [SPECIALS[i] if i < 2 else bytes([i - 2]) for i in ids if i >= 2 or not skip_special_tokens]
        return "".join(p if isinstance(p, str) else p.decode(errors="replace") for p in pieces)


class FakeTarget:
    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.config = tiny_config(vocab_size=258)  # eos id 1 = <|im_end|>
        self.name = "fake"
        self.model = object()


def fake_generate(calls=None, max_new=12, fail_after=None):
    """Answer "ans<k>" (k = number of prompt tokens) or run out of tokens on long prompts."""

    def generate(model, prompt_ids, params, *, max_batch, progress):
        if calls is not None:
            calls.append(len(prompt_ids))
            if fail_after is not None and len(calls) > fail_after:
                raise KeyboardInterrupt  # simulated kill
        out = []
        for ids in prompt_ids:
            text = f"ans{len(ids)}"
            if len(ids) > 150:
                text = "x" * params.max_new_tokens  # hits max_new_tokens: no end-of-turn token
            out.append([b + 2 for b in text.encode()][: params.max_new_tokens])
        return out

    return generate


def _write_prompts(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _row(i, domain="chat", turns=None):
    return {"id": f"p{i}", "domain": domain, "source": "test", "turns": turns or [f"question number {i}"]}


@pytest.fixture
def eval_dir(tmp_path):
    folder = tmp_path / "eval"
    folder.mkdir()
    _write_prompts(folder / "bench.jsonl", [{"id": "b0", "turns": ["What is  2+2?\n"]}])
    return folder


def test_malformed_line_names_file_and_line(tmp_path):
    path = _write_prompts(tmp_path / "p.jsonl", [_row(0), "{not json", _row(2)])
    with pytest.raises(UserError, match=r"p\.jsonl:2: not valid JSON"):
        read_prompts(path)
    path = _write_prompts(tmp_path / "q.jsonl", [_row(0), {"id": "x", "domain": "poetry", "source": "s", "turns": ["a"]}])
    with pytest.raises(UserError, match=r"q\.jsonl:2: unknown domain"):
        read_prompts(path)
    path = _write_prompts(tmp_path / "r.jsonl", [_row(0), {"id": "y", "domain": "chat", "source": "s", "turns": []}])
    with pytest.raises(UserError, match=r"r\.jsonl:2: 'turns'"):
        read_prompts(path)


def test_overlap_with_eval_prompt_is_refused(tmp_path, eval_dir):
    clean = read_prompts(_write_prompts(tmp_path / "a.jsonl", [_row(0), _row(1)]))
    assert check_overlap(clean, eval_dir) == 1
    dirty = read_prompts(_write_prompts(tmp_path / "b.jsonl", [_row(0), _row(1, turns=["What is 2+2?"])]))
    with pytest.raises(UserError, match="p1 = bench.jsonl:1"):
        check_overlap(dirty, eval_dir)
    with pytest.raises(UserError, match="no evaluation prompts"):
        check_overlap(clean, tmp_path / "missing")


def test_prepare_writes_masked_sequences(tmp_path, eval_dir):
    rows = [_row(0, "math"), _row(1, "code"), _row(2, turns=["first turn", "second turn"]), _row(3, turns=["y" * 200])]
    prompts = _write_prompts(tmp_path / "p.jsonl", rows)
    target = FakeTarget()
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=0)
    summary = prepare(prompts, tmp_path / "out", target, max_new_tokens=12, params=params,
                      eval_dir_for_overlap_check=eval_dir, shard_size=3, progress=False, generate_fn=fake_generate())
    assert summary["sequences"] == 4 and len(shard_paths(tmp_path / "out")) == 2
    store = SequenceStore(tmp_path / "out")
    tok = target.tokenizer
    for i, rid in enumerate(store.ids):
        ids, mask = store.get(i)
        ids, mask = ids.tolist(), mask.tolist()
        assistant = tok.decode([t for t, m in zip(ids, mask) if m], skip_special_tokens=False)
        text = tok.decode(ids)
        if rid == "p0":
            assert MATH_SUFFIX.strip() in text  # math prompts get the evaluation suffix
        if rid == "p3":  # hit max_new_tokens: 12 answer tokens, no end-of-turn token
            assert sum(mask) == 12 and ids[-1] != 1
        else:
            assert ids[-1] == 1 and mask[-1] == 1  # the end-of-turn token is learned
        if rid == "p2":  # two turns: both answers masked, the second saw the first
            assert "first turn" in text and "second turn" in text
            assert assistant.count("ans") == 2
        else:
            assert assistant.count("ans") == (0 if rid == "p3" else 1)
        first = mask.index(1)
        assert tok.decode(ids[:first], skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_prepare_resumes_after_interruption(tmp_path, eval_dir):
    prompts = _write_prompts(tmp_path / "p.jsonl", [_row(i) for i in range(7)])
    target = FakeTarget()
    kw = dict(max_new_tokens=12, eval_dir_for_overlap_check=eval_dir, shard_size=2, progress=False)
    calls = []
    with pytest.raises(KeyboardInterrupt):
        prepare(prompts, tmp_path / "out", target, generate_fn=fake_generate(calls, fail_after=2), **kw)
    assert len(shard_paths(tmp_path / "out")) == 2  # two complete shards, nothing half-written
    assert not list((tmp_path / "out").glob("*.tmp"))
    calls.clear()
    summary = prepare(prompts, tmp_path / "out", target, generate_fn=fake_generate(calls), **kw)
    assert calls == [2, 1] and summary["sequences"] == 7  # only the 3 missing prompts were generated
    ids = [i for p in shard_paths(tmp_path / "out") for i in read_shard(p)[1]]
    assert sorted(ids) == [f"p{i}" for i in range(7)]
    more = _write_prompts(tmp_path / "p.jsonl", [_row(i) for i in range(8)])  # same file grown: new sha256
    with pytest.raises(UserError, match="prompts_sha256"):
        prepare(more, tmp_path / "out", target, generate_fn=fake_generate(), **kw)
    prompts = _write_prompts(tmp_path / "p.jsonl", [_row(i) for i in range(7)])
    assert prepare(prompts, tmp_path / "out", target, generate_fn=fake_generate(), limit=3, **kw)["prompts"] == 3
    with pytest.raises(UserError, match="other settings"):
        prepare(prompts, tmp_path / "out", target, generate_fn=fake_generate(), math_suffix=False, **kw)


@pytest.mark.slow
def test_real_chat_template_masks(tmp_path, eval_dir):
    """The embedded SmolLM2 tokenizer's ChatML template: masks cover exactly the answers."""
    from dspark.models.embedded import ensure_embedded_target
    from dspark.models.loading import load_tokenizer, read_target_config

    folder = ensure_embedded_target()
    target = FakeTarget()
    target.tokenizer, target.config = load_tokenizer(folder), read_target_config(folder)
    tok = target.tokenizer

    def generate(model, prompt_ids, params, *, max_batch, progress):
        return [tok.encode(f"Answer {len(p)} done.", add_special_tokens=False) for p in prompt_ids]

    prompts = _write_prompts(tmp_path / "p.jsonl", [_row(0, turns=["Hi there", "And now?"])])
    prepare(prompts, tmp_path / "out", target, max_new_tokens=32, eval_dir_for_overlap_check=eval_dir,
            progress=False, generate_fn=generate)
    ids, mask = SequenceStore(tmp_path / "out").get(0)
    spans = tok.decode([t for t, m in zip(ids.tolist(), mask.tolist()) if m])
    assert spans.count("Answer") == 2 and "Hi there" not in spans and "And now" not in spans
    assert int(ids[-1]) in target.config.eos_token_ids

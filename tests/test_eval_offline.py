"""`dspark eval offline`: expected acceptance on the target's own answers.

The batched all-anchor scorer matches a one-block-at-a-time recomputation
(draft vocabulary included); answers and scores are cached and reused, a
higher --limit generates only the new prompts; two copies of one drafter are
paired at exactly 1x; scores read back from an earlier page (--against) pair as
when scored together, and only when the answers are the same; bad input is
refused before any model work."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import dspark.engine.generate
import dspark.models
from dspark.draft.checkpoint import save_drafter
from dspark.draft.factory import build_drafter
from dspark.errors import UserError
from dspark.eval import offline
from dspark.eval.offline import OfflineRun, run_offline, score_drafter
from dspark.types import RaggedBatch
from dspark.models.tiny import tiny_target
from dspark.train.data import SequenceStore
from tests.test_train_prepare import FakeTokenizer
from tests.train_toys import write_toy_data


def _drafter(kind: str, target, block_size: int = 4):
    options = {"dspark": dict(num_hidden_layers=1, markov_rank=8), "eagle3": {}, "dflash": dict(num_hidden_layers=1)}
    return build_drafter(kind, target.config, target.embed_tokens, target.lm_head_weight, seed=3,
                         block_size=block_size, **options[kind]).eval()


@torch.no_grad()
def _one_block_at_a_time(drafter, target, store, index):
    """(full blocks, tau sum, c* sums per position) of one sequence, each block drafted alone."""
    tokens, mask = store.get(index)
    n, g = tokens.numel(), drafter.block_size
    cache = target.new_cache(1, n)
    out = target.forward(RaggedBatch(tokens, [cache.allocate()], [n]), cache, tap_layers=drafter.tap_layers)
    blocks, tau, acc = 0, 0.0, [0.0] * g
    for p in range(n - g):
        if not bool(mask[p + 1 : p + 1 + g].all()):
            continue
        logits = drafter.forward_train(out.tapped_hidden[None], tokens[None], torch.tensor([[p]])).logits[0, 0].float()
        target_probs = torch.softmax(out.logits[p : p + g].float(), -1)
        if drafter.draft_ids is not None:  # logits over the draft vocabulary: the target's mass elsewhere is lost
            assert logits.shape[-1] == drafter.draft_ids.numel()
            inside = target_probs[:, drafter.draft_ids]
            l1 = (torch.softmax(logits, -1) - inside).abs().sum(-1) + (1.0 - inside.sum(-1))
        else:
            l1 = (torch.softmax(logits, -1) - target_probs).abs().sum(-1)
        c = 1.0 - 0.5 * l1
        blocks += 1
        tau += 1.0 + float(torch.cumprod(c.double(), 0).sum())
        acc = [a + float(x) for a, x in zip(acc, c)]
    return blocks, tau, acc


@pytest.mark.parametrize("kind,vocab", [("dspark", None), ("dspark", 40), ("eagle3", None), ("dflash", 30)])
def test_batched_scoring_matches_one_block_at_a_time(tmp_path, kind, vocab):
    target = tiny_target(seed=0)
    store = SequenceStore(write_toy_data(tmp_path / "data", num=5))
    drafter = _drafter(kind, target)
    if vocab is not None:
        drafter.set_draft_vocab(torch.randperm(target.config.vocab_size, generator=torch.Generator().manual_seed(1)), vocab)
    got = score_drafter(drafter, target, store, [0, 1, 2, 3, 4], batch_size=2, progress=False)
    for i in range(5):
        blocks, tau, acc = _one_block_at_a_time(drafter, target, store, i)
        assert got[i].blocks == blocks > 0
        assert got[i].tau_sum == pytest.approx(tau, rel=1e-4)
        assert got[i].accept_sum == pytest.approx(acc, rel=1e-4, abs=1e-5)
        assert 1.0 <= got[i].tau_sum / blocks <= 1.0 + drafter.block_size


class _Loaded:
    def __init__(self) -> None:
        self.model = tiny_target(seed=0, vocab_size=258)
        self.tokenizer, self.config, self.name = FakeTokenizer(), self.model.config, "tiny"


@pytest.fixture
def tiny_world(monkeypatch, tmp_path):
    loaded = _Loaded()
    monkeypatch.setattr(dspark.models, "load_target", lambda *a, **k: loaded, raising=False)
    a = save_drafter(_drafter("dspark", loaded.model), tmp_path / "dspark-a", dtype=torch.float32)
    b = shutil.copytree(a, tmp_path / "dspark-b")
    c = save_drafter(_drafter("eagle3", loaded.model), tmp_path / "eagle3-c", dtype=torch.float32)
    return tmp_path, [str(a), str(b), str(c)]


def _run(tmp_path, specs, limit=1):
    return run_offline(",".join(specs), "gsm8k,mt-bench", limit=limit, max_new_tokens=12, answers_root=tmp_path / "ans",
                       results_dir=tmp_path / "out", progress=False)


def test_run_writes_page_and_reuses_answers_and_scores(tiny_world, monkeypatch):
    tmp_path, specs = tiny_world
    run, page = _run(tmp_path, specs)
    assert run.prompts == {"gsm8k": 1, "mt-bench": 1, "heldout": 1}
    a, b, c = run.drafters
    for d in run.drafters:
        for name in ("gsm8k", "mt-bench", "heldout"):
            assert 1.0 <= d.tau(name) <= 5.0
    assert [x.per_prompt for x in (a,)] == [b.per_prompt]  # a copy of one drafter scores the same
    text = page.read_text()
    assert "/ dspark-b: benchmarks 1.000x (1.000-1.000)" in text and "| eagle3-c |" in text
    assert page.with_suffix(".png").is_file()
    again = OfflineRun.from_dict(json.loads(page.with_suffix(".json").read_text()))
    assert [d.macro() for d in again.drafters] == [d.macro() for d in run.drafters]

    # a rerun generates nothing and scores nothing: both are cached
    monkeypatch.setattr(dspark.engine.generate, "generate_many", lambda *a, **k: pytest.fail("generated again"))
    monkeypatch.setattr(offline, "score_drafter", lambda *a, **k: pytest.fail("scored again"))
    rerun, _ = _run(tmp_path, specs)
    assert [d.per_prompt for d in rerun.drafters] == [d.per_prompt for d in run.drafters]


def test_a_higher_limit_generates_only_the_new_prompts(tiny_world, monkeypatch):
    tmp_path, specs = tiny_world
    first, _ = _run(tmp_path, specs[:1], limit=1)
    real, asked = dspark.engine.generate.generate_many, []

    def counting(model, prompt_ids, params, **kw):
        asked.append(len(prompt_ids))
        return real(model, prompt_ids, params, **kw)

    monkeypatch.setattr(dspark.engine.generate, "generate_many", counting)
    second, _ = _run(tmp_path, specs[:1], limit=2)
    assert sum(asked) == 4  # one new gsm8k and one new held-out prompt; mt-bench's two turns: two calls of one
    assert second.prompts == {"gsm8k": 2, "mt-bench": 2, "heldout": 2}
    for name, rows in first.drafters[0].per_prompt.items():  # the first prompts' answers were kept
        for pid, counts in rows.items():
            assert second.drafters[0].per_prompt[name][pid] == counts


def test_bad_input_is_refused_before_model_work(tiny_world, monkeypatch):
    tmp_path, specs = tiny_world
    monkeypatch.setattr(dspark.models, "load_target", lambda *a, **k: pytest.fail("target loaded"), raising=False)
    with pytest.raises(UserError, match="none and ngram have no distribution"):
        run_offline("ngram", "gsm8k", limit=1, answers_root=tmp_path / "ans", results_dir=tmp_path / "out")
    with pytest.raises(UserError, match="top-p"):
        run_offline(specs[0], "gsm8k", top_p=0.0, answers_root=tmp_path / "ans", results_dir=tmp_path / "out")
    with pytest.raises(UserError, match="unknown benchmark"):
        run_offline(specs[0], "gsm9k", answers_root=tmp_path / "ans", results_dir=tmp_path / "out")


def test_answers_of_other_settings_are_not_mixed(tiny_world):
    tmp_path, specs = tiny_world
    _run(tmp_path, specs[:1])
    folder = next((tmp_path / "ans").iterdir())
    meta = json.loads((folder / "meta.json").read_text())
    meta["target"] = "another"
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"prepared with other settings \(target\)"):
        _run(tmp_path, specs[:1])


def test_cli_offline_errors_name_the_fix(capsys):
    from dspark.cli import main

    for argv, needle in ((["eval", "offline", "--drafter", "ngram"], "none and ngram have no distribution"),
                         (["eval", "offline", "--drafter", "default", "--temperature", "0"], "temperature must be > 0"),
                         (["eval", "offlin"], "use 'dspark eval report' or 'dspark eval offline'"),
                         (["eval", "offline", "--drafter", "default", "--against", "gone.json:eagle3"], "no such file")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err


def _against(tmp_path, spec, against):
    return run_offline(spec, "gsm8k,mt-bench", limit=1, max_new_tokens=12, answers_root=tmp_path / "ans",
                       results_dir=tmp_path / "out2", progress=False, against=against)


def test_against_pairs_with_stored_scores_of_the_same_answers(tiny_world):
    tmp_path, specs = tiny_world
    first, page = _run(tmp_path, specs)
    stored = page.with_suffix(".json")
    digests = json.loads(stored.read_text())["answer_digests"]
    assert sorted(digests) == ["gsm8k/gsm8k-0000", "heldout/" + next(iter(first.drafters[0].per_prompt["heldout"])),
                               "mt-bench/mt-bench-0000"]
    shutil.rmtree(specs[2])  # the Eagle3 checkpoint is gone; its scores are read back
    run, page2 = _against(tmp_path, specs[0], [f"{stored}:eagle3-c", f"{stored}:dspark-b"])
    a, c, b = run.drafters
    assert (c.label, b.label) == ("eagle3-c (stored)", "dspark-b (stored)")
    assert c.per_prompt == first.drafters[2].per_prompt and a.per_prompt == first.drafters[0].per_prompt
    text = page2.read_text()
    assert text.count("the same answers (digests checked)") == 2
    assert "/ dspark-b (stored): benchmarks 1.000x (1.000-1.000)" in text
    before = offline.offline_table(first).split("/ eagle3-c: benchmarks ")[1].split(";")[0]
    assert f"/ eagle3-c (stored): benchmarks {before}" in text  # the same pairing as when both were scored together
    whole, _ = _against(tmp_path, specs[0], [str(stored)])  # no label: every drafter of the page
    assert [d.label for d in whole.drafters[1:]] == ["dspark-a (stored)", "dspark-b (stored)", "eagle3-c (stored)"]
    again = OfflineRun.from_dict(json.loads(page2.with_suffix(".json").read_text()))
    assert again.drafters[1].note == c.note and again.digests == run.digests


def test_against_refuses_other_answers_settings_labels_and_prompts(tiny_world, monkeypatch):
    tmp_path, specs = tiny_world
    _, page = _run(tmp_path, specs)
    stored = page.with_suffix(".json")
    data = json.loads(stored.read_text())

    def variant(name, change):
        copy = json.loads(json.dumps(data))
        change(copy)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(copy))
        return str(path)

    with pytest.raises(UserError, match="no drafter labelled 'eagle9' .* it holds dspark-a, dspark-b, eagle3-c"):
        _against(tmp_path, specs[0], [f"{stored}:eagle9"])
    hot = variant("hot", lambda d: d["settings"].update(temperature=0.7))
    with pytest.raises(UserError, match="scored with temperature = 0.7, this run with 1.0"):
        _against(tmp_path, specs[0], [hot])
    other = variant("other", lambda d: d["answer_digests"].update({"gsm8k/gsm8k-0000": "0" * 16}))
    with pytest.raises(UserError, match=r"1 of this run's 3 answers are not the ones .* \(e.g. gsm8k/gsm8k-0000\)"):
        _against(tmp_path, specs[0], [other])
    short = variant("short", lambda d: d["drafters"][2]["per_prompt"]["mt-bench"].clear())
    with pytest.raises(UserError, match="eagle3-c in .* has no score for 1 of this run's prompts .*mt-bench/mt-bench-0000"):
        _against(tmp_path, specs[0], [f"{short}:eagle3-c"])
    old = variant("old", lambda d: d.pop("answer_digests"))  # a page from before digests: read, and said so
    run, page2 = _against(tmp_path, specs[0], [f"{old}:eagle3-c"])
    assert "answers not checked (the page predates answer digests)" in page2.read_text()
    monkeypatch.setattr(dspark.models, "load_target", lambda *a, **k: pytest.fail("target loaded"), raising=False)
    with pytest.raises(UserError, match="no such file"):
        _against(tmp_path, specs[0], [str(tmp_path / "nope.json")])
    with pytest.raises(UserError, match="give the .json"):
        _against(tmp_path, specs[0], [str(page)])


def test_exclude_leaves_prompts_out_of_scoring_only(tiny_world):
    tmp_path, specs = tiny_world
    full, _ = _run(tmp_path, specs[:1])
    gsm = "gsm8k/" + next(iter(full.drafters[0].per_prompt["gsm8k"]))
    two, page = run_offline(specs[0], "gsm8k,mt-bench", limit=2, max_new_tokens=12, answers_root=tmp_path / "ans",
                            results_dir=tmp_path / "out3", progress=False, exclude=[gsm])
    assert two.prompts == {"gsm8k": 1, "mt-bench": 2, "heldout": 2}
    assert gsm.split("/")[1] not in two.drafters[0].per_prompt["gsm8k"] and gsm not in two.digests
    for pid, counts in full.drafters[0].per_prompt["mt-bench"].items():  # the kept answers are the same answers
        assert two.drafters[0].per_prompt["mt-bench"][pid] == counts
    assert f"left out with --exclude: {gsm}" in page.read_text() and f"--exclude {gsm}" in two.command
    _, whole = run_offline(specs[0], "gsm8k,mt-bench", limit=2, max_new_tokens=12, answers_root=tmp_path / "ans",
                           results_dir=tmp_path / "out3", progress=False)
    assert whole != page and f"left out with --exclude: {gsm}" in page.read_text()  # neither page overwrote the other
    with pytest.raises(UserError, match="gsm8k/gsm8k-9999 is not a prompt of this run; give SET/ID"):
        run_offline(specs[0], "gsm8k", limit=1, answers_root=tmp_path / "ans", results_dir=tmp_path / "out",
                    exclude=["gsm8k/gsm8k-9999"])
    with pytest.raises(UserError, match="leaves no prompt of gsm8k; leave it out with --bench"):
        run_offline(specs[0], "gsm8k,mt-bench", limit=1, answers_root=tmp_path / "ans", results_dir=tmp_path / "out",
                    exclude=[gsm])


def test_same_answers_names_the_prompts_one_drafter_scored_differently(tiny_world, capsys):
    from dspark.eval import same_answers

    tmp_path, specs = tiny_world
    _, page = _run(tmp_path, specs)
    data = json.loads(page.with_suffix(".json").read_text())
    data["drafters"][0]["per_prompt"]["mt-bench"]["mt-bench-0000"]["tau_sum"] += 0.5  # as if its answer had changed
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    assert same_answers.main([f"{page.with_suffix('.json')}:dspark-a", f"{other}:dspark-a"]) == 0
    out = capsys.readouterr().out
    assert "3 prompts on both, 1 scored differently (mt-bench/mt-bench-0000)" in out
    assert out.strip().endswith("--exclude mt-bench/mt-bench-0000")
    assert same_answers.main([f"{page.with_suffix('.json')}:dspark-a", f"{other}:dspark-b"]) == 0  # b untouched
    assert "0 scored differently" in capsys.readouterr().out
    for argv, needle in (([f"{other}:dspark-a"], "usage"), ([f"{other}:nope", f"{other}:dspark-a"], "no drafter labelled 'nope'"),
                         ([str(other), f"{other}:dspark-a"], "give PAGE.json:LABEL")):
        assert same_answers.main(argv) == 2
        assert needle in capsys.readouterr().err

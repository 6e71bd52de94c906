"""Bad input on the command line: one line naming the problem and the fix,
exit status 2, no traceback."""

from __future__ import annotations

import json

import pytest

from dspark.cli import main
from dspark.models.tiny import tiny_hf_folder


def _error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dspark: error: "), err
    assert "Traceback" not in err[0]
    return err[0]


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-3"], "top_k"),
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--block-size", "0"], "block-size"),
    ],
)
def test_bad_sampling_flags(capsys, extra, needle):
    assert needle in _error(capsys, ["generate", "--prompt", "hi", *extra])


def test_empty_prompt(capsys):
    assert "empty" in _error(capsys, ["generate", "--prompt", "   "])


def test_missing_model_folder(capsys, tmp_path):
    msg = _error(capsys, ["generate", "--prompt", "hi", "--target", str(tmp_path / "nope")])
    assert "does not exist" in msg


def test_corrupt_model_files(capsys, tmp_path):
    folder = tiny_hf_folder(tmp_path, seed=1)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    assert "model.safetensors" in _error(capsys, ["generate", "--prompt", "hi", "--target", str(folder)])
    (folder / "config.json").write_text("{not json")
    assert "config.json" in _error(capsys, ["generate", "--prompt", "hi", "--target", str(folder)])


def test_folder_without_tokenizer(capsys, tmp_path):
    folder = tiny_hf_folder(tmp_path, seed=1)
    assert "tokenizer" in _error(capsys, ["generate", "--prompt", "hi", "--target", str(folder)])


@pytest.fixture
def embedded_converted(capsys):
    """Convert the embedded model first, so its one-time progress lines are not
    mistaken for the error output under test."""
    from dspark.models.embedded import ensure_embedded_target

    ensure_embedded_target()
    capsys.readouterr()


@pytest.mark.slow
def test_unknown_drafter_and_long_prompt_on_embedded_model(capsys, embedded_converted):
    msg = _error(capsys, ["generate", "--prompt", "hi", "--drafter", "no-such-drafter"])
    assert "unknown drafter" in msg and "ngram" in msg
    msg = _error(capsys, ["generate", "--prompt", "word " * 9000, "--drafter", "none"])
    assert "context" in msg


def _greedy_json(capsys, drafters: tuple[str, ...], prompt: str, max_new_tokens: int, policy: str = "auto") -> list[dict]:
    """`dspark generate --chat --temperature 0 --json` once per drafter: the printed objects."""
    outs = []
    for drafter in drafters:
        argv = ["generate", "--chat", "--prompt", prompt, "--drafter", drafter, "--temperature", "0",
                "--max-new-tokens", str(max_new_tokens), "--policy", policy, "--json"]
        assert main(argv) == 0
        outs.append(json.loads(capsys.readouterr().out))
    return outs


@pytest.mark.slow
def test_ngram_and_none_print_identical_greedy_tokens(capsys):
    # --policy fixed verifies every lookup hit. Under auto (the DSpark scheduler) whether a hit is
    # verified depends on the engine profile measured at start-up, so on a loaded machine it may
    # verify none, and the hit count below would test the machine's load, not the drafter.
    outs = _greedy_json(capsys, ("ngram", "none"), "List the numbers from 1 to 20, separated by commas.", 48,
                        policy="fixed")
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and outs[0]["num_generated"] == 48
    assert set(outs[0]["stats"]) == {"rounds", "draft_tokens", "accepted_tokens", "mean_accepted_length", "per_position_acceptance"}
    assert outs[0]["stats"]["accepted_tokens"] > 0  # the list repeats itself: prompt lookup must hit


@pytest.mark.slow
def test_default_drafter_with_auto_policy_prints_the_greedy_tokens_of_none(capsys):
    """`--drafter default` (the shipped DSpark drafter; the n-gram drafter if none
    is shipped) under `--policy auto` (the DSpark scheduler with its draft gate,
    after a batch-1 profile) gives exactly plain greedy decoding's tokens."""
    outs = _greedy_json(capsys, ("default", "none"), "Explain in two sentences why the sky is blue.", 40)
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and outs[0]["num_generated"] == 40


@pytest.mark.slow
def test_shipped_mtp1_drafter_prints_the_greedy_tokens_of_none(capsys):
    """`--drafter mtp1` (the shipped MTP-1 baseline: no confidences, so every drafted token is
    verified) gives exactly plain greedy decoding's tokens, and its drafts are accepted sometimes."""
    outs = _greedy_json(capsys, ("mtp1", "none"), "Write a Python function that adds two numbers.", 40)
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and outs[0]["num_generated"] == 40
    assert outs[0]["stats"]["draft_tokens"] > 0 and outs[0]["stats"]["accepted_tokens"] > 0


def test_shipped_drafter_names_are_for_the_embedded_target_only(capsys):
    """`default` falls back to prompt lookup for another target; `mtp1` names a drafter trained
    for the embedded model only, so another target gets an error that says to pass a folder."""
    from dspark.draft.registry import load_drafter
    from dspark.errors import UserError
    from dspark.models.tiny import tiny_target

    target = tiny_target(seed=0)
    with pytest.raises(UserError, match="trained for the embedded SmolLM2-135M-Instruct target only; pass the path"):
        load_drafter("mtp1", target, embedded=False)
    assert load_drafter("default", target, embedded=False).name == "ngram"
    capsys.readouterr()  # the fallback's notice


@pytest.mark.slow
def test_greedy_tokens_are_the_same_with_and_without_the_cpu_kernel(capsys):
    """Plain greedy decoding on torch's matmuls (`--no-cpu-kernel`) and speculative greedy
    decoding (prompt lookup) on the C kernel print the same tokens on the embedded model."""
    outs = []
    # --policy fixed: every lookup hit is verified whatever the start-up profile (see above)
    for extra in (["--drafter", "none", "--no-cpu-kernel"], ["--drafter", "ngram", "--policy", "fixed"]):
        argv = ["generate", "--chat", "--prompt", "List the numbers from 1 to 20, separated by commas.",
                "--temperature", "0", "--max-new-tokens", "40", "--json", *extra]
        assert main(argv) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["token_ids"] == outs[1]["token_ids"] and outs[1]["stats"]["accepted_tokens"] > 0

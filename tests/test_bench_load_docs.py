"""The docs' load-run entry point (`python -m dspark.bench.load_docs`): its options reach
`docs_run`, and bad options stop it with a message that names the fix (no run starts)."""

from __future__ import annotations

import pytest

from dspark.bench import load_docs

DOCS_RUN = load_docs.docs_run


@pytest.fixture
def calls(monkeypatch):
    seen: list[tuple[tuple, dict]] = []
    monkeypatch.setattr(load_docs, "docs_run", lambda *a, **kw: seen.append((a, kw)))
    return seen


def test_options_reach_the_run(calls):
    load_docs.main(["runs/dspark", "runs/mtp", "--only", "nospec,dspark", "--name", "load_x", "--repeats", "5"])
    assert calls == [(("runs/dspark", "runs/mtp"), {"name": "load_x", "only": ["nospec", "dspark"], "repeats": 5})]
    load_docs.main([])
    assert calls[-1] == ((), {"name": "load_cpu", "only": None, "repeats": None})


def test_arms_replace_the_default_ones(calls):
    load_docs.main(["--arm", "plain=none:none", "--arm", "ng=ngram:dspark", "--name", "load_ng"])
    (args, kw), = calls
    assert args == () and [a.name for a in kw["arms"]] == ["plain", "ng"] and kw["arms"][1].policy == "dspark"


def test_temperature_reaches_the_run_and_seeds_every_request(calls, monkeypatch):
    load_docs.main(["--arm", "a=none:none", "--temperature", "1"])
    assert calls[-1][1]["temperature"] == 1.0
    import torch

    captured = {}
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(load_docs, "run_load_bench", lambda arms, settings, **kw: captured.update(settings=settings))
    monkeypatch.setattr(load_docs, "docs_run", DOCS_RUN)
    load_docs.docs_run(temperature=0.8, out_dir="unused")
    assert captured["settings"].sampling.temperature == 0.8 and captured["settings"].sampling.seed == 0
    assert load_docs.DOCS_SETTINGS.sampling.temperature == 0.0  # greedy stays the default


@pytest.mark.parametrize("argv,message", [(["--repeats", "0"], "--repeats takes a whole number >= 1"),
                                          (["--temperature", "hot"], "--temperature takes a number in \\[0, 2\\]"),
                                          (["--arm", "ng=ngram:fast"], "bad arm 'ng=ngram:fast'"),
                                          (["runs/d", "--arm", "a=none:none"], "drafter folders or --arm, not both"),
                                          (["--repeats", "two"], "--repeats takes a whole number >= 1"),
                                          (["--fast"], "unknown option --fast"),
                                          (["--concurrency", "1,0"], "--concurrency takes comma-separated whole"),
                                          (["--concurrency", "1.5"], "--concurrency takes comma-separated whole"),
                                          (["--rates", "fast"], "--rates takes comma-separated numbers > 0"),
                                          (["--rates", "1,-2"], "--rates takes comma-separated numbers > 0"),
                                          (["--max-seconds", "-5"], "--max-seconds takes")])
def test_bad_options_stop_before_running(calls, argv, message):
    with pytest.raises(SystemExit, match=message):
        load_docs.main(argv)
    assert calls == []


def test_help_prints_usage_and_runs_nothing(calls, capsys):
    load_docs.main(["--help"])
    assert "usage: python -m dspark.bench.load_docs" in capsys.readouterr().out and calls == []


def test_repeats_replace_the_default_sweeps(monkeypatch):
    import torch

    captured = {}
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # docs_run pins 1 thread; not in this process
    monkeypatch.setattr(load_docs, "run_load_bench", lambda arms, settings, **kw: captured.update(settings=settings))
    load_docs.docs_run(repeats=7, out_dir="unused")
    assert captured["settings"].repeats == 7
    assert load_docs.DOCS_SETTINGS.repeats == 3  # the default is left alone


def test_levels_and_bound_reach_the_run(calls):
    load_docs.main(["runs/d", "--concurrency", "1,2,64", "--rates", "0.5,2", "--max-seconds", "900"])
    (args, kw), = calls
    assert kw["concurrency"] == (1, 2, 64) and kw["rates"] == (0.5, 2.0) and kw["max_seconds"] == 900.0


@pytest.mark.parametrize("given,levels", [({"concurrency": (2, 8)}, ((2, 8), ())),
                                          ({"rates": (1.0,)}, ((), (1.0,))),
                                          ({"concurrency": (32,), "rates": (0.5,)}, ((32,), (0.5,))),
                                          ({}, ((1, 4, 16), ()))])
def test_levels_replace_the_docs_levels(monkeypatch, given, levels):
    """Either option alone replaces both default level lists: --rates alone runs only Poisson levels."""
    import torch

    captured = {}
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(load_docs, "run_load_bench", lambda arms, settings, **kw: captured.update(settings=settings))
    load_docs.docs_run(out_dir="unused", max_seconds=600.0, **given)
    assert (captured["settings"].concurrency, captured["settings"].rates) == levels
    assert captured["settings"].max_seconds == 600.0
    assert load_docs.DOCS_SETTINGS.concurrency == (1, 4, 16) and load_docs.DOCS_SETTINGS.max_seconds == 2700.0

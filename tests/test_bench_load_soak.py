"""A small soak of a real server (uvicorn on 127.0.0.1, tiny random target,
bigram drafter behind the DSpark scheduler): concurrent streaming clients,
client disconnects, malformed requests and greedy checks. It must end with no
failed well-formed request, the KV cache back at its baseline and greedy
outputs equal to running alone, also when the engine's fresh KV buffers come
from memory holding NaN; a negative control shows the soak notices failing
requests."""

from __future__ import annotations

import dataclasses

import httpx
import pytest
import torch

from dspark.bench.local_server import local_server
from dspark.bench.soak import MALFORMED, SoakSettings, run_soak
from dspark.engine.async_engine import AsyncEngine
from dspark.server import ServingStack
from tests.server_harness import CharTokenizer, make_engine, running_server, single_torch_thread


SETTINGS = SoakSettings(clients=8, requests=60, max_seconds=25, max_new_tokens=16, greedy_prompts=3,
                        bench="mbpp,alpaca,mt-bench", max_prompt_chars=120, settle_seconds=10, seed=3)


def test_small_soak_passes():
    settings = SETTINGS
    engine = make_engine(seed=11, max_running=4)
    stack = ServingStack(AsyncEngine(engine), CharTokenizer(), "tiny-test", None)
    with single_torch_thread(), local_server(stack) as url:
        report = run_soak(url, settings, progress=False)
        assert engine.kv.tokens_in_use() == 0 and not engine.requests
    assert not stack.async_engine.is_alive  # local_server shut the engine down
    with pytest.raises(httpx.TransportError):  # and stopped serving
        httpx.get(url + "/health", timeout=2)
    assert report.passed, report.errors
    assert report.sent == 60 and report.failed == 0 and report.engine_failures == 0
    assert report.kv_baseline == report.kv_end == 0
    assert report.greedy_checked > 0 and report.greedy_mismatches == 0
    assert report.cancelled > 0 and report.completed > 0
    assert report.malformed == report.malformed_rejected > 0 and report.healthy


def test_soak_with_nan_garbage_in_fresh_memory():
    """Free 100 MB of NaN-filled tensors first: the KV buffers of the next engine
    (torch.empty, ~256 KB a layer) then come from memory holding NaN. The cache
    must zero never-written positions before attention reads them."""
    junk = [torch.full((65536,), float("nan")) for _ in range(400)]
    del junk
    engine = make_engine(seed=11, max_running=4)
    stack = ServingStack(AsyncEngine(engine), CharTokenizer(), "tiny-test", None)
    with single_torch_thread(), local_server(stack) as url:
        report = run_soak(url, dataclasses.replace(SETTINGS, requests=30), progress=False)
    assert report.passed, report.errors


def test_soak_reports_failing_requests():
    """Negative control: the drafter raises on the first step, which fails the
    requests that step ran (server-side 'error' events); the soak must count
    them and not pass."""
    settings = SoakSettings(clients=4, requests=12, max_seconds=20, max_new_tokens=8, greedy_prompts=0,
                            greedy_fraction=0.0, cancel_fraction=0.0, malformed_fraction=0.0, bench="alpaca",
                            max_prompt_chars=80, settle_seconds=10)
    with single_torch_thread(), running_server(make_engine(seed=11, max_running=4, delay_s=0.05)) as server:
        server.engine.drafter.fail_next = True
        report = run_soak(server.base_url, settings, progress=False)
    assert not report.passed
    assert report.failed >= 1 and report.engine_failures >= 1
    assert report.completed + report.failed == 12 and any("failed" in e for e in report.errors)


def test_malformed_catalog_covers_json_and_fields():
    kinds = {type(m).__name__ for m in MALFORMED}
    assert kinds == {"bytes", "dict"} and len(MALFORMED) >= 6


@pytest.mark.parametrize("argv, message", [
    (["--clients", "x"], "--clients takes a whole number"), (["--requests", "0"], "--requests takes a whole number"),
    (["--bogus"], "unknown option --bogus"), (["a", "b", "c"], "at most a drafter and a policy"),
    (["--slots"], "--slots needs a value"),
])
def test_soak_docs_bad_options_name_the_fix(argv, message):
    from dspark.bench.soak_docs import main

    with pytest.raises(SystemExit, match=message):
        main(argv)

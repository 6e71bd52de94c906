"""A client that goes away mid-request cancels it: the engine aborts it between
steps and frees its KV cache, and the server keeps serving. The drafter
sleeps 20 ms per step so that generation is still running when the client
leaves (the request asks for far more tokens than it could finish)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.server_harness import make_engine, running_server, single_torch_thread

MODEL = "tiny-test"
LONG = {"max_tokens": 400, "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server():
    with single_torch_thread(), running_server(make_engine(seed=6, delay_s=0.02), MODEL) as handle:
        yield handle


def _aborted(server) -> int:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return int(re.search(r"^dspark_requests_aborted_total (\d+)$", text, re.M).group(1))


def _wait_running(server) -> None:
    import time

    deadline = time.monotonic() + 10
    while server.engine.kv.tokens_in_use() == 0:
        assert time.monotonic() < deadline, "request never started"
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_disconnect_mid_stream_frees_kv(server, kind):
    client = server.client()
    before = _aborted(server)
    if kind == "chat":
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go on"}],
                                                stream=True, **LONG)
    else:
        stream = client.completions.create(model=MODEL, prompt="and then", stream=True, **LONG)
    received = []
    for chunk in stream:
        received.append(chunk)
        if len(received) == 4:
            break
    assert server.engine.kv.tokens_in_use() > 0  # still generating
    stream.close()  # drop the connection
    server.wait_idle()
    assert _aborted(server) == before + 1
    assert server.engine.kv.num_free_slots == server.engine.kv.max_slots


def test_disconnect_while_waiting_for_a_full_response_frees_kv(server):
    before = _aborted(server)
    body = {"model": MODEL, "prompt": "wait for it", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.5))
    server.wait_idle()
    assert _aborted(server) == before + 1


def test_other_requests_survive_a_cancelled_neighbour(server):
    client = server.client()
    want = client.completions.create(model=MODEL, prompt="steady", max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    doomed = client.completions.create(model=MODEL, prompt="doomed", stream=True, **LONG)
    next(iter(doomed))
    _wait_running(server)
    got = client.completions.create(model=MODEL, prompt="steady", max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    doomed.close()
    assert got == want
    server.wait_idle()

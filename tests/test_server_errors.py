"""Bad input gets an OpenAI-style JSON error with a 4xx status, and the server
keeps serving afterwards; with an API key, requests without it get 401."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_harness import make_engine, running_server, single_torch_thread

MODEL = "tiny-test"
CONTEXT = 128
MAX_BODY = 8192


@pytest.fixture(scope="module")
def server():
    with single_torch_thread(), running_server(make_engine(seed=4, max_seq_len=CONTEXT), MODEL,
                                               max_body_bytes=MAX_BODY) as handle:
        yield handle


def _post(server, path: str, body: dict | None = None, content: bytes | None = None, headers=None) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, content=content, headers=headers, timeout=30)


def _assert_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def _completion(**overrides) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0, **overrides}


BAD_COMPLETIONS = [
    ({"temperature": 2.5}, "temperature", None),
    ({"temperature": "hot"}, "temperature", None),
    ({"top_p": 0}, "top_p", None),
    ({"top_p": 1.5}, "top_p", None),
    ({"top_k": -3}, "top_k", None),
    ({"max_tokens": 0}, "max_tokens", None),
    ({"max_tokens": 1.5}, "max_tokens", None),
    ({"n": 2}, "n", None),
    ({"seed": -1}, "seed", None),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
    ({"stop": [""]}, "stop", None),
    ({"stream": "yes"}, "stream", None),
    ({"logprobs": 3}, "logprobs", None),
    ({"echo": True}, "echo", None),
    ({"prompt": ["one", "two"]}, "prompt", None),
    ({"prompt": 42}, "prompt", None),
    ({"prompt": ""}, "prompt", None),
    ({"prompt": [5, 9999]}, "prompt", None),  # token id outside the vocabulary
    ({"prompt": "x" * (CONTEXT + 10)}, "prompt", "context_length_exceeded"),
    ({"prompt": "x" * 100, "max_tokens": 60}, "max_tokens", "context_length_exceeded"),
    ({"model": None}, "model", None),
]


@pytest.mark.parametrize("overrides,param,code", BAD_COMPLETIONS, ids=[str(b[0])[:40] for b in BAD_COMPLETIONS])
def test_bad_completion_fields_are_400(server, overrides, param, code):
    _assert_error(_post(server, "/v1/completions", _completion(**overrides)), 400, param, code)


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
]


@pytest.mark.parametrize("overrides,param", BAD_CHATS, ids=[str(b[0])[:40] for b in BAD_CHATS])
def test_bad_chat_fields_are_400(server, overrides, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **overrides}
    _assert_error(_post(server, "/v1/chat/completions", body), 400, param)


def test_unknown_model_is_404(server):
    _assert_error(_post(server, "/v1/completions", _completion(model="gpt-9")), 404, "model", "model_not_found")


def test_malformed_and_non_object_json_are_400(server):
    headers = {"content-type": "application/json"}
    _assert_error(_post(server, "/v1/completions", content=b'{"model": ', headers=headers), 400, code="invalid_json")
    _assert_error(_post(server, "/v1/completions", content=b"\xff\xfe", headers=headers), 400, code="invalid_json")
    _assert_error(_post(server, "/v1/chat/completions", content=b"[1, 2]", headers=headers), 400, code="invalid_json")


def test_oversized_body_is_413(server):
    big = _completion(prompt="a" * (MAX_BODY + 100))
    _assert_error(_post(server, "/v1/completions", big), 413, code="request_too_large")

    def chunked():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "tiny-test", "prompt": "'
        for _ in range(MAX_BODY // 1000 + 2):
            yield b"b" * 1000
        yield b'"}'

    resp = httpx.post(server.base_url + "/v1/completions", content=chunked(), timeout=30)
    _assert_error(resp, 413, code="request_too_large")


def test_unknown_route_and_method_are_json_errors(server):
    _assert_error(httpx.get(server.base_url + "/v1/nothing", timeout=10), 404)
    _assert_error(httpx.get(server.base_url + "/v1/completions", timeout=10), 405)


def test_client_library_raises_typed_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=9)
    assert info.value.status_code == 400 and info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_server_still_serves_after_errors(server):
    for overrides, _, _ in BAD_COMPLETIONS[:5]:
        _post(server, "/v1/completions", _completion(**overrides))
    out = server.client().completions.create(model=MODEL, prompt="still there?", max_tokens=5, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    server.wait_idle()


def test_api_key_is_required_when_set():
    with single_torch_thread(), running_server(make_engine(seed=5), MODEL, api_key="sekret") as srv:
        with pytest.raises(openai.AuthenticationError) as info:
            srv.client(api_key="wrong").completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert info.value.status_code == 401
        no_header = httpx.post(srv.base_url + "/v1/completions", json=_completion(), timeout=10)
        _assert_error(no_header, 401, code="invalid_api_key")
        _assert_error(httpx.get(srv.base_url + "/v1/models", timeout=10), 401)
        _assert_error(httpx.get(srv.base_url + "/metrics", timeout=10), 401)
        assert httpx.get(srv.base_url + "/health", timeout=10).status_code == 200  # liveness stays open
        out = srv.client(api_key="sekret").completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0)
        assert out.choices[0].finish_reason in ("stop", "length")
        srv.wait_idle()


def test_engine_failure_is_a_500_and_the_server_keeps_serving(server):
    drafter = server.engine.drafter  # SlowDrafter: fail_next makes the next propose raise
    body = _completion(prompt="boom", max_tokens=30, ignore_eos=True)
    drafter.fail_next = True
    err = _assert_error(_post(server, "/v1/completions", body), 500)
    assert err["type"] == "server_error" and "injected drafter failure" in err["message"]
    drafter.fail_next = True
    with pytest.raises(openai.APIError, match="injected drafter failure"):
        list(server.client().completions.create(model=MODEL, prompt="boom", max_tokens=30, stream=True,
                                                extra_body={"ignore_eos": True}))
    assert not drafter.fail_next
    server.wait_idle()
    out = server.client().completions.create(model=MODEL, prompt="fine", max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")

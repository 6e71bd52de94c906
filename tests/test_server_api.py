"""The OpenAI-compatible API through the official `openai` client against a real
uvicorn server (tiny random target, character tokenizer): completions, chat,
streaming, stop strings, seeds, and batching invariance of greedy outputs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dspark.engine.generate import generate
from dspark.types import SamplingParams
from tests.server_harness import CharTokenizer, make_engine, running_server, single_torch_thread

MODEL = "tiny-test"
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
PROMPTS = ["Hello there, ", "abcabcabc", "The cat sat on the mat. The cat", "x = 1\ny = 2\n", "zzzz", "Once upon"]


@pytest.fixture(scope="module")
def server():
    with single_torch_thread(), running_server(make_engine(seed=3), MODEL) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_completion_is_the_greedy_continuation(server, client):
    prompt = PROMPTS[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, **GREEDY)
    ref_engine = make_engine(seed=3)  # same weights, driven directly
    ids = CharTokenizer().encode(prompt)
    ref = generate(ref_engine, ids, SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True))
    choice = out.choices[0]
    assert choice.text == CharTokenizer().decode(ref.token_ids)
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == 24
    assert out.usage.total_tokens == len(ids) + 24
    assert out.model == MODEL and out.object == "text_completion"


def test_token_id_prompt_equals_text_prompt(client):
    text = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, **GREEDY)
    ids = client.completions.create(model=MODEL, prompt=CharTokenizer().encode(PROMPTS[1]), max_tokens=12, **GREEDY)
    assert ids.choices[0].text == text.choices[0].text


def test_chat_completion_uses_the_chat_template(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, **GREEDY)
    template = CharTokenizer().apply_chat_template(messages)
    raw = client.completions.create(model=MODEL, prompt=template, max_tokens=16, **GREEDY)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == raw.choices[0].text
    assert out.usage.prompt_tokens == len(template)
    assert out.object == "chat.completion"


def test_default_chat_max_tokens_fills_the_context(server, client):
    """Without max_tokens a chat may use the rest of the context; the EOS token stops it."""
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}], temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens + out.usage.completion_tokens <= server.engine.max_seq_len


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_chunks_concatenate_to_the_full_text(client, kind):
    """One content chunk per committed token batch (the prefill's first token,
    then one per speculative round), in order, ending in finish_reason and usage."""
    if kind == "chat":
        call = client.chat.completions.create
        kw = {"messages": [{"role": "user", "content": "Count: 1 2 3"}]}
    else:
        call = client.completions.create
        kw = {"prompt": PROMPTS[2]}
    full = call(model=MODEL, max_tokens=40, **kw, **GREEDY)
    chunks = list(call(model=MODEL, max_tokens=40, stream=True, stream_options={"include_usage": True}, **kw, **GREEDY))
    assert len({c.id for c in chunks}) == 1
    if kind == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"
        pieces = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
        text = full.choices[0].message.content
    else:
        pieces = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
        text = full.choices[0].text
    assert "".join(pieces) == text
    assert len(pieces) == full.dspark["rounds"] + 1  # nothing merged, nothing split
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 40


def test_stream_ends_with_done_marker(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 5, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_stop_string_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=40, **GREEDY).choices[0].text
    stop = full[9:11]
    want = full[: full.find(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=40, stop=[stop, "\x7f"], **GREEDY)
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=40, stop=stop, stream=True, **GREEDY)
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPTS[4], max_tokens=30, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"ignore_eos": True, "top_k": 20})
    first = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == first


def test_concurrent_greedy_requests_equal_running_alone(server, client):
    def run(prompt: str) -> str:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, **GREEDY).choices[0].text

    alone = [run(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # 6 requests, 4 KV slots: some wait, join mid-flight
        together = list(pool.map(run, PROMPTS))
    assert together == alone
    server.wait_idle()


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = httpx.get(server.base_url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"

"""The server on the embedded SmolLM2 target with its real tokenizer and chat
template (slow: loads the model)."""

from __future__ import annotations

import pytest

from dspark.engine.engine import EngineConfig
from tests.server_harness import running_server

pytestmark = pytest.mark.slow


def test_chat_and_stop_strings_on_the_embedded_model():
    from dspark.server.launch import build_stack

    stack = build_stack(None, "ngram", "fixed", engine_config=EngineConfig(max_running=2, max_seq_len=512))
    with running_server(stack.async_engine, stack.model_name, tokenizer=stack.tokenizer) as server:
        client = server.client()
        messages = [{"role": "user", "content": "Write the word hello in French."}]
        full = client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=16,
                                              temperature=0)
        text = full.choices[0].message.content
        assert text.strip() and full.usage.completion_tokens == 16
        stream = client.chat.completions.create(model=stack.model_name, messages=messages, max_tokens=16,
                                                temperature=0, stream=True)
        pieces = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
        assert "".join(pieces) == text  # multi-token pieces with leading spaces survive streaming
        out = client.completions.create(model=stack.model_name, prompt="The capital of France is", max_tokens=8,
                                        temperature=0, stop=["."])
        assert out.choices[0].finish_reason == "stop" and "." not in out.choices[0].text
        server.wait_idle()

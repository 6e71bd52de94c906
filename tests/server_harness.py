"""Test support for the server and async-engine tests: a character-level fake
tokenizer for the tiny targets, drafter wrappers that slow down or fail on
demand, and a real uvicorn server on 127.0.0.1 in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn

from dspark.draft.base import Drafter
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.engine import Engine, EngineConfig
from dspark.models.tiny import tiny_target
from dspark.schedule import CostTable, make_policy
from dspark.server import create_app
from tests.drafters_for_tests import BigramDrafter

VOCAB = 96
BOS, EOS = 0, 1  # tiny_config: bos 0, eos (1,)
FIRST_CHAR = 32  # token id i >= 2 is the character chr(FIRST_CHAR + i - 2): ' ' .. '}'


class CharTokenizer:
    """One token per printable ASCII character (' ' .. '}'), ids 2..95; 0 and 1
    are the special <s> and </s>. Unknown characters encode as '?'."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [self._id(c) for c in text]
        return ([BOS] if add_special_tokens else []) + ids

    @staticmethod
    def _id(char: str) -> int:
        code = ord(char)
        if not FIRST_CHAR <= code < FIRST_CHAR + VOCAB - 2:
            code = ord("?")
        return code - FIRST_CHAR + 2

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if i in (BOS, EOS):
                if not skip_special_tokens:
                    out.append("<s>" if i == BOS else "</s>")
                continue
            out.append(chr(FIRST_CHAR + int(i) - 2))
        return "".join(out)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tokenize: bool = True):
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text) if tokenize else text


class SlowDrafter(Drafter):
    """Wraps a drafter: `delay_s` of sleep per propose (slows the engine down
    so a test can act mid-generation); raises once when `fail_next` is set."""

    def __init__(self, inner: Drafter, delay_s: float = 0.0) -> None:
        self.inner = inner
        self.name = inner.name
        self.block_size = inner.block_size
        self.tap_layers = inner.tap_layers
        self.has_confidence = inner.has_confidence
        self.delay_s = delay_s
        self.fail_next = False
        self.released = 0

    def new_state(self):
        return self.inner.new_state()

    def observe(self, states, token_ids, tapped_hidden) -> None:
        self.inner.observe(states, token_ids, tapped_hidden)

    def propose(self, states, anchors, params, generators):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected drafter failure")
        if self.delay_s:
            time.sleep(self.delay_s)
        return self.inner.propose(states, anchors, params, generators)

    def truncate(self, state, num_context: int) -> None:
        self.inner.truncate(state, num_context)

    def release(self, state) -> None:
        self.released += 1
        self.inner.release(state)


COST = CostTable({1: 0.010, 4: 0.011, 16: 0.016, 64: 0.040, 256: 0.150})


def make_engine(seed: int = 3, delay_s: float = 0.0, policy: str = "dspark", **config) -> Engine:
    """A tiny random target with a bigram drafter (confidences on) behind `policy`."""
    target = tiny_target(seed=seed, vocab_size=VOCAB)
    drafter = SlowDrafter(BigramDrafter(VOCAB, block_size=4, seed=seed), delay_s)
    defaults = dict(max_running=4, max_seq_len=512)
    cfg = EngineConfig(**{**defaults, **config})
    options = {"fixed": {"k": 4}, "threshold": {"threshold": 0.3}}.get(policy, {})
    return Engine(target, drafter, make_policy(policy, COST, **options), cfg, tokenizer=CharTokenizer())


class ServerHandle:
    def __init__(self, server: uvicorn.Server, thread: threading.Thread, port: int, async_engine: AsyncEngine):
        self.server, self.thread, self.port, self.async_engine = server, thread, port, async_engine
        self.base_url = f"http://127.0.0.1:{port}"

    @property
    def engine(self) -> Engine:
        return self.async_engine.engine

    def client(self, api_key: str = "none", **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until the engine holds no request and no KV."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.engine.requests and self.engine.kv.tokens_in_use() == 0:
                return
            time.sleep(0.01)
        raise AssertionError(
            f"engine not idle after {timeout_s} s: {len(self.engine.requests)} requests, "
            f"{self.engine.kv.tokens_in_use()} KV tokens"
        )


@contextmanager
def running_server(engine: Engine | AsyncEngine, model_name: str = "tiny-test", tokenizer=None, **app_kw):
    """Serve `engine` with uvicorn on 127.0.0.1 and a free port, in a thread
    (with the character tokenizer unless another is given)."""
    async_engine = engine if isinstance(engine, AsyncEngine) else AsyncEngine(engine)
    app = create_app(async_engine, tokenizer or CharTokenizer(), model_name, **app_kw)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    handle = ServerHandle(server, thread, port, async_engine)
    try:
        yield handle
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
        async_engine.shutdown()


@contextmanager
def single_torch_thread():
    """Run torch ops on one thread: tiny models gain nothing from two, and on a
    shared 2-core box two OpenMP threads per process make steps ~20x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)

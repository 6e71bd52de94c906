"""A real `dspark serve` app on 127.0.0.1 (a free port) in a background thread,
for benchmarks and soaks that bring their own server:

    with local_server(stack) as url:   # stack: dspark.server.ServingStack
        run_soak(url, ...)
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def local_server(stack, *, start_timeout_s: float = 60.0) -> Iterator[str]:
    """Serve `stack` with uvicorn on 127.0.0.1 until the block ends -> its base URL."""
    import uvicorn

    from dspark.server import create_app

    app = create_app(stack.async_engine, stack.tokenizer, stack.model_name)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="dspark-bench-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the benchmark's uvicorn server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        stack.async_engine.shutdown()

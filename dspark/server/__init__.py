"""OpenAI-compatible HTTP serving (FastAPI + uvicorn); no tensors in here.

`create_app(async_engine, tokenizer, model_name, ...)` builds the app from an
engine you made; `run_server(target, drafter, policy, host, port, api_key, ...)`
loads everything by name and serves (`dspark serve`).
"""

from dspark.server.app import create_app
from dspark.server.launch import ServingStack, build_stack, run_server

__all__ = ["ServingStack", "build_stack", "create_app", "run_server"]

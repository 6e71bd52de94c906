"""`dspark serve`: load the target and drafter, profile SPS(B) if the policy
needs it, start the engine loop and run uvicorn."""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass

from dspark.engine.async_engine import AsyncEngine
from dspark.engine.engine import Engine, EngineConfig
from dspark.engine.profile import ProfileSettings, profile_engine
from dspark.errors import UserError
from dspark.schedule import make_policy
from dspark.schedule.cost import SplitCost
from dspark.server.app import DEFAULT_MAX_BODY_BYTES, create_app

POLICIES_NEEDING_COST = ("dspark", "dspark-async")
_DTYPES = ("float32", "bfloat16")


@dataclass
class ServingStack:
    """Everything `create_app` needs, built from names and paths."""

    async_engine: AsyncEngine
    tokenizer: object
    model_name: str
    cost: SplitCost | None  # the step-time profile the policy uses (None: the policy needs none)


def build_stack(
    target: str | None = None,
    drafter: str = "default",
    policy: str = "dspark",
    *,
    home: str | None = None,
    dtype: str = "float32",
    cpu_kernels: bool = True,
    device: str = "cpu",
    block_size: int | None = None,
    threshold: float = 0.5,
    engine_config: EngineConfig = EngineConfig(),
    profile: ProfileSettings | None = None,
    refresh_profile: bool = False,
) -> ServingStack:
    """Load target + drafter, build the verify policy (profiling SPS(B) first for
    'dspark' / 'dspark-async', cached per machine), and wrap an Engine."""
    import torch

    from dspark.draft.registry import load_drafter
    from dspark.models import load_target

    if dtype not in _DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    loaded = load_target(target, home=home, dtype=getattr(torch, dtype), cpu_kernels=cpu_kernels, device=device)
    if loaded.tokenizer is None:
        raise UserError(f"the target {loaded.path} has no tokenizer files; the server needs one to read prompts")
    draft = load_drafter(drafter, loaded.model, block_size=block_size, embedded=target is None)
    cost = None
    if policy in POLICIES_NEEDING_COST:
        settings = profile or ProfileSettings(max_requests=min(16, engine_config.max_running))
        cost = profile_engine(
            loaded.model, draft, model_id=f"{loaded.name}@{loaded.path}", drafter_id=f"{drafter}:{draft.name}",
            settings=settings, tokenizer=loaded.tokenizer, home=home, refresh=refresh_profile,
        ).cost
    options = {"fixed": {"k": draft.block_size}, "threshold": {"threshold": threshold}}.get(policy, {})
    verify_policy = make_policy(policy, cost, **options)
    engine = Engine(loaded.model, draft, verify_policy, engine_config, tokenizer=loaded.tokenizer)
    return ServingStack(AsyncEngine(engine), loaded.tokenizer, loaded.name, cost)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_server(
    target: str | None = None,
    drafter: str = "default",
    policy: str = "dspark",
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    *,
    home: str | None = None,
    dtype: str = "float32",
    cpu_kernels: bool = True,
    device: str = "cpu",
    block_size: int | None = None,
    threshold: float = 0.5,
    engine_config: EngineConfig = EngineConfig(),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    log_level: str = "info",
) -> None:
    """Serve the OpenAI-compatible API until interrupted (Ctrl-C shuts down cleanly)."""
    import uvicorn

    if not 0 <= port <= 65535:
        raise UserError(f"--port must be in 0..65535, got {port}")
    stack = build_stack(target, drafter, policy, home=home, dtype=dtype, cpu_kernels=cpu_kernels, device=device,
                        block_size=block_size, threshold=threshold, engine_config=engine_config)
    if not _is_loopback(host) and not api_key:
        print(f"[dspark] warning: serving on {host} without an API key; anyone who can reach it can use it",
              file=sys.stderr)
    app = create_app(stack.async_engine, stack.tokenizer, stack.model_name, api_key=api_key,
                     max_body_bytes=max_body_bytes)
    engine = stack.async_engine.engine
    print(f"[dspark] serving {stack.model_name} at http://{host}:{port}/v1 (drafter {engine.drafter.name}, "
          f"G={engine.drafter.block_size}, policy {policy}, context {engine.max_seq_len}, "
          f"on {engine.kv.device})", file=sys.stderr)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)

"""AsyncEngine without HTTP: streams carry exactly the engine's committed
tokens, cancel frees KV between steps, a failing step fails only the requests
it ran, bad input is refused without harming the loop, shutdown aborts."""

from __future__ import annotations

import asyncio

import pytest

from dspark.engine.async_engine import AsyncEngine, EngineStopped, RequestFailed
from dspark.engine.generate import generate
from dspark.errors import UserError
from dspark.types import SamplingParams
from tests.server_harness import make_engine, single_torch_thread

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8] * 3, [40, 41, 42], [9] * 7, [70, 20, 70, 20, 70]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_torch_thread():
        yield


def _run(coro_fn, engine, timeout_s: float = 30.0):
    async_engine = AsyncEngine(engine)
    async_engine.start()

    async def main():
        return await asyncio.wait_for(coro_fn(async_engine), timeout_s)

    try:
        return asyncio.run(main()), async_engine
    finally:
        async_engine.shutdown()


async def _collect(stream) -> tuple[list[int], list]:
    ids, outs = [], []
    async for out in stream:
        ids.extend(out.new_token_ids)
        outs.append(out)
    return ids, outs


def test_streams_equal_running_alone_and_carry_metrics():
    alone = [generate(make_engine(seed=8), p, GREEDY).token_ids for p in PROMPTS]

    async def body(ae: AsyncEngine):
        streams = [ae.submit(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
        return streams, await asyncio.gather(*(_collect(s) for s in streams))

    (streams, results), ae = _run(body, make_engine(seed=8, max_running=2))
    assert [ids for ids, _ in results] == alone
    for prompt, stream, (ids, outs) in zip(PROMPTS, streams, results):
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert all(not o.finished for o in outs[:-1]) and all(o.new_token_ids for o in outs[:-1])
        m = stream.metrics
        assert m.output_tokens == len(ids) == GREEDY.max_new_tokens and m.prompt_tokens == len(prompt)
        assert m.ttft_s is not None and 0 <= m.ttft_s <= m.latency_s and m.tpot_s > 0
        assert m.stats.rounds == len(outs) - 1  # first token from prefill, then one batch per round
    assert ae.engine.kv.tokens_in_use() == 0 and not ae.engine.requests


def test_cancel_frees_kv_between_steps():
    async def body(ae: AsyncEngine):
        long = SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True)
        stream = ae.submit(PROMPTS[0], long, request_id="victim")
        await stream.accepted()
        first = await stream.__anext__()
        ae.cancel("victim")
        rest = [out async for out in stream]
        ae.cancel("victim")  # a second cancel of a finished request is a no-op
        return first, rest, stream

    (first, rest, stream), ae = _run(body, make_engine(seed=9, delay_s=0.01))
    assert not first.finished and rest[-1].finished and rest[-1].finish_reason == "abort"
    assert stream.metrics.finish_reason == "abort" and stream.metrics.output_tokens < 400
    assert ae.engine.kv.tokens_in_use() == 0 and ae.engine.kv.num_free_slots == ae.engine.kv.max_slots
    assert "dspark_requests_aborted_total 1" in ae.metrics.render()


def test_bad_input_is_refused_and_the_loop_continues():
    async def body(ae: AsyncEngine):
        bad = ae.submit([], GREEDY)
        with pytest.raises(UserError, match="empty"):
            await bad.accepted()
        with pytest.raises(UserError, match="token ids"):
            await ae.submit([10_000], GREEDY).accepted()
        ok = ae.submit(PROMPTS[1], GREEDY)
        return await _collect(ok)

    (ids, _), _ = _run(body, make_engine(seed=10))
    assert ids == generate(make_engine(seed=10), PROMPTS[1], GREEDY).token_ids


def test_a_failing_step_fails_its_requests_and_the_loop_survives():
    engine = make_engine(seed=11)

    async def body(ae: AsyncEngine):
        doomed = ae.submit(PROMPTS[2], SamplingParams(temperature=0.0, max_new_tokens=200, ignore_eos=True))
        await doomed.__anext__()  # prefill done, decoding
        engine.drafter.fail_next = True  # the next propose raises
        with pytest.raises(RequestFailed, match="injected drafter failure"):
            async for _ in doomed:
                pass
        after = ae.submit(PROMPTS[3], GREEDY)
        return await _collect(after)

    (ids, _), ae = _run(body, engine)
    assert ids == generate(make_engine(seed=11), PROMPTS[3], GREEDY).token_ids
    assert ae.engine.kv.tokens_in_use() == 0
    text = ae.metrics.render()
    assert "dspark_step_errors_total 1" in text and "dspark_requests_failed_total 1" in text


def test_shutdown_aborts_running_requests_and_refuses_new_ones():
    engine = make_engine(seed=12, delay_s=0.01)
    ae = AsyncEngine(engine)
    ae.start()

    async def body():
        stream = ae.submit(PROMPTS[0], SamplingParams(temperature=0.0, max_new_tokens=400, ignore_eos=True))
        await stream.__anext__()
        await asyncio.to_thread(ae.shutdown)
        with pytest.raises(EngineStopped):
            async for _ in stream:
                pass
        with pytest.raises(EngineStopped):
            ae.submit(PROMPTS[1], GREEDY)

    asyncio.run(asyncio.wait_for(body(), 30))
    assert not ae.is_alive and engine.kv.tokens_in_use() == 0 and not engine.requests


def test_shutdown_with_drain_lets_requests_finish():
    ae = AsyncEngine(make_engine(seed=13))
    ae.start()

    async def body():
        stream = ae.submit(PROMPTS[3], GREEDY)
        await stream.accepted()
        await asyncio.to_thread(ae.shutdown, 30.0)
        return await _collect(stream)

    ids, outs = asyncio.run(asyncio.wait_for(body(), 60))
    assert outs[-1].finish_reason == "length" and len(ids) == GREEDY.max_new_tokens

import asyncio

import pytest

from conveyor.engine import AsyncEngine, EngineConfig, SamplingParams


@pytest.fixture(scope="module", params=[False, True], ids=["in-thread", "core-process"])
def engine(request: pytest.FixtureRequest) -> AsyncEngine:
    e = AsyncEngine(EngineConfig(model="demo:llama-tiny", num_blocks=64), engine_core_process=request.param)
    yield e
    e.shutdown()


async def _collect(engine: AsyncEngine, ids: list[int], params: SamplingParams, rid: str) -> list:
    return [out async for out in engine.generate(ids, params, request_id=rid)]


def test_concurrent_streams_finish_once_and_free_blocks(engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    async def main() -> list[list]:
        return await asyncio.gather(*(_collect(engine, [1, 50 + i, 60, 70 + i], params, f"r{i}") for i in range(6)))

    streams = asyncio.run(main())
    for outs in streams:
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
        assert len(outs[-1].outputs[0].token_ids) == 10
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0


def test_cancelling_the_stream_aborts_and_frees_blocks(engine: AsyncEngine) -> None:
    async def main() -> None:
        async def consume() -> None:
            async for _ in engine.generate(
                [1] + [40] * 100, SamplingParams(max_tokens=500, ignore_eos=True), request_id="cancel-me"
            ):
                pass

        task = asyncio.create_task(consume())
        while engine.stats().num_running == 0:
            await asyncio.sleep(0.01)
        assert engine.stats().kv_blocks_free < engine.stats().kv_blocks_total
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            s = engine.stats()
            if s.num_running == 0 and s.kv_blocks_free == s.kv_blocks_total:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"blocks not returned after cancel: {engine.stats()}")

    asyncio.run(main())
    assert engine.stats().num_aborted >= 1


def test_bad_request_raises_and_engine_keeps_serving(engine: AsyncEngine) -> None:
    async def main() -> list:
        with pytest.raises(ValueError, match="vocabulary"):
            await _collect(engine, [1, 10**6], SamplingParams(), "bad")
        return await _collect(engine, [1, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True), "good")

    assert asyncio.run(main())[-1].finished
    engine.check_health()

"""The engine core in its own process: same tokens as in process (and as transformers), stop strings found
on the front end, a crash fails in-flight requests instead of hanging; stream_interval batching."""
import asyncio
import os
import signal

import pytest

from engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from engine.core_client import EngineCoreDied
from tests.helpers import hf_greedy, prompt_ids

MODEL = "demo:llama-tiny"


@pytest.fixture(scope="module")
def llm_mp() -> LLM:
    llm = LLM(MODEL, engine_core_process=True, dtype="float32", num_blocks=128)
    yield llm
    llm.shutdown()


def test_core_process_greedy_matches_transformers(llm_mp: LLM) -> None:
    prompts = prompt_ids(MODEL)[:3]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm_mp.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(MODEL, prompts, 12)
    s = llm_mp.engine.stats()
    assert s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0
    assert not hasattr(llm_mp.engine, "scheduler"), "the core's parts live in the other process"


def test_core_process_stop_strings_n_and_logprobs_like_in_process(llm_mp: LLM) -> None:
    local = LLM(MODEL, dtype="float32", num_blocks=128)
    prompts = ["def", "import os\nimport sys\n", "class Parser:\n"]
    base = local.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    stops = [o.outputs[0].text[5:8] for o in base]
    params = [SamplingParams(temperature=0, max_tokens=24, stop=[s], logprobs=2) for s in stops]
    params.append(SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=8))
    prompts.append("for i in range(10):")
    want = local.generate(prompts, params, use_tqdm=False)
    got = llm_mp.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in g.outputs] == \
               [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in w.outputs]
    for w, g in zip(want[:3], got[:3]):
        assert g.outputs[0].finish_reason == "stop" and len(g.outputs[0].logprobs) == len(g.outputs[0].token_ids)
        assert [sorted(d) for d in g.outputs[0].logprobs] == [sorted(d) for d in w.outputs[0].logprobs]
    local.shutdown()
    assert _until_idle(llm_mp), f"core kept blocks after stop-string finishes: {llm_mp.engine.stats()}"


def _until_idle(llm: LLM) -> bool:
    for _ in range(100):
        s = llm.engine.stats()
        if s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0 and s.num_waiting == 0:
            return True
        llm.engine.core.get_outputs(0.05)
    return False


def test_core_crash_fails_inflight_requests_and_health() -> None:
    engine = AsyncEngine(EngineConfig(model=MODEL, num_blocks=64), engine_core_process=True)

    async def main() -> None:
        async def consume() -> int:
            n = 0
            async for _ in engine.generate([1] + [40] * 20, SamplingParams(max_tokens=500, ignore_eos=True)):
                n += 1
            return n
        task = asyncio.create_task(consume())
        for _ in range(1000):
            if engine.stats().num_running or task.done():
                break
            await asyncio.sleep(0.01)
        assert engine.stats().num_running == 1
        os.kill(engine.engine.core.core_pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="died"):
            await asyncio.wait_for(task, timeout=10)
        with pytest.raises(RuntimeError):
            engine.check_health()
        with pytest.raises(RuntimeError):
            await anext(engine.generate([1, 2, 3], SamplingParams(max_tokens=2)))

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_core_that_cannot_start_raises() -> None:
    with pytest.raises(EngineCoreDied, match="kv_cache_memory|KV block"):
        LLM(MODEL, engine_core_process=True, kv_cache_memory=1)


@pytest.mark.parametrize("interval", [1, 4])
def test_stream_interval_batches_tokens_first_token_at_once(interval: int) -> None:
    engine = AsyncEngine(EngineConfig(model=MODEL, num_blocks=64))

    async def main() -> list[int]:
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        return [len(o.outputs[0].token_ids) async for o in
                engine.generate([1, 5, 6, 7], sp, stream_interval=interval)]

    try:
        counts = asyncio.run(main())
    finally:
        engine.shutdown()
    assert counts == ([1, 5, 9, 10] if interval == 4 else list(range(1, 11)))

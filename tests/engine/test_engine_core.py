"""The engine core in its own process: same tokens as in process (and as transformers), stop strings found
on the front end, KV events, a crash fails in-flight requests instead of hanging; a model step that raises
fails its requests only (both modes); stream_interval batching."""

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch

from conveyor.engine import LLM, AsyncEngine, EngineConfig, SamplingParams
from conveyor.engine.frontend.async_engine import RequestFailed
from conveyor.engine.process.core_client import EngineCoreDied
from conveyor.engine.process.core_priority import REFRESH_S, SHEDDING_S, CorePriority, mark_shedding
from tests.faulty_runner import MARK, RUNNER
from tests.helpers import hf_greedy, prompt_ids

MODEL = "demo:llama-tiny"


@pytest.fixture(scope="module")
def llm_mp() -> LLM:
    llm = LLM(MODEL, engine_core_process=True, dtype="float32", num_blocks=128, core_process_priority="low")
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


def test_core_process_priority_low_yields_the_cpu_high_outranks_ray_workers(llm_mp: LLM) -> None:
    assert {p for p, _ in _policies(llm_mp.engine.core.core_pid)} == {os.SCHED_IDLE}
    with pytest.raises(ValueError, match="core_process_priority"):
        EngineConfig(model=MODEL, core_process_priority="idle")
    pid = os.fork()
    if pid == 0:  # a front end at Ray's worker niceness (15): its "high" core asks for niceness 0
        try:
            os.setpriority(os.PRIO_PROCESS, 0, 15)
            llm = LLM(MODEL, engine_core_process=True, dtype="float32", num_blocks=32, core_process_priority="high")
            tasks = os.listdir(f"/proc/{llm.engine.core.core_pid}/task")
            nices = {os.getpriority(os.PRIO_PROCESS, int(t)) for t in tasks}
            other = all(os.sched_getscheduler(int(t)) == os.SCHED_OTHER for t in tasks)
            allowed = os.geteuid() == 0  # lowering niceness needs CAP_SYS_NICE; without it the core keeps 15
            llm.shutdown()
            os._exit(0 if other and nices == ({0} if allowed else {15}) else 1)
        except BaseException:
            os._exit(2)
    assert os.waitpid(pid, 0)[1] == 0


def _policies(pid: int) -> set[tuple[int, int]]:
    tasks = os.listdir(f"/proc/{pid}/task")
    return {(os.sched_getscheduler(int(t)), os.getpriority(os.PRIO_PROCESS, int(t))) for t in tasks}


def test_auto_priority_follows_the_cores_on_the_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A core whose threads leave a CPU runs as an ordinary process; a second core that fills the last CPU
    turns both to SCHED_IDLE within REFRESH_S, and its exit turns the first back."""
    cpus, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    assert cpus >= 2, "this test needs two CPUs"
    monkeypatch.setenv("CONVEYOR_CORE_REGISTRY", str(tmp_path))  # this module's other cores are not counted
    try:
        torch.set_num_threads(cpus - 1)
        a = LLM(MODEL, engine_core_process=True, dtype="float32", num_blocks=32)
        torch.set_num_threads(1)
        assert _until(lambda: {p for p, _ in _policies(a.engine.core.core_pid)} == {os.SCHED_OTHER})
        b = LLM(MODEL, engine_core_process=True, dtype="float32", num_blocks=32)
        both = (a.engine.core.core_pid, b.engine.core.core_pid)
        assert _until(lambda: all({p for p, _ in _policies(pid)} == {os.SCHED_IDLE} for pid in both))
        b.shutdown()
        assert _until(lambda: {p for p, _ in _policies(a.engine.core.core_pid)} == {os.SCHED_OTHER})
        a.shutdown()
    finally:
        torch.set_num_threads(threads)


def test_auto_priority_yields_while_a_router_on_the_node_sheds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy core at "auto" that leaves a CPU runs SCHED_IDLE within a step of its node being marked shedding, for
    SHEDDING_S after the last mark, then as an ordinary process again. (An idle core looks only every
    IDLE_POLL_MS, and has no CPU to yield.)"""
    cpus, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    assert cpus >= 2, "this test needs two CPUs"
    monkeypatch.setenv("CONVEYOR_CORE_REGISTRY", str(tmp_path))
    torch.set_num_threads(cpus - 1)
    llm = LLM(MODEL, engine_core_process=True, dtype="float32", num_blocks=32)
    torch.set_num_threads(threads)
    stop, prompt = threading.Event(), prompt_ids(MODEL)[:1]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def busy() -> None:
        while not stop.is_set():
            llm.generate(prompt, params, use_tqdm=False)

    generating = threading.Thread(target=busy)
    generating.start()
    try:
        pid = llm.engine.core.core_pid
        assert _until(lambda: {p for p, _ in _policies(pid)} == {os.SCHED_OTHER})
        marked = time.monotonic()
        mark_shedding(tmp_path)
        assert _until(lambda: {p for p, _ in _policies(pid)} == {os.SCHED_IDLE}, SHEDDING_S)
        assert _until(lambda: {p for p, _ in _policies(pid)} == {os.SCHED_OTHER})
        assert time.monotonic() - marked >= SHEDDING_S * 0.9
    finally:
        stop.set()
        generating.join()
        llm.shutdown()


def _until(check: Callable[[], bool], timeout_s: float = 3 * REFRESH_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_auto_priority_is_high_while_the_node_cores_leave_a_cpu(tmp_path: Path) -> None:
    cpus = len(os.sched_getaffinity(0))
    me = CorePriority("auto", max(1, cpus - 1), tmp_path)
    assert me.spare_cpus() == cpus - max(1, cpus - 1) and me.decide() == ("high" if cpus > 1 else "low")
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / str(dead.pid)).write_text("64")  # a core that died without removing its file
    assert me.decide() == ("high" if cpus > 1 else "low") and not (tmp_path / str(dead.pid)).exists()
    (tmp_path / str(os.getppid())).write_text("1")  # a second live core on the node
    assert me.spare_cpus() == cpus - max(1, cpus - 1) - 1 and me.decide() == "low"
    assert CorePriority("high", cpus, tmp_path).decide() == "high"
    me.close()
    assert not (tmp_path / str(os.getpid())).exists()


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
        assert [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in g.outputs] == [
            (c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in w.outputs
        ]
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


def test_params_that_fail_their_checks_in_the_core_fail_that_request_only(llm_mp: LLM) -> None:
    bad = SamplingParams(temperature=0, max_tokens=4)
    bad.top_p = 2.0  # assigned after construction: only the core's decode checks it again
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm_mp.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, [bad, good], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "SamplingParams.top_p" in outs[0].outputs[0].stop_reason
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 4
    llm_mp.engine.check_health()


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
        return [len(o.outputs[0].token_ids) async for o in engine.generate([1, 5, 6, 7], sp, stream_interval=interval)]

    try:
        counts = asyncio.run(main())
    finally:
        engine.shutdown()
    assert counts == ([1, 5, 9, 10] if interval == 4 else list(range(1, 11)))


@pytest.fixture(scope="module", params=[False, True], ids=["in-thread", "core-process"])
def faulty(request: pytest.FixtureRequest) -> LLM:
    llm = LLM(MODEL, engine_core_process=request.param, dtype="float32", num_blocks=64, model_runner_cls=RUNNER)
    yield llm
    llm.shutdown()


def test_a_model_step_that_raises_fails_its_requests_and_the_loop_goes_on(faulty: LLM) -> None:
    """Every request of the failed step ends with finish_reason "error" and its blocks come back; the next
    requests get transformers' greedy tokens (in the core's own process too). In process the three requests
    share the first step; a core process may have started the first one a step earlier."""
    prompts = prompt_ids(MODEL)[:2]
    want = hf_greedy(MODEL, prompts, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = faulty.generate(
        [{"prompt_token_ids": p} for p in (prompts[0], MARK + [5, 6], prompts[1])], params, use_tqdm=False
    )
    got = [(o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outs]
    assert got[1] == ("error", []) and "injected model fault" in outs[1].outputs[0].stop_reason
    if faulty.engine.in_process:
        assert got == [("error", [])] * 3
    for (reason, tokens), w in zip(got[::2], want):
        assert reason == "error" and tokens == w[: len(tokens)] or (reason, tokens) == ("length", w)
    again = faulty.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == want
    assert _until_idle(faulty) if not faulty.engine.in_process else faulty.engine.stats().kv_blocks_free == 64


def test_a_faulted_stream_raises_to_its_caller_others_finish(faulty: LLM) -> None:
    """Through AsyncEngine: a stream already running when the fault hits fails with RequestFailed, as does the
    marked one; a request after them completes; the engine stays healthy."""
    engine = AsyncEngine(
        EngineConfig(model=MODEL, num_blocks=64, model_runner_cls=RUNNER),
        engine_core_process=not faulty.engine.in_process,
    )
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)

    async def consume(ids: list[int], sp: SamplingParams) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(ids, sp):
            tokens = out.outputs[0].token_ids
        return tokens

    async def main() -> None:
        running = asyncio.create_task(consume([1, 40, 41, 42], params))
        for _ in range(1000):
            if engine.stats().num_decode_tokens >= 2 or running.done():
                break
            await asyncio.sleep(0.01)
        with pytest.raises(RequestFailed, match="injected model fault"):
            await consume(MARK + [9], params)
        with pytest.raises(RequestFailed, match="injected model fault"):
            await asyncio.wait_for(running, timeout=30)
        assert len(await consume([1, 40, 41], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))) == 5
        engine.check_health()
        for _ in range(100):
            s = engine.stats()
            if s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0:
                break
            await asyncio.sleep(0.02)
        assert s.kv_blocks_free == s.kv_blocks_total and s.num_running == 0

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()


def test_kv_events_cross_from_the_core_process(llm_mp: LLM) -> None:
    """The replica's stats push drains KV events from the front end; a core process reports them per step."""
    first = llm_mp.engine.drain_kv_events()
    assert first.reset
    ids = prompt_ids(MODEL)[3]
    llm_mp.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert _until_idle(llm_mp)
    events = llm_mp.engine.drain_kv_events()
    assert not events.reset and len(events.stored) >= len(ids) // 16 and not events.evicted
    llm_mp.engine.request_kv_reset()
    listing = llm_mp.engine.drain_kv_events()
    assert listing.reset and set(events.stored) <= set(listing.stored)

"""The step trace records exactly the steps the scheduler ran; `conveyor bench throughput | timeline` run
end to end on demo:tiny and write valid JSON and PNG files (`bench serve` runs in tests/serve/test_metrics.py,
against the served app); the cluster bench waits for ports a previous run still holds; the benchmarks' HTTP
client reads what a server answers."""

import json
import random
import socket
import threading
import time
from pathlib import Path

import pytest

from benchmarks.lengths import Lengths, token_prompts
from conveyor.cli import main
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.core.step_trace import assign_slots, chrome_trace

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_timeline_has_exactly_the_steps_the_scheduler_ran(policy: str) -> None:
    llm = LLM(
        "demo:tiny",
        dtype="float32",
        max_num_seqs=4,
        max_num_batched_tokens=96,
        scheduling_policy=policy,
        enable_prefix_caching=False,
    )
    eng, ran = llm.engine, []
    execute = eng.local_core.executor.execute_model

    def spy(so):  # an independent record of what the scheduler handed to the model
        ran.append([(c.req_id, len(c.token_ids)) for c in so.chunks])
        return execute(so)

    eng.local_core.executor.execute_model = spy
    steps_before = eng.local_core.scheduler.num_steps
    eng.local_core.step_trace.enable()
    outputs = [3, 9, 5, 12]
    prompts = [list(range(10, 10 + n)) for n in (20, 30, 7, 12)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True) for n in outputs],
        use_tqdm=False,
    )
    trace = eng.local_core.step_trace.disable()
    assert len(trace) == len(ran) == eng.local_core.scheduler.num_steps - steps_before
    assert [r.step for r in trace] == list(range(steps_before + 1, eng.local_core.scheduler.num_steps + 1))
    assert [[(w.req_id, w.num_tokens) for w in r.work] for r in trace] == ran
    rid = {o.request_id: o for o in outs}
    assert sum(r.tokens("prefill") for r in trace) == sum(map(len, prompts))  # one prefill step, no preemption
    assert sum(r.tokens("decode") for r in trace) == sum(n - 1 for n in outputs)
    padding = sum(r.tokens("padding") for r in trace)
    # static batching keeps a finished request decoding (output discarded) until its whole batch is done
    assert padding == (sum(max(outputs) - n for n in outputs) if policy == "static" else 0)
    assert [len(rid[str(i)].outputs[0].token_ids) for i in range(4)] == outputs
    assert all(r.kv_blocks_used <= r.kv_blocks_total and r.duration_s > 0 for r in trace)
    assert (
        trace[-1].kv_blocks_used > 0
        and eng.local_core.block_manager.num_free_blocks == eng.local_core.block_manager.num_blocks
    )
    slots = assign_slots(trace)
    assert set(slots.values()) <= set(range(4))
    for r_i, r in enumerate(trace):  # no two requests share a slot in a step
        assert len({slots[(r_i, w.req_id)] for w in r.work}) == len(r.work)
    events = json.loads(json.dumps(chrome_trace(trace)))
    assert sum(e["ph"] == "X" and e["cat"] == "step" for e in events) == len(trace)
    assert sum(e["ph"] == "X" and e["cat"] != "step" for e in events) == sum(len(r.work) for r in trace)


def test_lengths_specs() -> None:
    rng = random.Random(0)
    heavy = Lengths.parse("heavy-tail:16,2000")
    xs = [heavy.sample(rng) for _ in range(2000)]
    assert min(xs) >= 16 and max(xs) <= 2000 and sorted(xs)[1000] < 60 and max(xs) > 500
    shared = token_prompts(Lengths.parse("shared-prefix:32,8"), 3, 100, rng)
    assert all(len(p) == 40 and p[:32] == shared[0][:32] for p in shared) and shared[0][32:] != shared[1][32:]
    for bad, field in (("normal:3", "kind"), ("uniform:9,3", "HI"), ("fixed:0", ">= 1"), ("fixed:a", "numbers")):
        with pytest.raises(ValueError, match=field):
            Lengths.parse(bad, "--prompt-len")


@pytest.mark.slow
def test_bench_throughput_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, plot = tmp_path / "t.json", tmp_path / "t.png"
    assert (
        main(
            [
                "bench",
                "throughput",
                "--num-requests",
                "3",
                "--cap-output-tokens",
                "3",
                "--max-num-seqs",
                "4",
                "--out",
                str(out),
                "--plot",
                str(plot),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    rows = result["results"]
    assert [(r["workload"], r["policy"]) for r in rows] == [
        (w, p) for w in ("seed", "heavy-tail", "shared-prefix", "memory-pressure") for p in ("continuous", "static")
    ]
    assert all(r["output_tokens"] == 9 and r["outputs_match_first_policy"] and r["tok_per_s"] > 0 for r in rows)
    assert next(r for r in rows if r["workload"] == "shared-prefix")["prefix_cache_hit_tokens"] > 0
    assert plot.read_bytes()[:8] == PNG and "continuous/static" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_timeline_end_to_end(tmp_path: Path) -> None:
    png, trace = tmp_path / "tl.png", tmp_path / "tl.json"
    assert (
        main(
            [
                "bench",
                "timeline",
                "--num-requests",
                "5",
                "--prompt-len",
                "uniform:8,24",
                "--output-len",
                "uniform:2,8",
                "--max-num-seqs",
                "3",
                "--out",
                str(png),
                "--trace",
                str(trace),
            ]
        )
        == 0
    )
    assert png.read_bytes()[:8] == PNG
    data = json.loads(trace.read_text())
    names = {e["args"]["name"] for e in data["traceEvents"] if e["name"] == "process_name"}
    assert names == {"static batching", "continuous batching"}
    other = data["otherData"]
    assert other["static"]["padding_tokens"] > 0 and other["continuous"]["padding_tokens"] == 0
    assert other["static"]["decode_tokens"] == other["continuous"]["decode_tokens"]


def test_bench_rejects_bad_options(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "serve", "--slo", "ttft=fast", "--num-requests", "1"]) == 2
    assert "--slo" in capsys.readouterr().err
    assert main(["bench", "timeline", "--prompt-len", "gauss:3"]) == 2
    assert "--prompt-len" in capsys.readouterr().err


def test_serve_bench_goodput_and_percentiles() -> None:
    import argparse

    from benchmarks.serve_bench import RequestResult, parse_slo, summarize

    fast = RequestResult(0.0, 10, ok=True, ttft_s=0.2, e2e_s=0.5, output_tokens=4, itl_s=[0.1, 0.1, 0.1])
    slow_start = RequestResult(0.1, 10, ok=True, ttft_s=0.8, e2e_s=0.9, output_tokens=4, itl_s=[0.03] * 3)
    jerky = RequestResult(0.2, 10, ok=True, ttft_s=0.1, e2e_s=0.4, output_tokens=3, itl_s=[0.01, 0.29])
    failed = RequestResult(0.3, 10, error="HTTPStatusError: 503")
    slo = parse_slo("ttft=0.5,itl=0.12")
    assert [r.meets(slo) for r in (fast, slow_start, jerky, failed)] == [True, False, False, False]
    assert jerky.tpot_s == pytest.approx(0.15) and fast.tpot_s == pytest.approx(0.1)
    args = argparse.Namespace(request_rate=float("inf"), out=Path("x.json"), plot=Path("x.png"), model="m")
    s = summarize(args, [fast, slow_start, jerky, failed], 2.0, slo)["summary"]
    assert s["completed"] == 3 and s["failed"] == 1 and s["goodput"] == 0.5 and s["good_fraction"] == 0.25
    assert s["output_tokens"] == 11 and s["output_throughput"] == 5.5 and s["request_throughput"] == 1.5
    assert s["ttft_s"]["p50"] == pytest.approx(0.2) and s["itl_s"]["mean"] == pytest.approx(0.69 / 8)
    assert s["errors"] == ["HTTPStatusError: 503"]
    with pytest.raises(ValueError, match="--slo"):
        parse_slo("latency=1")


def test_cluster_bench_waits_for_ports_the_last_run_still_holds() -> None:
    from benchmarks.cluster_setup import wait_for_ports

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    threading.Timer(0.7, held.close).start()
    start = time.monotonic()
    wait_for_ports([("127.0.0.1", port)], timeout_s=20)
    assert 0.6 <= time.monotonic() - start < 20
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(RuntimeError, match="still in use"):
            wait_for_ports([("127.0.0.1", busy.getsockname()[1])], timeout_s=0.2)


def test_http_client_reads_streams_refusals_and_whole_answers() -> None:
    """The benchmarks' client against a real HTTP server on 127.0.0.1: a stream's content chunks, usage and
    Server-Timing; an SSE error event; a 429's Retry-After and error code; a whole answer; no server at all."""
    import asyncio

    from aiohttp import web

    from benchmarks.http_client import complete, session

    def sse(event: dict) -> bytes:
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["prompt"] == "refuse":
            error = {"error": {"message": "busy", "type": "rate_limited", "code": "queue_time"}}
            return web.json_response(error, status=429, headers={"Retry-After": "2"})
        if not body["stream"]:
            return web.json_response({"choices": [{"text": "ab"}], "usage": {"completion_tokens": 2}})
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Server-Timing": "replica;dur=4.5"})
        await r.prepare(request)
        chunks = [{"choices": [{"text": t}]} for t in ("", "a", "b")]
        if body["prompt"] == "fail":
            chunks.append({"error": {"message": "engine died", "code": 500}})
        for event in chunks:
            await r.write(sse(event))
            await asyncio.sleep(0.01)
        await r.write(sse({"choices": [], "usage": {"completion_tokens": 2}}) + b"data: [DONE]\n\n")
        return r

    async def scenario() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/completions"
        try:
            async with session(4, timeout_s=10) as client:
                ok = await complete(client, url, {"prompt": "x", "stream": True})
                assert ok.ok and ok.tokens == 2 and len(ok.chunks) == 2 and ok.server_timing == {"replica": 4.5}
                assert 0 < ok.ttft_s <= ok.done - ok.sent and len(ok.gaps_s) == 1 and ok.gaps_s[0] >= 0.005
                failed = await complete(client, url, {"prompt": "fail", "stream": True})
                assert failed.status == 200 and not failed.ok and "engine died" in failed.error
                refused = await complete(client, url, {"prompt": "refuse", "stream": True})
                assert (refused.status, refused.retry_after, refused.error_code) == (429, "2", "queue_time")
                assert not refused.ok and refused.ttft_s is None and "busy" in refused.error
                whole = await complete(client, url, {"prompt": "x", "stream": False})
                assert whole.ok and whole.tokens == 2 and whole.chunks == [] and whole.ttft_s == whole.done - whole.sent
                await runner.cleanup()
                gone = await complete(client, url, {"prompt": "x", "stream": True})
                assert gone.status == -1 and not gone.ok and gone.error
        finally:
            await runner.cleanup()

    asyncio.run(scenario())

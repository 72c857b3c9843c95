"""End to end over real Ray Serve and loopback HTTP: one app for the module, plus `serve run serve_config.yaml`."""

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
import ray
import yaml
from ray import serve

from tests.serve_app import ENGINE, ROOT, App, free_port, serve_app, sse_events, start_ray, stop_ray, wait_ready

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):"


def test_serve_run_config(tmp_path: Path) -> None:
    port = free_port()
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["http_options"]["port"] = port
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    address = start_ray(haproxy=True)  # the README's command: RAY_SERVE_ENABLE_HA_PROXY=1 serve run serve_config.yaml
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.serve.scripts", "run", "--address", address, str(path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 300, proc=proc)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "demo:smollm2"
        r = httpx.post(
            f"{url}/v1/completions",
            json={"model": "demo:smollm2", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        question = [{"role": "user", "content": "What is the capital of France?"}]
        chunks = list(
            client.chat.completions.create(
                model="demo:smollm2", messages=question, max_tokens=16, temperature=0, stream=True
            )
        )
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == "The capital of France is Paris."
        assert chunks[-1].choices[0].finish_reason == "stop"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out[-3000:]
        assert "shutting down" in out.lower()
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{url}/v1/models", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop_ray()


@pytest.fixture(scope="module")
def server() -> Iterator[App]:
    with serve_app({}) as app:
        yield app


@pytest.fixture(scope="module")
def offline() -> Iterator[object]:
    from conveyor.engine import LLM

    llm = LLM(**ENGINE, model="demo:tiny")
    yield llm
    llm.shutdown() if hasattr(llm, "shutdown") else None


@pytest.mark.usefixtures("pool_whole")
def test_models_health_metrics(server: App) -> None:
    models = server.http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "demo:tiny"
    assert models["data"][0]["max_model_len"] == 512
    assert server.http.get("/health").status_code == 200
    routing = server.replica.record_routing_stats.remote().result()
    assert {"kv_cache_utilization", "kv_blocks_free", "num_waiting", "num_running"} <= set(routing)
    scaling = server.replica.record_autoscaling_stats.remote().result()
    assert scaling["kv_blocks_free"] == routing["kv_blocks_total"] and all(type(v) is float for v in scaling.values())
    assert server.replica.info.remote().result()["torch_threads"] == 1


@pytest.mark.usefixtures("pool_whole")
def test_greedy_matches_offline_engine(server: App, offline: object) -> None:
    from conveyor.engine import SamplingParams

    out = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    r = server.http.post(
        "/v1/completions",
        json={"model": "demo:tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True},
    )
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == out.outputs[0].text
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": 24,
        "total_tokens": len(out.prompt_token_ids) + 24,
    }
    ids = server.http.post(
        "/v1/completions", json={"prompt": out.prompt_token_ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    ).json()
    assert ids["choices"][0]["text"] == out.outputs[0].text


@pytest.mark.usefixtures("pool_whole")
def test_openai_client(server: App) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == ["demo:tiny"]
    kw = dict(model="demo:tiny", max_tokens=12, temperature=0)
    full = client.completions.create(prompt=PROMPT, **kw)
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    chat = client.chat.completions.create(messages=messages, **kw)
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    stream = list(
        client.chat.completions.create(messages=messages, stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat.choices[0].message.content
    assert stream[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert stream[-2].choices[0].finish_reason == chat.choices[0].finish_reason
    lp = client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=2, max_completion_tokens=3, model="demo:tiny", temperature=0
    )
    assert len(lp.choices[0].logprobs.content) == lp.usage.completion_tokens
    assert len(lp.choices[0].logprobs.content[0].top_logprobs) == 2


@pytest.mark.usefixtures("pool_whole")
def test_n_and_batch_and_httpx_stream(server: App) -> None:
    r = server.http.post(
        "/v1/completions",
        json={"prompt": ["a = 1", "import os"], "n": 2, "max_tokens": 5, "seed": 7, "ignore_eos": True, "logprobs": 1},
    )
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["completion_tokens"] == 20
    assert all(len(c["logprobs"]["tokens"]) == 5 for c in body["choices"])
    with server.http.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "stream": True,
            "n": 2,
            "ignore_eos": True,
        },
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "DONE"
    finishes = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert finishes == ["length", "length"]


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1] * 600}, 400, "prompt"),
        ("/v1/completions", {"prompt": [99999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "top_k": -5}, 400, "top_k"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
        ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}], "top_logprobs": 50}, 400, "top_logprobs"),
        ("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
        ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
        ("/v1/completions", {"prompt": "x", "best_of": 2}, 400, "best_of"),
        (
            "/v1/completions",
            {"prompt": "x", "guided_json": {"type": "object", "properties": {"a": {"type": "bogus"}}}},
            400,
            "guided_json",
        ),
        ("/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "[z-a]"}}, 400, "structured_outputs"),
        ("/v1/completions", {"prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400, "guided_choice"),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            },
            400,
            "tools",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            400,
            "tool_choice",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "colour": "red"}]}, 400, "messages"),
    ],
)
@pytest.mark.usefixtures("pool_whole")
def test_bad_requests(server: App, path: str, body: dict, status: int, param: str) -> None:
    r = server.http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]
    assert server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.usefixtures("pool_whole")
def test_malformed_json_and_unknown_route(server: App) -> None:
    r = server.http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert server.http.get("/v1/nothing").status_code == 404


@pytest.mark.usefixtures("pool_whole")
def test_client_disconnect_aborts_and_frees_blocks(server: App) -> None:
    before = server.replica.stats.remote().result()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        with client.stream(
            "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 480, "stream": True, "ignore_eos": True}
        ) as resp:
            lines = resp.iter_lines()
            assert [next(lines) for _ in range(3)][0].startswith("data: ")
            busy = server.replica.stats.remote().result()
            assert busy["num_running"] + busy["num_waiting"] == 1
            assert busy["kv_blocks_free"] < busy["kv_blocks_total"]
    deadline = time.time() + 20
    while time.time() < deadline:
        stats = server.replica.stats.remote().result()
        if stats["num_aborted"] > before["num_aborted"] and stats["num_running"] == 0:
            break
        time.sleep(0.1)
    assert stats["num_aborted"] == before["num_aborted"] + 1
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200


@pytest.mark.usefixtures("pool_whole")
def test_metrics_after_traffic(server: App) -> None:
    assert server.http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
    assert server.http.post("/v1/completions", json={"prompt": "x", "temperature": -1}).status_code == 400
    text = server.http.get("/metrics").text
    lines = [x for x in text.splitlines() if x.startswith('conveyor:http_requests_total{endpoint="/v1/completions"')]
    assert any('status="200"}' in x for x in lines) and any('status="400"}' in x for x in lines)
    assert 'conveyor:kv_cache_usage_perc{model_name="demo:tiny",replica=' in text
    assert "conveyor:time_to_first_token_seconds_count" in text  # tests/serve/test_metrics.py checks the values


@pytest.mark.usefixtures("pool_whole")
def test_tensor_parallel_replica(server: App, offline: object) -> None:
    from conveyor.deployments.app import AppArgs, build_app
    from conveyor.engine import SamplingParams

    args = AppArgs(
        engine={**ENGINE, "tensor_parallel_size": 2}, replica_num_cpus=0.1, worker_num_cpus=0.4, router_num_cpus=0.1
    )
    assert ray.available_resources().get("CPU", 0) >= 1.0 - 1e-6, "no room for the TP app's placement group"
    serve.run(build_app(args), name="tp", route_prefix="/tp")
    try:
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = server.http.post("/tp/v1/completions", json=body)
        want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.outputs[0].text
    finally:
        serve.delete("tp")


@pytest.mark.usefixtures("pool_whole")
def test_tensor_parallel_prefill_hands_off_to_a_tp1_decode_replica(server: App, offline: object) -> None:
    """A TP=2 prefill replica's KV (each rank's heads) reaches a TP=1 decode replica whole: the tokens are the
    offline engine's."""
    from conveyor.deployments.app import AppArgs, build_app
    from conveyor.engine import SamplingParams

    args = AppArgs(
        engine={**ENGINE, "tensor_parallel_size": 2},
        disaggregation={"decode_engine": {"tensor_parallel_size": 1}},
        admission={"enabled": False},
        replica_num_cpus=0.1,
        worker_num_cpus=0.3,
        router_num_cpus=0.1,
    )
    serve.run(build_app(args), name="tpd", route_prefix="/tpd")
    try:
        body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = server.http.post("/tpd/v1/completions", json=body)
        want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.outputs[0].text
        decode = serve.get_deployment_handle("LLMDecode", app_name="tpd").handoff_stats.remote().result()
        assert decode["imports"] == 1 and decode["refused"] == 0
    finally:
        serve.delete("tpd")


def test_engine_core_crash_fails_the_stream_and_the_health_check(server: App) -> None:
    """Last in the module: the replica is replaced afterwards."""
    import os

    pid = server.replica.info.remote().result()["engine_core_pid"]
    assert pid is not None, "the replica runs its engine core in a process of its own by default"
    with httpx.Client(base_url=server.url, timeout=30) as client:
        with client.stream(
            "POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 480, "stream": True, "ignore_eos": True}
        ) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and "engine" in rest[-2] and "died" in rest[-2]
    health = server.http.get("/health")
    assert health.status_code == 503 and "died" in health.json()["error"]["message"]

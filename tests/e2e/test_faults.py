"""Faults against real Ray Serve apps on 127.0.0.1: a replica killed under load, the admission actor killed,
a tensor-parallel worker killed, SIGINT to `serve run` (which cuts) and to the draining launcher with requests
in flight. Nothing hangs: every request completes or ends with an explicit error, and the block pools end whole.
One Ray cluster and one 2-replica app for the module; the TP app, the `serve run` app and the launcher's app
come and go in their tests (the last two replace the module's app and end Serve)."""

import asyncio
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import httpx
import pytest
import ray
import yaml
from ray import serve

from conveyor.cluster.admission_actor import AdmissionActor, AdmissionClient
from tests.paced_runner import RUNNER as PACED
from tests.serve_app import ROOT, TEMP_DIRS, free_port, start_ray, stop_ray

ENGINE = dict(
    model="demo:tiny",
    dtype="float32",
    max_num_seqs=8,
    max_num_batched_tokens=256,
    block_size=16,
    num_blocks=256,
    max_model_len=1024,
)
ADMISSION = {"staleness_s": 0.5, "drop_after_s": 3.0}
APP = dict(
    model="demo:tiny",
    engine={k: v for k, v in ENGINE.items() if k != "model"},
    replica_num_cpus=0.25,
    router_num_cpus=0.1,
    torch_threads=1,
    admission=ADMISSION,
)


def eventually(check: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> float:
    start = time.time()
    while time.time() - start < timeout:
        try:
            if check():
                return time.time() - start
        except Exception:
            pass
        time.sleep(every)
    raise AssertionError(f"not within {timeout}s: {what}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimpleNamespace]:
    from conveyor.deployments.app import AppArgs, build_app

    address = start_ray()
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        paced = {**APP, "engine": {**APP["engine"], "model_runner_cls": PACED}}  # 700 tokens take >= 14 s
        serve.run(build_app(AppArgs(**paced, num_replicas=2)), name="faults", route_prefix="/faults")
        url = f"http://127.0.0.1:{port}"
        http = httpx.Client(base_url=f"{url}/faults", timeout=60)
        eventually(lambda: fresh_replicas(http) == 2, 60, "both replicas report to admission")
        yield SimpleNamespace(url=url, port=port, address=address, http=http)
    finally:
        serve.shutdown()
        stop_ray()


def router_log() -> str:
    logs = Path(TEMP_DIRS[-1], "session_latest", "logs", "serve").glob("replica_faults_Router_*.log")
    return "".join(f.read_text(errors="replace") for f in logs)


def view(http: httpx.Client) -> dict[str, Any]:
    return http.get("/v1/cluster").json()


def fresh_replicas(http: httpx.Client) -> int:
    return sum(r["fresh"] for r in view(http)["replicas"])


def pool_whole(http: httpx.Client, replicas: int) -> bool:
    rows = view(http)["replicas"]
    return len(rows) == replicas and all(
        r["fresh"] and r["num_running"] == r["num_waiting"] == 0 and r["kv_blocks_free"] == r["kv_blocks_total"]
        for r in rows
    )


def running_replicas(app: str) -> int:
    return serve.status().applications[app].deployments["LLMReplica"].replica_states.get("RUNNING", 0)


def replica_actor(replica_id: str) -> Any:
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(replica_id):
            return ray.get_actor(a["name"], namespace=a["namespace"])
    raise LookupError(replica_id)


class Request(threading.Thread):
    """One long completion in a thread, recording how it ended: status, replica, SSE events or body."""

    def __init__(self, url: str, stream: bool, max_tokens: int, seed: int) -> None:
        super().__init__(daemon=True)
        rng = random.Random(seed)
        self.url, self.stream, self.max_tokens = url, stream, max_tokens
        self.body = {
            "prompt": [rng.randrange(4, 8000) for _ in range(24)],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        }
        self.status: int | None = None
        self.replica: str | None = None
        self.events: list[Any] = []
        self.json: dict[str, Any] | None = None
        self.transport_error: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=httpx.Timeout(90)) as c:
                if self.stream:
                    with c.stream("POST", "/v1/completions", json=self.body) as r:
                        self.status, self.replica = r.status_code, r.headers.get("x-conveyor-replica")
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                self.events.append("DONE" if line == "data: [DONE]" else json.loads(line[6:]))
                                self.started.set()
                else:
                    r = c.post("/v1/completions", json=self.body)
                    self.status, self.replica, self.json = r.status_code, r.headers.get("x-conveyor-replica"), r.json()
        except httpx.TransportError as e:
            self.transport_error = repr(e)
        finally:
            self.started.set()

    @property
    def completed(self) -> bool:
        if self.stream:
            finish = [
                e["choices"][0]["finish_reason"]
                for e in self.events
                if isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
            ]
            errors = [e for e in self.events if isinstance(e, dict) and "error" in e]
            return self.status == 200 and finish == ["length"] and not errors and self.events[-1] == "DONE"
        return (
            self.status == 200
            and self.json["choices"][0]["finish_reason"] == "length"
            and self.json["usage"]["completion_tokens"] == self.max_tokens
        )

    @property
    def errored(self) -> bool:
        """An explicit error: 5xx in the OpenAI error shape, or an SSE error event followed by [DONE]."""
        if self.stream:
            return (
                self.status == 200
                and len(self.events) >= 2
                and self.events[-1] == "DONE"
                and isinstance(self.events[-2], dict)
                and "error" in self.events[-2]
                and bool(self.events[-2]["error"]["message"])
            )
        return self.status is not None and self.status >= 500 and bool(self.json.get("error", {}).get("message"))


def start_requests(url: str, n_stream: int, n_plain: int, max_tokens: int) -> list[Request]:
    reqs = [Request(url, i < n_stream, max_tokens, seed=i) for i in range(n_stream + n_plain)]
    for r in reqs:
        r.start()
    return reqs


def join(reqs: list[Request], timeout: float) -> None:
    deadline = time.time() + timeout
    for r in reqs:
        r.join(max(0.0, deadline - time.time()))
    hung = [r.body["stream"] for r in reqs if r.is_alive()]
    assert not hung, f"{len(hung)} requests hung past {timeout}s"


class FakeAdmissionActor:
    """No Ray: `sync.remote` calls the actor body after a short await, counts calls, fails while not `alive[0]`."""

    def __init__(self, body: AdmissionActor, alive: list[bool]) -> None:
        self.syncs = 0

        async def call(*args: Any) -> dict[str, Any]:
            self.syncs += 1
            await asyncio.sleep(0.01)
            if not alive[0]:
                raise ConnectionError("actor died")
            return body.sync(*args)

        self.sync = SimpleNamespace(remote=call)


def test_admission_client_fails_open_while_the_actor_is_unreachable(caplog: pytest.LogCaptureFixture) -> None:
    """No Ray here: an actor whose calls fail. The client admits with no replica list (the request router then
    uses the replicas' own load) instead of answering 503 to everyone, logs it once, and is back on the
    actor's view as soon as a refresh succeeds."""
    body, alive = AdmissionActor(ADMISSION), [True]
    actor = FakeAdmissionActor(body, alive)

    async def get_actor() -> FakeAdmissionActor:
        return actor

    async def scenario() -> None:
        from conveyor.engine.stats import EngineStats

        client = AdmissionClient(get_actor)
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10).to_dict(), "replica_id": "r"})
        d = await client.decide(2)
        assert d.admit and d.replicas == ["r"] and d.reason == "ok"
        alive[0] = False
        await asyncio.sleep(ADMISSION["staleness_s"] + 0.1)
        logger = logging.getLogger("ray.serve")
        logger.addHandler(caplog.handler)
        try:
            decisions = [await client.decide(2) for _ in range(5)]
        finally:
            logger.removeHandler(caplog.handler)
        assert all(d.admit and d.replicas == [] and d.reason == "fail_open" for d in decisions)
        assert sum("admitting without admission control" in r.message for r in caplog.records) == 1
        alive[0] = True
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10).to_dict(), "replica_id": "r"})
        await client.refresh()
        d = await client.decide(2)
        assert d.admit and d.replicas == ["r"] and d.reason == "ok"
        client.controller.replicas.clear()
        body.controller.forget("r")
        assert (await client.decide(2)).reason == "no_replicas", "a reachable actor without replicas still refuses"

    asyncio.run(scenario())


def test_a_router_that_never_reached_the_actor_syncs_before_deciding_instead_of_failing_open() -> None:
    """A router starts before its replicas, so its first syncs fail; a burst that comes once the actor answers
    is decided on the actor's view (admitted up to the watermark, then refused), not failed open. The requests
    that find the view stale share one sync."""
    body, alive = AdmissionActor(ADMISSION), [False]
    actor = FakeAdmissionActor(body, [True])

    async def get_actor() -> FakeAdmissionActor:
        if not alive[0]:
            raise ConnectionError("no replica yet")
        return actor

    async def scenario() -> None:
        from conveyor.engine.stats import EngineStats

        client = AdmissionClient(get_actor)
        with pytest.raises(ConnectionError):
            await client.refresh()
        alive[0] = True
        body.report({**EngineStats(kv_blocks_total=10, kv_blocks_free=10).to_dict(), "replica_id": "r"})
        decisions = await asyncio.gather(*(client.decide(2) for _ in range(8)))
        assert actor.syncs == 1, actor.syncs
        assert [d.reason for d in decisions] == ["ok"] * 4 + ["no_room"] * 4, decisions
        assert all(d.replicas == ["r"] for d in decisions[:4])

    asyncio.run(scenario())


@pytest.mark.slow
def test_killed_replica_is_replaced_and_its_requests_end_with_an_error(cluster: SimpleNamespace) -> None:
    url, http = f"{cluster.url}/faults", cluster.http
    before = {r["replica_id"] for r in view(http)["replicas"]}
    reqs = start_requests(url, n_stream=6, n_plain=4, max_tokens=700)
    streams = [r for r in reqs if r.stream]
    for r in streams:
        assert r.started.wait(60), "a stream never started"
    on = {rid: [r for r in streams if r.replica == rid] for rid in before}
    victim = max(on, key=lambda rid: len(on[rid]))
    assert on[victim] and all(r.events and r.events[-1] != "DONE" for r in on[victim]), "victim's streams in flight"
    ray.kill(replica_actor(victim), no_restart=True)
    killed_at = time.time()
    served = []
    for i in range(6):
        r = http.post("/v1/completions", json={"prompt": f"after the kill {i}", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        served.append(r.headers["x-conveyor-replica"])
    assert victim not in served
    eventually(
        lambda: all(not r["fresh"] or r["replica_id"] != victim for r in view(http)["replicas"]),
        10,
        "admission stops trusting the dead replica",
    )
    stale = time.time() - killed_at
    eventually(
        lambda: victim not in {r["replica_id"] for r in view(http)["replicas"]},
        15,
        "admission forgets the dead replica",
    )
    dropped = time.time() - killed_at
    print(
        f"dead replica stale in admission after {stale:.2f}s, dropped {dropped:.2f}s after the kill "
        f"(staleness_s {ADMISSION['staleness_s']}, drop_after_s {ADMISSION['drop_after_s']})"
    )
    assert dropped <= ADMISSION["drop_after_s"] + 5
    join(reqs, 120)
    for r in reqs:
        assert r.transport_error is None, r.transport_error
        assert r.completed or r.errored, (r.stream, r.status, r.events[-3:] if r.stream else r.json)
        if r.stream:
            assert r.completed == (r.replica != victim), (r.replica, victim, r.events[-2:])
    assert sum(r.errored for r in reqs) >= len(on[victim])
    eventually(lambda: running_replicas("faults") == 2, 120, "Serve replaces the killed replica")
    eventually(
        lambda: fresh_replicas(http) == 2 and victim not in {r["replica_id"] for r in view(http)["replicas"]},
        60,
        "the new replica reports to admission",
    )
    eventually(lambda: pool_whole(http, 2), 30, "both block pools are whole")


@pytest.mark.slow
def test_killed_admission_actor_fails_open_and_comes_back(cluster: SimpleNamespace) -> None:
    http = cluster.http
    handle = serve.get_deployment_handle("LLMReplica", app_name="faults")
    actor = handle.admission.remote().result()
    old = actor._actor_id.hex()
    ray.kill(actor, no_restart=True)
    time.sleep(ADMISSION["staleness_s"] + 0.5)
    codes = []
    for i in range(8):
        r = http.post("/v1/completions", json={"prompt": f"no admission {i}", "max_tokens": 4, "temperature": 0})
        codes.append(r.status_code)
    assert codes == [200] * 8, codes
    eventually(
        lambda: "admitting without admission control" in router_log(),
        10,
        "the router's warning reaches its log file at once (Serve buffers the request path's logs)",
    )

    def back() -> bool:
        return handle.admission.remote().result()._actor_id.hex() != old and fresh_replicas(http) == 2

    took = eventually(back, 90, "Serve recreates the admission actor and both replicas report to it")
    print(f"admission actor back after {took:.1f}s")
    r = http.post("/v1/completions", json={"prompt": "admitted again", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200
    metrics = http.get("/metrics").text
    assert 'conveyor_admission_decisions_total{admitted="true",reason="fail_open"}' in metrics
    eventually(lambda: pool_whole(http, 2), 30, "both block pools are whole")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killed_tp_worker_makes_the_replica_unhealthy_and_it_is_replaced(cluster: SimpleNamespace) -> None:
    from conveyor.deployments.app import AppArgs, build_app

    args = AppArgs(**{**APP, "engine": {**APP["engine"], "tensor_parallel_size": 2}, "worker_num_cpus": 0.25})
    serve.run(build_app(args), name="tp", route_prefix="/tp")
    http = httpx.Client(base_url=f"{cluster.url}/tp", timeout=60)
    try:
        r = http.post("/v1/completions", json={"prompt": "tp", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200
        first = r.headers["x-conveyor-replica"]
        workers = [
            a
            for a in ray._private.state.actors().values()
            if a["ActorClassName"].endswith("Worker") and a["State"] == "ALIVE"
        ]
        assert len(workers) == 2, [a["ActorClassName"] for a in workers]
        os.kill(workers[1]["Pid"], signal.SIGKILL)
        killed = time.time()
        unhealthy = eventually(
            lambda: http.get("/health", timeout=15).status_code == 503, 60, "the replica reports itself unhealthy"
        )
        print(f"TP replica unhealthy {unhealthy:.1f}s after its worker was killed")

        def replaced() -> bool:
            r = http.post("/v1/completions", json={"prompt": "tp again", "max_tokens": 4, "temperature": 0}, timeout=30)
            return r.status_code == 200 and r.headers["x-conveyor-replica"] != first

        eventually(
            replaced, 480, "Serve replaces the replica whose TP worker died", every=2.0
        )  # a TP start: minutes here
        print(f"TP replica replaced {time.time() - killed:.1f}s after its worker was killed")
        assert running_replicas("tp") == 1
    finally:
        serve.delete("tp")


def launch_config(tmp_path: Path, port: int, name: str, args: dict[str, Any]) -> Path:
    config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": name,
                "route_prefix": f"/{name}",
                "import_path": "conveyor.deployments.app:build_app",
                "args": args,
            }
        ],
    }
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Output(threading.Thread):
    """A child's stdout, read as it comes (so the test can wait for a line) and kept whole."""

    def __init__(self, proc: subprocess.Popen) -> None:
        super().__init__(daemon=True)
        self.proc, self.lines = proc, []
        self.start()

    def run(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)


@pytest.mark.slow
def test_sigint_on_serve_run_cuts_requests_in_flight(cluster: SimpleNamespace, tmp_path: Path) -> None:
    """Ray's own `serve run` does not drain: on SIGINT it calls serve.shutdown(), whose controller kills the
    HTTP proxy in the same tick as the replicas (Ray Serve 2.60), so requests in flight are CUT (connection
    closed), not finished and not told why. `python -m conveyor.deployments.launch` is the start command that drains
    (the next test). Steps here take >= 20 ms (tests/paced_runner.py), so no 300-token request can finish
    before the shutdown. The child gets SIGINT back to the default handler, as a background job of a shell
    would not."""
    path = launch_config(
        tmp_path,
        cluster.port,
        "cut",
        {**APP, "admission": {"enabled": False}, "engine": {**APP["engine"], "model_runner_cls": PACED}},
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.serve.scripts", "run", "--address", cluster.address, str(path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    url = f"{cluster.url}/cut"
    try:
        eventually(
            lambda: httpx.get(f"{url}/v1/models", timeout=5).status_code == 200, 180, "serve run is up", every=0.5
        )
        reqs = start_requests(url, n_stream=3, n_plain=3, max_tokens=300)
        for r in reqs[:3]:
            assert r.started.wait(60)
        proc.send_signal(signal.SIGINT)
        join(reqs, 90)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0 and "shutting down" in out.lower(), out[-3000:]
        outcomes = [
            ("completed" if r.completed else "errored" if r.errored else "cut" if r.transport_error else "?")
            for r in reqs
        ]
        print("after SIGINT on serve run:", outcomes)
        assert "?" not in outcomes, [(r.status, r.events[-2:] if r.stream else r.json) for r in reqs]
        assert "completed" not in outcomes and "cut" in outcomes, "serve run cuts requests in flight"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_launcher_drains_on_sigint(cluster: SimpleNamespace, tmp_path: Path) -> None:
    """Last in the module: `python -m conveyor.deployments.launch` deploys a config (replacing the apps on the cluster,
    as `serve run` does) and SIGINT drains it. Steps take >= 20 ms (tests/paced_runner.py), so a 900-token
    request needs >= 18 s and cannot finish within the 8 s drain timeout, while 100-token ones have ~5x slack.
    In flight at the signal: 3 streaming + 3 plain short requests, which finish in full, and 1 + 1 long ones,
    which end with an explicit 503 `drain_timeout` (an SSE error event then [DONE] for the stream). A request
    sent during the drain gets 503 `shutting_down` with Retry-After; /health says 503 too. Then the launcher
    reports the pool whole, shuts Serve down and exits 0; the app's replicas are gone."""
    drain_s, short, long_ = 8.0, 100, 900
    path = launch_config(
        tmp_path, cluster.port, "launch", {**APP, "engine": {**APP["engine"], "model_runner_cls": PACED}}
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "conveyor.deployments.launch",
            "--address",
            cluster.address,
            "--drain-timeout",
            str(drain_s),
            str(path),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out, url = Output(proc), f"{cluster.url}/launch"
    try:
        eventually(
            lambda: httpx.get(f"{url}/v1/models", timeout=5).status_code == 200, 180, "the launcher is up", every=0.5
        )
        http = httpx.Client(base_url=url, timeout=30)
        reqs = start_requests(url, n_stream=3, n_plain=3, max_tokens=short)
        longs = [Request(url, stream, long_, seed=10 + stream) for stream in (True, False)]
        for r in longs:
            r.start()
        eventually(
            lambda: sum(r["num_running"] for r in view(http)["replicas"]) == 8, 60, "all 8 requests running", every=0.05
        )
        proc.send_signal(signal.SIGINT)
        signalled = time.time()
        eventually(lambda: "draining:" in out.text, 30, "the launcher starts the drain")
        probes: list[httpx.Response] = []

        def refused() -> bool:
            probes.append(
                httpx.post(
                    f"{url}/v1/completions", timeout=30, json={"prompt": "too late", "max_tokens": 2, "temperature": 0}
                )
            )
            return probes[-1].status_code == 503

        eventually(refused, 10, "a new request is refused during the drain", every=0.05)
        late = probes[-1]
        assert all(p.status_code in (200, 503) for p in probes), [p.status_code for p in probes]
        error = late.json()["error"]
        assert error["code"] == "shutting_down" and error["type"] == "service_unavailable" and error["message"]
        assert int(late.headers["Retry-After"]) >= 1
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        join(reqs + longs, 90)
        assert proc.wait(timeout=60) == 0, out.text[-3000:]
        took = time.time() - signalled
        print(
            f"launcher exited {took:.1f}s after SIGINT; {len(probes)} probe(s) until the first refusal; its output:\n"
            + "".join(
                line
                for line in out.lines
                if "draining" in line or "drained" in line or "app launch" in line or "Serve" in line
            )
        )
        for r in reqs + longs:
            assert r.transport_error is None, (r.stream, r.max_tokens, r.transport_error)
        assert all(r.completed for r in reqs), [
            (r.stream, r.status, r.events[-2:] if r.stream else r.json) for r in reqs
        ]
        for r in longs:
            assert r.errored, (r.stream, r.status, r.events[-3:] if r.stream else r.json)
            error = (r.events[-2] if r.stream else r.json)["error"]
            assert "drain timeout" in error["message"], error
            assert error["code"] == (503 if r.stream else "drain_timeout"), error
        assert (
            "drained: 8 request(s) in flight at the signal, 6 finished, 2 ended with an error at the drain's end, 0 left"
            in out.text
        ), out.text[-3000:]
        assert "every KV pool whole, nothing running or waiting" in out.text, out.text[-3000:]
        eventually(
            lambda: (
                not [
                    a
                    for a in ray.util.list_named_actors(all_namespaces=True)
                    if a["name"].startswith("SERVE_REPLICA::launch#")
                ]
            ),
            30,
            "the app's replicas are gone",
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

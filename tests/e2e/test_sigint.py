"""SIGINT with requests in flight, on a real Ray cluster on 127.0.0.1: Ray's `serve run` cuts them; the draining
launcher finishes what it can, ends the rest with an explicit error, refuses new ones, and exits with the
pools whole. Both replace the module's app and end Serve."""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import ray
import yaml

from tests.e2e.faults import APP, Request, eventually, join, start_requests, view
from tests.paced_runner import RUNNER as PACED
from tests.serve_app import ROOT


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

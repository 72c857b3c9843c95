"""One real Ray Serve app on 127.0.0.1 for a test module, and the checks every end-to-end test ends with."""

import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator

import httpx
import ray
from ray import serve

from conveyor.deployments.ingress import use_haproxy

ROOT = Path(__file__).resolve().parents[1]
TEMP_DIRS: list[str] = []
ENGINE = dict(
    dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_blocks=96, max_model_len=512
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ALL_HAPROXY = os.environ.get("CONVEYOR_TEST_INGRESS") == "haproxy"


def start_ray(env: dict[str, str] | None = None, haproxy: bool = False) -> str:
    """A local Ray cluster; `haproxy`: behind Serve's HAProxy ingress (the README's serve command), else Serve's
    proxy; CONVEYOR_TEST_INGRESS=haproxy puts every cluster of the suite behind HAProxy."""
    tmp = tempfile.mkdtemp(prefix="ray-serve-", dir="/tmp")
    TEMP_DIRS.append(tmp)
    use_haproxy(haproxy or ALL_HAPROXY, tmp)
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _temp_dir=tmp,
        _node_ip_address="127.0.0.1",
        object_store_memory=200 * 2**20,
        log_to_driver=False,
        runtime_env={"env_vars": env} if env else None,
    )
    return ray.get_runtime_context().gcs_address


@contextmanager
def local_nodes(haproxy: bool, prefix: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """The setting for a ray.cluster_utils.Cluster on this machine: yields its temp dir and the arguments every
    node takes (all on 127.0.0.1: Ray rewrites that address to the machine's outward one unless "clusters" are
    off for this process); `haproxy`: behind Serve's HAProxy ingress."""
    from ray._private import ray_constants

    keep = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.makedirs("/tmp/ray", exist_ok=True)  # Cluster writes the current cluster's address there
    use_haproxy(haproxy, tmp)
    try:
        yield tmp, dict(node_ip_address="127.0.0.1", object_store_memory=80 * 2**20, temp_dir=tmp)
    finally:
        use_haproxy(False, tmp)
        ray_constants.ENABLE_RAY_CLUSTER = keep
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def serve_on(cluster: Any, app: Any, name: str) -> Iterator[str]:
    """`app` served on `cluster` (Serve's proxy on the head only: per-node proxies would all bind one port of this
    machine), its URL once ready; then Serve, the driver and the cluster shut down."""
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name=name, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 240)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def stop_ray() -> None:
    ray.shutdown()
    while TEMP_DIRS:
        shutil.rmtree(TEMP_DIRS.pop(), ignore_errors=True)


def wait_ready(
    url: str,
    timeout: float,
    ok: Callable[[], bool] = lambda: True,
    headers: dict | None = None,
    proc: subprocess.Popen | None = None,
) -> None:
    """Until `url` answers /v1/models and `ok()` holds; fails at once if `proc` (a `serve run`) exits."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc is None or proc.poll() is None, "serve run exited early"
        try:
            if httpx.get(f"{url}/v1/models", timeout=5, headers=headers).status_code == 200 and ok():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def wait_for(check: Callable[[], Any], timeout: float = 20.0, every: float = 0.02) -> Any:
    """Poll `check` until it returns something truthy; its last value on timeout (for the assertion)."""
    deadline, value = time.time() + timeout, None
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    return value


@dataclass
class App:
    url: str
    name: str
    replica: Any
    temp_dir: str
    headers: dict[str, str] = field(default_factory=dict)

    @cached_property
    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, headers=self.headers)

    def stats(self) -> dict[str, Any]:
        return self.replica.stats.remote().result()

    def num_replicas(self) -> int:
        return serve.status().applications[self.name].deployments["LLMReplica"].replica_states.get("RUNNING", 0)

    def admission_queued(self) -> float:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        m = re.search(r"^conveyor_admission_queued (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def pool_whole(self, timeout: float = 20.0) -> dict[str, Any]:
        """Wait until the replica is idle with every KV block free; the last stats either way."""

        def idle() -> dict[str, Any] | None:
            s = self.stats()
            done = not s["num_running"] and not s["num_waiting"] and s["kv_blocks_free"] == s["kv_blocks_total"]
            return s if done else None

        return wait_for(idle, timeout) or self.stats()


def app_at(url: str, name: str = "default", timeout: float = 60) -> App:
    """The App view of an app a module deployed itself (its own arguments, its own Ray cluster)."""
    app = App(url, name, serve.get_deployment_handle("LLMReplica", app_name=name), "", {})
    app.http = httpx.Client(base_url=url, timeout=timeout)
    return app


def assert_pool_whole(app: Any) -> None:
    """Every end-to-end test ends here: one replica, idle, every KV block free (polled, not slept for)."""
    assert app.num_replicas() == 1, "these checks read the one replica's stats"
    s = app.pool_whole()
    assert s["num_running"] == 0 and s["num_waiting"] == 0, s
    assert s["kv_blocks_free"] == s["kv_blocks_total"], s


@contextmanager
def serve_app(
    args: dict[str, Any],
    env: dict[str, str] | None = None,
    headers: dict[str, str] | None = None,
    name: str = "default",
    haproxy: bool = False,
) -> Iterator[App]:
    from conveyor.deployments.app import deploy

    start_ray(env, haproxy)
    port = free_port()
    try:
        deploy(
            {
                "num_replicas": 1,
                "replica_num_cpus": 0.5,
                "router_num_cpus": 0.5,
                "torch_threads": 1,
                **args,
                "engine": {**ENGINE, **args.get("engine", {})},
                "port": port,
            },
            name=name,
        )
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 180, headers=headers)
        replica_name = "LLMPrefill" if args.get("disaggregation") else "LLMReplica"
        replica = serve.get_deployment_handle(replica_name, app_name=name)
        yield App(url, name, replica, TEMP_DIRS[-1], dict(headers or {}))
    finally:
        serve.shutdown()
        stop_ray()


API_KEY = "sk-conveyor-test-6b1f0c"
SHARED_ARGS: dict[str, Any] = {
    "api_key": API_KEY,
    "max_body_bytes": 64 * 1024,
    "engine": {"max_num_seqs": 1, "max_num_batched_tokens": 8, "num_blocks": 48, "enable_prefix_caching": True},
    "admission": {"queue_timeout_s": 5.0, "max_queued": 4, "retry_after_s": 1.0},
}
"""The app the HTTP reliability modules share (starting Serve costs ~30 s or more here), behind HAProxy as the
README serves (the other modules' apps use Serve's proxy, so the suite covers both ingresses): one sequence at a
time and 8-token prefill chunks, so a test can catch a request waiting, in prefill or in decode; a 48-block
pool that two long requests overfill, so admission queues and refuses."""
_shared: list[Any] = []


def shared_app() -> App:
    if not _shared:
        ctx = serve_app(SHARED_ARGS, headers={"Authorization": f"Bearer {API_KEY}"}, haproxy=True)
        _shared.extend([ctx, ctx.__enter__()])
    return _shared[1]


def release_shared_app() -> None:
    """Called by conftest before any test that does not use the shared app, and at the session's end."""
    if _shared:
        ctx = _shared[0]
        _shared.clear()
        ctx.__exit__(None, None, None)


def sse_events(resp: httpx.Response) -> list[Any]:
    return [
        "DONE" if line == "data: [DONE]" else json.loads(line[6:])
        for line in resp.iter_lines()
        if line.startswith("data: ")
    ]

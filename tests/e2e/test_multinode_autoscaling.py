"""KV-demand autoscaling across nodes, with Ray's own autoscaler and its fake multi-node provider (every node a
set of Ray processes on this machine, on 127.0.0.1). The head node holds one LLM replica (the `conveyor_replica`
per-node resource), the router and the admission actor; a worker node type offers one more `conveyor_replica`
and starts with no node. Under KV demand above target, Serve asks for a second replica, which no node can place;
the autoscaler adds a node, the replica starts there and serves. When demand falls, Serve stops that replica and
the autoscaler removes the idle node. Each phase's time prints with AUTOSCALE (run with -s to see them).

The head is started here rather than by `ray.cluster_utils.AutoscalingCluster`, whose start and shutdown run
`ray stop --force` and would kill every other Ray process on the machine."""

import json
import os
import shutil
import tempfile
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import httpx
import psutil
import pytest
import ray
from ray import serve

from tests.load import Load

pytestmark = pytest.mark.slow

SLOT = "conveyor_replica"
IDLE_NODE_S = 6  # the autoscaler's idle_timeout_minutes, 0.1
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=256, block_size=16, max_model_len=512)
SCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "look_back_period_s": 2,
    "metrics_interval_s": 0.5,
    "policy": {"target_kv_utilization": 0.5, "tolerance": 0.1, "upscale_delay_s": 1, "downscale_delay_s": 4},
}
APP = dict(
    model="demo:tiny",
    replica_num_cpus=0.25,
    router_num_cpus=0.1,
    torch_threads=1,
    replica_node_resource=SLOT,
    engine={**ENGINE, "num_blocks": 48},
    kv_autoscaling=SCALING,
)
STORE = 80 * 2**20


def autoscaler_config(gcs_address: str) -> dict[str, Any]:
    """Ray's fake_multinode example config with our node types: the head, and up to one replica node."""
    return {
        "cluster_name": "conveyor-autoscaling",
        "max_workers": 1,
        "provider": {
            "type": "fake_multinode",
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
            "gcs_address": gcs_address,
        },
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1, SLOT: 1}, "node_config": {}, "max_workers": 0},
            "replica_node": {
                "resources": {"CPU": 1, SLOT: 1, "object_store_memory": STORE},
                "node_config": {},
                "min_workers": 0,
                "max_workers": 1,
            },
        },
        "head_node_type": "ray.head.default",
        "auth": {},
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": IDLE_NODE_S / 60,
        "docker": {},
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
    }


def kill_processes_under(path: str) -> None:
    """The autoscaler's nodes outlive the head's shutdown (the provider starts them without a reaper): every Ray
    process of this cluster names its temp dir on its command line."""
    procs = [p for p in psutil.process_iter(["cmdline"]) if any(path in c for c in p.info["cmdline"] or [])]
    for p in procs:
        p.kill()
    psutil.wait_procs(procs, timeout=10)


def report(what: str, **values: float) -> None:
    print(f"AUTOSCALE {what}: " + ", ".join(f"{k}={v:.1f}" for k, v in values.items()))


def eventually(check: Callable[[], Any], timeout: float, what: str, every: float = 0.25) -> float:
    start = time.time()
    while time.time() - start < timeout:
        if check():
            return time.time()
        time.sleep(every)
    raise AssertionError(f"not within {timeout}s: {what}")


@pytest.fixture(scope="module")
def scaled(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[SimpleNamespace]:
    from ray._private import ray_constants
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID
    from ray.cluster_utils import Cluster

    from conveyor.deployments.app import AppArgs, build_app
    from conveyor.deployments.ingress import use_haproxy
    from tests.serve_app import free_port, wait_ready

    # read by the autoscaler's monitor and the nodes it starts (child processes of the head): the fake provider,
    # a 1 s autoscaler loop, and Ray's "clusters" off so that every node stays on 127.0.0.1
    for key, value in {
        "RAY_FAKE_CLUSTER": "1",
        "AUTOSCALER_UPDATE_INTERVAL_S": "1",
        ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR: "0",
    }.items():
        monkeypatch_module.setenv(key, value)
    monkeypatch_module.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    tmp = tempfile.mkdtemp(prefix="ray-as-", dir="/tmp")
    os.makedirs("/tmp/ray", exist_ok=True)  # Cluster writes the current cluster's address there
    use_haproxy(False, tmp)
    gcs_port = free_port()
    config_path = os.path.join(tmp, "autoscaler.json")
    with open(config_path, "w") as f:
        json.dump(autoscaler_config(f"127.0.0.1:{gcs_port}"), f)
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=1,
            resources={SLOT: 1},
            node_ip_address="127.0.0.1",
            object_store_memory=STORE,
            temp_dir=tmp,
            include_dashboard=False,
            gcs_server_port=gcs_port,
            autoscaling_config=config_path,
            # the provider knows the head by this id: without it, the autoscaler counts the head's free
            # conveyor_replica from the config and never adds a node for it
            env_vars={"RAY_OVERRIDE_NODE_ID_FOR_TESTING": FAKE_HEAD_NODE_ID},
        ),
    )
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(AppArgs(**APP)), name="default", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 240)
        yield SimpleNamespace(url=url, head=cluster.head_node.node_id)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
        kill_processes_under(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def replica_states() -> dict[str, int]:
    return dict(serve.status().applications["default"].deployments["LLMReplica"].replica_states)


def alive_nodes() -> list[dict[str, Any]]:
    return [n for n in ray.nodes() if n["Alive"]]


def rows(url: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/v1/cluster", timeout=10).json()["replicas"]


def test_kv_demand_adds_a_node_for_a_replica_and_removes_it_when_idle(scaled: SimpleNamespace) -> None:
    assert len(alive_nodes()) == 1 and replica_states().get("RUNNING") == 1
    started = time.time()
    with Load(scaled.url, n=6, prompt_len=48, max_tokens=160) as load:
        wanted = eventually(lambda: sum(replica_states().values()) == 2, 120, "Serve asks for a second replica")
        added = eventually(lambda: len(alive_nodes()) == 2, 120, "the autoscaler adds a node")
        node = next(n["NodeID"] for n in alive_nodes() if n["NodeID"] != scaled.head)
        running = eventually(lambda: replica_states().get("RUNNING") == 2, 180, "the new replica runs")
        new = eventually(
            lambda: any(r["node_id"] == node and r["fresh"] for r in rows(scaled.url)), 60, "it reports to admission"
        )
        replica = next(r["replica_id"] for r in rows(scaled.url) if r["node_id"] == node)
        served = eventually(lambda: replica in load.replicas, 120, "the new node's replica answers a request")
    # 503 + Retry-After is a clean refusal too: while a replica starts, admission may see stale stats
    assert load.codes.count(200) >= 1 and set(load.codes) <= {200, 429, 503}, load.codes
    calm = time.time()
    stopped = eventually(lambda: replica_states().get("RUNNING") == 1, 120, "scale back to one replica")
    eventually(lambda: [r["node_id"] for r in rows(scaled.url)] == [scaled.head], 30, "only the head's replica reports")
    removed = eventually(lambda: len(alive_nodes()) == 1, 120, "the autoscaler removes the idle node")
    report(
        "up",
        replica_wanted_s=wanted - started,
        node_added_s=added - wanted,
        replica_running_s=running - added,
        reporting_s=new - running,
        first_answer_s=served - new,
        total_s=served - started,
    )
    report("down", replica_stopped_s=stopped - calm, node_removed_s=removed - stopped, total_s=removed - calm)
    assert httpx.post(f"{scaled.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60).is_success

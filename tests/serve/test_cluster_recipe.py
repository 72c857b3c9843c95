"""The cluster recipe's files deploy: the KubeRay RayService's serveConfigV2 and the cluster serve config pass Ray
Serve's own schema and Conveyor's AppArgs, hold the same application, and ask for one replica per node that the
worker group provides; the default placement pins the admission actor and a single router to the head node."""

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from conveyor.deployments.app import AppArgs, build_app
from conveyor.deployments.node_placement import HEAD_PIN

ROOT = Path(__file__).resolve().parents[2]
RAYSERVICE = ROOT / "deployments" / "kuberay" / "rayservice.yaml"
CLUSTER_CONFIG = ROOT / "deployments" / "cluster_serve_config.yaml"


def rayservice() -> dict[str, Any]:
    return yaml.safe_load(RAYSERVICE.read_text())


def serve_config_v2() -> dict[str, Any]:
    return yaml.safe_load(rayservice()["spec"]["serveConfigV2"])


@pytest.mark.parametrize(
    "config",
    [
        serve_config_v2(),
        yaml.safe_load(CLUSTER_CONFIG.read_text()),
        yaml.safe_load((ROOT / "serve_config.yaml").read_text()),
    ],
    ids=["rayservice", "cluster_serve_config", "serve_config"],
)
def test_serve_configs_pass_serve_schema_and_app_args(config: dict[str, Any]) -> None:
    schema = ServeDeploySchema.model_validate(config)
    for app in schema.applications:
        assert app.import_path == "conveyor.deployments.app:build_app"
        AppArgs.model_validate(app.args)


def test_rayservice_serves_the_cluster_config_one_replica_per_worker() -> None:
    service = rayservice()
    assert service["apiVersion"] == "ray.io/v1" and service["kind"] == "RayService"
    assert serve_config_v2() == yaml.safe_load(CLUSTER_CONFIG.read_text())
    args = AppArgs.model_validate(serve_config_v2()["applications"][0]["args"])
    cluster = service["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    declared = json.loads(json.loads(group["rayStartParams"]["resources"]))
    assert declared == {args.replica_node_resource: 1}
    assert args.kv_autoscaling is not None and args.kv_autoscaling.max_replicas <= group["maxReplicas"]
    for spec in [cluster["headGroupSpec"], group]:
        (container,) = spec["template"]["spec"]["containers"]
        assert {"name": "RAY_SERVE_ENABLE_HA_PROXY", "value": "1"} in container["env"]


def test_replica_bundle_takes_the_whole_node_resource_and_workers_share_its_group() -> None:
    args = AppArgs(replica_node_resource="conveyor_replica", engine={"tensor_parallel_size": 2, "device": "cpu"})
    opts = args.replica_options()
    assert opts["placement_group_strategy"] == "STRICT_PACK"
    assert opts["placement_group_bundles"][0]["conveyor_replica"] == 1.0
    assert all("conveyor_replica" not in b for b in opts["placement_group_bundles"][1:])
    assert "conveyor_replica" not in str(AppArgs().replica_options()["placement_group_bundles"])


def test_admission_actor_and_single_router_on_the_head_node() -> None:
    (actor,) = AppArgs().replica_options()["deployment_actors"]
    assert actor.actor_options["resources"] == HEAD_PIN
    assert AppArgs(admission_resources={"x": 0.01}).replica_options()["deployment_actors"][0].actor_options[
        "resources"
    ] == {"x": 0.01}
    router = build_app(AppArgs())._bound_deployment
    assert router.ray_actor_options["resources"] == HEAD_PIN
    spread = build_app(AppArgs(router_replicas=2))._bound_deployment
    assert spread.ray_actor_options["resources"] == {}

"""KV-demand autoscaling: the policy's decisions (dead band, delays, bounds, waiting requests), the metrics it
reads, and serve_config.yaml's policy and router as Ray Serve builds them."""

import pytest
import yaml

from conveyor.cluster.autoscaling import (
    KVCacheAutoscalingPolicy,
    KVScalingConfig,
    autoscaling_metrics,
    desired_replicas,
)
from conveyor.cluster.routing import (
    KVAwareRequestRouter,
    RouterConfig,
)
from conveyor.engine.stats import EngineStats

SCALE = KVScalingConfig(
    target_kv_utilization=0.5,
    tolerance=0.1,
    target_waiting_per_replica=4,
    upscale_delay_s=0.0,
    downscale_delay_s=10.0,
    min_replicas=1,
    max_replicas=6,
)


def test_autoscaling_up_down_hold():
    assert desired_replicas(2, [0.9, 0.7], [0, 0], SCALE, {}, 0.0) == 4  # ceil(2 * 0.8 / 0.5)
    assert desired_replicas(2, [0.52, 0.5], [0, 0], SCALE, {}, 0.0) == 2  # inside the dead band
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, {}, 0.0) == 4  # down needs 10 s
    state: dict = {}
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 0.0) == 4
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 9.0) == 4
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 10.0) == 2  # ceil(4 * 0.2 / 0.5)
    assert state == {}


def test_autoscaling_hysteresis_resets_and_no_flap():
    state: dict = {}
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 0.0) == 4
    assert desired_replicas(4, [0.5] * 4, [0] * 4, SCALE, state, 5.0) == 4  # load came back: timer reset
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 12.0) == 4
    assert desired_replicas(4, [0.2] * 4, [0] * 4, SCALE, state, 22.0) == 2
    n, util = 1, 0.95  # after scaling to ceil(n u / t) the new per-replica load holds steady
    m = desired_replicas(n, [util], [0], SCALE, {}, 0.0)
    assert m == 2 and desired_replicas(m, [n * util / m] * m, [0] * m, SCALE, {}, 100.0) == m


def test_autoscaling_bounds_waiting_and_starting():
    assert desired_replicas(4, [1.0] * 4, [0] * 4, SCALE, {}, 0.0) == 6  # max
    assert desired_replicas(2, [0.0, 0.0], [0, 0], SCALE, {}, 100.0) == 2  # down after delay...
    state: dict = {}
    desired_replicas(2, [0.0, 0.0], [0, 0], SCALE, state, 0.0)
    assert desired_replicas(2, [0.0, 0.0], [0, 0], SCALE, state, 10.0) == 1  # ...never below min
    assert desired_replicas(2, [0.5, 0.5], [10, 10], SCALE, {}, 0.0) == 5  # ceil(2 * 10 / 4)
    assert desired_replicas(4, [0.1, 0.1], [0, 0], SCALE, {"kv_down_since": -99.0}, 0.0) == 4  # 2 of 4 up
    assert desired_replicas(3, [], [], SCALE, {}, 0.0) == 3
    assert desired_replicas(9, [0.5] * 9, [0] * 9, SCALE, {"kv_down_since": 0.0}, 10.0) == 6


def test_autoscaling_metrics_from_stats():
    """Autoscaling reads the blocks committed (held, waiting prompts', likely growth), not only those held."""
    s = EngineStats(num_waiting=3, num_waiting_tokens=20, kv_blocks_total=10, kv_blocks_free=4, num_growth_blocks=1)
    m = autoscaling_metrics(s)  # 6 held + 2 for the 20 waiting prompt tokens + 1 of growth, not 6
    assert m == {"kv_demand": pytest.approx(0.9), "num_waiting": 3.0, "num_waiting_tokens": 20.0}
    assert all(isinstance(v, float) for v in m.values())


SERVE_YAML = """
applications:
- name: conveyor
  route_prefix: /
  import_path: conveyor.deployments.app:app
  deployments:
  - name: LLMReplica
    max_ongoing_requests: 64
    autoscaling_config:
      min_replicas: 1
      max_replicas: 4
      look_back_period_s: 15
      upscale_delay_s: 0
      downscale_delay_s: 0
      policy:
        policy_function: conveyor.cluster.autoscaling:KVCacheAutoscalingPolicy
        policy_kwargs: {target_kv_utilization: 0.7, tolerance: 0.1, target_waiting_per_replica: 4,
                        upscale_delay_s: 5, downscale_delay_s: 60}
    request_router_config:
      request_router_class: conveyor.cluster.routing:KVAwareRequestRouter
      request_routing_stats_period_s: 0.5
      request_routing_stats_timeout_s: 2
      request_router_kwargs: {affinity_weight: 1.0, headroom_weight: 0.5, queue_weight: 0.5,
                              high_watermark: 0.9, low_watermark: 0.75, max_queue_imbalance: 8}
"""


def test_serve_config_yaml_builds_policy_and_router():
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext, RequestRouterConfig
    from ray.serve.schema import ServeDeploySchema

    from tests.cluster.autoscaling_context import autoscaling_context

    dep = ServeDeploySchema(**yaml.safe_load(SERVE_YAML)).applications[0].deployments[0]
    router_cfg = RequestRouterConfig(**dep.request_router_config)
    assert router_cfg.get_request_router_class() is KVAwareRequestRouter
    assert RouterConfig(**router_cfg.request_router_kwargs).max_queue_imbalance == 8
    autoscaling = AutoscalingConfig(**dep.autoscaling_config)
    policy = _resolve_policy_callable(autoscaling.policy)
    assert isinstance(policy, KVCacheAutoscalingPolicy) and policy.config.downscale_delay_s == 60

    def ctx(util: list[float], t: float, state: dict) -> AutoscalingContext:
        ids = [f"r{i}" for i in range(len(util))]
        metrics = {"kv_demand": dict(zip(ids, util)), "num_waiting": dict.fromkeys(ids, 0.0)}
        return autoscaling_context("LLMReplica", metrics, ids, autoscaling, t, state, 1, 4)

    wrapped = _apply_autoscaling_config(policy)  # Ray's own wrapper: bounds, factors, its (zero) delays
    n, state = wrapped(ctx([0.9, 0.9], 0.0, {}))
    assert n == 2 and "kv_up_since" in state  # our 5 s upscale delay runs
    n, state = wrapped(ctx([0.9, 0.9], 5.0, state))
    assert n == 3  # ceil(2 * 0.9 / 0.7)
    n, _ = wrapped(ctx([1.0] * 3, 5.0, {"kv_up_since": 0.0}))
    assert n == 4  # ceil(3 / 0.7) = 5, bounded by max_replicas

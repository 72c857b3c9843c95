"""Per-role autoscaling of a disaggregated app: each policy decides from its role's stat, read from real
EngineStats as a replica reports them (record_autoscaling_stats) and run through Ray's own policy wrapper."""

from typing import Any

from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve.autoscaling_policy import _apply_autoscaling_config

from conveyor.cluster.autoscaling import (
    KVCacheAutoscalingPolicy,
    PrefillAutoscalingPolicy,
    PrefillScalingConfig,
    desired_prefill_replicas,
)
from conveyor.deployments.app import role_replicas
from conveyor.deployments.kv_autoscaling import KV_POLICY, PREFILL_POLICY, KVAutoscaling
from conveyor.engine.stats import EngineStats
from tests.cluster.autoscaling_context import autoscaling_context

SCALING = KVAutoscaling(min_replicas=1, max_replicas=4, policy={"downscale_delay_s": 10})


def reported(stats: EngineStats) -> dict[str, float]:
    """What LLMReplica.record_autoscaling_stats returns for these stats."""
    return {k: float(v) for k, v in stats.to_dict().items() if isinstance(v, (int, float))}


def policy(function: str) -> Any:
    config = role_replicas(1, SCALING, function)["autoscaling_config"]
    return _apply_autoscaling_config(_resolve_policy_callable(config.policy)), config


def decide(function: str, replicas: list[EngineStats], t: float = 0.0, state: dict | None = None) -> tuple[int, dict]:
    wrapped, config = policy(function)
    ids = [f"r{i}" for i in range(len(replicas))]
    metrics: dict[str, dict[str, float]] = {}
    for rid, s in zip(ids, replicas):
        for k, v in reported(s).items():
            metrics.setdefault(k, {})[rid] = v
    ctx = autoscaling_context(
        "LLMDecode", metrics, ids, config, t, state or {}, config.min_replicas, config.max_replicas
    )
    return wrapped(ctx)


# a prefill replica with a long queue of prompts (3000 tokens) that its pool holds easily: it exports each
# prompt's KV after its first token, so its KV demand stays low while the queue delays every first token
QUEUED = EngineStats(num_running=1, num_waiting=3, num_waiting_tokens=3000, kv_blocks_total=1000, kv_blocks_free=990)
# a decode replica full of running requests that still grow, nothing queued
DECODING = EngineStats(num_running=8, kv_blocks_total=100, kv_blocks_free=20, num_growth_blocks=15)
IDLE = EngineStats(kv_blocks_total=100, kv_blocks_free=100)


def test_roles_build_their_own_policies() -> None:
    assert role_replicas(2, None, KV_POLICY) == {"num_replicas": 2}
    prefill, decode = policy(PREFILL_POLICY)[1], policy(KV_POLICY)[1]
    assert prefill.min_replicas == decode.min_replicas == 1 and prefill.max_replicas == 4
    assert isinstance(_resolve_policy_callable(prefill.policy), PrefillAutoscalingPolicy)
    assert type(_resolve_policy_callable(decode.policy)) is KVCacheAutoscalingPolicy


def test_prefill_scales_on_queued_prompt_tokens_not_kv() -> None:
    assert QUEUED.kv_demand < 0.7 and QUEUED.num_waiting < 4  # the KV policy sees nothing to add
    assert decide(KV_POLICY, [QUEUED])[0] == 1
    assert decide(PREFILL_POLICY, [QUEUED])[0] == 3  # ceil(3000 / 1024)
    assert decide(PREFILL_POLICY, [DECODING, DECODING])[0] == 2  # KV demand alone adds no prefill replica


def test_decode_scales_on_kv_demand_not_queue() -> None:
    assert DECODING.kv_demand > 0.9 and DECODING.num_waiting_tokens == 0
    assert decide(PREFILL_POLICY, [DECODING])[0] == 1
    assert decide(KV_POLICY, [DECODING])[0] == 2  # ceil(0.95 / 0.7)


def test_idle_roles_scale_down_after_their_delay() -> None:
    n, state = decide(PREFILL_POLICY, [IDLE, IDLE], 0.0)
    assert n == 2 and state
    assert decide(PREFILL_POLICY, [IDLE, IDLE], 10.0, state)[0] == 1
    n, state = decide(KV_POLICY, [IDLE, IDLE], 0.0)
    assert decide(KV_POLICY, [IDLE, IDLE], 10.0, state)[0] == 1


def test_prefill_dead_band_and_starting_replicas() -> None:
    cfg = PrefillScalingConfig(target_waiting_tokens=1000, tolerance=0.1, downscale_delay_s=0)
    assert desired_prefill_replicas(2, [1050, 1000], cfg, {}, 0.0) == 2  # inside the band
    assert desired_prefill_replicas(2, [2000, 1500], cfg, {}, 0.0) == 4  # ceil(3500 / 1000)
    assert desired_prefill_replicas(3, [0, 0], cfg, {}, 0.0) == 3  # one still starting: never down
    assert desired_prefill_replicas(3, [], cfg, {}, 0.0) == 3

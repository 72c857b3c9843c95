"""Replica autoscaling on KV-cache demand (and waiting queue), as a Ray Serve 2.60 policy.

Demand is what a replica's KV cache is committed to: blocks held, the waiting prompts' blocks and the likely
growth of what runs and waits (EngineStats.kv_demand). Admission charges that growth (cluster.admission_controller) and
fills a replica only to its high watermark of demand, so the blocks in use alone stay well below it (~0.5 of the
cache on tests/e2e/test_cluster_e2e.py's load, where demand reads ~0.8) and would never call for a new replica.

desired = ceil(n * mean_demand / target) outside a dead band of +-tolerance around the target,
raised to ceil(n * mean_waiting / target_waiting_per_replica) when queues are long; a direction
must persist for its delay before it is taken; min/max bound the result. n = replicas that
reported metrics; while replicas are still starting (n < current) it never scales down.

Replica side: `record_autoscaling_stats` returns at least `autoscaling_metrics(engine.stats())`.
Deployment side (AppArgs.kv_autoscaling builds it): `autoscaling_config.policy =
{policy_function: "conveyor.cluster.autoscaling:KVCacheAutoscalingPolicy", policy_kwargs: {...}}`, where
policy_kwargs are `KVScalingConfig` fields except min/max (those come from the autoscaling_config).
Ray 2.60 wraps the policy in its own upscale/downscale delays (defaults 30 s / 600 s): set them to 0.
Replicas push these metrics every `autoscaling_config.metrics_interval_s` (default 10 s; the
RAY_SERVE_*_AUTOSCALING_METRIC_PUSH_INTERVAL_S variables are defined but not read in 2.60). The
policy runs in the Serve controller, which receives this module by value: it imports no torch.
"""

import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from conveyor.cluster.rules import check_rules

if TYPE_CHECKING:
    from conveyor.engine.stats import EngineStats

DEMAND_METRIC = "kv_demand"
WAITING_METRIC = "num_waiting"
WAITING_TOKENS_METRIC = "num_waiting_tokens"


def band_and_delay_rules(cfg: "KVScalingConfig | PrefillScalingConfig") -> dict[str, tuple[bool, str]]:
    """The rules both policies' configs share: dead band, delays, bounds."""
    return {
        "tolerance": (0.0 <= cfg.tolerance < 1.0, "must be in [0, 1)"),
        "upscale_delay_s": (cfg.upscale_delay_s >= 0, "must be >= 0"),
        "downscale_delay_s": (cfg.downscale_delay_s >= 0, "must be >= 0"),
        "min_replicas": (0 <= cfg.min_replicas <= cfg.max_replicas, "need 0 <= min_replicas <= max_replicas"),
    }


@dataclass(frozen=True)
class KVScalingConfig:
    target_kv_utilization: float = 0.7
    tolerance: float = 0.1
    target_waiting_per_replica: float = 4.0
    upscale_delay_s: float = 0.0
    downscale_delay_s: float = 30.0
    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        rules = {
            "target_kv_utilization": (0.0 < self.target_kv_utilization <= 1.0, "must be in (0, 1]"),
            "target_waiting_per_replica": (self.target_waiting_per_replica > 0, "must be > 0"),
        }
        check_rules({**rules, **band_and_delay_rules(self)})


@dataclass(frozen=True)
class PrefillScalingConfig:
    """desired = ceil(n * mean_waiting_tokens / target_waiting_tokens) outside a dead band of +-tolerance around
    the target; delays and bounds as KVScalingConfig's."""

    target_waiting_tokens: float = 1024.0  # prompt tokens queued per prefill replica the deployment is sized for
    tolerance: float = 0.1
    upscale_delay_s: float = 0.0
    downscale_delay_s: float = 30.0
    min_replicas: int = 1
    max_replicas: int = 8

    def __post_init__(self) -> None:
        check_rules(
            {"target_waiting_tokens": (self.target_waiting_tokens > 0, "must be > 0"), **band_and_delay_rules(self)}
        )


def autoscaling_metrics(stats: "EngineStats") -> dict[str, float]:
    """What a replica's `record_autoscaling_stats` returns."""
    return {
        DEMAND_METRIC: float(stats.kv_demand),
        WAITING_METRIC: float(stats.num_waiting),
        WAITING_TOKENS_METRIC: float(stats.num_waiting_tokens),
    }


def _after_delay(state: dict[str, Any], key: str, other: str, delay_s: float, now: float) -> bool:
    state.pop(other, None)
    since = state.setdefault(key, now)
    if now - since + 1e-9 >= delay_s:
        state.pop(key)
        return True
    return False


def desired_replicas(
    current: int,
    utilizations: Sequence[float],
    waiting: Sequence[float],
    cfg: KVScalingConfig,
    state: dict[str, Any],
    now: float,
) -> int:
    """`current` is the deployment's current target; one utilisation/waiting value per reporting
    replica. `state` is mutated (keeps when a scale direction was first wanted)."""
    n = len(utilizations)
    want = current
    if n:
        mean_util = sum(utilizations) / n
        mean_wait = sum(waiting) / len(waiting) if waiting else 0.0
        target = cfg.target_kv_utilization
        if mean_util > target * (1 + cfg.tolerance) or mean_wait > cfg.target_waiting_per_replica:
            want = max(
                current,
                math.ceil(n * mean_util / target - 1e-9),
                math.ceil(n * mean_wait / cfg.target_waiting_per_replica - 1e-9),
            )
        elif mean_util < target * (1 - cfg.tolerance) and n >= current:
            want = math.ceil(n * mean_util / target - 1e-9)
    return settle(want, current, cfg, state, now)


def settle(
    want: int, current: int, cfg: "KVScalingConfig | PrefillScalingConfig", state: dict[str, Any], now: float
) -> int:
    """`want` within the bounds, taken once its direction has persisted for its delay."""
    want = max(cfg.min_replicas, min(cfg.max_replicas, want))
    if want > current:
        return want if _after_delay(state, "kv_up_since", "kv_down_since", cfg.upscale_delay_s, now) else current
    if want < current:
        return want if _after_delay(state, "kv_down_since", "kv_up_since", cfg.downscale_delay_s, now) else current
    state.pop("kv_up_since", None)
    state.pop("kv_down_since", None)
    return current


def desired_prefill_replicas(
    current: int, waiting_tokens: Sequence[float], cfg: PrefillScalingConfig, state: dict[str, Any], now: float
) -> int:
    """As desired_replicas, on one queued-prompt-tokens value per reporting prefill replica."""
    n, want = len(waiting_tokens), current
    if n:
        mean, target = sum(waiting_tokens) / n, cfg.target_waiting_tokens
        if mean > target * (1 + cfg.tolerance):
            want = max(current, math.ceil(n * mean / target - 1e-9))
        elif mean < target * (1 - cfg.tolerance) and n >= current:
            want = math.ceil(n * mean / target - 1e-9)
    return settle(want, current, cfg, state, now)


class KVCacheAutoscalingPolicy:
    """Class-callable `AutoscalingPolicy.policy_function`; Ray 2.60 builds it once with policy_kwargs."""

    config_class: type = KVScalingConfig

    def __init__(self, **kwargs: Any):
        self.config = self.config_class(**kwargs)

    def desired(self, current: int, reported: Callable[[str], list[float]], cfg: Any, state: dict, now: float) -> int:
        """reported(metric): one value per running replica that reported it."""
        return desired_replicas(current, reported(DEMAND_METRIC), reported(WAITING_METRIC), cfg, state, now)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        cfg = replace(
            self.config,
            min_replicas=ctx.capacity_adjusted_min_replicas,
            max_replicas=ctx.capacity_adjusted_max_replicas,
        )
        state = dict(ctx.policy_state or {})
        now = ctx.current_time if ctx.current_time is not None else time.time()
        metrics, running = ctx.aggregated_metrics or {}, list(ctx.running_replicas)

        def reported(name: str) -> list[float]:
            values = metrics.get(name, {})
            return [float(values[r]) for r in running if r in values]

        return self.desired(ctx.target_num_replicas, reported, cfg, state, now), state


class PrefillAutoscalingPolicy(KVCacheAutoscalingPolicy):
    """A disaggregated app's prefill replicas: on the prompt tokens queued at them (PrefillScalingConfig)."""

    config_class = PrefillScalingConfig

    def desired(self, current: int, reported: Callable[[str], list[float]], cfg: Any, state: dict, now: float) -> int:
        return desired_prefill_replicas(current, reported(WAITING_TOKENS_METRIC), cfg, state, now)

"""An AutoscalingContext as Serve's controller hands one to a deployment's policy, for the policy tests."""

from typing import Any

from ray.serve.config import AutoscalingConfig, AutoscalingContext


def autoscaling_context(
    name: str,
    metrics: dict[str, dict[str, float]],
    replicas: list[str],
    config: AutoscalingConfig,
    t: float,
    state: dict[str, Any],
    min_replicas: int,
    max_replicas: int,
) -> AutoscalingContext:
    """`metrics`: each metric's value by replica id, as Serve aggregates them over `replicas`."""
    return AutoscalingContext(
        deployment_id=None,
        deployment_name=name,
        app_name="conveyor",
        current_num_replicas=len(replicas),
        target_num_replicas=len(replicas),
        running_replicas=replicas,
        total_num_requests=1.0,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=min_replicas,
        capacity_adjusted_max_replicas=max_replicas,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=t,
        config=config,
    )

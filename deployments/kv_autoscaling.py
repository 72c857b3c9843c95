"""The `kv_autoscaling` app argument (and a disaggregated app's per-role `prefill_autoscaling` /
`decode_autoscaling`): Ray Serve's autoscaling_config around one of conveyor.cluster.autoscaling's policies."""

from pydantic import BaseModel, ConfigDict, Field
from ray.serve.config import AutoscalingConfig

KV_POLICY = "conveyor.cluster.autoscaling:KVCacheAutoscalingPolicy"
PREFILL_POLICY = "conveyor.cluster.autoscaling:PrefillAutoscalingPolicy"


class KVAutoscaling(BaseModel):
    """Replica autoscaling on KV-cache demand (EngineStats.kv_demand): Ray's autoscaling_config around
    conveyor.cluster.autoscaling:KVCacheAutoscalingPolicy, whose own delays replace Ray's (set to 0). As a
    disaggregated app's `prefill_autoscaling`, the policy is PrefillAutoscalingPolicy (queued prompt tokens)."""

    model_config = ConfigDict(extra="forbid")
    min_replicas: int = Field(1, ge=1)
    max_replicas: int = Field(2, ge=1)
    initial_replicas: int | None = Field(None, ge=1)
    look_back_period_s: float = Field(10.0, gt=0)
    metrics_interval_s: float = Field(1.0, gt=0)
    policy: dict[str, float] = {}  # the policy's config: KVScalingConfig's fields (PrefillScalingConfig's for prefill)

    def config(self, policy_function: str = KV_POLICY) -> AutoscalingConfig:
        policy = {"policy_function": policy_function, "policy_kwargs": self.policy}
        return AutoscalingConfig(
            **self.model_dump(exclude={"policy"}), upscale_delay_s=0, downscale_delay_s=0, policy=policy
        )

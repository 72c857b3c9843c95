"""AdmissionConfig: the admission controller's settings (cluster/admission_controller.py), validated."""

from dataclasses import dataclass

from conveyor.cluster.rules import check_rules
from conveyor.cluster.watermarks import HIGH_WATERMARK, LOW_WATERMARK, Watermarks
from conveyor.engine.stats import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class AdmissionConfig:
    high_watermark: float = HIGH_WATERMARK
    low_watermark: float = LOW_WATERMARK
    staleness_s: float = 0.5
    drop_after_s: float = 10.0
    retry_after_s: float = 1.0
    settle_s: float = 0.3  # replicas that do not report num_added: settle by time
    settle_max_s: float = 2.0  # replicas that do: settle on arrival, or after this if the request never arrives
    arrival_credit_s: float = 0.5  # an arrival counted before its reservation reached the actor settles it later
    queue_timeout_s: float = 0.0
    max_queued: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    saturate_on_preemption: bool = True
    max_queue_time_s: float = 0.0  # the longest wait to start a request may be predicted (x queue_time_safety); 0: none
    queue_time_safety: float = 2.0  # benchmarks/cluster.py measured waits of ~2x the raw estimate
    rate_window_s: float = 4.0
    affinity_weight: float = 1.0
    lora_affinity: bool = True  # replicas holding the request's LoRA adapter rank first (False: adapter-blind)
    headroom_weight: float = 0.5
    queue_weight: float = 0.5
    placement: bool = True  # rank by expected TTFT (cluster.placement) once prefill rates are measured
    hot_window_s: float = 10.0
    hot_fraction: float = 0.6  # the rest holds running requests' own blocks and the LRU's one-off tails
    lease_s: float = 1.0
    # idle, unchanged replicas push and idle routers sync only every staleness_s/4, /3: less idle CPU, staler views
    # when load returns (docs/decisions/07-quiet-when-idle-off.md)
    quiet_when_idle: bool = False

    def __post_init__(self) -> None:
        rules = {
            "low_watermark": (0.0 < self.low_watermark <= self.high_watermark, "need 0 < low <= high_watermark"),
            "staleness_s": (0.0 < self.staleness_s <= self.drop_after_s, "need 0 < staleness_s <= drop_after_s"),
            "settle_s": (self.settle_s >= 0.0, "must be >= 0"),
            "retry_after_s": (self.retry_after_s >= 0.0, "must be >= 0"),
            "block_size": (self.block_size >= 1, "must be >= 1"),
            "settle_max_s": (self.settle_max_s >= 0.0, "must be >= 0"),
            "arrival_credit_s": (self.arrival_credit_s >= 0.0, "must be >= 0"),
            "queue_timeout_s": (self.queue_timeout_s >= 0.0, "must be >= 0"),
            "max_queued": (self.max_queued >= 0, "must be >= 0"),
            "max_queue_time_s": (self.max_queue_time_s >= 0.0, "must be >= 0"),
            "rate_window_s": (self.rate_window_s > 0.0, "must be > 0"),
            "queue_time_safety": (self.queue_time_safety >= 1.0, "must be >= 1"),
            "hot_window_s": (self.hot_window_s > 0.0, "must be > 0"),
            "hot_fraction": (0.0 < self.hot_fraction <= 1.0, "must be in (0, 1]"),
            "lease_s": (self.lease_s > 0.0, "must be > 0"),
        }
        check_rules(rules)

    @property
    def watermarks(self) -> Watermarks:
        return Watermarks(self.high_watermark, self.low_watermark)

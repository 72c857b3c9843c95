from dataclasses import asdict, dataclass, field
import time

ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class EngineStats:
    """A snapshot of one engine's load, cheap to copy across process boundaries."""

    num_running: int = 0
    num_waiting: int = 0
    num_waiting_tokens: int = 0
    num_swapped: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_steps: int = 0
    iteration_tokens_sum: int = 0
    iteration_tokens_counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    timestamp: float = field(default_factory=time.time)

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def kv_cache_utilization(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["kv_blocks_used"] = self.kv_blocks_used
        d["kv_cache_utilization"] = self.kv_cache_utilization
        return d

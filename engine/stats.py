import time
from dataclasses import asdict, dataclass, field

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block unless EngineConfig.block_size says otherwise


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers."""
    return -(-a // b)


ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class KVUsage:
    """Derived load of anything with kv_blocks_total / kv_blocks_free (EngineStats, cluster's ReplicaStats)."""

    kv_blocks_total: int
    kv_blocks_free: int

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def kv_cache_utilization(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def to_dict(self) -> dict:
        return {
            **asdict(self),
            "kv_blocks_used": self.kv_blocks_used,
            "kv_cache_utilization": self.kv_cache_utilization,
        }


@dataclass
class EngineStats(KVUsage):
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
    num_added: int = 0  # cumulative requests (sequences) the engine took in: admission settles reservations on it
    max_num_seqs: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE  # tokens per KV block: every block count here is in these
    busy_time_s: float = 0.0  # cumulative wall time inside step(): rates below are per busy second
    num_prefill_tokens: int = 0  # cumulative tokens computed that sampled nothing (prompt, recompute)
    num_decode_tokens: int = 0  # cumulative tokens sampled
    num_steps: int = 0
    tokens_left: list[int] = field(default_factory=list)  # running requests' likely tokens left, ascending, <= 64
    num_growth_blocks: int = 0  # blocks running and waiting requests still take at their likely output lengths
    likely_output_tokens: int = 0  # a new request's likely output length (0: not known)
    kv_blocks_demand: int = 0  # blocks held, the waiting prompts' and num_growth_blocks: what the replica committed to
    iteration_tokens_sum: int = 0
    iteration_tokens_counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    timestamp: float = field(default_factory=time.time)

    @property
    def kv_demand(self) -> float:
        """KV blocks committed / the cache (may pass 1): with admission charging outputs, replicas are held near the
        high watermark of demand while their used blocks stay lower, so autoscaling reads this."""
        return self.kv_blocks_demand / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def to_dict(self) -> dict:
        return {**super().to_dict(), "kv_demand": self.kv_demand}

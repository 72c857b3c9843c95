import math
import time
from dataclasses import asdict, dataclass, field

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block unless EngineConfig.block_size says otherwise


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers."""
    return -(-a // b)


ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, kw_only=True)
class EngineStats:
    """A snapshot of one engine's load, cheap to copy across process boundaries. The cluster layer reads it as
    cluster.stats.ReplicaStats; the KV quantities its watermarks, admission and autoscaling compare are defined
    here, once."""

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
    lora_adapters: list[str] = field(default_factory=list)  # LoRA adapters resident in the model's slots, by name
    num_lora_loads: int = 0  # cumulative adapter loads into a slot
    iteration_tokens_sum: int = 0
    # speculative decoding (vLLM's names): speculating request-steps, their draft tokens, the accepted ones
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    iteration_tokens_counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    # the lower KV tiers (engine/core/kv_tiers.py), by tier name: blocks loaded back (hits), written, held now
    kv_tier_hits: dict[str, int] = field(default_factory=dict)
    kv_tier_stored: dict[str, int] = field(default_factory=dict)
    kv_tier_blocks: dict[str, int] = field(default_factory=dict)
    kv_tier_block_bytes: int = 0
    kv_tier_load_s: float = 0.0  # cumulative time of the steps' copies before their forwards (loads)
    kv_tier_loads: int = 0  # cumulative blocks loaded
    kv_tier_load_cost: float = 0.0  # a block's load time over its prefill time (0: no tier)
    timestamp: float = field(default_factory=time.time)

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free

    @property
    def kv_cache_utilization(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def growth_blocks(self) -> int:
        """num_growth_blocks (estimated where a replica does not report it: cluster.stats.ReplicaStats)."""
        return self.num_growth_blocks

    def waiting_blocks(self, miss_ratio: float = 1.0) -> int:
        """Blocks the waiting prompts will take: their tokens (the engine counts their cached part too) times
        `miss_ratio`, the share of them expected to miss the prefix cache."""
        return cdiv(math.ceil(self.num_waiting_tokens * miss_ratio), self.block_size)

    def kv_pressure(self, miss_ratio: float = 1.0) -> float:
        """Blocks in use plus the waiting prompts', over the cache (may pass 1; 1 with no cache known): what the
        KV watermarks compare (cluster.watermarks)."""
        if not self.kv_blocks_total:
            return 1.0
        return (self.kv_blocks_used + self.waiting_blocks(miss_ratio)) / self.kv_blocks_total

    def demand_blocks(self, miss_ratio: float = 1.0) -> int:
        """KV demand in blocks: those held, the waiting prompts' and the likely growth of what runs and waits;
        what the replica is committed to, and what admission commits up to its high watermark."""
        return self.kv_blocks_used + self.waiting_blocks(miss_ratio) + self.growth_blocks

    @property
    def kv_demand(self) -> float:
        """demand_blocks() over the cache (may pass 1): with admission charging outputs, replicas are held near the
        high watermark of demand while their used blocks stay lower, so autoscaling reads this."""
        return self.demand_blocks() / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens per speculating request-step: 1 + accepted / drafts (0 with no drafts)."""
        d = self.spec_decode_num_drafts
        return 1 + self.spec_decode_num_accepted_tokens / d if d else 0.0

    def to_dict(self) -> dict:
        """The wire format: the fields, plus the derived load for readers of the dict."""
        return {
            **asdict(self),
            "kv_blocks_used": self.kv_blocks_used,
            "kv_cache_utilization": self.kv_cache_utilization,
            "kv_demand": self.kv_demand,
        }

"""Replica stats and KV events as replicas push them, for the cluster tests: `rs` a ReplicaStats, `stats` its
dict (the push's body), `events` a KVEvents dict."""

from conveyor.cluster.stats import ReplicaStats


def rs(
    rid: str,
    used: int = 0,
    total: int = 100,
    waiting: int = 0,
    waiting_tokens: int = 0,
    running: int = 0,
    preemptions: int = 0,
    ts: float = 0.0,
) -> ReplicaStats:
    return ReplicaStats(
        rid,
        num_running=running,
        num_waiting=waiting,
        num_waiting_tokens=waiting_tokens,
        kv_blocks_total=total,
        kv_blocks_free=total - used,
        num_preemptions=preemptions,
        timestamp=ts,
    )


def stats(
    rid: str,
    free: int = 100,
    total: int = 100,
    running: int = 0,
    waiting: int = 0,
    waiting_tokens: int = 0,
    busy: float = 0.0,
    prefill: int = 0,
    decode: int = 0,
    finished: int = 0,
    seqs: int = 8,
    queries: int = 0,
    hits: int = 0,
    ts: float = 0.0,
) -> dict:
    return ReplicaStats(
        rid,
        num_running=running,
        num_waiting=waiting,
        num_waiting_tokens=waiting_tokens,
        kv_blocks_total=total,
        kv_blocks_free=free,
        num_finished=finished,
        max_num_seqs=seqs,
        busy_time_s=busy,
        num_prefill_tokens=prefill,
        num_decode_tokens=decode,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        timestamp=ts,
    ).to_dict()


def events(stored=(), evicted=(), offloaded=(), reset=False) -> dict:
    return {"stored": list(stored), "evicted": list(evicted), "offloaded": list(offloaded), "reset": reset}

"""Router-side memory of which prompt blocks (chain hashes) were sent to which replica, LRU-bounded per
replica by the replica's KV-cache size when known: blocks a replica must have evicted stop attracting."""

from collections import OrderedDict
from typing import Iterable, Sequence


class PrefixIndex:
    def __init__(self, max_blocks_per_replica: int = 65536):
        self.max_blocks_per_replica = max_blocks_per_replica
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, replica_id: str, hashes: Sequence[bytes], capacity: int | None = None) -> None:
        lru = self._blocks.setdefault(replica_id, OrderedDict())
        for h in reversed(hashes):  # leading blocks end up most recent: deep blocks are evicted first
            lru[h] = None
            lru.move_to_end(h)
        limit = min(self.max_blocks_per_replica, capacity or self.max_blocks_per_replica)
        while len(lru) > limit:
            lru.popitem(last=False)

    def match(self, replica_id: str, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks of `hashes` this replica was sent."""
        lru = self._blocks.get(replica_id)
        if not lru:
            return 0
        n = 0
        for h in hashes:
            if h not in lru:
                break
            n += 1
        return n

    def drop(self, replica_id: str) -> None:
        self._blocks.pop(replica_id, None)

    def retain(self, replica_ids: Iterable[str]) -> None:
        keep = set(replica_ids)
        for rid in [r for r in self._blocks if r not in keep]:
            del self._blocks[rid]

    def size(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))

    def replicas(self) -> list[str]:
        return list(self._blocks)

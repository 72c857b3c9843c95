"""Router-side memory of which prompt blocks (chain hashes) were sent to which replica, LRU-bounded."""
from collections import OrderedDict
from typing import Iterable, Sequence


class PrefixIndex:
    def __init__(self, max_blocks_per_replica: int = 65536):
        self.max_blocks_per_replica = max_blocks_per_replica
        self._blocks: dict[str, OrderedDict[bytes, None]] = {}

    def record(self, replica_id: str, hashes: Sequence[bytes]) -> None:
        lru = self._blocks.setdefault(replica_id, OrderedDict())
        for h in reversed(hashes):  # leading blocks end up most recent: deep blocks are evicted first
            lru[h] = None
            lru.move_to_end(h)
        while len(lru) > self.max_blocks_per_replica:
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

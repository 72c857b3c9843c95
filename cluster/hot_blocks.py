"""Per replica, the prompt block keys sent there at least twice within `window_s`: the blocks its cache
should keep. A key sent once is one prompt's own tail (or a prefix nobody reused yet) and does not count."""
from collections import OrderedDict
from typing import Iterable, Sequence


class HotBlocks:
    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.seen: dict[str, OrderedDict[bytes, tuple[float, int]]] = {}  # key -> (last sent, times), oldest first
        self.hot: dict[str, int] = {}

    def record(self, replica_id: str, keys: Sequence[bytes], now: float) -> None:
        seen = self.seen.setdefault(replica_id, OrderedDict())
        for k in keys:
            times = seen.pop(k, (0.0, 0))[1] + 1
            seen[k] = (now, times)
            if times == 2:
                self.hot[replica_id] = self.hot.get(replica_id, 0) + 1
        self.prune(replica_id, now)

    def prune(self, replica_id: str, now: float) -> None:
        seen = self.seen.get(replica_id)
        while seen and now - next(iter(seen.values()))[0] > self.window_s:
            _, (_, times) = seen.popitem(last=False)
            if times >= 2:
                self.hot[replica_id] -= 1

    def count(self, replica_id: str, now: float, exclude: Iterable[bytes] = ()) -> int:
        """Hot blocks on the replica, less those among `exclude` (the prompt being placed)."""
        self.prune(replica_id, now)
        seen = self.seen.get(replica_id, {})
        return self.hot.get(replica_id, 0) - sum(1 for k in set(exclude) if seen.get(k, (0.0, 0))[1] >= 2)

    def forget(self, replica_id: str) -> None:
        self.seen.pop(replica_id, None)
        self.hot.pop(replica_id, None)

    def retain(self, replica_ids: Iterable[str]) -> None:
        keep = set(replica_ids)
        for rid in [r for r in self.seen if r not in keep]:
            self.forget(rid)

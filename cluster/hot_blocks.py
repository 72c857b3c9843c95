"""Per replica, the prompt blocks its cache should keep: block keys sent there at least twice within
`window_s`, and for a prompt whose first block was sent there once (a prefix nobody reused yet, or a
one-off prompt) all its blocks. The rest of a once-sent prompt is its own tail and does not count."""

from collections import OrderedDict
from typing import Iterable, Sequence


class HotBlocks:
    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self.seen: dict[str, OrderedDict[bytes, tuple[float, int]]] = {}  # key -> (last sent, times), oldest first
        self.roots: dict[str, dict[bytes, int]] = {}  # first keys sent once -> that prompt's blocks
        self.total: dict[str, int] = {}

    def _add(self, replica_id: str, n: int) -> None:
        self.total[replica_id] = self.total.get(replica_id, 0) + n

    def record(self, replica_id: str, keys: Sequence[bytes], now: float) -> None:
        seen = self.seen.setdefault(replica_id, OrderedDict())
        roots = self.roots.setdefault(replica_id, {})
        for i, k in enumerate(keys):
            times = seen.pop(k, (0.0, 0))[1] + 1
            seen[k] = (now, times)
            if times == 2:
                self._add(replica_id, 1 - roots.pop(k, 0))
            elif times == 1 and i == 0:
                roots[k] = len(keys)
                self._add(replica_id, len(keys))
        self.prune(replica_id, now)

    def prune(self, replica_id: str, now: float) -> None:
        seen, roots = self.seen.get(replica_id), self.roots.get(replica_id, {})
        while seen and now - next(iter(seen.values()))[0] > self.window_s:
            k, (_, times) = seen.popitem(last=False)
            self._add(replica_id, -(1 if times >= 2 else roots.pop(k, 0)))

    def count(self, replica_id: str, now: float, exclude: Sequence[bytes] = ()) -> int:
        """Hot blocks on the replica, less those of `exclude` (the prompt being placed)."""
        self.prune(replica_id, now)
        seen, roots = self.seen.get(replica_id, {}), self.roots.get(replica_id, {})
        own = sum(1 for k in set(exclude) if seen.get(k, (0.0, 0))[1] >= 2)
        return self.total.get(replica_id, 0) - own - (roots.get(exclude[0], 0) if exclude else 0)

    def forget(self, replica_id: str) -> None:
        for d in (self.seen, self.roots, self.total):
            d.pop(replica_id, None)

    def retain(self, replica_ids: Iterable[str]) -> None:
        keep = set(replica_ids)
        for rid in [r for r in self.seen if r not in keep]:
            self.forget(rid)

"""The cluster's index of what each replica's KV cache really holds, fed by the replicas' KV events: the keys
in its device pool (`keys`) and those only in a lower tier of its prefix cache (`lower`: host, disk), which
a request finds at the cost of a load instead of a prefill.

A replica counts as reported once a reset (full listing) of its keys arrived; from then on its set follows
its stored/evicted events, at most one stats push behind. Events from a replica that has not reported are
not applied: `apply` answers that it must send a reset (the replica then lists its keys on its next push).
Other processes (routers) follow the index through `changes(since)`: the pushes applied after version
`since` while the bounded log still holds them, else a full copy; `load` applies either.
"""

from collections import deque
from typing import Any, Iterable, Sequence


class KVIndex:
    def __init__(self, log_size: int = 4096) -> None:
        self.keys: dict[str, set[bytes]] = {}
        self.lower: dict[str, set[bytes]] = {}
        self.version = 0
        self.log: deque[tuple[int, str, list[bytes] | None, list[bytes], list[bytes], bool]] = deque(maxlen=log_size)

    def apply(
        self,
        replica_id: str,
        stored: Sequence[bytes],
        evicted: Sequence[bytes],
        reset: bool,
        offloaded: Sequence[bytes] = (),
    ) -> bool:
        """Applies one push's events; True when the replica must send a reset first."""
        if not reset and replica_id not in self.keys:
            return True
        if not reset and not stored and not evicted and not offloaded:
            return False
        self._apply(replica_id, list(stored), list(evicted), list(offloaded), reset)
        self.version += 1
        self.log.append((self.version, replica_id, list(stored), list(evicted), list(offloaded), reset))
        return False

    def _apply(
        self, replica_id: str, stored: list[bytes], evicted: list[bytes], offloaded: list[bytes], reset: bool
    ) -> None:
        if reset or replica_id not in self.keys:
            self.keys[replica_id], self.lower[replica_id] = set(stored), set(offloaded)
            return
        keys, lower = self.keys[replica_id], self.lower[replica_id]
        keys.difference_update(evicted)
        keys.difference_update(offloaded)
        keys.update(stored)
        lower.difference_update(evicted)
        lower.difference_update(stored)
        lower.update(offloaded)

    def forget(self, replica_id: str) -> None:
        self.lower.pop(replica_id, None)
        if self.keys.pop(replica_id, None) is not None:
            self.version += 1
            self.log.append((self.version, replica_id, None, [], [], True))

    def retain(self, replica_ids: Iterable[str]) -> None:
        keep = set(replica_ids)
        for rid in [r for r in self.keys if r not in keep]:
            self.forget(rid)

    def reported(self, replica_id: str) -> bool:
        return replica_id in self.keys

    def match(self, replica_id: str, hashes: Sequence[bytes], extra: set[bytes] | None = None) -> int | None:
        """Leading blocks of `hashes` the replica holds (or in `extra`: blocks on their way there); None when
        the replica has not reported."""
        keys = self.keys.get(replica_id)
        if keys is None:
            return None
        n = 0
        for h in hashes:
            if h not in keys and (extra is None or h not in extra):
                break
            n += 1
        return n

    def match_lower(self, replica_id: str, hashes: Sequence[bytes], start: int) -> int:
        """Blocks of `hashes` from `start` on (after those `match` found) the replica holds in a lower tier."""
        lower = self.lower.get(replica_id, ())
        n = 0
        for h in hashes[start:]:
            if h not in lower:
                break
            n += 1
        return n

    def changes(self, since: int | None) -> dict[str, Any]:
        if (
            since is not None
            and since <= self.version
            and (since == self.version or (self.log and self.log[0][0] <= since + 1))
        ):
            return {"version": self.version, "events": [e for e in self.log if e[0] > since]}
        return {
            "version": self.version,
            "full": {rid: list(keys) for rid, keys in self.keys.items()},
            "lower": {rid: list(keys) for rid, keys in self.lower.items()},
        }

    def load(self, changes: dict[str, Any]) -> None:
        if "full" in changes:
            self.keys = {rid: set(keys) for rid, keys in changes["full"].items()}
            self.lower = {rid: set(changes.get("lower", {}).get(rid, ())) for rid in self.keys}
        else:
            for _, rid, stored, evicted, offloaded, reset in changes["events"]:
                if stored is None:
                    self.keys.pop(rid, None)
                    self.lower.pop(rid, None)
                else:
                    self._apply(rid, stored, evicted, offloaded, reset)
        self.version = changes["version"]

    def size(self, replica_id: str) -> int:
        return len(self.keys.get(replica_id, ()))

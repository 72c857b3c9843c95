"""What a KV cache stored and evicted, by prefix-cache key, for a cluster-side index of its real contents.

The block pool records each key it publishes (stored) and each cached key it drops (evicted); a reader
drains the net change since its last drain. Only a key's latest event is kept, so the log holds at most one
entry per key and stays bounded by the keys touched between drains (and by `max_entries`, past which it
restarts as a reset). A reset drain lists every cached key: the reader replaces what it had."""

import threading
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class KVEvents:
    stored: list[bytes] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)
    reset: bool = False

    def __len__(self) -> int:
        return len(self.stored) + len(self.evicted)

    def to_dict(self) -> dict[str, Any]:
        return {"stored": self.stored, "evicted": self.evicted, "reset": self.reset}


class KVEventLog:
    """Written by the engine thread, drained by another (the replica's stats pusher): one lock."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self.max_entries = max_entries
        self._latest: dict[bytes, bool] = {}
        self._reset = True  # the first drain is a full listing: a reader never sees a partial start
        self._lock = threading.Lock()

    def add(self, key: bytes, stored: bool) -> None:
        with self._lock:
            if self._reset:
                return
            self._latest.pop(key, None)
            self._latest[key] = stored
            if len(self._latest) > self.max_entries:
                self._latest.clear()
                self._reset = True

    def request_reset(self) -> None:
        with self._lock:
            self._latest.clear()
            self._reset = True

    def drain(self, cached_keys: Callable[[], list[bytes]], max_events: int | None = None) -> KVEvents:
        """The oldest `max_events` net changes (the rest stay for the next drain), or after a reset every key
        `cached_keys()` lists. A key stored between the listing and its own event comes again: harmless."""
        with self._lock:
            if self._reset:
                self._reset = False
                self._latest.clear()
                return KVEvents(stored=list(cached_keys()), reset=True)
            n = len(self._latest) if max_events is None else min(max_events, len(self._latest))
            out = KVEvents()
            for key in list(self._latest)[:n]:
                (out.stored if self._latest.pop(key) else out.evicted).append(key)
            return out

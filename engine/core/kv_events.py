"""Where a replica's KV cache holds each prefix-cache key, for a cluster-side index of its real contents.

A key is in the device pool (`stored`), only in a lower tier of the prefix cache (`offloaded`: host or disk,
engine/core/kv_tiers.py), or nowhere (`evicted`). The cache marks each key whose place changed; a reader
drains the marked keys with their places at the drain, so the log holds a key at most once and stays
bounded by the keys touched between drains (and by `max_entries`, past which it restarts as a reset). A
reset drain lists every key held anywhere: the reader replaces what it had."""

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

Place = Literal["pool", "lower", "none"]


@dataclass
class KVEvents:
    stored: list[bytes] = field(default_factory=list)
    evicted: list[bytes] = field(default_factory=list)
    offloaded: list[bytes] = field(default_factory=list)
    reset: bool = False

    def __len__(self) -> int:
        return len(self.stored) + len(self.evicted) + len(self.offloaded)

    def add(self, key: bytes, place: Place) -> None:
        (self.stored if place == "pool" else self.offloaded if place == "lower" else self.evicted).append(key)

    def to_dict(self) -> dict[str, Any]:
        return {"stored": self.stored, "evicted": self.evicted, "offloaded": self.offloaded, "reset": self.reset}


class KVEventLog:
    """Marked by the engine thread, drained by another (the replica's stats pusher): one lock. `place(key)`
    says where a key is now; `held()` lists every key held anywhere (for a reset)."""

    def __init__(
        self, place: Callable[[bytes], Place], held: Callable[[], Iterable[bytes]], max_entries: int = 1 << 16
    ) -> None:
        self.place, self.held, self.max_entries = place, held, max_entries
        self._touched: dict[bytes, None] = {}
        self._reset = True  # the first drain is a full listing: a reader never sees a partial start
        self._lock = threading.Lock()

    def add(self, key: bytes) -> None:
        with self._lock:
            if self._reset:
                return
            self._touched.pop(key, None)
            self._touched[key] = None
            if len(self._touched) > self.max_entries:
                self._touched.clear()
                self._reset = True

    def request_reset(self) -> None:
        with self._lock:
            self._touched.clear()
            self._reset = True

    def drain(self, max_events: int | None = None) -> KVEvents:
        """The oldest `max_events` changed keys with their places now (the rest stay for the next drain), or
        after a reset every key held. A key changed between the listing and its own mark comes again: harmless."""
        with self._lock:
            if self._reset:
                self._reset = False
                self._touched.clear()
                out = KVEvents(reset=True)
                for key in dict.fromkeys(self.held()):
                    if (place := self.place(key)) != "none":
                        out.add(key, place)
                return out
            n = len(self._touched) if max_events is None else min(max_events, len(self._touched))
            out = KVEvents()
            for key in list(self._touched)[:n]:
                del self._touched[key]
                out.add(key, self.place(key))
            return out

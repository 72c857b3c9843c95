"""The admission actor and its router-side client.

`AdmissionActor` is a Serve deployment-scoped actor of the LLM replica deployment, so it lives and
dies with the app: replicas `report` their stats every <= 100 ms and `forget` themselves on shutdown;
silent replicas go stale (count as saturated), then are dropped. `AdmissionClient` keeps a router's
local `AdmissionController` restored from the actor's snapshots.
"""
import asyncio
from dataclasses import replace
import logging
import time
from typing import Any, Awaitable, Callable

from cluster.admission import AdmissionConfig, AdmissionController, Decision
from cluster.stats import ReplicaStats

log = logging.getLogger("ray.serve")


class AdmissionActor:
    """Ray actor body (`ray.remote(AdmissionActor)`, deployed as a Serve deployment-scoped actor)."""

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.controller = AdmissionController(AdmissionConfig(**(config or {})))
        self.metric_dumps: dict[str, list[dict[str, Any]]] = {}

    def report(self, stats: dict[str, Any]) -> None:
        if "metrics" in stats:
            self.metric_dumps[str(stats["replica_id"])] = stats.pop("metrics")
        now = self.clock()
        self.controller.update(ReplicaStats.from_dict(stats), now)
        self.controller.expire(now)

    def forget(self, replica_id: str) -> None:
        self.controller.forget(replica_id)
        if replica_id in self.metric_dumps:  # a departed source keeps its counters, so sums never go back
            self.metric_dumps[replica_id] = [f for f in self.metric_dumps[replica_id] if f["type"] != "gauge"]

    def report_metrics(self, source: str, dump: list[dict[str, Any]]) -> None:
        """Prometheus families (deployments.metrics dump format) of a router, rendered by every router."""
        self.metric_dumps[source] = dump

    def metrics(self) -> dict[str, list[dict[str, Any]]]:
        return self.metric_dumps

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        self.controller.expire(now)
        return self.controller.snapshot(now)

    def configure(self, config: dict[str, Any]) -> None:
        self.controller.config = replace(self.controller.config, **config)



class AdmissionClient:
    """Router side: a local controller restored from the actor's snapshot every `refresh_s` in the
    background. `decide` is local; when no replica reports (startup, a stalled refresh) it fetches a
    snapshot (at most one per `refresh_s`) before refusing; when replicas are full, up to
    `max_queued` requests wait (FIFO, re-deciding on each refresh) up to `queue_timeout_s` for room.
    `get_actor` resolves the actor handle (again after the actor was recreated)."""

    def __init__(self, get_actor: Callable[[], Awaitable[Any]], refresh_s: float = 0.05,
                 clock: Callable[[], float] = time.monotonic):
        self.controller = AdmissionController()
        self.snapshot: dict[str, Any] | None = None
        self.refresh_s, self._get_actor, self.clock = refresh_s, get_actor, clock
        self._actor: Any = None
        self._task: asyncio.Task | None = None
        self.fetched_at = float("-inf")
        self.queued = 0
        self._refreshed = asyncio.Event()

    async def refresh(self) -> dict[str, Any]:
        try:
            if self._actor is None:
                self._actor = await self._get_actor()
            snapshot = await asyncio.wait_for(self._actor.snapshot.remote(), timeout=2.0)
        except Exception:
            self._actor = None
            raise
        self.fetched_at = self.clock()
        self.controller.restore(snapshot, self.fetched_at)
        self.snapshot = snapshot
        event, self._refreshed = self._refreshed, asyncio.Event()
        event.set()
        return snapshot

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception as e:
                log.warning("admission snapshot refresh failed: %r", e)
                await asyncio.sleep(0.5)
            await asyncio.sleep(self.refresh_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def decide(self, num_prompt_blocks: int, largest_blocks: int | None = None) -> Decision:
        """Admit (reserving the prompt's blocks on the roomiest replica) or refuse."""
        now = self.clock()
        d = self.controller.decide(num_prompt_blocks, now, largest_blocks)
        if not d.admit and d.reason in ("no_replicas", "stale") and now - self.fetched_at > self.refresh_s:
            try:
                await self.refresh()
            except Exception:
                return d
            now = self.clock()
            d = self.controller.decide(num_prompt_blocks, now, largest_blocks)
        cfg = self.controller.config
        if not d.admit and d.reason in ("saturated", "no_room") and self.queued < cfg.max_queued:
            deadline, self.queued = now + cfg.queue_timeout_s, self.queued + 1
            try:
                while not d.admit and (left := deadline - self.clock()) > 0:
                    try:
                        await asyncio.wait_for(self._refreshed.wait(), left)
                    except asyncio.TimeoutError:
                        pass
                    now = self.clock()
                    d = self.controller.decide(num_prompt_blocks, now, largest_blocks)
            finally:
                self.queued -= 1
        if d.admit:
            self.controller.reserve(d.replicas[0], num_prompt_blocks, now)
        return d

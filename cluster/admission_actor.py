"""The admission actor and its router-side client.

`AdmissionActor` is a Serve deployment-scoped actor of the LLM replica deployment, so it lives and
dies with the app: replicas `report` their stats and KV events every <= 100 ms and `forget` themselves on
shutdown; silent replicas go stale (count as saturated), then are dropped. `AdmissionClient` keeps a
router's local `AdmissionController` in step with the actor: each refresh is one `sync` call that hands
over the router's new reservations and returns a snapshot with every router's reservations and the KV
index's changes since the router's last version, so several routers see each other's decisions within
one refresh.
"""

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, Awaitable, Callable, Collection, Sequence

from conveyor.cluster import admission_snapshot
from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.admission_controller import AdmissionController, Decision
from conveyor.cluster.leases import Leases
from conveyor.cluster.nodes import node_of_this_process
from conveyor.cluster.reservations import Reservation, ReservationReport
from conveyor.cluster.stats import ReplicaStats

log = logging.getLogger("ray.serve")
ROUTER_TTL_S = 5.0


class AdmissionActor:
    """Ray actor body (`ray.remote(AdmissionActor)`, deployed as a Serve deployment-scoped actor)."""

    def __init__(self, config: dict[str, Any] | None = None, clock: Callable[[], float] = time.time):
        self.clock = clock
        self.controller = AdmissionController(AdmissionConfig(**(config or {})))
        self.routers: dict[str, float] = {}
        self.leases = Leases(self.controller.config.lease_s)
        self.metric_dumps: dict[str, list[dict[str, Any]]] = {}
        self.node = node_of_this_process()
        self.nodes: dict[str, dict[str, str]] = {}  # replica id -> {"node_id", "node_ip"}, as the replica reported
        self.loras: dict[str, str] = {}  # LoRA adapters loaded at run time through any router: name -> path

    def report(self, stats: dict[str, Any]) -> dict[str, Any]:
        """A replica's push: its stats, under "kv_events" its KVEvents dict, under "metrics" its metric families.
        Under "node" its Ray node ({"node_id", "node_ip"}). The answer asks for a full listing of its KV keys when the index has none for it (first contact, or this
        actor restarted)."""
        if "metrics" in stats:
            self.metric_dumps[str(stats["replica_id"])] = stats.pop("metrics")
        if "node" in stats:
            self.nodes[str(stats["replica_id"])] = stats.pop("node")
        now = self.clock()
        reset = self.controller.update(ReplicaStats.from_dict(stats), now, stats.get("kv_events"))
        for rid in self.controller.expire(now):
            self.nodes.pop(rid, None)
        return {"kv_reset": reset}

    def sync(
        self,
        reservations: Sequence[ReservationReport] = (),
        kv_since: int | None = None,
        router_id: str | None = None,
        demand: int = 0,
        short: int = 0,
        withdrawn: Sequence[ReservationReport] = (),
    ) -> dict[str, Any]:
        """A router's refresh: takes its reservations since the last sync, returns `snapshot()` plus "kv": the KV index's changes since `kv_since` and the reserved keys,
        "routers": how many routers synced in the last `ROUTER_TTL_S`, and for a router that names itself,
        "lease": its new lease (cluster.leases; `demand`: the blocks it wanted since its last sync, `short`: what
        its request refused for want of lease needs); `withdrawn`: reservations it sent before whose requests will
        not go there after all."""
        now = self.clock()
        if router_id is not None:
            self.routers[router_id] = now
        self.routers = {r: t for r, t in self.routers.items() if now - t <= ROUTER_TTL_S}
        for r in reservations:
            self.controller.reserve(
                r.replica_id, r.blocks, now - max(0.0, r.age_s), r.requests, r.keys, r.prefill_blocks
            )
        for r in withdrawn:
            self.controller.book.withdraw(r, now)
        snap = self.snapshot()
        snap["kv"] = admission_snapshot.kv_snapshot(self.controller, kv_since)
        snap["routers"] = max(1, len(self.routers))
        if router_id is not None:
            self.leases.ttl_s = self.controller.config.lease_s
            headroom = {rid: self.controller.headroom(rid) for rid in self.controller.replicas}
            snap["lease"] = self.leases.grant(router_id, headroom, now, demand, len(self.routers), short)
        return snap

    def forget(self, replica_id: str) -> None:
        self.controller.forget(replica_id)
        self.nodes.pop(replica_id, None)
        if replica_id in self.metric_dumps:  # a departed source keeps its counters, so sums never go back
            self.metric_dumps[replica_id] = [f for f in self.metric_dumps[replica_id] if f["type"] != "gauge"]

    def register_lora(self, name: str, path: str) -> str | None:
        """Serve adapter `name` from `path` on every router (snapshots carry the registry); if the name is taken,
        the path it names, and nothing changes."""
        if name in self.loras:
            return self.loras[name]
        self.loras[name] = path
        return None

    def unregister_lora(self, name: str) -> bool:
        return self.loras.pop(name, None) is not None

    def report_metrics(self, source: str, dump: list[dict[str, Any]]) -> None:
        """Prometheus families (deployments.metrics dump format) of a router, rendered by every router."""
        self.metric_dumps[source] = dump

    def metrics(self) -> dict[str, list[dict[str, Any]]]:
        return self.metric_dumps

    def snapshot(self) -> dict[str, Any]:
        now = self.clock()
        for rid in self.controller.expire(now):
            self.nodes.pop(rid, None)
        snap = admission_snapshot.snapshot(self.controller, now)
        for row in snap["replicas"]:
            row.update(self.nodes.get(row["replica_id"], {}))
        snap["admission_node"] = self.node
        snap["loras"] = dict(self.loras)
        return snap

    def configure(self, config: dict[str, Any]) -> None:
        self.controller.config = replace(self.controller.config, **config)


class AdmissionClient:
    """Router side: a local controller restored from the actor's snapshot every `refresh_s` in the
    background (with `quiet_when_idle`, while the router decides nothing and no replica works, every
    `idle_refresh_s`; the next request wakes it). `decide` is local; when no replica reports (startup, a
    stalled refresh) it fetches a snapshot (at most one per `refresh_s`) before refusing; when replicas are
    full, up to `max_queued` requests wait (FIFO, re-deciding on each refresh) up to `queue_timeout_s` for
    room. `get_actor` resolves the actor handle (again after the actor was recreated). Once the router had
    reached the actor, while the actor cannot be reached and the local view is stale, `decide` fails open:
    it admits with no replica list (reason "fail_open"), so the request router falls back to the replicas'
    own routing stats, and logs it."""

    def __init__(
        self,
        get_actor: Callable[[], Awaitable[Any]],
        refresh_s: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.controller = AdmissionController()
        self.snapshot: dict[str, Any] | None = None
        self.refresh_s, self._get_actor, self.clock = refresh_s, get_actor, clock
        self._actor: Any = None
        self._task: asyncio.Task | None = None
        self.fetched_at = float("-inf")
        self.queued = 0
        self._refreshed = asyncio.Event()
        self._lock = asyncio.Lock()
        self.kv_version: int | None = None
        self.router_id = uuid.uuid4().hex
        self.failed_at, self.error = float("-inf"), None
        self.fail_open_logged_at = float("-inf")
        self.demand = 0  # blocks wanted since the last sync: reserved, and refused for want of lease
        self.short = 0  # the largest request refused for want of lease since the last sync: its claim
        self._wake = asyncio.Event()
        self.decisions = 0
        self.quiet = False  # the last refresh found no request here and no work on any replica: sync slower
        self.withdrawn: list[Reservation] = []  # released after they were sent: the actor drops them at the next sync

    async def refresh(self, unless_since: float | None = None) -> dict[str, Any]:
        """One sync with the actor; `unless_since`: none if a sync ended since then (the requests of a burst that
        all found the view stale share one sync, and one failure)."""
        async with self._lock:
            if unless_since is not None and self.snapshot is not None and self.fetched_at >= unless_since:
                return self.snapshot
            if unless_since is not None and self.error is not None and self.failed_at >= unless_since:
                raise self.error
            taken, withdrawn, self.withdrawn = self.controller.book.take(), self.withdrawn, []
            try:
                if self._actor is None:
                    self._actor = await asyncio.wait_for(self._get_actor(), timeout=2.0)
                asked_at = now = self.clock()
                sent = [r.report(now) for r in taken]
                demand, short, self.demand, self.short = self.demand, self.short, 0, 0
                gone = [r.report(now) for r in withdrawn]
                call = self._actor.sync.remote(sent, self.kv_version, self.router_id, demand, short, gone)
                snapshot = await asyncio.wait_for(call, timeout=2.0)
            except Exception as e:
                self._actor, self.failed_at, self.error = None, self.clock(), e
                self.controller.book.untake(taken)
                self.withdrawn = withdrawn + self.withdrawn
                self.controller.synced_at = None  # cut off: the view ages by the clock again (then fails open)
                raise
            self.fetched_at = self.clock()
            admission_snapshot.restore(self.controller, snapshot, self.fetched_at, asked_at)
            self.kv_version = snapshot["kv"]["changes"]["version"]
            snapshot.pop("kv")
            self.snapshot = snapshot
        event, self._refreshed = self._refreshed, asyncio.Event()
        event.set()
        return snapshot

    async def _run(self) -> None:
        while True:
            decided = self.decisions
            try:
                await self.refresh()
            except Exception as e:
                log.warning("admission snapshot refresh failed: %r", e)
                await asyncio.sleep(0.5)
            self.quiet = (
                self.controller.config.quiet_when_idle
                and self.decisions == decided
                and not self.queued
                and self.controller.idle()
            )
            try:
                await asyncio.wait_for(self._wake.wait(), self.idle_refresh_s if self.quiet else self.refresh_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    @property
    def idle_refresh_s(self) -> float:
        """While nothing happens anywhere (`quiet_when_idle`): a third of the staleness bound."""
        return max(self.refresh_s, self.controller.config.staleness_s / 3)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def decide(
        self,
        num_prompt_blocks: int,
        largest_blocks: int | None = None,
        keys: Sequence[bytes] = (),
        num_seqs: int = 1,
        output_tokens: int = 0,
        lora: str | None = None,
        hold: bool = True,
        queue_time: bool = True,
    ) -> Decision:
        """Admit (reserving the request's blocks and `num_seqs` sequences on the best-ranked replica) or
        refuse; `keys`: the prompt's block keys; `output_tokens`: each sequence's max_tokens; `lora`: its
        LoRA adapter; `hold=False`: the verdict only, nothing reserved (`decide_now` reserves later);
        `queue_time=False`: its queue time was judged at the door (AdmissionController.decide)."""
        self.decisions += 1
        if self.quiet:
            self.quiet = False
            self._wake.set()
        now = self.clock()
        reached = self.fetched_at > float("-inf")
        if reached and self.failed_at <= self.fetched_at and now - self.fetched_at > self.controller.config.staleness_s:
            # the view is older than staleness_s: this router's loop lagged (a burst), or its syncs stopped; one
            # sync tells which (a failed one makes the view age by the clock, and the decision fail open)
            try:
                await self.refresh(unless_since=now)
            except Exception:
                pass
            now = self.clock()
        judge = functools.partial(self.controller.decide, queue_time=queue_time)
        d = judge(num_prompt_blocks, now, largest_blocks, keys, output_tokens, num_seqs, lora)
        if not d.admit and d.reason in ("no_replicas", "stale") and reached and self.failed_at > self.fetched_at:
            return self._fail_open(d, self.error)  # the background refresh keeps trying; requests don't wait on it
        # a router that never reached the actor is starting (its replicas came up after it), not cut off: sync first
        if not d.admit and d.reason in ("no_replicas", "stale") and now - self.fetched_at > self.refresh_s:
            try:
                await self.refresh(unless_since=now)
            except Exception as e:
                return self._fail_open(d, e)
            now = self.clock()
            d = judge(num_prompt_blocks, now, largest_blocks, keys, output_tokens, num_seqs, lora)
        short = not d.admit and d.reason == "lease"
        if short:
            self.demand += d.new_blocks
            d = await self._await_lease(
                d, judge, num_prompt_blocks, largest_blocks, keys, output_tokens, num_seqs, lora
            )
            now = self.clock()
        cfg = self.controller.config
        if not d.admit and d.reason in ("saturated", "no_room", "lease") and self.queued < cfg.max_queued:
            deadline, self.queued = now + cfg.queue_timeout_s, self.queued + 1
            try:
                while not d.admit and (left := deadline - self.clock()) > 0:
                    try:
                        await asyncio.wait_for(self._refreshed.wait(), left)
                    except asyncio.TimeoutError:
                        pass
                    now = self.clock()
                    d = judge(num_prompt_blocks, now, largest_blocks, keys, output_tokens, num_seqs, lora)
            finally:
                self.queued -= 1
        if d.admit and hold:
            d = self._hold(d, now, num_seqs, keys, count_demand=not short)
        return replace(d, reason="no_room") if d.reason == "lease" else d

    def decide_now(
        self,
        num_prompt_blocks: int,
        largest_blocks: int | None = None,
        keys: Sequence[bytes] = (),
        num_seqs: int = 1,
        output_tokens: int = 0,
        lora: str | None = None,
        exclude: Collection[str] = (),
    ) -> Decision:
        """`decide` on the current view without waiting (no sync, lease claim or queue): reserves when admitted;
        `exclude`: replicas not to reserve on."""
        self.decisions += 1
        now = self.clock()
        d = self.controller.decide(num_prompt_blocks, now, largest_blocks, keys, output_tokens, num_seqs, lora, exclude)
        if d.admit:
            d = self._hold(d, now, num_seqs, keys)
        return replace(d, reason="no_room") if d.reason == "lease" else d

    def _hold(
        self, d: Decision, now: float, num_seqs: int, keys: Sequence[bytes], count_demand: bool = True
    ) -> Decision:
        r = self.controller.reserve(d.replicas[0], d.new_blocks, now, num_seqs, keys, d.prefill_blocks)
        self.demand += d.new_blocks if count_demand else 0
        return replace(d, reservation=r)

    def release(self, d: Decision) -> None:
        """Withdraw what admitting `d` reserved (its request will not go there): at once if not sent yet, else from
        the actor at the next sync."""
        r = d.reservation
        if r is None:
            return
        if self.controller.book.release(r):
            self.demand = max(0, self.demand - r.blocks)
        else:
            self.withdrawn.append(r)

    async def _await_lease(self, d: Decision, judge: Callable[..., Decision], *args: Any) -> Decision:
        """A replica has room but this router's lease of it is spent: claim what the request needs at once (the
        next sync, without waiting out the interval), then once more at the next regular sync (after the other
        routers' syncs have returned what they hold beyond their shares); a refusal then is `no_room`."""
        for attempt in range(2):
            self.short = max(self.short, d.new_blocks)
            try:
                if self._task is None:  # no background refresh (tests, tools): sync here
                    await self.refresh()
                else:
                    if attempt == 0:
                        self._wake.set()
                    await asyncio.wait_for(self._refreshed.wait(), 2.0 + self.refresh_s)
            except Exception:
                break
            d = judge(args[0], self.clock(), *args[1:])
            if d.admit or d.reason != "lease":
                break
        return d

    def _fail_open(self, refused: Decision, error: BaseException | None) -> Decision:
        """The actor is unreachable: admitting without a replica list beats refusing every request."""
        now = self.clock()
        if now - self.fail_open_logged_at > 5.0:
            self.fail_open_logged_at = now
            log.warning(
                "admission actor unreachable (%r) and the view is %s: admitting without admission control "
                "(routing by the replicas' own load)",
                error,
                refused.reason,
            )
        return Decision(True, [], 0.0, "fail_open")

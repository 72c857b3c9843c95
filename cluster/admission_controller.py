"""Cluster-wide admission: per-replica KV watermarks with hysteresis over pushed replica stats, and (with
`max_queue_time_s`) a queue-time objective from the replicas' measured service rates.

One `AdmissionActor` per app (cluster/admission_actor.py) holds the cluster's source of truth; replicas
push stats and KV events to it every <= 100 ms. Each router keeps its own controller, refreshed in the
background from the actor (cluster/admission_snapshot.py), and asks `decide(...)` locally per request: no
remote call on the request path. An admitted prompt is `reserve`d at once on the router, sent to the actor
with the next refresh and from then on counted there for every router, until the replica's stats include it
(cluster/reservations.py; what the controller knows of each replica: cluster/replica_view.py). Reservations
carry the prompt's block keys: blocks on their way to a replica attract its prefix as if cached. Admission
commits a replica's room only up to its high watermark; with several routers, each commits only within its
lease of that headroom (cluster/leases.py), granted by the actor at every sync. Staleness is measured by
receipt time on the actor and carried as an age in snapshots, so clocks of different hosts never get compared.
"""

from dataclasses import dataclass, field
from typing import Collection, Sequence

from conveyor.cluster import placement
from conveyor.cluster.queue_time import retry_after_s
from conveyor.cluster.replica_view import ReplicaView
from conveyor.cluster.reservations import Reservation
from conveyor.cluster.score import prefer_resident, replica_score


@dataclass(frozen=True)
class Decision:
    admit: bool
    replicas: list[str] = field(default_factory=list)
    retry_after_s: float = 0.0
    reason: str = "ok"
    cached_blocks: dict[str, float] = field(default_factory=dict)  # per replica: credited_blocks
    queue_time_s: float = 0.0
    new_blocks: int = 0  # on replicas[0]: the prompt's blocks less those reserved there already, and its output's
    prefill_blocks: int = 0  # of new_blocks, the prompt's
    reservation: Reservation | None = None  # router side: what admitting it reserved on replicas[0]


class AdmissionController(ReplicaView):
    def score(self, replica_id: str, keys: Sequence[bytes], cached: float | None) -> float:
        """The KV-aware router's score (cluster.routing), so the reserved replica is the one it picks; `cached`:
        its credited prefix blocks."""
        cfg, e = self.config, self.replicas[replica_id]
        affinity = (cached or 0) / len(keys) if keys else 0.0
        load = e.stats.num_running + e.stats.num_waiting + self.reserved(replica_id)[1]
        return replica_score(cfg, affinity, self.kv_demand(replica_id), load)

    def decide(
        self,
        num_prompt_blocks: int,
        now: float,
        largest_blocks: int | None = None,
        keys: Sequence[bytes] = (),
        output_tokens: int = 0,
        num_seqs: int = 1,
        lora: str | None = None,
        exclude: Collection[str] = (),
        queue_time: bool = True,
    ) -> Decision:
        """`exclude`: replicas the request must not go to (a handoff retried after they refused or lost it).
        `queue_time=False`: the router's door judged the request's queue time already (deployments/door.py).
        `lora`: the LoRA adapter it runs with (replicas reporting it resident rank first, score.prefer_resident).
        `num_prompt_blocks`: the whole request's prompt blocks; `largest_blocks`: its largest single
        sequence (defaults to the whole), which alone decides `prompt_too_large`; `keys`: the prompt's block
        keys, for the ranking; `output_tokens`: each of its `num_seqs` sequences' max_tokens, charged as
        its likely output (output_blocks).
        Admitted: the replicas with room, best first (the KV-aware router's score); with `max_queue_time_s`,
        only those whose queue time is within it, else a refusal `queue_time` whose Retry-After is when the
        shortest queue is due to be back within it."""
        retry = self.config.retry_after_s
        if not self.replicas:
            return Decision(False, [], retry, "no_replicas")
        capacity = max(e.stats.kv_blocks_total for e in self.replicas.values())
        if (num_prompt_blocks if largest_blocks is None else largest_blocks) > capacity:
            return Decision(False, [], 0.0, "prompt_too_large")
        fresh = [rid for rid, e in self.replicas.items() if self.fresh(e, now)]
        if not fresh:
            return Decision(False, [], retry, "stale")
        open_ = [rid for rid in fresh if not self.replicas[rid].saturated and rid not in exclude]
        if not open_:
            return Decision(False, [], retry, "saturated")
        cached = {rid: c for rid in open_ if (c := self.cached_blocks(rid, keys)) is not None}
        prefill = {rid: max(0, num_prompt_blocks - cached.get(rid, self.shared_blocks(rid, keys))) for rid in open_}
        need = {rid: prefill[rid] + self.output_blocks(rid, output_tokens, num_seqs) for rid in open_}
        fits = [rid for rid in open_ if self.fits(rid, need[rid])]
        if not fits:
            return Decision(False, [], retry, "no_room")
        if self.lease is not None:
            leased = [
                rid
                for rid in fits
                if self.fits(rid, need[rid], self.lease_room(rid, now)) or need[rid] > self.even_share(rid)
            ]
            if not leased:
                return Decision(False, [], retry, "lease", new_blocks=min(need[rid] for rid in fits))
            fits = leased
        wait = {rid: self.queue_time(rid) for rid in fits}
        limit = self.config.max_queue_time_s
        if limit > 0 and queue_time:
            best = min(wait.values())
            fits = [rid for rid in fits if wait[rid] <= limit]
            if not fits:
                return Decision(False, [], retry_after_s(best, limit, retry), "queue_time", queue_time_s=best)
        lower = {rid: self.kv.match_lower(rid, keys, c) for rid, c in cached.items() if rid in wait}
        fits = self.rank(fits, keys, num_prompt_blocks, cached, wait, now, lower)
        if lora is not None and self.config.lora_affinity:
            resident = {rid for rid in fits if lora in self.replicas[rid].stats.lora_adapters}
            load = {rid: self.replicas[rid].stats.num_running + self.replicas[rid].stats.num_waiting for rid in fits}
            fits = prefer_resident(fits, resident, {rid: n + self.reserved(rid)[1] for rid, n in load.items()})
        credit = {r: self.credited_blocks(r, c, lower[r]) for r, c in cached.items() if r in wait}
        best = fits[0]
        return Decision(True, fits, 0.0, "ok", credit, wait[best], need[best], prefill[best])

    def rank(
        self,
        rids: list[str],
        keys: Sequence[bytes],
        prompt_blocks: int,
        cached: dict[str, int],
        wait: dict[str, float],
        now: float,
        lower: dict[str, int] | None = None,
    ) -> list[str]:
        """Best first: by expected TTFT (cluster.placement) once some replica's prefill rate is measured, else
        by the KV-aware router's score. One pooled rate for all: replicas of one deployment run one model, and
        their own rates differ mostly by how much of their busy time went to decoding."""
        lower = lower or {}
        measured = [self.replicas[rid].rates for rid in rids]
        busy = sum(r.busy_s for r in measured if r.prefill_tokens > 0)
        if not self.config.placement or busy <= 0:

            def credit(rid: str) -> float | None:
                c = cached.get(rid)
                return None if c is None else self.credited_blocks(rid, c, lower.get(rid, 0))

            return sorted(rids, key=lambda rid: (-self.score(rid, keys, credit(rid)), wait[rid], -self.room(rid), rid))
        rate = sum(r.prefill_tokens for r in measured if r.prefill_tokens > 0) / busy
        options = []
        for rid in rids:
            e = self.replicas[rid]
            options.append(
                placement.Option(
                    rid,
                    cached.get(rid, self.shared_blocks(rid, keys)),
                    self.queue_time(rid, self.shared_blocks(rid, keys)) / self.config.queue_time_safety,
                    rate,
                    self.hot.count(rid, now, keys),
                    e.stats.kv_blocks_total,
                    e.stats.num_running + e.stats.num_waiting + self.reserved(rid)[1],
                    lower.get(rid, 0),
                    self.load_cost(rid),
                )
            )
        return placement.rank(options, prompt_blocks, self.config.block_size, self.config.hot_fraction)

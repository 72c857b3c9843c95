"""KV-aware replica choice: prefix affinity + KV headroom + queue, skipping saturated replicas.

Wiring (Ray Serve 2.60):
- LLM replica deployment: `request_router_config=RequestRouterConfig(request_router_class=
  "conveyor.cluster.routing:KVAwareRequestRouter", request_router_kwargs={...RouterConfig fields...},
  request_routing_stats_period_s=0.5)`, and a replica method
  `def record_routing_stats(self) -> dict: return engine_stats.to_dict()` (replica_id optional).
  Ray's controller polls it and hands it to the router as `RunningReplica.routing_stats`.
- Caller (router deployment): pass a `RoutingHint` as the keyword argument `routing_hint` of the
  handle call, e.g. `handle.generate.remote(request, routing_hint=RoutingHint.from_token_ids(ids,
  16, decision.replicas, admission.kv_demands(now)))`. The replica method must accept (and may
  ignore) `routing_hint`. A positional hint is found too. No hint: load-only routing. Ray ships
  this module to the caller's process by value, so hints are recognised by shape, not class.
- Load is Ray's own in-flight count per replica (fresh) when known, else the routing stats (up to
  a period old); the pressure the router's watermarks compare is admission's KV demand (fresher, counts
  just-admitted prompts and likely growth: AdmissionController.kv_demand) when the hint carries it, else
  the routing stats' `kv_pressure()`.
- Replica ids are `RunningReplica.replica_id.unique_id`, the same string replicas report to
  admission (`serve.get_replica_context().replica_id.unique_id`).
- With a hint from admission, the router follows admission's ranking: admission
  scored the replicas the same way with its fresher view and reserved the request on its first one.
  Without a hint the router skips saturated replicas and moves off an overloaded one (Ray's in-flight
  counts).
- Prefix affinity: for replicas whose real KV contents admission knows (their KV events, plus
  prompts reserved there), the hint's `cached_blocks`; for the others, this router's own guess, a
  `PrefixIndex` that learns in `on_request_routed`, which Ray 2.60 calls once the replica accepted the
  request (the default, strict max_ongoing_requests path).
"""

import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from conveyor.cluster.prefix_index import PrefixIndex
from conveyor.cluster.score import prefer_resident, replica_score
from conveyor.cluster.stats import ReplicaStats, block_hashes, num_blocks
from conveyor.cluster.watermarks import HIGH_WATERMARK, LOW_WATERMARK, Watermarks
from conveyor.engine.stats import DEFAULT_BLOCK_SIZE

MAX_PREFIX_BLOCKS = 256
LORA_ROUTED_S = 2.0  # a replica sent an adapter's request counts as holding it this long, until its stats say so


@dataclass(frozen=True)
class RoutingHint:
    """What the caller knows: the prompt's block keys, and from admission (fresher than routing stats)
    the replicas with room for it, each replica's KV demand including prompts just admitted, and the
    leading blocks of the prompt each reported replica really holds."""

    prefix_hashes: tuple[bytes, ...] = ()
    num_prompt_blocks: int = 0
    replicas: tuple[str, ...] = ()
    kv_demand: dict[str, float] = field(
        default_factory=dict
    )  # admission's, per replica (AdmissionController.kv_demand)
    cached_blocks: dict[str, float] = field(default_factory=dict)  # credited: lower-tier blocks count part
    lora: str | None = None  # the LoRA adapter the request runs with, by name
    exclude: tuple[str, ...] = ()  # replicas not to route to (they refused it), unless no other is left

    @classmethod
    def from_token_ids(
        cls,
        token_ids: Sequence[int],
        block_size: int,
        replicas: Sequence[str] = (),
        kv_demand: dict[str, float] | None = None,
        salt: str | None = None,
        cached_blocks: dict[str, float] | None = None,
        keys: Sequence[bytes] | None = None,
        lora: tuple[str, str] | None = None,
    ) -> "RoutingHint":
        """lora: the adapter's (name, cache key): its requests' prefix keys are its own."""
        if keys is None:
            keys = block_hashes(token_ids, block_size, salt, MAX_PREFIX_BLOCKS, lora[1] if lora else None)
        return cls(
            tuple(keys),
            num_blocks(len(token_ids), block_size),
            tuple(replicas),
            dict(kv_demand or {}),
            dict(cached_blocks or {}),
            lora[0] if lora else None,
        )


def find_hint(args: Sequence[Any], kwargs: dict[str, Any]) -> RoutingHint | None:
    """Found by shape, not class: Ray ships this module to the caller's process by value (cloudpickle), so
    the caller's `RoutingHint` is not the class this module sees there."""
    return next(
        (a for a in (kwargs.get("routing_hint"), *args) if hasattr(a, "prefix_hashes") and hasattr(a, "replicas")), None
    )


@dataclass(frozen=True)
class RouterConfig:
    affinity_weight: float = 1.0
    lora_affinity: bool = True  # replicas holding the request's LoRA adapter first (False: adapter-blind)
    headroom_weight: float = 0.5
    queue_weight: float = 0.5
    high_watermark: float = HIGH_WATERMARK
    low_watermark: float = LOW_WATERMARK
    max_queue_imbalance: int = 8
    max_pressure_imbalance: float = 0.5
    max_blocks_per_replica: int = 65536
    block_size: int = DEFAULT_BLOCK_SIZE


@dataclass(frozen=True)
class Candidate:
    """`ongoing` (requests at the replica, Ray's fresh count) and `pressure` (admission's) override the
    slower routing stats when known."""

    replica_id: str
    stats: ReplicaStats | None = None
    ongoing: int | None = None
    pressure: float | None = None


@dataclass(frozen=True)
class Scored:
    replica_id: str
    score: float
    affinity: float
    headroom: float
    load: int
    pressure: float
    saturated: bool


def score_replicas(
    candidates: Sequence[Candidate],
    prefix_hashes: Sequence[bytes],
    index: PrefixIndex,
    cfg: RouterConfig,
    was_saturated: dict[str, bool] | None = None,
    cached_blocks: dict[str, float] | None = None,
) -> list[Scored]:
    """Scores, best first. Replicas with neither stats nor a pressure count as empty. Affinity: the leading
    blocks a replica holds (`cached_blocks`, real contents) or else, unreported, `index`'s guess."""
    marks = Watermarks(cfg.high_watermark, cfg.low_watermark)
    was_saturated, cached_blocks = was_saturated or {}, cached_blocks or {}
    out = []
    for c in candidates:
        s = c.stats
        pressure = c.pressure if c.pressure is not None else s.kv_pressure() if s else 0.0
        load = c.ongoing if c.ongoing is not None else s.num_running + s.num_waiting if s else 0
        held = cached_blocks.get(c.replica_id)
        held = index.match(c.replica_id, prefix_hashes) if held is None else held
        affinity = held / len(prefix_hashes) if prefix_hashes else 0.0
        headroom = min(1.0, max(0.0, 1.0 - pressure))
        score = replica_score(cfg, affinity, pressure, load)
        known = s is not None or c.pressure is not None
        saturated = marks.saturated(was_saturated.get(c.replica_id, False), pressure) if known else False
        out.append(Scored(c.replica_id, score, affinity, headroom, load, pressure, saturated))
    return sorted(out, key=lambda x: (-x.score, x.load, x.replica_id))


def overloaded(preferred: Scored, least: Scored, cfg: RouterConfig) -> bool:
    return (
        preferred.load - least.load > cfg.max_queue_imbalance
        or preferred.pressure - least.pressure > cfg.max_pressure_imbalance
    )


def choose(scored: Sequence[Scored], cfg: RouterConfig, allowed: Sequence[str] = ()) -> list[str]:
    """Ranked replica ids. Without admission's list (`allowed`): the best scored one (or the least loaded if
    it is overloaded relative to it), then the rest, saturated replicas only when every replica is saturated.
    With it: the allowed replicas in admission's order, never skipped as saturated or overloaded (admission
    found room on its first with its fresher view, counting the request itself, and reserved the request
    there: sent elsewhere, it would be counted on neither replica until its reservation expired), then the
    rest."""
    ok = {rid: i for i, rid in enumerate(allowed)}
    trusted = any(s.replica_id in ok for s in scored)
    usable = [s for s in scored if not s.saturated or s.replica_id in ok] or sorted(
        scored, key=lambda s: (s.load, s.pressure)
    )
    if not usable:
        return []
    if trusted:
        pool = sorted((s for s in usable if s.replica_id in ok), key=lambda s: ok[s.replica_id])
        return [s.replica_id for s in pool] + [s.replica_id for s in usable if s.replica_id not in ok]
    preferred = usable[0]
    least = min(usable, key=lambda s: (s.load, s.pressure))
    first = least if overloaded(preferred, least, cfg) else preferred
    return [first.replica_id] + [s.replica_id for s in usable if s is not first]


class KVAwareRequestRouter(RequestRouter):
    """Ray Serve RequestRouter over `score_replicas`/`choose`; kwargs = `RouterConfig` fields."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.config = RouterConfig(**kwargs)
        self.index = PrefixIndex(self.config.max_blocks_per_replica)
        self.saturated: dict[str, bool] = {}
        self.lora_routed: dict[tuple[str, str], float] = {}  # (adapter, replica) -> when this router sent one there

    def _ensure_state(self) -> None:
        if not hasattr(self, "config"):
            self.initialize_state()

    def candidates(self, replicas: Sequence[RunningReplica], hint: RoutingHint | None = None) -> list[Candidate]:
        out = []
        cache, demand = self.replica_queue_len_cache, getattr(hint, "kv_demand", None) or {}
        for r in replicas:
            rid = r.replica_id.unique_id
            raw = r.routing_stats or {}
            stats = ReplicaStats.from_dict({**raw, "replica_id": rid}) if raw.get("kv_blocks_total") else None
            out.append(Candidate(rid, stats, cache.get(r.replica_id), demand.get(rid)))
        return out

    def rank(self, replicas: Sequence[RunningReplica], hint: RoutingHint | None) -> list[RunningReplica]:
        self._ensure_state()
        excluded = set(getattr(hint, "exclude", ()))
        replicas = [r for r in replicas if r.replica_id.unique_id not in excluded] or replicas
        by_id = {r.replica_id.unique_id: r for r in replicas}
        scored = score_replicas(
            self.candidates(replicas, hint),
            hint.prefix_hashes if hint else (),
            self.index,
            self.config,
            self.saturated,
            getattr(hint, "cached_blocks", None),
        )
        self.saturated.update({s.replica_id: s.saturated for s in scored})
        order = choose(scored, self.config, hint.replicas if hint else ())
        lora = getattr(hint, "lora", None)
        if (
            lora is not None and self.config.lora_affinity and not any(rid in by_id for rid in hint.replicas)
        ):  # admission's order already is
            order = prefer_resident(order, self.resident(lora, replicas), {s.replica_id: s.load for s in scored})
        return [by_id[rid] for rid in order]

    def resident(self, lora: str, replicas: Sequence[RunningReplica]) -> set[str]:
        """Replicas whose routing stats list the adapter, or that this router sent it to lately."""
        now, out = time.monotonic(), set()
        for r in replicas:
            rid = r.replica_id.unique_id
            if (
                lora in (r.routing_stats or {}).get("lora_adapters", ())
                or now - self.lora_routed.get((lora, rid), -1e9) < LORA_ROUTED_S
            ):
                out.add(rid)
        return out

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        hint = None
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # else Ray retries full replicas without sleeping
            hint = find_hint(pending_request.args, pending_request.kwargs)
        return [[r] for r in self.rank(candidate_replicas, hint)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._ensure_state()
        hint = find_hint(pending_request.args, pending_request.kwargs) if pending_request else None
        if getattr(hint, "lora", None) is not None:
            self.lora_routed[(hint.lora, replica_id.unique_id)] = time.monotonic()
            if len(self.lora_routed) > 4096:
                self.lora_routed = dict(sorted(self.lora_routed.items(), key=lambda kv: kv[1])[-2048:])
        if hint and hint.prefix_hashes:
            replica = self.curr_replicas.get(replica_id)
            capacity = (getattr(replica, "routing_stats", None) or {}).get("kv_blocks_total")
            self.index.record(replica_id.unique_id, hint.prefix_hashes, capacity)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._ensure_state()
        live = {r.replica_id.unique_id for r in replicas}
        self.index.retain(live)
        self.saturated = {k: v for k, v in self.saturated.items() if k in live}

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ensure_state()
        self.index.drop(replica_id.unique_id)
        self.saturated.pop(replica_id.unique_id, None)

"""Leases: how several routers share each replica's room without jointly oversubscribing it.

Routers decide locally and hand their reservations to the admission actor once per refresh, so between two
refreshes each router's admissions are invisible to the others. At every sync the actor therefore grants the
router a lease: per replica, the blocks it may commit until its next sync. A lease never exceeds the replica's
headroom (room up to the high watermark, counting every reservation the actor knows) less the leases other
routers still hold, so all routers together stay within it; a router's unshared reservations count against
its own lease only.

Shares: half split evenly among the routers that synced lately, half by each lease holder's demand over its
last interval (blocks it reserved plus blocks it was refused for want of lease), so an idle router keeps enough
for a request at once and a busy one gets the rest. Room frees a request at a time, and split in shares it
would fit no one's next request: a router refused for want of lease claims what its request needs (`short`),
and claims are served first come first served (a later grant leaves room for an earlier unmet claim). A
request larger than an even share of an idle replica cannot wait for a lease; the router decides it on its
own view (cluster.admission_controller).
"""

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Lease:
    blocks: dict[str, int]
    granted_at: float
    demand: int = 0
    short: int = 0
    short_since: float | None = None


@dataclass
class Leases:
    ttl_s: float = 1.0
    held: dict[str, Lease] = field(default_factory=dict)

    def expire(self, now: float) -> None:
        self.held = {r: lease for r, lease in self.held.items() if now - lease.granted_at <= self.ttl_s}

    def grant(
        self, router_id: str, headroom: dict[str, int], now: float, demand: int = 0, routers: int = 1, short: int = 0
    ) -> dict[str, int]:
        """The router's new lease; its old one is spent (its reservations came with this sync) or returned.
        `routers`: how many routers synced lately, this one included; `short`: its claim."""
        prev = self.held.pop(router_id, None)
        since = (prev.short_since if prev is not None and prev.short_since is not None else now) if short else None
        self.expire(now)
        others = list(self.held.values())
        earlier = [
            o for o in others if o.short and o.short_since is not None and (since is None or o.short_since < since)
        ]
        total_demand = demand + sum(o.demand for o in others)
        k = max(routers, len(others) + 1)
        share = 0.5 / k + 0.5 * (demand / total_demand if total_demand else 1.0 / k)
        blocks = {}
        for rid, room in headroom.items():
            free = room - sum(o.blocks.get(rid, 0) for o in others)
            free -= sum(max(0, o.short - o.blocks.get(rid, 0)) for o in earlier)
            blocks[rid] = max(0, min(free, max(math.floor(share * room), short)))
        self.held[router_id] = Lease(blocks, now, demand, short, since)
        return blocks

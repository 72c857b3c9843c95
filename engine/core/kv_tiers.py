"""The lower KV tiers' index: prefix-cache key -> (tier, slot), an LRU per tier, and the copies that keep the
tiers' contents true to it.

Tier 0 is the device pool (a slot there is a block id); tiers 1.. are the ones below it (host, disk), each
holding a key at most once, and a key in at most one of them. A key is stored when its pool block goes idle
(copied beside a later step's forward) or, if it never was, when the pool evicts it (copied before the step's
forward). A full tier makes room by moving its least recently used key one tier down, or dropping it from
the last. Copies run in the order they are planned, so one plan needs no pinning: a load planned before a
store that reuses its slot reads the slot first."""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from conveyor.engine.step import KVCopy, KVTransfer


@dataclass
class TierStats:
    hits: int = 0  # blocks loaded from this tier into the pool
    stored: int = 0  # blocks written into this tier (stores and moves from the tier above)
    dropped: int = 0  # blocks this tier let go of (moved down, or lost from the last tier)


@dataclass
class Tier:
    name: str
    num_slots: int
    lru: OrderedDict[bytes, int] = field(default_factory=OrderedDict)  # key -> slot, least recent first
    free: list[int] = field(default_factory=list)
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self) -> None:
        self.free = list(range(self.num_slots - 1, -1, -1))


class KVTiers:
    def __init__(self, tiers: list[tuple[str, int]]) -> None:
        if not tiers:
            raise ValueError("KVTiers needs at least one tier with a slot")
        self.tiers = [Tier(name, n) for name, n in tiers]
        self.where: dict[bytes, int] = {}  # key -> tier number (1..)
        self.before: list[KVCopy] = []
        self.after: list[KVCopy] = []
        self.num_loads = 0
        self.held: set[bytes] = set()  # keys about to be loaded: no store may take their slots
        self.on_change: Callable[[bytes], None] = lambda key: None  # a key entered or left the tiers

    def tier(self, number: int) -> Tier:
        return self.tiers[number - 1]

    def __contains__(self, key: bytes) -> bool:
        return key in self.where

    def load(self, key: bytes, block_id: int) -> None:
        """Plans the copy of key's block into pool block `block_id`, before this step's forward."""
        t = self.where[key]
        tier = self.tier(t)
        tier.lru.move_to_end(key)
        tier.stats.hits += 1
        self.before.append((t, tier.lru[key], 0, block_id))
        self.num_loads += 1

    def store(self, key: bytes, block_id: int, before_forward: bool) -> None:
        """Plans the copy of pool block `block_id` (holding key) into the top tier (none if every key there is
        held for a load)."""
        if key in self.where:
            return
        copies = self.before if before_forward else self.after
        slot = self._room(1, copies)
        if slot is not None:
            copies.append((0, block_id, 1, slot))
            self._put(key, 1, slot)

    def _room(self, t: int, copies: list[KVCopy]) -> int | None:
        """A free slot of tier t, made by moving its least recently used key that is not `held` down (or
        dropping it); None when every key is held."""
        tier = self.tier(t)
        if tier.free:
            return tier.free.pop()
        key = next((k for k in tier.lru if k not in self.held), None)
        if key is None:
            return None
        slot = tier.lru.pop(key)
        del self.where[key]
        tier.stats.dropped += 1
        below = self._room(t + 1, copies) if t < len(self.tiers) else None
        if below is not None:
            copies.append((t, slot, t + 1, below))
            self._put(key, t + 1, below)
        else:
            self.on_change(key)
        return slot

    def _put(self, key: bytes, t: int, slot: int) -> None:
        tier = self.tier(t)
        tier.lru[key] = slot
        tier.stats.stored += 1
        if key not in self.where:
            self.on_change(key)
        self.where[key] = t

    def take(self) -> KVTransfer | None:
        """This step's planned copies, handed to the model runner with the step."""
        if not self.before and not self.after:
            return None
        out = KVTransfer(self.before, self.after, self.num_loads)
        self.before, self.after, self.num_loads = [], [], 0
        return out

    def check(self) -> str | None:
        """What is inconsistent in the index, or None (engine/core/invariants.py)."""
        total = 0
        for number, tier in enumerate(self.tiers, 1):
            slots = list(tier.lru.values()) + tier.free
            if sorted(slots) != list(range(tier.num_slots)):
                return f"tier {tier.name}: used and free slots are not each slot once"
            for key in tier.lru:
                if self.where.get(key) != number:
                    return f"tier {tier.name}: holds a key the index places in tier {self.where.get(key)}"
            total += len(tier.lru)
        if total != len(self.where):
            return f"the tier index names {len(self.where)} keys but the tiers hold {total}"
        return None


class LoadCost:
    """What loading a block from a lower tier costs against computing it: load seconds per block over prefill
    seconds per block, each a moving average over the steps that did it. The scheduler charges loads to the
    step's token budget by it; the router credits lower-tier blocks by 1 minus it."""

    def __init__(self, block_size: int, prior: float = 0.1, alpha: float = 0.2) -> None:
        self.block_size, self.prior, self.alpha = block_size, prior, alpha
        self.load_s_per_block: float | None = None
        self.prefill_s_per_token: float | None = None
        self.load_s = 0.0  # cumulative, for the load-latency metric
        self.num_loads = 0

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.alpha * (new - old)

    def observe(self, step_s: float, num_prefill_tokens: int, load_s: float, num_loads: int) -> None:
        if num_loads:
            self.load_s += load_s
            self.num_loads += num_loads
            self.load_s_per_block = self._avg(self.load_s_per_block, load_s / num_loads)
        if num_prefill_tokens >= self.block_size and step_s > load_s:
            self.prefill_s_per_token = self._avg(self.prefill_s_per_token, (step_s - load_s) / num_prefill_tokens)

    @property
    def ratio(self) -> float:
        if self.load_s_per_block is None or not self.prefill_s_per_token:
            return self.prior
        return min(max(self.load_s_per_block / (self.prefill_s_per_token * self.block_size), 0.001), 1.0)

"""Paged KV-cache bookkeeping: a block pool with reference counts, an LRU of reusable cached blocks,
per-request block tables, prefix hashes, CPU swap slots and the lower KV tiers' index (kv_tiers.py). Holds
ids only; the tensors live in the model runner."""

from collections import OrderedDict
from dataclasses import dataclass

from conveyor.engine.core.kv_events import KVEventLog, KVEvents, Place
from conveyor.engine.core.kv_tiers import KVTiers
from conveyor.engine.core.prefix_hash import block_hash
from conveyor.engine.core.sequence import Sequence
from conveyor.engine.stats import cdiv
from conveyor.engine.step import KVTransfer


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockPool:
    """Free blocks in two LRU queues: never-cached ones are handed out before cached ones are evicted."""

    def __init__(self, num_blocks: int, tiers: KVTiers | None = None) -> None:
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_plain: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.free_cached: OrderedDict[int, Block] = OrderedDict()
        self.cached: dict[bytes, Block] = {}
        self.tiers = tiers  # cached blocks are stored there as they go idle or are evicted
        self.kv_events = KVEventLog(self.place, self.held, max(1 << 16, 4 * num_blocks))
        if tiers is not None:
            tiers.on_change = self.kv_events.add
        self.idle: list[Block] = []  # cached blocks whose ref count fell to 0 since the tiers last looked

    def place(self, key: bytes) -> Place:
        if key in self.cached:
            return "pool"
        return "lower" if self.tiers is not None and key in self.tiers else "none"

    def held(self) -> list[bytes]:
        return [*self.cached, *(self.tiers.where if self.tiers is not None else ())]

    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    def allocate(self, n: int) -> list[Block]:
        out = []
        for _ in range(n):
            queue = self.free_plain if self.free_plain else self.free_cached
            _, block = queue.popitem(last=False)
            if self.tiers is not None and block.hash is not None:
                self.tiers.store(block.hash, block.block_id, before_forward=True)
            self.unregister(block)
            block.ref_count = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        for b in blocks:
            if b.ref_count == 0:
                del (self.free_cached if b.hash is not None else self.free_plain)[b.block_id]
            b.ref_count += 1

    def release(self, blocks: list[Block]) -> None:
        for b in reversed(blocks):
            b.ref_count -= 1
            if b.ref_count == 0:
                (self.free_cached if b.hash is not None else self.free_plain)[b.block_id] = b
                if self.tiers is not None and b.hash is not None:
                    self.idle.append(b)

    def unregister(self, block: Block) -> None:
        if block.hash is not None and self.cached.get(block.hash) is block:
            del self.cached[block.hash]
            self.kv_events.add(block.hash)
        block.hash = None

    def register(self, block: Block, h: bytes) -> None:
        if block.hash is None and h not in self.cached:
            block.hash = h
            self.cached[h] = block
            self.kv_events.add(h)


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        num_swap_blocks: int = 0,
        tiers: KVTiers | None = None,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.caching = enable_prefix_caching
        self.tiers = tiers if enable_prefix_caching else None
        self.pool = BlockPool(num_blocks, self.tiers)
        self.tables: dict[str, list[Block]] = {}
        self.hashes: dict[str, list[bytes]] = {}
        self.num_registered: dict[str, int] = {}
        self.free_swap = list(range(num_swap_blocks - 1, -1, -1))
        self.num_swap_blocks = num_swap_blocks
        self.swapped: dict[str, list[int]] = {}
        self.queries = self.hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self.tables.get(seq.request_id, [])]

    def _hashes(self, seq: Sequence) -> list[bytes]:
        hashes = self.hashes.setdefault(seq.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), seq.num_tokens // bs):
            parent, tokens = hashes[-1] if hashes else None, seq.token_ids[i * bs : (i + 1) * bs]
            hashes.append(block_hash(parent, tokens, seq.cache_salt, seq.lora and seq.lora.cache_key))
        return hashes

    def cached_prefix(self, seq: Sequence) -> list[Block]:
        """The longest run of cached full blocks at the start of seq, leaving >= 1 token to compute."""
        if not self.caching:
            return []
        blocks = []
        for h in self._hashes(seq):
            block = self.pool.cached.get(h)
            if block is None:
                break
            blocks.append(block)
        if len(blocks) * self.block_size >= seq.num_tokens:
            blocks.pop()
        return blocks

    def lower_prefix(self, seq: Sequence, prefix: list[Block]) -> list[bytes]:
        """The keys after `prefix` (seq's cached run in the pool) that the lower tiers hold, leaving >= 1 token
        to compute: their blocks are loaded back instead of computed."""
        if self.tiers is None:
            return []
        hashes, tiers = self._hashes(seq), self.tiers
        end = len(prefix)
        while end < len(hashes) and hashes[end] in tiers:
            end += 1
        end = min(end, (seq.num_tokens - 1) // self.block_size)
        return hashes[len(prefix) : max(end, len(prefix))]

    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        prefix: list[Block] = (),
        reserve: int = 0,
        loads: list[bytes] = (),
    ) -> list[int] | None:
        """Grow seq's table to hold its computed tokens (+ prefix, + the blocks of `loads`, keys the lower tiers
        copy back) plus num_new_tokens. Returns the block ids appended to the table, or None (nothing changed)
        if they don't fit."""
        table = self.tables.get(seq.request_id, [])
        computed = seq.num_computed_tokens + (len(prefix) + len(loads)) * self.block_size
        if not prefix and not loads and computed + num_new_tokens <= len(table) * self.block_size:
            num_full = (computed + num_new_tokens) // self.block_size
            if self.caching and num_full > self.num_registered.get(seq.request_id, 0):
                self._register(seq, table, num_full)
            return []
        num_new = self.blocks_for(computed + num_new_tokens) - len(table) - len(prefix)
        reused_free = sum(1 for b in prefix if b.ref_count == 0)
        if num_new + reused_free > self.pool.num_free - reserve:
            return None
        self.pool.touch(list(prefix))
        if loads:  # the blocks evicted for them are stored without taking their slots
            self.tiers.held = set(loads)
        added = list(prefix) + self.pool.allocate(max(num_new, 0))
        if loads:
            self.tiers.held = set()
            for key, block in zip(loads, added[len(prefix) :]):
                self.tiers.load(key, block.block_id)
        table = self.tables.setdefault(seq.request_id, table)
        table.extend(added)
        if self.caching:
            self._register(seq, table, (computed + num_new_tokens) // self.block_size)
        return [b.block_id for b in added]

    def allocate_decode(self, seq: Sequence) -> list[int] | None:
        """allocate(seq, 1) for a running request, with the common case (its last block has room) kept short."""
        table = self.tables[seq.request_id]
        computed = seq.num_computed_tokens + 1
        if computed > len(table) * self.block_size:
            return self.allocate(seq, 1)
        if self.caching and computed % self.block_size == 0:
            self._register(seq, table, computed // self.block_size)
        return []

    def _register(self, seq: Sequence, table: list[Block], num_full: int) -> None:
        """Publishes the blocks this step's chunk fills, so requests admitted in the same step share them
        (each layer stores every token's K/V before any attention reads). free() takes back the ones
        whose chunk was dropped before running."""
        rid = seq.request_id
        hashes = self._hashes(seq)
        num_full = min(num_full, len(hashes))  # a speculative chunk's draft tokens are not the request's yet
        for i in range(self.num_registered.get(rid, 0), num_full):
            self.pool.register(table[i], hashes[i])
        self.num_registered[rid] = max(self.num_registered.get(rid, 0), num_full)

    def roll_back(self, seq: Sequence) -> None:
        """After a speculative step: blocks past the computed tokens (rejected drafts' slots) go back to the
        pool; full blocks of accepted tokens are published. The stale K/V in the kept slots past
        num_computed_tokens is overwritten by the next chunk before any attention reads it."""
        table = self.tables[seq.request_id]
        keep = self.blocks_for(seq.num_computed_tokens)
        if len(table) > keep:
            self.pool.release(table[keep:])
            del table[keep:]
        if self.caching:
            self._register(seq, table, seq.num_computed_tokens // self.block_size)

    def take_transfer(self) -> KVTransfer | None:
        """The step's tier copies: stores of the cached blocks that went idle (if no tier holds their key yet),
        after the ones planned while scheduling."""
        tiers = self.tiers
        if tiers is None:
            return None
        for b in self.pool.idle:
            if b.ref_count == 0 and b.hash is not None:
                tiers.store(b.hash, b.block_id, before_forward=False)
        self.pool.idle.clear()
        return tiers.take()

    def drain_kv_events(self, max_events: int | None = None) -> KVEvents:
        """Keys whose place (pool, lower tier, none) changed since the last drain (thread-safe); the first drain
        lists every key held."""
        return self.pool.kv_events.drain(max_events)

    def request_kv_reset(self) -> None:
        self.pool.kv_events.request_reset()

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def free(self, seq: Sequence) -> None:
        rid = seq.request_id
        table = self.tables.pop(rid, [])
        for block in table[seq.num_computed_tokens // self.block_size : self.num_registered.pop(rid, 0)]:
            self.pool.unregister(block)  # published for a chunk that never ran: its request was preempted
        self.pool.release(table)
        self.free_swap.extend(self.swapped.pop(rid, []))

    def forget(self, seq: Sequence) -> None:
        self.free(seq)
        self.hashes.pop(seq.request_id, None)

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]] | None:
        computed = self.tables.get(seq.request_id, [])[: self.blocks_for(seq.num_computed_tokens)]
        if len(computed) > len(self.free_swap):
            return None
        slots = [self.free_swap.pop() for _ in computed]
        pairs = [(b.block_id, s) for b, s in zip(computed, slots)]
        self.free(seq)
        self.swapped[seq.request_id] = slots
        return pairs

    def swap_in(self, seq: Sequence, num_new_tokens: int, reserve: int = 0) -> list[tuple[int, int]] | None:
        """Only if the blocks for num_new_tokens fit too: undoing a swap-in would remap the slots."""
        slots = self.swapped.get(seq.request_id, [])
        grow = max(self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(slots), 0)
        if len(slots) + grow > self.pool.num_free - reserve:
            return None
        blocks = self.pool.allocate(len(slots))
        self.tables[seq.request_id] = blocks
        self.free_swap.extend(self.swapped.pop(seq.request_id))
        return [(s, b.block_id) for s, b in zip(slots, blocks)]

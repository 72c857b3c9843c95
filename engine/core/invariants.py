"""Debug-mode consistency checks of the KV-cache bookkeeping (pool, tables, swap slots, lower tiers;
`EngineConfig(check_invariants=True)`), run by the scheduler after every step's update. Each check names the structure and block that broke."""

from collections import Counter
from typing import TYPE_CHECKING

from conveyor.engine.core.prefix_hash import block_hash
from conveyor.engine.core.sequence import SequenceStatus

if TYPE_CHECKING:
    from conveyor.engine.core.block_manager import BlockManager
    from conveyor.engine.core.scheduler import Scheduler
    from conveyor.engine.execution.persistent_batch import PersistentBatch


class InvariantError(AssertionError):
    """A block-pool, block-table, prefix-cache or swap invariant does not hold."""


def _fail(what: str) -> None:
    raise InvariantError(what)


def check_pool(kv: "BlockManager") -> None:
    """Ref counts equal the tables holding each block; the free queues hold exactly the ref-0 blocks
    (cached ones in free_cached, plain ones in free_plain); the prefix map and the blocks' hashes agree.
    One pass over the pool (8192 blocks: ~25 ms for the itemised checks, a few ms for this pass);
    the itemised checks run only to name what broke."""
    pool = kv.pool
    owners = Counter(b.block_id for table in kv.tables.values() for b in table)
    plain, cached_free, cached = pool.free_plain, pool.free_cached, pool.cached
    idle = hashed = 0
    ok = True
    for b in pool.blocks:
        rc, h = b.ref_count, b.hash
        if rc != owners.get(b.block_id, 0) or (h is not None and cached.get(h) is not b):
            ok = False
            break
        hashed += h is not None
        if rc == 0:
            idle += 1
            if (cached_free if h is not None else plain).get(b.block_id) is not b:
                ok = False
                break
    if ok and idle == len(plain) + len(cached_free) and hashed == len(cached) and _tables_hold_pool_blocks(kv):
        return
    _explain_pool(kv)
    _fail("block pool inconsistent")


def _tables_hold_pool_blocks(kv: "BlockManager") -> bool:
    blocks = kv.pool.blocks
    return all(
        len({b.block_id for b in t}) == len(t) and all(blocks[b.block_id] is b for b in t) for t in kv.tables.values()
    )


def _explain_pool(kv: "BlockManager") -> None:
    pool = kv.pool
    owners = Counter(b.block_id for table in kv.tables.values() for b in table)
    for rid, table in kv.tables.items():
        if len({b.block_id for b in table}) != len(table):
            _fail(f"block table of {rid!r} holds a block twice: {[b.block_id for b in table]}")
        for b in table:
            if pool.blocks[b.block_id] is not b:
                _fail(f"block table of {rid!r} holds a stray Block object for id {b.block_id}")
    for b in pool.blocks:
        if b.ref_count != owners[b.block_id]:
            _fail(f"block {b.block_id}: ref_count {b.ref_count} but {owners[b.block_id]} block tables hold it")
    both = pool.free_plain.keys() & pool.free_cached.keys()
    if both:
        _fail(f"blocks {sorted(both)} are in both free queues")
    for name, queue, hashed in (("free_plain", pool.free_plain, False), ("free_cached", pool.free_cached, True)):
        for bid, b in queue.items():
            if b is not pool.blocks[bid]:
                _fail(f"{name}[{bid}] is not block {bid}")
            if b.ref_count != 0:
                _fail(f"block {bid} is in {name} with ref_count {b.ref_count} (free and owned)")
            if (b.hash is not None) != hashed:
                _fail(f"block {bid} is in {name} but its hash is {'set' if b.hash is not None else 'None'}")
    free = pool.free_plain.keys() | pool.free_cached.keys()
    idle = {b.block_id for b in pool.blocks if b.ref_count == 0}
    if free != idle:
        _fail(f"free queues != ref-0 blocks: missing {sorted(idle - free)}, extra {sorted(free - idle)}")
    for h, b in pool.cached.items():
        if b.hash != h:
            _fail(
                f"prefix map entry {h.hex()[:12]} points at block {b.block_id} whose hash is "
                f"{b.hash.hex()[:12] if b.hash else None}"
            )
    for b in pool.blocks:
        if b.hash is not None and pool.cached.get(b.hash) is not b:
            _fail(f"block {b.block_id} has hash {b.hash.hex()[:12]} but the prefix map does not point at it")


def check_tables(sched: "Scheduler") -> None:
    """Queues partition the unfinished requests; running ones own exactly the blocks of their computed
    tokens and cached blocks sit where the request's own hash chain says; swapped ones own their slots."""
    kv = sched.kv
    queues = {"running": sched.running, "waiting": sched.waiting, "swapped": sched.swapped}
    status = {"running": SequenceStatus.RUNNING, "waiting": SequenceStatus.WAITING, "swapped": SequenceStatus.SWAPPED}
    seen: dict[str, str] = {}
    for name, queue in queues.items():
        for seq in queue:
            if seq.request_id in seen:
                _fail(f"request {seq.request_id!r} is in both {seen[seq.request_id]} and {name}")
            seen[seq.request_id] = name
            if seq.status is not status[name]:
                _fail(f"request {seq.request_id!r} is in {name} with status {seq.status.name}")
            if sched.requests.get(seq.request_id) is not seq:
                _fail(f"request {seq.request_id!r} is in {name} but not in the scheduler's requests")
    if seen.keys() != sched.requests.keys():
        _fail(f"unfinished requests in no queue: {sorted(sched.requests.keys() - seen.keys())}")
    if len(sched.running) > sched.config.max_num_seqs:
        _fail(f"{len(sched.running)} running requests > max_num_seqs {sched.config.max_num_seqs}")
    running = {s.request_id for s in sched.running}
    if kv.tables.keys() != running:
        _fail(f"block tables {sorted(kv.tables)} != running requests {sorted(running)}")
    bs = kv.block_size
    for seq in sched.running:
        table, rid = kv.tables[seq.request_id], seq.request_id
        if len(table) != kv.blocks_for(seq.num_computed_tokens):
            _fail(f"request {rid!r}: {len(table)} blocks for {seq.num_computed_tokens} computed tokens")
        hashes = kv.hashes.get(rid, [])
        parent = None
        for i, h in enumerate(hashes):
            parent = block_hash(
                parent, seq.token_ids[i * bs : (i + 1) * bs], seq.cache_salt, seq.lora and seq.lora.cache_key
            )
            if h != parent:
                _fail(f"request {rid!r}: prefix hash of block {i} does not match its tokens")
        for i, b in enumerate(table):
            if b.hash is not None and (i >= len(hashes) or b.hash != hashes[i]):
                _fail(f"request {rid!r}: block {b.block_id} at position {i} is cached under another prefix")
    check_swap(sched)


def check_swap(sched: "Scheduler") -> None:
    kv = sched.kv
    swapped = {s.request_id: s for s in sched.swapped}
    if kv.swapped.keys() != swapped.keys():
        _fail(f"swap slots held by {sorted(kv.swapped)} but swapped requests are {sorted(swapped)}")
    for rid, slots in kv.swapped.items():
        if len(slots) != kv.blocks_for(swapped[rid].num_computed_tokens):
            _fail(f"request {rid!r}: {len(slots)} swap slots for {swapped[rid].num_computed_tokens} computed tokens")
    held = [s for slots in kv.swapped.values() for s in slots] + list(kv.free_swap)
    if sorted(held) != list(range(kv.num_swap_blocks)):
        dup = sorted(s for s, n in Counter(held).items() if n > 1)
        lost = sorted(set(range(kv.num_swap_blocks)) - set(held))
        _fail(
            f"swap slots: duplicated {dup}, lost {lost}, out of range {sorted(set(held) - set(range(kv.num_swap_blocks)))}"
        )


def check_batch(sched: "Scheduler", batch: "PersistentBatch") -> None:
    """The model runner's persistent batch rows hold the same block ids as the running requests' tables."""
    rows = list(batch.rows.values())
    if len(set(rows)) != len(rows) or set(rows) & set(batch.free):
        _fail(f"persistent batch rows overlap each other or its free list: rows {rows}, free {batch.free}")
    for seq in sched.running:
        row = batch.rows.get(seq.request_id)
        if row is None:
            _fail(f"request {seq.request_id!r} runs but has no persistent batch row")
        got = batch.block_table[row, : int(batch.num_blocks[row])].tolist()
        want = sched.kv.block_ids(seq)
        if got != want:
            _fail(f"request {seq.request_id!r}: persistent batch row {row} holds blocks {got}, its table {want}")


def check_tiers(kv: "BlockManager") -> None:
    """Each lower tier's slots are used or free exactly once, the index places each key in the one tier that
    holds it, and every planned copy went out with its step (a copy left behind would land after its slot
    was reused)."""
    tiers = kv.tiers
    if tiers is None:
        return
    problem = tiers.check()
    if problem is not None:
        _fail(problem)
    if tiers.before or tiers.after:
        _fail(f"{len(tiers.before) + len(tiers.after)} tier copies planned but not handed to the model runner")


def check_invariants(sched: "Scheduler", batch: "PersistentBatch | None" = None) -> None:
    check_pool(sched.kv)
    check_tiers(sched.kv)
    check_tables(sched)
    if batch is not None:
        check_batch(sched, batch)

"""Prefill/decode disaggregation at the engine core: a request added with `prefill_only` leaves the engine after
its first token with a KVHandoff (its computed tokens' KV blocks, its tokens, its sampling state); another
engine's `import_handoff` takes it in and decodes on as if it had prefilled it. The KV travels as bytes so the
same object crosses a ZeroMQ socket (msgpack), Ray's object store or a torch.distributed send. A LoRA request's
handoff names its adapter: the importing engine runs it with the same adapter (loaded from its path into one of
its own slots) and keys the imported blocks with that adapter's prefix keys."""

import time
import warnings
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from conveyor.engine.core.sequence import Sequence, SequenceStatus
from conveyor.engine.execution.kv_shares import KVGeometry, adopt, gather, generator_state, kv_geometry, read_share
from conveyor.engine.lora_request import LoRARequest
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.step import NewRequestData

if TYPE_CHECKING:
    from conveyor.engine.core.engine_core import EngineCore

HANDOFF = "handoff"  # the finish_reason of a prefill-only request that left with its KV


class KVHandoff(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request between a prefill and a decode engine. `kv`: the KV of its first `num_computed` tokens
    (prompt + outputs but the last), laid out [2, layers, blocks, block_size, kv_heads, head_dim] in `dtype`.
    `lora`: the adapter the prefill engine ran it with (None: the base model)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    kv: bytes
    shape: list[int]
    dtype: str
    priority: int = 0
    cache_salt: str | None = None
    generator_state: bytes | None = None
    num_cached_tokens: int = 0
    lora: LoRARequest | None = None
    kv_layout: str = ""  # within a block (engine/execution/kv_shares.py); the importing engine's must be the same

    @property
    def num_computed(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) - 1

    @property
    def num_bytes(self) -> int:
        return len(self.kv)

    def kv_tensor(self) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only buffer: the tensor is only read (copied into the pool)
            raw = torch.from_numpy(np.frombuffer(self.kv, dtype=np.uint8))
        return raw.view(getattr(torch, self.dtype)).reshape(self.shape)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def geometry(core: "EngineCore") -> KVGeometry:
    """The engine's KV geometry, asked of its runner (rank 0) once."""
    if core.kv_geometry is None:
        core.kv_geometry = core.executor.collective_rpc(kv_geometry)[0]
    return core.kv_geometry


def export_handoff(core: "EngineCore", seq: Sequence) -> KVHandoff:
    """The request's computed KV (its table's first blocks, every rank's heads) and state, read before its blocks
    are freed."""
    kv, g = core.block_manager, geometry(core)
    n = kv.blocks_for(seq.num_computed_tokens)
    ids = [b.block_id for b in kv.tables[seq.request_id][:n]]
    blocks = gather(core.executor.collective_rpc(read_share, ids), g.layout)
    gen = core.executor.collective_rpc(generator_state, seq.request_id)[0]
    return KVHandoff(
        seq.request_id,
        list(seq.prompt_token_ids),
        list(seq.output_token_ids),
        seq.params,
        tensor_bytes(blocks),
        list(blocks.shape),
        str(blocks.dtype).removeprefix("torch."),
        seq.priority,
        seq.cache_salt,
        tensor_bytes(gen) if gen is not None else None,
        seq.num_cached_tokens,
        seq.lora,
        g.layout,
    )


def check_handoff(core: "EngineCore", h: KVHandoff, request_id: str | None = None) -> int:
    """The blocks the handoff's KV needs here; ValueError when it does not fit this engine's layout, or is more
    than its whole pool."""
    kv, sched, g = core.block_manager, core.scheduler, geometry(core)
    rid = request_id or h.request_id
    if rid in sched.requests or rid in core.compiling or any(rid == w[0] for w in core.importing):
        raise ValueError(f"request_id {rid!r} is already running")
    if not h.output_token_ids:
        raise ValueError("KVHandoff.output_token_ids: a handoff carries at least the first token")
    want = g.shape(kv.blocks_for(h.num_computed))
    if h.shape != want or h.dtype != g.dtype:
        raise ValueError(f"KVHandoff.shape: {h.shape} {h.dtype} does not fit this engine's KV cache {want} {g.dtype}")
    if h.kv_layout != g.layout:
        raise ValueError(
            f"KVHandoff.kv_layout: {h.kv_layout!r} blocks, this engine's attention backend reads {g.layout!r}"
        )
    if h.params.structured is not None:
        raise ValueError("KVHandoff.params: structured outputs are not handed off")
    if want[2] > kv.num_blocks:
        raise ValueError(f"KVHandoff: {want[2]} blocks are more than this engine's {kv.num_blocks}")
    if h.lora is not None and sched.lora_slots is None:
        raise ValueError("KVHandoff.lora: LoRA is off here (EngineConfig.max_loras is 0)")
    return want[2]


def can_start(core: "EngineCore", h: KVHandoff, num_blocks: int) -> bool:
    """Whether the handoff's KV fits the free blocks and its adapter a slot beside the running requests'."""
    sched = core.scheduler
    if num_blocks > core.block_manager.num_free_blocks:
        return False
    return h.lora is None or sched.lora_slots.fits(h.lora, sched.running)


def import_handoff(core: "EngineCore", h: KVHandoff, request_id: str | None = None) -> Sequence:
    """Allocates blocks for the handoff's KV, writes it, publishes its full blocks' prefix keys and runs the
    request from its next decode step (with the handoff's adapter, which the scheduler gives a slot as it does
    any running request's). ValueError (nothing changed) when the KV does not fit this engine's layout or its
    free blocks, or its adapter no slot."""
    kv, sched = core.block_manager, core.scheduler
    rid = request_id or h.request_id
    n = check_handoff(core, h, rid)
    if n > kv.num_free_blocks:
        raise ValueError(f"KVHandoff: {n} blocks do not fit the {kv.num_free_blocks} free blocks")
    if h.lora is not None and not sched.lora_slots.fits(h.lora, sched.running):
        raise ValueError(f"KVHandoff.lora: the running requests' adapters hold every slot ({h.lora.name!r} waits)")
    seq = Sequence(rid, list(h.prompt_token_ids), h.params, priority=h.priority, cache_salt=h.cache_salt, lora=h.lora)
    seq.token_ids += h.output_token_ids
    seq.num_computed_tokens, seq.num_cached_tokens = h.num_computed, h.num_cached_tokens
    table = kv.pool.allocate(n)
    kv.tables[rid] = table
    ids = [b.block_id for b in table]
    if kv.caching:
        kv._register(seq, table, h.num_computed // kv.block_size)
    p = h.params
    stop_ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(sched.eos_token_ids))
    gen = torch.frombuffer(bytearray(h.generator_state), dtype=torch.uint8) if h.generator_state else None
    new = NewRequestData(rid, seq.prompt_token_ids, p, stop_ids)
    core.executor.collective_rpc(adopt, new, ids, h.output_token_ids, gen, h.kv_tensor(), h.kv_layout)
    seq.seen_by_runner = True
    seq.status = SequenceStatus.RUNNING
    seq.enqueued_step = sched.num_steps
    seq.first_scheduled_time = seq.first_token_time = time.monotonic()
    sched.requests[rid] = seq
    sched.running.append(seq)
    return seq

"""A step's model inputs, built from its scheduled chunks and the persistent batch: token ids, positions,
attention metadata (slots, block tables, lengths) and the rows to sample."""

from itertools import chain, compress
from operator import attrgetter, itemgetter

import numpy as np
import torch

from conveyor.engine.execution.persistent_batch import PersistentBatch
from conveyor.engine.model.attention import AttentionMetadata
from conveyor.engine.model.linear import padded_rows
from conveyor.engine.model.lora import LoRAModel
from conveyor.engine.step import ScheduledChunk

ModelInputs = tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, np.ndarray, list[str]]
"""input_ids, positions, metadata, sample_idx (rows of the hidden states to sample), their persistent-batch
rows, their request ids."""

_req_id, _token_ids, _start, _sample = (attrgetter(f) for f in ("req_id", "token_ids", "start", "sample"))


def cu_of(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums: where each group starts."""
    return np.cumsum(counts) - counts


def prepare_inputs(
    chunks: list[ScheduledChunk],
    drafts: dict[str, list[int]] | None,
    batch: PersistentBatch,
    block_size: int,
    device: torch.device,
    pad_steps: bool,
    lora: LoRAModel | None,
) -> ModelInputs:
    """Returns the model's inputs, then the persistent-batch rows and request ids of the sampled rows: one per
    sampled chunk, k + 1 (all its tokens) for a chunk carrying k drafts. Decodes (one-token chunks) come first in
    `chunks`. pad_steps: a step with a prefill runs at padded_rows(tokens) rows. Sets `lora`'s batch."""
    bs, n = block_size, len(chunks)
    req_ids = list(map(_req_id, chunks))
    token_ids = list(map(_token_ids, chunks))
    q_lens = np.fromiter(map(len, token_ids), dtype=np.int64, count=n)
    starts = np.fromiter(map(_start, chunks), dtype=np.int64, count=n)
    sample = np.fromiter(map(_sample, chunks), dtype=bool, count=n)
    seq_lens = starts + q_lens
    rows = batch.index(req_ids)
    block_tables = batch.block_tables(rows)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu[1:])
    nd = int((q_lens == 1).sum())  # one-token chunks (decodes) come first
    if nd == n:  # decode-only step: one query row per sequence, no prefill metadata to build
        positions = starts
        input_ids = np.fromiter(map(itemgetter(0), token_ids), dtype=np.int64, count=n)
        slots = block_tables[np.arange(n), starts // bs].astype(np.int64) * bs + starts % bs
    else:
        seq_of_token = np.repeat(np.arange(n), q_lens)
        positions = np.arange(cu[-1]) - cu[:-1][seq_of_token] + starts[seq_of_token]
        slots = block_tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        input_ids = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=int(cu[-1]))
        if pad_steps and (pad := padded_rows(int(cu[-1])) - int(cu[-1])):
            # rows no chunk owns: token 0 at position 0, K/V not stored (slot -1), never sampled
            input_ids, positions = np.pad(input_ids, (0, pad)), np.pad(positions, (0, pad))
            slots = np.pad(slots, (0, pad), constant_values=-1)
    sample_idx = cu[1:][sample] - 1
    sampled = req_ids if sample.all() else list(compress(req_ids, sample))
    sample_rows = rows[sample]
    if drafts:
        per_chunk = np.where([r in drafts for r in req_ids], q_lens, sample)
        owner = np.repeat(np.arange(n), per_chunk)
        sample_idx = cu[1:][owner] - per_chunk[owner] + np.arange(len(owner)) - np.repeat(cu_of(per_chunk), per_chunk)
        sampled, sample_rows = [req_ids[i] for i in owner], rows[owner]

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    pre_cu = cu[nd:] - cu[nd]
    seq_lens32 = seq_lens.astype(np.int32)
    meta = AttentionMetadata(
        slot_mapping=t(slots),
        num_decodes=nd,
        decode_block_tables=t(block_tables[:nd]),
        decode_seq_lens=t(seq_lens32[:nd]),
        decode_max_seq_len=int(seq_lens[:nd].max()) if nd else 0,
        prefill_block_tables=t(block_tables[nd:]),
        prefill_seq_lens=t(seq_lens32[nd:]),
        prefill_query_start_loc=t(pre_cu.astype(np.int32)),
        prefill_max_query_len=int(q_lens[nd:].max()) if nd < n else 0,
        prefill_max_seq_len=int(seq_lens[nd:].max()) if nd < n else 0,
        block_tables=t(block_tables),
        seq_lens=t(seq_lens32),
        query_start_loc=t(cu.astype(np.int32)),
    )
    if len(sample_idx) < cu[-1] and not drafts:
        meta.sampled = sampled_metadata(meta.slot_mapping, block_tables[sample], seq_lens32[sample], device)
    sample_idx = t(sample_idx)
    if lora is not None:
        lora_slots = np.fromiter((c.lora_slot for c in chunks), dtype=np.int64, count=n)
        token_slots = lora_slots if nd == n else np.repeat(lora_slots, q_lens)
        token_slots = np.pad(token_slots, (0, len(input_ids) - len(token_slots)), constant_values=-1)
        lora.set_batch(token_slots, sample_idx if meta.sampled is not None else None)
    return t(input_ids), t(positions), meta, sample_idx, sample_rows, sampled


def sampled_metadata(
    slot_mapping: torch.Tensor, block_tables: np.ndarray, seq_lens: np.ndarray, device: torch.device
) -> AttentionMetadata:
    """The last layer's view: this step's slots, one query per sampled sequence at its last position."""
    n, dev = len(seq_lens), device
    tables, lens = torch.from_numpy(block_tables).to(dev), torch.from_numpy(seq_lens).to(dev)
    none = torch.zeros(0, dtype=torch.int32, device=dev)
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        num_decodes=n,
        decode_block_tables=tables,
        decode_seq_lens=lens,
        decode_max_seq_len=int(seq_lens.max()) if n else 0,
        prefill_block_tables=tables[:0],
        prefill_seq_lens=none,
        prefill_query_start_loc=none,
        prefill_max_query_len=0,
        prefill_max_seq_len=0,
        block_tables=tables,
        seq_lens=lens,
        query_start_loc=torch.arange(n + 1, dtype=torch.int32, device=dev),
    )

from dataclasses import dataclass

import torch
from torch import nn

from conveyor.kernels import AttentionOps


@dataclass
class AttentionMetadata:
    """One step's view of the paged KV cache. Tokens are packed decodes first, then prefills."""

    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    decode_max_seq_len: int
    prefill_block_tables: torch.Tensor
    prefill_seq_lens: torch.Tensor
    prefill_query_start_loc: torch.Tensor
    prefill_max_query_len: int
    prefill_max_seq_len: int
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    # The last layer's view when only some tokens are sampled: the same slots to store this step's K/V,
    # and one query per sampled sequence (its last token), as decodes.
    sampled: "AttentionMetadata | None" = None


class Attention(nn.Module):
    """Stores this step's K/V in the paged cache, then attends over each sequence's blocks."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, ops: AttentionOps) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.ops = ops
        self.k_cache = self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        ops, kc, vc = self.ops, self.k_cache, self.v_cache
        ops.store_kv_cache(k, v, kc, vc, meta.slot_mapping)
        if ops.paged_attention is not None:
            return ops.paged_attention(q, kc, vc, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale)
        d = meta.num_decodes
        if d == q.shape[0]:
            return ops.paged_decode_attention(
                q,
                kc,
                vc,
                meta.decode_block_tables,
                meta.decode_seq_lens,
                self.scale,
                max_seq_len=meta.decode_max_seq_len,
            )
        prefill = ops.paged_prefill_attention(
            q[d:],
            kc,
            vc,
            meta.prefill_block_tables,
            meta.prefill_seq_lens,
            meta.prefill_query_start_loc,
            meta.prefill_max_query_len,
            self.scale,
            max_seq_len=meta.prefill_max_seq_len,
        )
        if d == 0:
            return prefill
        decode = ops.paged_decode_attention(
            q[:d],
            kc,
            vc,
            meta.decode_block_tables,
            meta.decode_seq_lens,
            self.scale,
            max_seq_len=meta.decode_max_seq_len,
        )
        return torch.cat((decode, prefill))

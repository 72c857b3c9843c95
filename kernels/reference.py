"""Pure-torch paged attention: the oracle of the C++ and Triton kernels and the fallback of the engine.

Every step shape is valid input, empty ones included (no decodes, no prefills, no sampled rows). Scores,
softmax and the weighted sum of values are computed in float32 whatever the q and cache dtypes, as
FlashAttention and vLLM accumulate; the output is cast back to q's dtype.

Layouts (shared with kernels/triton_*.py):
  q             [num_tokens, num_heads, head_dim]            packed, no padding
  k_cache/v_cache [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables  [num_seqs, max_blocks] int32                  unused entries may hold any valid id
  seq_lens      [num_seqs] int32   context length after this step (cached + new tokens)
  query_start_loc [num_seqs + 1] int32  cumulative new-token counts; query i of sequence b sits at
                absolute position seq_lens[b] - q_len[b] + i and sees keys 0..that position.
"""

import torch
import torch.nn.functional as F


def store_kv_cache(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value rows [T, kv_heads, d] to flat slots; slot -1 is skipped."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    slots = slot_mapping.long()
    flat_k = k_cache.view(-1, *k_cache.shape[2:])
    flat_v = v_cache.view(-1, *v_cache.shape[2:])
    flat_k.index_copy_(0, slots, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slots, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, num_blocks: int) -> torch.Tensor:
    b = block_tables.shape[0]
    blocks = cache[block_tables[:, :num_blocks].long()]  # [B, nb, bs, kvh, d]
    return blocks.view(b, -1, cache.shape[2], cache.shape[3]).transpose(1, 2)  # [B, kvh, L, d]


def _attend(
    qp: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    q_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """qp: [B, max_q, h, d] padded queries -> [B, max_q, h, d]."""
    if qp.numel() == 0 or max_seq_len == 0:
        return torch.zeros_like(qp)
    block_size = k_cache.shape[1]
    num_blocks = (max_seq_len + block_size - 1) // block_size  # kernels/ imports only torch
    k = _gather(k_cache, block_tables, num_blocks)
    v = _gather(v_cache, block_tables, num_blocks)
    key_pos = torch.arange(k.shape[2], device=qp.device)
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(qp.shape[1], device=qp.device)
    mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (key_pos < seq_lens[:, None])[:, None, :]
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2).float(), k.float(), v.float(), attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).to(qp.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """One query per sequence: q [B, h, d] -> [B, h, d]."""
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    ones = torch.ones_like(seq_lens)
    return _attend(q[:, None], k_cache, v_cache, block_tables, seq_lens, ones, max_seq_len, scale)[:, 0]


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Variable-length new tokens over cached context: q [T, h, d] -> [T, h, d]."""
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    num_seqs = seq_lens.shape[0]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_idx = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens)
    pos = torch.arange(q.shape[0], device=q.device) - query_start_loc[:-1].long()[seq_idx]
    qp = q.new_zeros(num_seqs, max_query_len, *q.shape[1:])
    qp[seq_idx, pos] = q
    out = _attend(qp, k_cache, v_cache, block_tables, seq_lens.long(), q_lens, max_seq_len, scale)
    return out[seq_idx, pos]

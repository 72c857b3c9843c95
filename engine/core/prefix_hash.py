"""The prefix-cache key of a full KV block: the engine caches blocks by it, the cluster layer routes by it.
Imports only the standard library, so the HTTP edge and the Serve controller can use it without torch."""

import hashlib
import struct
from typing import Sequence


def _prefixed(text: str | None) -> bytes:
    data = (text or "").encode()
    return len(data).to_bytes(8, "little") + data


def block_hash(
    parent: bytes | None, token_ids: Sequence[int], salt: str | None = None, lora: str | None = None
) -> bytes:
    """sha256 over an injective encoding: a tag, then the parent key (later blocks) or the length-prefixed
    salt (first block, so the salt reaches every block through the chain) and, with an adapter (its
    LoRARequest.cache_key), a length-prefixed lora key under a tag of its own, then the token ids as int64 LE."""
    if parent is not None:
        h = hashlib.sha256(b"\x01" + parent)
    elif lora is None:
        h = hashlib.sha256(b"\x00" + _prefixed(salt))
    else:
        h = hashlib.sha256(b"\x02" + _prefixed(salt) + _prefixed(lora))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    max_blocks: int | None = None,
    lora: str | None = None,
) -> list[bytes]:
    """Chain keys of the leading FULL blocks of a prompt (at most `max_blocks`), as the engine computes them."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    keys: list[bytes] = []
    parent = None
    for i in range(n):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size], salt, lora)
        keys.append(parent)
    return keys

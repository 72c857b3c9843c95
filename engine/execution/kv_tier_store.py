"""The lower KV tiers' memory on one rank: a host tensor (pinned on CUDA) and a memory-mapped disk file, each
shaped like the pool, with its own shard of the KV heads at TP > 1. Runs a step's copies (engine/step.py
KVTransfer): `before` in the step's thread, `after` on a copy thread beside the forward; the next step waits
for them before it copies or runs."""

import os
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import groupby

import torch

from conveyor.engine.step import KVCopy


def _disk_tensor(path: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over a new file of its size (sparse), written through the page cache."""
    numel = 1
    for d in shape:
        numel *= d
    with open(path, "wb") as f:
        f.truncate(numel * torch.tensor([], dtype=dtype).element_size())
    try:
        return torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
    finally:
        os.unlink(path)  # the mapping keeps the file until the tensor goes: nothing is left behind


class KVTierStore:
    def __init__(self, pool: torch.Tensor, tiers: list[tuple[str, int]], disk_path: str | None, rank: int) -> None:
        """`pool`: the runner's KV cache, (2, layers, blocks, block_size, kv_heads, head_dim)."""
        self.tensors = [pool]
        for name, n in tiers:
            shape = (*pool.shape[:2], n, *pool.shape[3:])
            if name == "host":
                pin = pool.device.type == "cuda"
                self.tensors.append(torch.zeros(shape, dtype=pool.dtype, pin_memory=pin))
            else:
                os.makedirs(disk_path, exist_ok=True)
                path = os.path.join(disk_path, f"kv_tier_rank{rank}_{os.getpid()}.bin")
                self.tensors.append(_disk_tensor(path, shape, pool.dtype))
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-copy")
        self.pending: Future | None = None
        self.stream = torch.cuda.Stream(pool.device) if pool.device.type == "cuda" else None

    def run(self, copies: list[KVCopy]) -> None:
        """The copies in order; consecutive ones between the same two tiers as one indexed copy."""
        for (src_t, dst_t), group in groupby(copies, key=lambda c: (c[0], c[2])):
            group = list(group)
            src, dst = self.tensors[src_t], self.tensors[dst_t]
            src_idx = torch.tensor([c[1] for c in group], dtype=torch.long, device=src.device)
            dst_idx = torch.tensor([c[3] for c in group], dtype=torch.long, device=dst.device)
            dst[:, :, dst_idx] = src.index_select(2, src_idx).to(dst.device)

    def start(self, copies: list[KVCopy]) -> None:
        self.wait()
        if copies:
            self.pending = self.thread.submit(self._run_after, copies)

    def _run_after(self, copies: list[KVCopy]) -> None:
        with torch.inference_mode():
            if self.stream is None:
                return self.run(copies)
            with torch.cuda.stream(self.stream):
                self.run(copies)
            self.stream.synchronize()

    def wait(self) -> None:
        """The copy thread's last batch is done (its error, if any, raised here)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def close(self) -> None:
        self.wait()
        self.thread.shutdown()
        del self.tensors[1:]

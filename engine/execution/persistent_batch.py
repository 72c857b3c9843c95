"""The model runner's persistent batch: one numpy row per request it knows, holding its block table
(written when the request (re)starts, appended in place as it grows) and its sampling columns, so a
step gathers rows with numpy instead of rebuilding per-sequence Python lists."""

import numpy as np

from conveyor.engine.sampling_params import SamplingParams


class PersistentBatch:
    def __init__(self, max_blocks_per_seq: int, vocab_size: int, rows: int = 64) -> None:
        self.vocab_size = vocab_size
        self.block_table = np.zeros((rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.top_p = np.ones(rows, dtype=np.float32)
        self.top_k = np.full(rows, vocab_size, dtype=np.int64)
        self.min_p = np.zeros(rows, dtype=np.float32)
        self.rows: dict[str, int] = {}
        self.free = list(range(rows - 1, -1, -1))

    def _grow(self) -> None:
        n = len(self.num_blocks)
        for name in ("block_table", "num_blocks", "temperature", "top_p", "top_k", "min_p"):
            column = getattr(self, name)
            setattr(self, name, np.concatenate((column, column[:1].repeat(n, axis=0))))
        self.free = list(range(2 * n - 1, n - 1, -1))

    def add(self, req_id: str, params: SamplingParams) -> None:
        if not self.free:
            self._grow()
        row = self.rows[req_id] = self.free.pop()
        self.num_blocks[row] = 0
        self.temperature[row], self.top_p[row], self.min_p[row] = params.temperature, params.top_p, params.min_p
        self.top_k[row] = params.top_k if params.top_k > 0 else self.vocab_size

    def remove(self, req_id: str) -> None:
        row = self.rows.pop(req_id, None)
        if row is not None:
            self.free.append(row)

    def set_blocks(self, req_id: str, block_ids: list[int], append: bool) -> None:
        row = self.rows[req_id]
        start = int(self.num_blocks[row]) if append else 0
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def index(self, req_ids: list[str]) -> np.ndarray:
        return np.fromiter(map(self.rows.__getitem__, req_ids), dtype=np.int64, count=len(req_ids))

    def block_tables(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), width of the longest] block ids; entries past a row's end are stale but valid ids."""
        return self.block_table[rows, : int(self.num_blocks[rows].max())]

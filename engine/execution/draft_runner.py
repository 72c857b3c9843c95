"""The draft model of speculative method "draft", beside the target in the model runner. Its paged KV cache has
the target's block ids and block tables (its own tensors, shaped by its layers and KV heads), so the scheduler's
blocks serve both: every step it runs over the step's tokens at the same positions and slots, which keeps its
K/V in step with the target's through prefill chunks, decodes, verified drafts and recompute after preemption
(rejected drafts' slots are overwritten later, as the target's are). After the step, `propose` runs k greedy
single-token forwards from each named request's newest token, writing K/V into the k lookahead slots the
scheduler allocated past its chunk; the next step's forward over the request's chunk writes them again."""

import numpy as np
import torch

from conveyor.engine.checkpoints.loader import load_weights
from conveyor.engine.execution.model_inputs import sampled_metadata
from conveyor.engine.model.attention import AttentionMetadata
from conveyor.engine.model.llama import LlamaForCausalLM, head_dim_of
from conveyor.engine.resolved_config import ResolvedConfig
from conveyor.engine.stats import cdiv
from conveyor.kernels import AttentionOps


class DraftRunner:
    def __init__(self, config: ResolvedConfig, ops: AttentionOps, device: torch.device) -> None:
        hf = config.draft_hf_config
        self.k = config.speculative.num_speculative_tokens
        self.dtype, self.device = config.torch_dtype, device
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        with device:
            self.model = LlamaForCausalLM(hf, ops, config.max_model_len)
        torch.set_default_dtype(default_dtype)
        load_weights(self.model, config.draft_model_path, hf.tie_word_embeddings)
        self.attn_layers = self.model.attention_layers()
        self.num_kv_heads, self.head_dim = self.attn_layers[0].num_kv_heads, head_dim_of(hf)
        self.kv_cache = torch.empty(0)

    def block_bytes(self, block_size: int) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * len(self.attn_layers) * block_size * self.num_kv_heads * self.head_dim * elem

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        shape = (2, len(self.attn_layers), num_blocks, block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> None:
        """The step's tokens through the draft: only their K/V is kept."""
        self.model(input_ids, positions, meta)

    def propose(
        self, tokens: list[int], positions: np.ndarray, block_tables: np.ndarray, block_size: int
    ) -> list[list[int]]:
        """k greedy tokens after each request's newest token (`tokens`, at `positions`, not in the cache yet);
        block_tables' rows cover positions + k - 1. Writes K/V at positions .. positions + k - 1."""
        n, dev, bs = len(tokens), self.device, block_size
        ids = torch.tensor(tokens, dtype=torch.long, device=dev)
        out = torch.empty((n, self.k), dtype=torch.long, device=dev)
        rows = np.arange(n)
        for j in range(self.k):
            pos = positions + j
            lens = (pos + 1).astype(np.int32)
            tables = np.ascontiguousarray(block_tables[:, : cdiv(int(lens.max()), bs)])
            slots = torch.from_numpy(tables[rows, pos // bs].astype(np.int64) * bs + pos % bs).to(dev)
            meta = sampled_metadata(slots, tables, lens, dev)
            hidden = self.model(ids, torch.from_numpy(pos).to(dev), meta)
            ids = out[:, j] = self.model.compute_logits(hidden).argmax(-1)
        return out.tolist()

"""Owns the model and its paged KV cache on one device; turns a SchedulerOutput into sampled tokens."""

import functools
import logging
import os
import time

import numpy as np
import torch

from conveyor.engine.checkpoints.loader import load_weights
from conveyor.engine.checkpoints.lora import read_adapter
from conveyor.engine.execution.draft_runner import DraftRunner
from conveyor.engine.execution.host_memory import keep_freed_memory
from conveyor.engine.execution.kv_tier_store import KVTierStore
from conveyor.engine.execution.model_inputs import ModelInputs, prepare_inputs
from conveyor.engine.execution.persistent_batch import PersistentBatch
from conveyor.engine.execution.rejection_sampler import fold_drafts
from conveyor.engine.execution.sampler import SamplingBatch, add_constraints, sample
from conveyor.engine.execution.sampling_inputs import RequestState, sampling_batch
from conveyor.engine.model.attention import AttentionMetadata
from conveyor.engine.model.linear import pack_weights
from conveyor.engine.model.llama import LlamaForCausalLM, head_dim_of
from conveyor.engine.model.lora import LoRAModel
from conveyor.engine.model.parallel import tp_rank
from conveyor.engine.resolved_config import ResolvedConfig
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.stats import cdiv
from conveyor.engine.step import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput
from conveyor.kernels import attention_ops

log = logging.getLogger("conveyor")


@functools.cache
def _process_cpus() -> list[int]:
    """The cpus this process may use, as first seen: once threads are bound, the calling thread's own
    affinity is one cpu, and a second engine in the process would pin every thread there."""
    return sorted(os.sched_getaffinity(0))


def _is_prefill(c: ScheduledChunk) -> bool:
    return len(c.token_ids) > 1


class ModelRunner:
    def __init__(self, config: ResolvedConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if config.keep_freed_memory and self.device.type == "cpu":
            keep_freed_memory()
        self.rank = tp_rank()
        self.block_size = config.block_size
        hf = config.hf_config
        torch.manual_seed(config.seed)
        ops = attention_ops(config.attention_backend)
        if self.rank == 0:
            isa = f" ({ops.fused.isa})" if ops.fused is not None else ""
            log.info("attention backend: %s%s on %s", ops.name, isa, self.device)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.torch_dtype)
        with self.device:
            self.model = LlamaForCausalLM(hf, ops, config.max_model_len)
        torch.set_default_dtype(default_dtype)
        load_weights(self.model, config.model_path, hf.tie_word_embeddings)
        self.lora = None  # before packing: the slots take the linears' shapes and shard loaders
        if config.max_loras:
            self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank, config.torch_dtype, self.device)
        if config.cpu_threads_bind == "auto" and ops.fused is not None:
            allowed, n = _process_cpus(), torch.get_num_threads()
            cpus = [allowed[(self.rank * n + i) % len(allowed)] for i in range(n)]  # TP ranks on disjoint cores
            log.info("torch threads bound to cpus %s", ops.fused.bind_threads(cpus))
        self.draft = DraftRunner(config, ops, self.device) if config.draft_hf_config is not None else None
        self.pad_steps = False  # steps with a prefill run at padded_rows(tokens): bounded oneDNN primitive shapes
        if config.prepack_weights and self.device.type == "cpu":
            with torch.inference_mode():
                packed = pack_weights(self.model, ops.fused)  # timed per shape: after binding
                if self.draft is not None:
                    pack_weights(self.draft.model, ops.fused)
            self.pad_steps = packed > 0 and ops.fused is not None  # the C++ attention zeroes padding rows
        self.attn_layers = self.model.attention_layers()
        self.num_kv_heads = self.attn_layers[0].num_kv_heads
        self.head_dim = head_dim_of(hf)
        self.vocab_size = hf.vocab_size
        self.requests: dict[str, RequestState] = {}
        self.batch = PersistentBatch(cdiv(config.max_model_len, config.block_size), self.vocab_size)
        self.special: set[str] = set()  # requests the sampler must treat one by one (penalties, seeds, ...)
        self.biased: set[str] = set()  # requests with a logit_bias
        # ranks but 0 (which sample nothing): requests whose drafts were verified last time they ran, their block
        # table rows not yet cut back to their computed tokens (rank 0 cuts at once: rejection_sampler.fold_drafts)
        self.unfolded: set[str] = set()
        self.kv_cache = torch.empty(0)
        self.cpu_cache = torch.empty(0)
        self.tier_store: KVTierStore | None = None

    @property
    def block_bytes(self) -> int:
        elem = torch.tensor([], dtype=self.config.torch_dtype).element_size()
        draft = self.draft.block_bytes(self.block_size) if self.draft is not None else 0
        return 2 * len(self.attn_layers) * self.block_size * self.num_kv_heads * self.head_dim * elem + draft

    def available_blocks(self) -> int:
        cfg = self.config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = total * cfg.gpu_memory_utilization - (total - free) - self._profile_activation_bytes()
        else:
            budget = cfg.kv_cache_memory or 512 * 2**20
        return max(int(budget // self.block_bytes), 0)

    def _profile_activation_bytes(self) -> int:
        n = min(self.config.max_num_batched_tokens, self.config.max_model_len)
        blocks = cdiv(n, self.block_size)
        self.allocate_kv_cache(blocks)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        chunk = ScheduledChunk("profile", [0] * n, 0, list(range(blocks)), True, True)
        self.execute_model(SchedulerOutput([NewRequestData("profile", [0] * n, SamplingParams(), [])], [chunk]))
        self.requests.clear()
        self.batch.remove("profile")
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_cache = torch.empty(0)
        torch.cuda.empty_cache()
        return peak

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (2, len(self.attn_layers), num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.config.torch_dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks, self.block_size)
        swap_blocks = self.config.swap_space // self.block_bytes if self.config.preemption_mode == "swap" else 0
        if swap_blocks:
            pin = self.device.type == "cuda"
            self.cpu_cache = torch.zeros(
                (*shape[:2], swap_blocks, *shape[3:]), dtype=self.config.torch_dtype, pin_memory=pin
            )

    def allocate_kv_tiers(self) -> list[tuple[str, int]]:
        """The lower KV tiers' memory on this rank (its shard of every block); returns (tier, slots) from the
        top tier down, the same on every rank."""
        offload = self.config.kv_offload
        if offload is None:
            return []
        tiers = offload.tier_slots(self.block_bytes * self.config.tensor_parallel_size)
        if self.tier_store is not None:
            self.tier_store.close()
        self.tier_store = KVTierStore(self.kv_cache, tiers, offload.disk_path, self.rank) if tiers else None
        return tiers

    def swap_blocks(self, pairs: list[tuple[int, int]], to_cpu: bool) -> None:
        if not pairs:
            return
        src, dst = (torch.tensor(x, dtype=torch.long) for x in zip(*pairs))
        if to_cpu:
            self.cpu_cache[:, :, dst] = self.kv_cache[:, :, src.to(self.device)].to("cpu")
        else:
            self.kv_cache[:, :, dst.to(self.device)] = self.cpu_cache[:, :, src].to(self.device)

    def _add_request(self, r: NewRequestData) -> None:
        gen = None
        if r.params.seed is not None:
            gen = torch.Generator(self.device).manual_seed(r.params.seed)
        self.requests[r.req_id] = RequestState(r.prompt_token_ids, [], r.params, r.stop_ids_for_min_tokens, gen)
        self.batch.add(r.req_id, r.params)
        p = r.params
        if p.has_penalties or gen is not None or p.logprobs is not None or (p.min_tokens and r.stop_ids_for_min_tokens):
            self.special.add(r.req_id)
        if p.logit_bias:
            self.biased.add(r.req_id)

    def adopt_request(
        self, r: NewRequestData, block_ids: list[int], output_token_ids: list[int], generator_state: torch.Tensor | None
    ) -> None:
        """A request whose KV another engine computed (engine/core/kv_handoff.py): it joins the batch with its
        block table, sampled tokens and generator state, as if this runner had run its prefill."""
        self._add_request(r)
        state = self.requests[r.req_id]
        state.output_token_ids = list(output_token_ids) if r.req_id in self.special else []
        if generator_state is not None and state.generator is not None:
            state.generator.set_state(generator_state)
        self.batch.set_blocks(r.req_id, block_ids, append=False)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self.batch.remove(rid)
            self.special.discard(rid)
            self.biased.discard(rid)
            self.unfolded.discard(rid)
        for r in so.new_requests:
            self._add_request(r)
        self.swap_blocks(so.swap_out, to_cpu=True)
        self.swap_blocks(so.swap_in, to_cpu=False)
        for slot, lora in so.lora_loads:
            self.lora.load(slot, read_adapter(lora.path, self.config.hf_config, self.config.max_lora_rank))
        load_s = self._transfer(so) if self.tier_store is not None else 0.0
        if not so.chunks:
            return ModelRunnerOutput([], [], [], kv_load_s=load_s) if self.rank == 0 else None
        chunks = sorted(so.chunks, key=_is_prefill)
        for c in chunks:
            if c.req_id in self.unfolded:  # its computed tokens are c.start now: the scheduler rolled back the rest
                self.unfolded.discard(c.req_id)
                self.batch.num_blocks[self.batch.rows[c.req_id]] = cdiv(c.start, self.block_size)
            if c.new_block_ids or c.reset_blocks:
                self.batch.set_blocks(c.req_id, c.new_block_ids, append=not c.reset_blocks)
        input_ids, positions, meta, sample_idx, rows, sampled = self._prepare(chunks, so.draft_token_ids)
        batch = None
        if self.rank == 0:
            batch = sampling_batch(sampled, rows, self.batch, self.requests, self.special, self.vocab_size, self.device)
            if self.biased or so.grammar is not None:
                batch = add_constraints(
                    batch, [self.requests[r].params for r in sampled], sampled, so.grammar, self.device
                )
        tokens, logprobs = self._run(input_ids, positions, meta, sample_idx, batch)
        if self.draft is not None:
            self.draft.forward(input_ids, positions, meta)
        if self.rank != 0:
            self.unfolded |= so.draft_token_ids.keys()
            return None
        tokens = tokens.tolist()
        accepted = {}
        if so.draft_token_ids:
            sampled, tokens, logprobs, accepted = fold_drafts(
                chunks, so.draft_token_ids, sampled, tokens, logprobs, self.batch, self.block_size
            )
        proposals = self._propose(so, sampled, tokens, accepted) if so.lookahead_req_ids else {}
        if self.special:
            for rid, tok in zip(sampled, tokens):
                if rid in self.special:
                    self.requests[rid].output_token_ids.append(tok)
        return ModelRunnerOutput(
            sampled, tokens, logprobs or [None] * len(tokens), accepted, kv_load_s=load_s, proposals=proposals
        )

    def _propose(
        self, so: SchedulerOutput, sampled: list[str], tokens: list[int], accepted: dict[str, list[int]]
    ) -> dict[str, tuple[int, list[int]]]:
        """The draft model's proposals for the requests of so.lookahead_req_ids, each after the token this step
        gave it, tagged with the request's length then; their block table rows shrink back to the blocks of
        their computed tokens afterwards (the scheduler's roll_back)."""
        starts = {c.req_id: c.start + len(c.token_ids) for c in so.chunks}
        token_of = dict(zip(sampled, tokens))
        rids = so.lookahead_req_ids
        pos = np.array([starts[r] - len(so.draft_token_ids.get(r, ())) + len(accepted.get(r, ())) for r in rids])
        rows = self.batch.index(rids)
        drafts = self.draft.propose([token_of[r] for r in rids], pos, self.batch.block_table[rows], self.block_size)
        self.batch.num_blocks[rows] = -(-pos // self.block_size)
        return {r: (int(p) + 1, d) for r, p, d in zip(rids, pos, drafts)}

    def _transfer(self, so: SchedulerOutput) -> float:
        """The step's tier copies: the last step's background ones finish, this step's `before` ones run here
        (timed), its `after` ones start beside the forward."""
        store = self.tier_store
        store.wait()
        t = so.kv_transfer
        if t is None:
            return 0.0
        start = time.perf_counter()
        store.run(t.before)
        if self.device.type == "cuda" and t.before:
            torch.cuda.current_stream().synchronize()
        elapsed = time.perf_counter() - start
        store.start(t.after)
        return elapsed

    def _run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_idx: torch.Tensor,
        batch: SamplingBatch | None,
    ) -> tuple[torch.Tensor, list | None]:
        if meta.sampled is not None:
            logits = self.model.compute_logits(self.model(input_ids, positions, meta, keep=sample_idx))
        else:
            logits = self.model.compute_logits(self.model(input_ids, positions, meta)[sample_idx])
        return sample(logits, batch) if batch is not None else (torch.empty(0), None)

    def _prepare(self, chunks: list[ScheduledChunk], drafts: dict[str, list[int]] | None = None) -> ModelInputs:
        return prepare_inputs(chunks, drafts, self.batch, self.block_size, self.device, self.pad_steps, self.lora)

"""The engine core: scheduler + KV cache + grammars + executor and the busy loop over them (schedule ->
execute -> update). It reports token ids only; text, stop strings and streams are the front end's
(llm_engine.py, output_processor.py). Runs in the front end's thread or in its own process (core_process.py)."""

import logging
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from conveyor.engine.core.block_manager import BlockManager
from conveyor.engine.core.kv_events import KVEvents
from conveyor.engine.core.kv_handoff import (
    HANDOFF,
    KVHandoff,
    can_start,
    check_handoff,
    export_handoff,
    import_handoff,
)
from conveyor.engine.core.kv_tiers import KVTiers, LoadCost
from conveyor.engine.core.messages import AddRequest, CoreOutput
from conveyor.engine.core.output_lengths import OutputLengths
from conveyor.engine.core.scheduler import make_scheduler
from conveyor.engine.core.sequence import Sequence, SequenceStatus
from conveyor.engine.core.step_trace import StepTrace
from conveyor.engine.execution.executor import make_executor
from conveyor.engine.execution.kv_shares import KVGeometry
from conveyor.engine.model.llama import head_dim_of
from conveyor.engine.resolved_config import ResolvedConfig
from conveyor.engine.stats import EngineStats
from conveyor.engine.step import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from conveyor.engine.core.structured_output import StructuredOutputManager

log = logging.getLogger("conveyor")


class EngineCore:
    def __init__(
        self, config: ResolvedConfig, eos_token_ids: set[int], tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        self.config = config
        self.executor = make_executor(config)
        self.kv_geometry: KVGeometry | None = None  # kv_handoff.geometry
        if self.executor.num_blocks < 1:
            raise ValueError("EngineConfig.kv_cache_memory leaves no room for a single KV block")
        config.fit_max_model_len(self.executor.num_blocks)
        tiers = KVTiers(self.executor.kv_tiers) if self.executor.kv_tiers else None
        self.block_manager = BlockManager(
            self.executor.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.executor.num_swap_blocks,
            tiers,
        )
        self.load_cost = LoadCost(config.block_size)
        self.scheduler = make_scheduler(config, self.block_manager, eos_token_ids)
        self.scheduler.runner_batch = getattr(getattr(self.executor, "runner", None), "batch", None)
        self.tokenizer = tokenizer
        self._structured: "StructuredOutputManager | None" = None
        self.compiling: dict[str, tuple[Sequence, Future]] = {}
        self.importing: deque[tuple[str, KVHandoff, int]] = deque()  # handoffs waiting for free blocks
        self._growth: tuple[float, tuple, int] = (float("-inf"), (), 0)
        self.reported: dict[str, int] = {}
        self.prefill_only: set[str] = set()  # unfinished prefill-only requests (kv_handoff.py)
        self.num_finished = self.num_aborted = self.num_added = 0
        self.output_lengths = OutputLengths(prior=config.cold_output_tokens)
        self.busy_time_s, self.num_prefill_tokens, self.num_decode_tokens = 0.0, 0, 0
        self.step_trace = StepTrace()

    @property
    def structured(self) -> "StructuredOutputManager":
        """Built on the first constrained request: engine.structured_output imports xgrammar. Grammars live
        here, beside the sampler that applies their masks."""
        if self._structured is None:
            from conveyor.engine.core.structured_output import StructuredOutputManager

            if self.tokenizer is None:
                from transformers import AutoTokenizer

                self.tokenizer = AutoTokenizer.from_pretrained(self.config.model_path)
            self._structured = StructuredOutputManager(
                self.tokenizer, self.config.hf_config.vocab_size, sorted(self.scheduler.eos_token_ids)
            )
        return self._structured

    def add_request(self, req: AddRequest) -> None:
        rid = req.request_id
        if rid in self.scheduler.requests or rid in self.compiling:
            raise ValueError(f"request_id {rid!r} is already running")
        seq = Sequence(
            rid, list(req.prompt_token_ids), req.params, priority=req.priority, cache_salt=req.cache_salt, lora=req.lora
        )
        if req.arrival_time is not None:
            seq.arrival_time = req.arrival_time
        if req.prefill_only:
            if req.params.structured is not None:
                raise ValueError("prefill_only: structured outputs are not handed off")
            seq.prefill_only = True
            self.prefill_only.add(rid)
        if req.params.structured is not None:
            self.compiling[rid] = (seq, self.structured.compile(req.params.structured))
        else:
            self.scheduler.add(seq)
        self.reported[rid] = 0
        self.num_added += 1

    def finish_requests(
        self, request_ids: list[str], reason: str = "abort", stop_reasons: list[str | None] | None = None
    ) -> list[CoreOutput]:
        """Abort, or stop with a stop string the front end found (Scheduler.stop)."""
        outputs = []
        end = self.scheduler.finish if reason == "abort" else self.scheduler.stop
        for rid, stop in zip(request_ids, stop_reasons or [None] * len(request_ids)):
            seq = self.scheduler.requests.get(rid) or self.compiling.pop(rid, (None, None))[0]
            if seq is None:
                waiting = [w for w in self.importing if w[0] == rid]
                if waiting:
                    self.importing.remove(waiting[0])
                    outputs.append(self._unstarted(rid, reason, stop))
                continue
            end(seq, reason, stop)
            if seq.is_finished:
                outputs.append(self._output(seq, {}))
        return outputs

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.compiling) or bool(self.importing)

    def _admit_compiled(self) -> list[CoreOutput]:
        """Requests whose grammar is compiled join the scheduler; the rest wait here, so a slow compile holds
        up only its own request (and the loop sleeps on it only when there is nothing else to run)."""
        if not self.scheduler.has_unfinished:
            wait([f for _, f in self.compiling.values()], timeout=0.05, return_when=FIRST_COMPLETED)
        failed = []
        for rid, (seq, fut) in list(self.compiling.items()):
            if not fut.done():
                continue
            del self.compiling[rid]
            if fut.exception() is not None:
                log.warning("request %s: grammar compilation failed: %r", rid, fut.exception())
                self.scheduler.finish(seq, "abort")
                failed.append(self._output(seq, {}))
                continue
            self.structured.add(rid, fut.result())
            self.scheduler.add(seq)
        return failed

    def step(self) -> list[CoreOutput]:
        start = time.perf_counter()
        failed = self._admit_compiled() if self.compiling else []
        if self.importing:
            failed += self._import_waiting()
        so = self.scheduler.schedule()
        if self._structured is not None and self._structured.matchers:
            so.grammar = self._structured.bitmask([c.req_id for c in so.chunks if c.sample])
        try:
            ro = self.executor.execute_model(so)
        except Exception as e:
            return failed + self._fail_step(so, e)
        self.step_trace.record(so, self.scheduler, self.block_manager, start, ro)
        now = time.monotonic()
        changed = self.scheduler.update(so, ro, now)
        step_s = time.perf_counter() - start
        self.busy_time_s += step_s
        sampled = len(ro.token_ids) + sum(map(len, so.draft_token_ids.values()))
        self.num_decode_tokens += len(ro.token_ids) + sum(map(len, ro.accepted.values()))
        self.num_prefill_tokens += so.num_tokens - sampled
        if so.kv_transfer is not None or self.block_manager.tiers is not None:
            self._observe_load_cost(so, ro, step_s, so.num_tokens - sampled)
        if so.grammar is not None:
            for rid in self._structured.accept(ro.req_ids, ro.token_ids):
                seq = self.scheduler.requests.get(rid)
                if seq is not None:
                    self.scheduler.stop(seq, "stop")
        logprobs = dict(zip(ro.req_ids, ro.logprobs)) if ro.logprobs.count(None) < len(ro.logprobs) else {}
        handoffs = {}
        if self.prefill_only:
            handoffs = {s.request_id: self._hand_off(s) for s in changed if s.prefill_only and not s.is_finished}
        outputs = [self._output(seq, logprobs, now) for seq in changed]
        for out in outputs if handoffs else ():
            out.kv_handoff = handoffs.get(out.request_id)
        return failed + outputs

    def _hand_off(self, seq: Sequence) -> KVHandoff:
        """A prefill-only request has its first token: its KV leaves with it and its blocks are freed."""
        handoff = export_handoff(self, seq)
        self.scheduler.finish(seq, HANDOFF)
        return handoff

    def import_request(self, request_id: str, handoff: KVHandoff) -> None:
        """Continues a request another engine prefilled (kv_handoff.import_handoff); its first output reports
        only the tokens after the handoff's. Its KV goes in once its blocks fit the free ones and its adapter a
        slot: handoffs wait here in arrival order, imported before each step's schedule. ValueError (nothing
        changed) when it never could (check_handoff)."""
        blocks = check_handoff(self, handoff, request_id)
        self.importing.append((request_id, handoff, blocks))
        self.num_added += 1
        self._import_waiting()

    def _import_waiting(self) -> list[CoreOutput]:
        failed = []
        while self.importing and can_start(self, self.importing[0][1], self.importing[0][2]):
            rid, handoff, _ = self.importing.popleft()
            try:
                seq = import_handoff(self, handoff, rid)
            except ValueError as e:
                failed.append(self._unstarted(rid, "error", str(e)))
                continue
            self.reported[rid] = seq.num_output_tokens
        return failed

    def _unstarted(self, request_id: str, reason: str, why: str | None = None) -> CoreOutput:
        """The end of a handoff that never started here."""
        self.num_finished += 1
        self.num_aborted += reason == "abort"
        return CoreOutput(request_id, [], finish_reason=reason, stop_reason=why)

    def _observe_load_cost(
        self, so: SchedulerOutput, ro: ModelRunnerOutput, step_s: float, prefill_tokens: int
    ) -> None:
        num_loads = so.kv_transfer.num_loads if so.kv_transfer is not None else 0
        self.load_cost.observe(step_s, prefill_tokens, ro.kv_load_s, num_loads)
        self.scheduler.load_cost = self.load_cost.ratio

    def _fail_step(self, so: SchedulerOutput, error: Exception) -> list[CoreOutput]:
        """A model step that raised fails the requests it ran (and, if it swapped, the swapped ones, whose
        copies never happened); the blocks its chunks published are taken back, since their KV was never
        written. A broken executor (a lost TP rank) raises from check_health and ends the core instead."""
        log.exception("engine step failed; failing its %d requests", len(so.chunks))
        self.executor.check_health()
        message = f"model step failed: {error!r}"
        if so.kv_transfer is not None:  # the loads may not have run: their blocks must not serve their keys
            pool = self.block_manager.pool
            for _, _, dst_tier, block_id in so.kv_transfer.before:
                block = pool.blocks[block_id]
                if dst_tier == 0 and block.hash is not None:
                    if block.ref_count == 0:
                        del pool.free_cached[block_id]
                        pool.free_plain[block_id] = block
                    pool.unregister(block)
        victims = [self.scheduler.requests.get(c.req_id) for c in so.chunks]
        for c, seq in zip(so.chunks, victims):
            if seq is not None:
                seq.num_computed_tokens -= len(c.token_ids)
        if so.swap_out:
            victims += self.scheduler.swapped
        outputs = []
        for seq in dict.fromkeys(s for s in victims if s is not None):
            self.scheduler.finish(seq, "error", message)
            outputs.append(self._output(seq, {}))
        return outputs

    def _output(self, seq: Sequence, logprobs: dict, now: float | None = None) -> CoreOutput:
        rid = seq.request_id
        start = self.reported.get(rid, 0)
        new = seq.token_ids[len(seq.prompt_token_ids) + start :]
        lp = [logprobs.get(rid)] if new and seq.params.logprobs is not None else None
        if seq.status is SequenceStatus.FINISHED:
            self.reported.pop(rid, None)
            self.prefill_only.discard(rid)
            self.num_finished += 1
            self.num_aborted += seq.finish_reason == "abort"
            if seq.finish_reason in ("stop", "length"):
                self.output_lengths.add(seq.num_output_tokens)
            if self._structured is not None:
                self._structured.release(rid)
        else:
            self.reported[rid] = start + len(new)
        return CoreOutput(
            rid,
            new,
            lp,
            seq.finish_reason,
            seq.stop_reason,
            seq.first_scheduled_time,
            seq.first_token_time,
            now if seq.first_token_time else None,
            seq.finish_time,
            seq.num_preemptions,
            seq.num_cached_tokens,
        )

    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.block_manager
        waiting_tokens = sum(q.num_tokens - q.num_computed_tokens for q in s.waiting) + sum(
            q.num_tokens for q, _ in self.compiling.values()
        )
        waiting_tokens += sum(h.num_computed for _, h, _ in self.importing)  # KV handoffs waiting for blocks
        growth = self.growth_blocks()
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting) + len(self.compiling) + len(self.importing),
            num_waiting_tokens=waiting_tokens,
            num_swapped=len(s.swapped),
            kv_blocks_total=kv.num_blocks,
            kv_blocks_free=kv.num_free_blocks,
            num_preemptions=s.num_preemptions,
            prefix_cache_queries=kv.queries,
            prefix_cache_hits=kv.hits,
            num_finished=self.num_finished,
            num_aborted=self.num_aborted,
            num_added=self.num_added,
            max_num_seqs=self.config.max_num_seqs,
            block_size=self.config.block_size,
            busy_time_s=self.busy_time_s,
            num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens,
            **self.step_trace.counters(),
            tokens_left=sorted(self.tokens_left(q) for q in s.running)[:64],
            num_growth_blocks=growth,
            likely_output_tokens=self.output_lengths.typical(),
            **self._spec_counters(),
            **self.tier_stats(),
            lora_adapters=s.lora_slots.names() if s.lora_slots is not None else [],
            num_lora_loads=s.lora_slots.num_loads if s.lora_slots is not None else 0,
        )

    def _spec_counters(self) -> dict:
        spec = self.scheduler.spec
        if spec is None:
            return {}
        c = spec.counters
        return {
            "spec_decode_num_drafts": c.num_drafts,
            "spec_decode_num_draft_tokens": c.num_draft_tokens,
            "spec_decode_num_accepted_tokens": c.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(c.accepted_per_pos),
        }

    def tier_stats(self) -> dict:
        tiers = self.block_manager.tiers
        if tiers is None:
            return {}
        hf, cost = self.config.hf_config, self.load_cost
        elem = torch.tensor([], dtype=self.config.torch_dtype).element_size()
        block_bytes = (
            2 * hf.num_hidden_layers * self.config.block_size * hf.num_key_value_heads * head_dim_of(hf) * elem
        )
        return {
            "kv_tier_hits": {t.name: t.stats.hits for t in tiers.tiers},
            "kv_tier_stored": {t.name: t.stats.stored for t in tiers.tiers},
            "kv_tier_blocks": {t.name: len(t.lru) for t in tiers.tiers},
            "kv_tier_block_bytes": block_bytes,
            "kv_tier_load_s": cost.load_s,
            "kv_tier_loads": cost.num_loads,
            "kv_tier_load_cost": cost.ratio,
        }

    def tokens_left(self, seq: Sequence) -> int:
        """Output tokens the request likely still produces: up to its max_tokens, bounded by how long recent
        outputs ran (engine.output_lengths)."""
        done = seq.num_output_tokens
        return self.output_lengths.likely_total(done, seq.params.max_tokens) - done

    def growth_blocks(self, every_s: float = 0.02) -> int:
        """Blocks the running and waiting requests still allocate at their likely output lengths (a waiting
        prompt's own blocks are in num_waiting_tokens). Stats go out every step, and the count costs ~0.14 ms
        at 256 running requests, so while the same requests run it is recounted at most every `every_s` (its
        readers poll every 100 ms); a request that starts, waits or leaves recounts it at once."""
        s, now = self.scheduler, time.monotonic()
        key = (len(s.running), len(s.waiting), len(self.compiling), self.num_finished)
        if key == self._growth[1] and now - self._growth[0] < every_s:
            return self._growth[2]
        kv, limit = self.block_manager, self.config.max_model_len

        def final(q: Sequence) -> int:
            return kv.blocks_for(min(limit, q.num_tokens + self.tokens_left(q)))

        growth = sum(max(0, final(q) - len(kv.tables.get(q.request_id, ()))) for q in s.running) + sum(
            final(q) - kv.blocks_for(q.num_tokens) for q in [*s.waiting, *(q for q, _ in self.compiling.values())]
        )
        self._growth = (now, key, growth)
        return growth

    def drain_kv_events(self, max_events: int | None = None) -> KVEvents:
        return self.block_manager.drain_kv_events(max_events)

    def request_kv_reset(self) -> None:
        self.block_manager.request_kv_reset()

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        if self._structured is not None:
            self._structured.shutdown()
        self.executor.shutdown()

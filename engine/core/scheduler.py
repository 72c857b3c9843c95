"""Iteration-level scheduling. Each step every scheduled request gets
min(num_tokens - num_computed_tokens, budget left, chunk cap) tokens: prefill, chunked prefill,
decode and recompute after preemption are the same rule. `make_scheduler` picks this or the static policy's
subclass (engine/core/static_policy.py) by `scheduling_policy`."""

import time
from operator import attrgetter

from conveyor.engine.core.block_manager import BlockManager
from conveyor.engine.core.invariants import check_invariants
from conveyor.engine.core.lora_slots import LoRASlots
from conveyor.engine.core.sequence import Sequence, SequenceStatus
from conveyor.engine.core.spec_decode import SpecController
from conveyor.engine.core.watermark import Watermark
from conveyor.engine.execution.persistent_batch import PersistentBatch
from conveyor.engine.resolved_config import ResolvedConfig
from conveyor.engine.step import ModelRunnerOutput, NewRequestData, ScheduledChunk, SchedulerOutput

_run_order = attrgetter("priority", "arrival_time")


class Scheduler:
    def __init__(self, config: ResolvedConfig, kv: BlockManager, eos_token_ids: set[int]) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, Sequence] = {}
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.watermark = Watermark(config.watermark, config.adaptive_watermark, kv.num_blocks)
        self.finished_for_runner: list[str] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self.runner_batch: PersistentBatch | None = None  # the model runner's, in process: checked with the tables
        self.now = 0.0
        self.prefill_left = 0
        self.spec = SpecController(config.speculative) if config.speculative is not None else None
        self.lora_slots = LoRASlots(config.max_loras) if config.max_loras else None
        self.load_cost = 0.1  # a tier block's load time over its prefill time; the engine core measures it

    def add(self, seq: Sequence) -> None:
        seq.enqueued_step = self.num_steps
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _wait_key(self, seq: Sequence) -> tuple:
        aged = (self.num_steps - seq.enqueued_step) * self.config.aging_rate / 100
        return seq.priority - aged, seq.arrival_time

    @staticmethod
    def _victim_key(seq: Sequence) -> tuple:
        return seq.priority, -seq.num_computed_tokens, seq.arrival_time

    def _chunk(self, seq: Sequence, budget: int, partials: int) -> int:
        """Caps one request's chunk and the number of partial prefills (chunks leaving part of the prompt for
        later); a prompt that completes in this chunk is never held back, so long prompts can't block short ones."""
        cfg = self.config
        left = seq.num_tokens - seq.num_computed_tokens
        n = min(left, budget, self.prefill_left)
        if n > 1 and cfg.long_prefill_token_threshold:
            n = min(n, cfg.long_prefill_token_threshold)
        if n < left and cfg.max_num_partial_prefills and partials >= cfg.max_num_partial_prefills:
            return 0
        return n

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        self.now = time.monotonic()
        out = SchedulerOutput(finished_req_ids=self.finished_for_runner)
        self.finished_for_runner = []
        chunks: dict[str, ScheduledChunk] = {}
        self.running.sort(key=_run_order)
        self._schedule_step(list(self.running), out, chunks)
        out.chunks = list(chunks.values())
        if self.lora_slots is not None:
            self.lora_slots.assign(out, self.requests, self.running)
        out.kv_transfer = self.kv.take_transfer()
        return out

    def load_charge(self, num_blocks: int) -> int:
        """Budget tokens that loading num_blocks from the lower tiers costs: a block's load time over its prefill
        time (measured by the engine core, `load_cost`) times its tokens, at most half a step's budget."""
        if not num_blocks:
            return 0
        tokens = num_blocks * self.kv.block_size * self.load_cost
        return min(max(1, round(tokens)), self.config.max_num_batched_tokens // 2)

    def _schedule_step(
        self, running: list[Sequence], out: SchedulerOutput, chunks: dict[str, ScheduledChunk]
    ) -> tuple[int, int]:
        """Running requests first, then admissions unless one was preempted; returns the budget and the number
        of partial prefills after them."""
        self.prefill_left = self._prefill_cap(running)
        budget, partials, preempted = self._schedule_running(
            running, out, chunks, self.config.max_num_batched_tokens, 0
        )
        self.watermark.observe(preempted)
        if not preempted:
            budget, partials = self._admit(out, chunks, budget, partials)
        return budget, partials

    def _prefill_cap(self, live: list[Sequence]) -> int:
        cap, budget = self.config.max_prefill_tokens_while_decoding, self.config.max_num_batched_tokens
        if cap and cap < budget and any(len(s.token_ids) - s.num_computed_tokens == 1 for s in live):
            return cap
        return budget

    def _schedule_running(
        self,
        seqs: list[Sequence],
        out: SchedulerOutput,
        chunks: dict[str, ScheduledChunk],
        budget: int,
        partials: int,
        may_preempt: bool = True,
    ) -> tuple[int, int, bool]:
        """Each request's next chunk; a chunk that does not fit preempts the worst running request (with
        `may_preempt`, else it is skipped)."""
        preempted, running = False, SequenceStatus.RUNNING
        for seq in seqs:
            if seq.status is not running:
                continue
            computed = seq.num_computed_tokens
            left = len(seq.token_ids) - computed
            if left == 1 and budget > 1 and self.spec is not None and self._speculate(seq, out, chunks, budget):
                budget -= len(chunks[seq.request_id].token_ids)
                continue
            if left == 1 and budget > 0 and (ids := self._allocate_decode(seq, out)) is not None:
                chunks[seq.request_id] = ScheduledChunk(seq.request_id, seq.token_ids[-1:], computed, ids, False, True)
                seq.num_computed_tokens = computed + 1
                budget -= 1
                continue
            n = 1 if left == 1 and budget > 0 else self._chunk(seq, budget, partials)
            if n == 0:
                continue
            while (ids := self.kv.allocate(seq, n)) is None and may_preempt:
                victim = max(self.running, key=self._victim_key)
                if (dropped := chunks.pop(victim.request_id, None)) is not None:
                    victim.num_computed_tokens -= len(dropped.token_ids)
                    budget += len(dropped.token_ids)
                    drafted = out.draft_token_ids.pop(victim.request_id, None) is not None
                    if victim.request_id in out.lookahead_req_ids:
                        out.lookahead_req_ids.remove(victim.request_id)
                    self.prefill_left += len(dropped.token_ids) if len(dropped.token_ids) > 1 and not drafted else 0
                    partials -= len(dropped.token_ids) < victim.num_tokens - dropped.start
                self._preempt(victim, out)
                preempted = True
                if victim is seq:
                    break
            if ids is None:
                continue
            partials += n < seq.num_tokens - seq.num_computed_tokens
            chunks[seq.request_id] = self._make_chunk(seq, n, ids, reset=False)
            budget -= n
            if left > 1:
                self.prefill_left -= n
        return budget, partials, preempted

    def _speculate(self, seq: Sequence, out: SchedulerOutput, chunks: dict[str, ScheduledChunk], budget: int) -> bool:
        """A decoding request's chunk with draft tokens after its last token, if it has drafts and their blocks
        fit without preempting anyone. Drafts never pass max_model_len or the request's max_tokens."""
        room = min(
            budget - 1,
            self.config.max_model_len - seq.num_tokens,
            seq.params.max_tokens - seq.num_output_tokens - 1,
        )
        drafts = self.spec.propose(seq, self.num_steps, room, len(self.running))
        if not drafts:
            return False
        start = seq.num_computed_tokens
        look = self._lookahead(seq, 1 + len(drafts))
        ids = self.kv.allocate(seq, 1 + len(drafts) + look) if look else None
        if ids is None:
            look, ids = 0, self.kv.allocate(seq, 1 + len(drafts))
        if ids is None:
            return False
        chunks[seq.request_id] = ScheduledChunk(seq.request_id, [seq.token_ids[-1], *drafts], start, ids, False, True)
        seq.num_computed_tokens = start + 1 + len(drafts)
        out.draft_token_ids[seq.request_id] = drafts
        if look:
            out.lookahead_req_ids.append(seq.request_id)
        return True

    def _lookahead(self, seq: Sequence, n: int) -> int:
        """Slots past a decoding request's n-token chunk for the draft model's proposals after the step (speculative
        method "draft", the request speculating next step): num_speculative_tokens, or 0."""
        spec = self.spec
        if spec is None or not spec.lookahead(seq, self.num_steps):
            return 0
        return spec.k if seq.num_computed_tokens + n + spec.k <= self.config.max_model_len else 0

    def _allocate_decode(self, seq: Sequence, out: SchedulerOutput) -> list[int] | None:
        """A plain decode's blocks, with the draft model's lookahead slots where they fit (else without)."""
        if look := self._lookahead(seq, 1):
            ids = self.kv.allocate(seq, 1 + look)
            if ids is not None:
                out.lookahead_req_ids.append(seq.request_id)
                return ids
        return self.kv.allocate_decode(seq)

    def _admit(
        self, out: SchedulerOutput, chunks: dict[str, ScheduledChunk], budget: int, partials: int
    ) -> tuple[int, int]:
        """Swapped and waiting requests in one priority order, stopping at the first that does not fit:
        admitting past it would let a stream of later arrivals starve it. Only the partial-prefill cap
        lets a prompt that completes in one chunk pass one that would be split."""
        cfg = self.config
        capped: set[Sequence] = set()
        while budget > 0 and len(self.running) < cfg.max_num_seqs:
            candidates = self._candidates(capped)
            if not candidates:
                break
            seq = min(candidates, key=self._wait_key)
            if self.lora_slots is not None and not self.lora_slots.admits(seq, self.running):
                capped.add(seq)
                continue
            swapped = seq.status is SequenceStatus.SWAPPED
            prefix = [] if swapped else self.kv.cached_prefix(seq)
            loads = [] if swapped else self.kv.lower_prefix(seq, prefix)
            cached = seq.num_computed_tokens if swapped else (len(prefix) + len(loads)) * self.kv.block_size
            charge = self.load_charge(len(loads))
            n = self._chunk_from(seq, cached, budget - charge, partials) if budget > charge else 0
            if n == 0:
                capped.add(seq)
                continue
            if swapped:
                pairs = self.kv.swap_in(seq, n, self._reserve())
                ids = None if pairs is None else self.kv.allocate(seq, n)
            else:
                ids = self.kv.allocate(seq, n, prefix, self._reserve(), loads)
            if ids is None:
                if self._make_room():
                    continue
                break
            if swapped:
                out.swap_in += pairs
                self.swapped.remove(seq)
            else:
                self.kv.record_query(seq.num_tokens, cached)
                seq.num_computed_tokens = seq.num_cached_tokens = cached
                self.waiting.remove(seq)
            if not seq.seen_by_runner:
                seq.seen_by_runner = True
                stop_ids = list(seq.params.stop_token_ids) + ([] if seq.params.ignore_eos else list(self.eos_token_ids))
                out.new_requests.append(NewRequestData(seq.request_id, seq.prompt_token_ids, seq.params, stop_ids))
            self._start(seq, chunks, n, ids)
            budget, partials = budget - n - charge, partials + (n < seq.num_tokens - cached)
            self.prefill_left -= n
        return budget, partials

    def _candidates(self, capped: set[Sequence]) -> list[Sequence]:
        """Swapped and waiting requests that may be admitted now (`capped`: those the chunk caps hold back)."""
        return [s for s in self.swapped + self.waiting if s not in capped]

    def _make_room(self) -> bool:
        """Frees blocks that no request's output needs, without preempting one; False when there are none."""
        return False

    def _chunk_from(self, seq: Sequence, cached: int, budget: int, partials: int) -> int:
        computed, seq.num_computed_tokens = seq.num_computed_tokens, cached
        n = self._chunk(seq, budget, partials)
        seq.num_computed_tokens = computed
        return n

    def _reserve(self) -> int:
        return self.watermark.blocks if self.running else 0

    def _start(self, seq: Sequence, chunks: dict[str, ScheduledChunk], n: int, ids: list[int]) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        chunks[seq.request_id] = self._make_chunk(seq, n, self.kv.block_ids(seq), reset=True)

    def _make_chunk(self, seq: Sequence, n: int, block_ids: list[int], reset: bool) -> ScheduledChunk:
        """The chunk's tokens count as computed from here on; a chunk dropped by a preemption gives them back."""
        start = seq.num_computed_tokens
        seq.num_computed_tokens = start + n
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = self.now
        return ScheduledChunk(
            seq.request_id,
            seq.token_ids[start : start + n],
            start,
            block_ids,
            reset,
            sample=start + n == seq.num_tokens,
        )

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        pairs = self.kv.swap_out(seq) if self.config.preemption_mode == "swap" else None
        if pairs is not None:
            out.swap_out += pairs
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def update(self, so: SchedulerOutput, ro: ModelRunnerOutput, now: float) -> list[Sequence]:
        """Append sampled tokens, finish sequences that stop; returns the sequences that changed."""
        if so.draft_token_ids:
            self._verified(so, ro)
        if ro.proposals:
            self.spec.proposer.store(ro.proposals)
        changed = self._accept(ro, now)
        for rid in [*so.draft_token_ids, *(r for r in so.lookahead_req_ids if r not in so.draft_token_ids)]:
            seq = self.requests.get(rid)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                self.kv.roll_back(seq)
        if self.config.check_invariants:
            check_invariants(self, self.runner_batch)
        return changed

    def _verified(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> None:
        """Rejected drafts stop counting as computed (their blocks go back in update, after the tokens)."""
        for rid, drafts in so.draft_token_ids.items():
            seq = self.requests.get(rid)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            accepted = len(ro.accepted.get(rid, ()))
            seq.num_computed_tokens -= len(drafts) - accepted
            self.spec.observe(rid, len(drafts), accepted)

    def _accept(self, ro: ModelRunnerOutput, now: float) -> list[Sequence]:
        changed = []
        requests, running, accepted = self.requests, SequenceStatus.RUNNING, ro.accepted
        for rid, token in zip(ro.req_ids, ro.token_ids):
            seq = requests.get(rid)
            if seq is None or seq.status is not running:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            changed.append(seq)
            if accepted and rid in accepted:
                for t in accepted[rid]:
                    seq.token_ids.append(t)
                    self._check_stop(seq, t)
                    if seq.status is not running:
                        break
                if seq.status is not running:
                    continue
            seq.token_ids.append(token)
            self._check_stop(seq, token)
        return changed

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p, num_tokens = seq.params, len(seq.token_ids)
        num_output = num_tokens - len(seq.prompt_token_ids)
        if num_output >= p.min_tokens:
            if token in self.eos_token_ids and not p.ignore_eos:
                return self.stop(seq, "stop")
            if token in p.stop_token_ids:
                return self.stop(seq, "stop", token)
        if num_output >= p.max_tokens or num_tokens >= self.config.max_model_len:
            self.stop(seq, "length")

    def stop(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """The request's output is complete (a stop token, its length, its grammar, a stop string): it finishes."""
        self.finish(seq, reason, stop_reason)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """The request leaves: its blocks are freed and the model runner forgets it with the next step."""
        if seq.is_finished:
            return
        for queue in (self.running, self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        self.kv.forget(seq)
        if self.spec is not None:
            self.spec.forget(seq.request_id)
        seq.status, seq.finish_reason, seq.stop_reason = SequenceStatus.FINISHED, reason, stop_reason
        seq.finish_time = time.monotonic()
        self.requests.pop(seq.request_id, None)
        if seq.seen_by_runner:
            self.finished_for_runner.append(seq.request_id)

    def pads(self, seq: Sequence) -> bool:
        """The request's output is complete but it still runs, as padding (the static policy's batches)."""
        return False


def make_scheduler(config: ResolvedConfig, kv: BlockManager, eos_token_ids: set[int]) -> Scheduler:
    """The scheduler of `config.scheduling_policy`."""
    if config.scheduling_policy == "static":
        from conveyor.engine.core.static_policy import StaticScheduler  # a subclass: imported here, not at the top

        return StaticScheduler(config, kv, eos_token_ids)
    return Scheduler(config, kv, eos_token_ids)

"""Static (request-level) batching, the literature's baseline that the benchmarks compare continuous batching
with, on the same model code (`scheduling_policy: static`): a batch of up to `max_num_seqs` waiting requests
forms only when the previous one is done, and a member whose output is complete while others still run keeps
its slot and its blocks, decoding padding (its tokens discarded), until the whole batch is done. Its finish is
reported then."""

from typing import NamedTuple

from conveyor.engine.core.block_manager import BlockManager
from conveyor.engine.core.scheduler import Scheduler
from conveyor.engine.core.sequence import Sequence, SequenceStatus
from conveyor.engine.resolved_config import ResolvedConfig
from conveyor.engine.step import ModelRunnerOutput, ScheduledChunk, SchedulerOutput


class HeldFinish(NamedTuple):
    """How a member's output ended, kept until its batch is done."""

    reason: str
    stop_reason: int | str | None
    num_tokens: int  # its tokens then: the padding after them is dropped


class StaticScheduler(Scheduler):
    def __init__(self, config: ResolvedConfig, kv: BlockManager, eos_token_ids: set[int]) -> None:
        super().__init__(config, kv, eos_token_ids)
        self.batch: set[str] = set()  # request ids of the current batch
        self.held: dict[str, HeldFinish] = {}
        self.released: list[Sequence] = []  # held members finished since the last update, reported by it

    def pads(self, seq: Sequence) -> bool:
        return seq.request_id in self.held

    def _members(self) -> list[Sequence]:
        return [self.requests[r] for r in self.batch if r in self.requests]

    def _schedule_step(
        self, running: list[Sequence], out: SchedulerOutput, chunks: dict[str, ScheduledChunk]
    ) -> tuple[int, int]:
        """Padding runs after everything else, in the budget left, never preempting and never past
        max_model_len."""
        padding = [s for s in running if s.request_id in self.held]
        live = [s for s in running if s.request_id not in self.held] if padding else running
        budget, partials = super()._schedule_step(live, out, chunks)
        padding = [s for s in padding if s.num_tokens < self.config.max_model_len]
        budget, partials, _ = self._schedule_running(padding, out, chunks, budget, partials, may_preempt=False)
        return budget, partials

    def _admit(
        self, out: SchedulerOutput, chunks: dict[str, ScheduledChunk], budget: int, partials: int
    ) -> tuple[int, int]:
        """A new batch: the first `max_num_seqs` waiting requests in admission order, once nothing of the last
        one runs, is swapped out or waits."""
        if not self.running and not self.swapped and not self.batch.intersection(s.request_id for s in self.waiting):
            self.batch = {s.request_id for s in sorted(self.waiting, key=self._wait_key)[: self.config.max_num_seqs]}
        return super()._admit(out, chunks, budget, partials)

    def _candidates(self, capped: set[Sequence]) -> list[Sequence]:
        return [s for s in super()._candidates(capped) if s.request_id in self.batch]

    def _victim_key(self, seq: Sequence) -> tuple:
        """Padding goes first: preempting it finishes it."""
        return (seq.request_id in self.held, *Scheduler._victim_key(seq))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if seq.request_id in self.held:
            return self._release(seq)
        super()._preempt(seq, out)

    def _make_room(self) -> bool:
        held = [s for s in self.running if s.request_id in self.held]
        if held:
            self._release(max(held, key=self._victim_key))
        return bool(held)

    def _accept(self, ro: ModelRunnerOutput, now: float) -> list[Sequence]:
        """Padding tokens are appended and reported to no one; once every member is held, the batch is done."""
        if self.held and any(rid in self.held for rid in ro.req_ids):
            live = []
            for i, rid in enumerate(ro.req_ids):
                if rid not in self.held:
                    live.append(i)
                elif (seq := self.requests[rid]).status is SequenceStatus.RUNNING:
                    seq.token_ids.append(ro.token_ids[i])
            ro = ModelRunnerOutput(
                [ro.req_ids[i] for i in live], [ro.token_ids[i] for i in live], [ro.logprobs[i] for i in live]
            )
        changed = super()._accept(ro, now)
        members = self._members()
        if members and all(s.request_id in self.held for s in members):
            for seq in members:
                self._release(seq)
        released, self.released = self.released, []
        return list(dict.fromkeys(changed + released)) if released else changed

    def stop(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """A member whose output is complete while another member still runs is held; one already held stays."""
        if seq.is_finished or seq.request_id in self.held:
            return
        if any(s is not seq and s.request_id not in self.held for s in self._members()):
            self.held[seq.request_id] = HeldFinish(reason, stop_reason, seq.num_tokens)
            return
        self.finish(seq, reason, stop_reason)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """A held member finishes as its output ended, without its padding."""
        if (held := self.held.pop(seq.request_id, None)) is not None:
            reason, stop_reason = held.reason, held.stop_reason
            del seq.token_ids[held.num_tokens :]
        super().finish(seq, reason, stop_reason)
        self.batch.discard(seq.request_id)

    def _release(self, seq: Sequence) -> None:
        self.finish(seq, "")
        self.released.append(seq)

"""What the engine loop did, step by step. Always: the cumulative tokens-per-step histogram behind
`iteration_tokens_total`. After `enable()`: one StepRecord per step (which requests ran, prefill /
decode / padding tokens, KV use, preemptions, step time), exportable as Chrome trace JSON (Perfetto)."""

import bisect
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from conveyor.engine.stats import ITERATION_TOKENS_BUCKETS
from conveyor.engine.step import ModelRunnerOutput, SchedulerOutput

KINDS = ("prefill", "decode", "padding")


class _Scheduler(Protocol):
    requests: dict
    waiting: list
    num_preemptions: int
    num_steps: int

    def pads(self, seq: Any) -> bool: ...


class _KV(Protocol):
    num_blocks: int
    num_free_blocks: int


@dataclass
class SlotWork:
    req_id: str
    num_tokens: int
    kind: str


@dataclass
class StepRecord:
    step: int
    start_s: float
    duration_s: float
    work: list[SlotWork]
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    num_waiting: int
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified in the step (inside its decode tokens)
    num_accepted_tokens: int = 0

    def tokens(self, kind: str | None = None) -> int:
        return sum(w.num_tokens for w in self.work if kind is None or w.kind == kind)


@dataclass
class StepTrace:
    enabled: bool = False
    records: list[StepRecord] = field(default_factory=list)
    num_steps: int = 0
    tokens_sum: int = 0
    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    _origin: float = 0.0
    _preemptions: int = 0

    def enable(self) -> None:
        self.enabled, self.records, self._origin = True, [], time.perf_counter()

    def disable(self) -> list[StepRecord]:
        self.enabled = False
        return self.records

    def record(
        self, so: SchedulerOutput, scheduler: _Scheduler, kv: _KV, start: float, ro: ModelRunnerOutput | None = None
    ) -> None:
        """Called once per engine step after the model ran; `start` is perf_counter() before schedule()."""
        n = so.num_tokens
        self.num_steps += 1
        self.tokens_sum += n
        self.counts[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, n)] += 1
        preempted, self._preemptions = scheduler.num_preemptions - self._preemptions, scheduler.num_preemptions
        if not self.enabled:
            return
        work = []
        for c in so.chunks:
            seq = scheduler.requests.get(c.req_id)
            if seq is not None and scheduler.pads(seq):
                kind = "padding"
            elif c.req_id in so.draft_token_ids:
                kind = "decode"
            elif len(c.token_ids) > 1 or seq is None or c.start < seq.num_prompt_tokens:
                kind = "prefill"
            else:
                kind = "decode"
            work.append(SlotWork(c.req_id, len(c.token_ids), kind))
        end = time.perf_counter()
        self.records.append(
            StepRecord(
                scheduler.num_steps,
                start - self._origin,
                end - start,
                work,
                kv.num_blocks - kv.num_free_blocks,
                kv.num_blocks,
                preempted,
                len(scheduler.waiting),
                sum(map(len, so.draft_token_ids.values())),
                sum(map(len, ro.accepted.values())) if ro is not None else 0,
            )
        )

    def counters(self) -> dict[str, Any]:
        return {
            "num_steps": self.num_steps,
            "iteration_tokens_sum": self.tokens_sum,
            "iteration_tokens_counts": list(self.counts),
        }


def assign_slots(records: list[StepRecord]) -> dict[tuple[int, str], int]:
    """Batch slot of each (step index, request): a request holds the lowest free slot from the first to
    the last step it runs in (a preempted request keeps its slot while it waits)."""
    last = {}
    for i, r in enumerate(records):
        for w in r.work:
            last[w.req_id] = i
    slots, held, free = {}, {}, []
    for i, r in enumerate(records):
        for w in r.work:
            if w.req_id not in held:
                held[w.req_id] = free.pop(0) if free else len(held) + len(free)
            slots[(i, w.req_id)] = held[w.req_id]
        for w in r.work:
            if last[w.req_id] == i:
                bisect.insort(free, held.pop(w.req_id))
    return slots


def chrome_trace(records: list[StepRecord], name: str = "conveyor engine", pid: int = 0) -> list[dict]:
    """Trace events (Chrome trace format, opens in Perfetto): the engine's steps on thread 0, each batch
    slot's request on its own thread, KV blocks in use as a counter."""
    slots = assign_slots(records)
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "steps"}},
    ]
    for s in sorted(set(slots.values())):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": s + 1, "args": {"name": f"slot {s}"}})
    for i, r in enumerate(records):
        ts, dur = r.start_s * 1e6, r.duration_s * 1e6
        events.append(
            {
                "name": f"step {r.step}",
                "cat": "step",
                "ph": "X",
                "pid": pid,
                "tid": 0,
                "ts": ts,
                "dur": dur,
                "args": {kind: r.tokens(kind) for kind in KINDS}
                | {"preemptions": r.num_preemptions, "waiting": r.num_waiting}
                | (
                    {"draft_tokens": r.num_draft_tokens, "accepted_tokens": r.num_accepted_tokens}
                    if r.num_draft_tokens
                    else {}
                ),
            }
        )
        for w in r.work:
            events.append(
                {
                    "name": w.req_id,
                    "cat": w.kind,
                    "ph": "X",
                    "pid": pid,
                    "tid": slots[(i, w.req_id)] + 1,
                    "ts": ts,
                    "dur": dur,
                    "args": {"tokens": w.num_tokens, "kind": w.kind},
                }
            )
        events.append({"name": "kv_blocks_used", "ph": "C", "pid": pid, "ts": ts, "args": {"used": r.kv_blocks_used}})
    return events

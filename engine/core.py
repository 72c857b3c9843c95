"""The engine core: scheduler + KV cache + executor and the busy loop over them (schedule -> execute ->
update). It reports token ids only; text, stop strings and streams are the front end's (llm_engine.py)."""
import time

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.executor import make_executor
from engine.messages import AddRequest, CoreOutput
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stats import EngineStats


class EngineCore:
    def __init__(self, config: EngineConfig, eos_token_ids: set[int]) -> None:
        self.config = config
        self.executor = make_executor(config)
        if self.executor.num_blocks < 1:
            raise ValueError("EngineConfig.kv_cache_memory leaves no room for a single KV block")
        self.block_manager = BlockManager(self.executor.num_blocks, config.block_size,
                                          config.enable_prefix_caching, self.executor.num_swap_blocks)
        self.scheduler = Scheduler(config, self.block_manager, eos_token_ids)
        self.reported: dict[str, int] = {}
        self.num_finished = self.num_aborted = 0

    def add_request(self, req: AddRequest) -> None:
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {req.request_id!r} is already running")
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.params, priority=req.priority,
                       cache_salt=req.cache_salt)
        if req.arrival_time is not None:
            seq.arrival_time = req.arrival_time
        self.scheduler.add(seq)
        self.reported[req.request_id] = 0

    def finish_requests(self, request_ids: list[str], reason: str = "abort",
                        stop_reasons: list[str | None] | None = None) -> list[CoreOutput]:
        """Abort, or finish with a stop string the front end found; a static batch may keep the slot."""
        outputs = []
        for rid, stop in zip(request_ids, stop_reasons or [None] * len(request_ids)):
            seq = self.scheduler.requests.get(rid)
            if seq is None:
                continue
            self.scheduler.finish(seq, reason, stop)
            if seq.is_finished:
                outputs.append(self._output(seq, []))
        return outputs

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[CoreOutput]:
        so = self.scheduler.schedule()
        ro = self.executor.execute_model(so)
        changed = self.scheduler.update(so, ro, time.monotonic())
        logprobs = dict(zip(ro.req_ids, ro.logprobs)) if any(x is not None for x in ro.logprobs) else {}
        return [self._output(seq, logprobs) for seq in changed]

    def _output(self, seq: Sequence, logprobs: dict) -> CoreOutput:
        rid = seq.request_id
        start = self.reported.get(rid, 0)
        new = seq.token_ids[seq.num_prompt_tokens + start:]
        lp = [logprobs.get(rid)] if new and seq.params.logprobs is not None else None
        if seq.is_finished:
            self.reported.pop(rid, None)
            self.num_finished += 1
            self.num_aborted += seq.finish_reason == "abort"
        else:
            self.reported[rid] = start + len(new)
        return CoreOutput(rid, new, lp, seq.finish_reason, seq.stop_reason, seq.first_scheduled_time,
                          seq.first_token_time, seq.finish_time, seq.num_preemptions, seq.num_cached_tokens)

    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting),
            num_waiting_tokens=sum(q.num_tokens - q.num_computed_tokens for q in s.waiting),
            num_swapped=len(s.swapped), kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks,
            num_preemptions=s.num_preemptions, prefix_cache_queries=kv.queries, prefix_cache_hits=kv.hits,
            num_finished=self.num_finished, num_aborted=self.num_aborted)

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()

"""The synchronous engine: add_request / step / abort_request over scheduler, KV cache and executor."""
import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.executor import make_executor
from engine.generation_defaults import GenerationDefaults, load_generation_defaults
from engine.kv_events import KVEvents
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stats import EngineStats
from engine.step_trace import StepTrace

if TYPE_CHECKING:
    from engine.structured_output import StructuredOutputManager

log = logging.getLogger("conveyor")


def eos_token_ids(config: EngineConfig, tokenizer: PreTrainedTokenizerBase, defaults: GenerationDefaults) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(config.hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids | set(defaults.eos_token_ids)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.generation_defaults = load_generation_defaults(config.model_path)
        self.vocab_size = config.hf_config.vocab_size
        self.executor = make_executor(config)
        if self.executor.num_blocks < 1:
            raise ValueError("EngineConfig.kv_cache_memory leaves no room for a single KV block")
        config.fit_max_model_len(self.executor.num_blocks)
        self.max_model_len = config.max_model_len
        self.block_manager = BlockManager(self.executor.num_blocks, config.block_size,
                                          config.enable_prefix_caching, self.executor.num_swap_blocks)
        eos = eos_token_ids(config, self.tokenizer, self.generation_defaults)
        self.scheduler = Scheduler(config, self.block_manager, eos)
        self.scheduler.runner_batch = getattr(getattr(self.executor, "runner", None), "batch", None)
        self._structured = None
        self.compiling: dict[str, tuple[Sequence, Future]] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.logprobs: dict[str, list[dict[int, float]]] = {}
        self.prompts: dict[str, str | None] = {}
        self.num_finished = self.num_aborted = 0
        self.stream_outputs = True  # False: step() returns finished requests only (offline generate)
        self.busy_time_s, self.num_prefill_tokens, self.num_decode_tokens = 0.0, 0, 0
        self.step_trace = StepTrace()

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's generation_config.json defaults, as vLLM applies them."""
        return SamplingParams(**self.generation_defaults.sampling)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt is {n} tokens, max_model_len is {self.max_model_len} "
                             f"(the prompt must leave room for at least one generated token)")
        need = self.block_manager.blocks_for(min(n + params.max_tokens, self.max_model_len))
        if need > self.block_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens ({n} + {params.max_tokens}) needs {need} KV blocks but the "
                             f"cache holds {self.block_manager.num_blocks}")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < vocab size {self.vocab_size}")
        if params.logit_bias and max(params.logit_bias) >= self.vocab_size:
            raise ValueError(f"SamplingParams.logit_bias token ids must be < vocab size {self.vocab_size}, "
                             f"got {max(params.logit_bias)}")

    @property
    def structured(self) -> "StructuredOutputManager":
        """Built on the first constrained request: engine.structured_output imports xgrammar."""
        if self._structured is None:
            from engine.structured_output import StructuredOutputManager
            self._structured = StructuredOutputManager(self.tokenizer, self.vocab_size,
                                                       sorted(self.scheduler.eos_token_ids))
        return self._structured

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, prompt: str | None = None,
                    cache_salt: str | None = None) -> None:
        self.validate(prompt_token_ids, params)
        if request_id in self.scheduler.requests or request_id in self.compiling:
            raise ValueError(f"request_id {request_id!r} is already running")
        seq = Sequence(request_id, list(prompt_token_ids), params, priority=priority, cache_salt=cache_salt)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        if params.structured is not None:
            self.compiling[request_id] = (seq, self.structured.compile(params.structured))
        else:
            self.scheduler.add(seq)
        self.detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params)
        self.logprobs[request_id] = []
        self.prompts[request_id] = prompt

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.requests.get(request_id) or self.compiling.pop(request_id, (None, None))[0]
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self._output(seq)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or bool(self.compiling)

    def _admit_compiled(self) -> list[RequestOutput]:
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
                failed.append(self._output(seq))
                continue
            self.structured.add(rid, fut.result())
            self.scheduler.add(seq)
        return failed

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        failed = self._admit_compiled() if self.compiling else []
        so = self.scheduler.schedule()
        if self._structured is not None and self._structured.matchers:
            so.grammar = self._structured.bitmask([c.req_id for c in so.chunks if c.sample])
        ro = self.executor.execute_model(so)
        self.step_trace.record(so, self.scheduler, self.block_manager, start)
        now = time.monotonic()
        changed = self.scheduler.update(so, ro, now)
        self.busy_time_s += time.perf_counter() - start
        self.num_decode_tokens += len(ro.token_ids)
        self.num_prefill_tokens += so.num_tokens - len(ro.token_ids)
        if so.grammar is not None:
            for rid in self._structured.accept(ro.req_ids, ro.token_ids):
                seq = self.scheduler.requests.get(rid)
                if seq is not None and seq.held_finish is None:
                    self.scheduler.finish(seq, "stop")
        logprobs = dict(zip(ro.req_ids, ro.logprobs))
        outputs = []
        for seq in changed:
            rid = seq.request_id
            detok = self.detokenizers[rid]
            new_tokens = range(len(detok.token_ids), seq.num_output_tokens)
            if new_tokens and seq.params.logprobs is not None:
                self.logprobs[rid].append(logprobs[rid])
            for i in new_tokens:
                stop = detok.add(seq.output_token_ids[i], i + 1)
                if stop is not None and not seq.is_finished:
                    self.scheduler.finish(seq, "stop", stop)
            if self.stream_outputs or seq.is_finished:
                outputs.append(self._output(seq, now))
        return failed + outputs

    def _output(self, seq: Sequence, last_token_time: float | None = None) -> RequestOutput:
        rid, done = seq.request_id, seq.is_finished
        detok = self.detokenizers[rid]
        if done:
            if not isinstance(seq.stop_reason, str):
                detok.flush()
            self.detokenizers.pop(rid)
            self.num_finished += 1
            self.num_aborted += seq.finish_reason == "abort"
            if self._structured is not None:
                self._structured.release(rid)
        logprobs = self.logprobs.pop(rid) if done else self.logprobs[rid]
        completion = CompletionOutput(0, detok.visible_text(done), seq.output_token_ids, seq.finish_reason,
                                      seq.stop_reason, logprobs if seq.params.logprobs is not None else None)
        metrics = RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                                 last_token_time if seq.first_token_time else None, seq.finish_time,
                                 seq.num_preemptions, seq.num_cached_tokens)
        prompt = self.prompts.pop(rid) if done else self.prompts[rid]
        return RequestOutput(rid, prompt, seq.prompt_token_ids, [completion], done, metrics)

    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting) + len(self.compiling),
            num_waiting_tokens=sum(q.num_tokens - q.num_computed_tokens for q in s.waiting)
            + sum(q.num_tokens for q, _ in self.compiling.values()),
            num_swapped=len(s.swapped), kv_blocks_total=kv.num_blocks, kv_blocks_free=kv.num_free_blocks,
            num_preemptions=s.num_preemptions, prefix_cache_queries=kv.queries, prefix_cache_hits=kv.hits,
            num_finished=self.num_finished, num_aborted=self.num_aborted, max_num_seqs=self.config.max_num_seqs,
            busy_time_s=self.busy_time_s, num_prefill_tokens=self.num_prefill_tokens,
            num_decode_tokens=self.num_decode_tokens, **self.step_trace.counters(),
            tokens_left=sorted(q.params.max_tokens - q.num_output_tokens for q in s.running)[:64])

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

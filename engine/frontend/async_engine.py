"""asyncio front of the engine; each request is an async iterator of RequestOutputs. Closing or cancelling
the iterator aborts the request. One thread runs the engine: in-process it steps the core itself; with
engine_core_process=True it only receives the core process's deltas and detokenises them. Each step's
outputs reach an event loop in one call; a stream gets its first token at once, then an output whenever
it has `stream_interval` new tokens, and its finish."""

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator

from conveyor.engine.config import EngineConfig
from conveyor.engine.core.kv_events import KVEvents
from conveyor.engine.core.kv_handoff import KVHandoff
from conveyor.engine.frontend.llm_engine import LLMEngine
from conveyor.engine.frontend.outputs import RequestOutput
from conveyor.engine.lora_request import LoRARequest
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.stats import EngineStats

log = logging.getLogger("conveyor")
POLL_S = 0.05


class RequestFailed(RuntimeError):
    """The engine failed this request (a model step that raised, a core that refused it); others go on."""


class Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.queue = loop, asyncio.Queue()


class AsyncEngine:
    def __init__(self, config: EngineConfig, engine_core_process: bool = False) -> None:
        self.engine = LLMEngine(config, engine_core_process=engine_core_process)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self.limits = self.engine.limits
        self.model_name = config.model
        self.in_process = self.engine.in_process
        self._lock = threading.Lock()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, Stream] = {}
        self._stats = self.engine.stats()
        self._error: BaseException | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="conveyor-engine", daemon=True)
        self._thread.start()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    def stats(self) -> EngineStats:
        return self._stats

    def drain_kv_events(self, max_events: int | None = None) -> KVEvents:
        """Thread-safe: prefix-cache keys stored/evicted since the last drain (engine.kv_events)."""
        return self.engine.drain_kv_events(max_events)

    def request_kv_reset(self) -> None:
        self.engine.request_kv_reset()

    def add_lora(self, lora: LoRARequest) -> None:
        """Checks and registers an adapter (LLMEngine.add_lora); thread-safe."""
        self.engine.add_lora(lora)

    def remove_lora(self, name: str) -> bool:
        return self.engine.remove_lora(name)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.engine.loras.values())

    def check_health(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        if not self._thread.is_alive():
            raise RuntimeError("engine loop is not running")
        self.engine.check_health()

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        stream_interval: int = 1,
        validated: bool = False,
        lora_request: LoRARequest | None = None,
        prefill_only: bool = False,
        handoff: KVHandoff | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """validated: the caller (the replica, behind the router) has checked the request already.
        lora_request: the adapter it runs with; checked here (add_lora) unless registered already.
        prefill_only: the request ends after its first token, its output carrying the KVHandoff. handoff: continue
        that request here (prompt_token_ids and sampling_params are the handoff's; its tokens are not repeated
        as an output of their own)."""
        self.check_health()
        if handoff is not None:
            prompt_token_ids, sampling_params = handoff.prompt_token_ids, handoff.params
        elif not validated:
            self.validate(prompt_token_ids, sampling_params)
        if lora_request is not None:
            self.engine.add_lora(lora_request)
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in flight")
        stream = self._streams[rid] = Stream(asyncio.get_running_loop())
        interval = max(1, stream_interval)
        finished = False
        try:
            add = (rid, prompt_token_ids, sampling_params, priority, cache_salt, interval)
            add += (prefill_only, handoff, lora_request)
            if self.in_process:
                self._inbox.put(("add", *add))
            else:
                with self._lock:
                    self._add(*add)
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                await self.abort(rid)

    async def abort(self, request_id: str) -> None:
        if self.in_process:
            self._inbox.put(("abort", request_id))
            return
        with self._lock:
            out = self.engine.abort_request(request_id) if self._error is None else None
        if out is not None:
            self._deliver([out])

    def _deliver(self, outputs: list[RequestOutput | tuple[str, BaseException]]) -> None:
        """Hands each event loop its streams' news in one call_soon_threadsafe."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            rid, item = out if isinstance(out, tuple) else (out.request_id, out)
            stream = self._streams.get(rid)
            if stream is None:
                continue
            if isinstance(item, RequestOutput) and item.outputs[0].finish_reason == "error":
                item = RequestFailed(item.outputs[0].stop_reason)
            batches.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:
                pass

    def _add(
        self,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        priority: int,
        salt: str | None,
        interval: int,
        prefill_only: bool,
        handoff: KVHandoff | None,
        lora: LoRARequest | None,
    ) -> None:
        if handoff is not None:
            self.engine.import_request(rid, handoff, output_interval=interval)
            return
        self.engine.add_request(
            rid,
            ids,
            params,
            priority=priority,
            cache_salt=salt,
            validated=True,
            output_interval=interval,
            prefill_only=prefill_only,
            lora_request=lora,
        )

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            if command[1] not in self._streams:
                return
            try:
                self._add(*command[1:])
            except ValueError as e:
                self._deliver([(command[1], e)])
        elif command[0] == "abort":
            out = self.engine.abort_request(command[1])
            self._stats = self.engine.stats()
            if out is not None:
                self._deliver([out])

    def _step_in_process(self) -> list[RequestOutput]:
        idle = not self.engine.has_unfinished_requests()
        try:
            self._handle(self._inbox.get(timeout=POLL_S) if idle else self._inbox.get_nowait())
            while True:
                self._handle(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return self.engine.step() if self.engine.has_unfinished_requests() else []

    def _step_from_core(self) -> list[RequestOutput]:
        core_outputs = self.engine.core.get_outputs(POLL_S)
        if not core_outputs:
            return []
        with self._lock:
            return self.engine.process_outputs(core_outputs)

    def _loop(self) -> None:
        try:
            while not self._stopped.is_set():
                outputs = self._step_in_process() if self.in_process else self._step_from_core()
                self._stats = self.engine.stats()
                if outputs:
                    self._deliver(outputs)
        except BaseException as e:
            log.exception("engine loop failed")
            self._error = e
            self._deliver([(rid, RuntimeError(f"engine failed: {e!r}")) for rid in list(self._streams)])

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput | BaseException]]) -> None:
    for q, item in items:
        q.put_nowait(item)

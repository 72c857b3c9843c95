"""asyncio front of the engine: the engine loop runs in its own thread; each request is an async
iterator of RequestOutputs. Closing or cancelling the iterator aborts the request."""
import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.kv_events import KVEvents
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

log = logging.getLogger("conveyor")


class AsyncEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self.model_name = config.model
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
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

    def check_health(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        if not self._thread.is_alive():
            raise RuntimeError("engine loop is not running")
        self.engine.check_health()

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                       request_id: str | None = None, priority: int = 0,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        self.check_health()
        self.validate(prompt_token_ids, sampling_params)
        rid = request_id or uuid.uuid4().hex
        if rid in self._streams:
            raise ValueError(f"request_id {rid!r} is already in flight")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), stream)
        self._inbox.put(("add", rid, prompt_token_ids, sampling_params, priority, cache_salt))
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:
                self._inbox.put(("abort", rid))

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def _deliver(self, rid: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(rid)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)

    def _handle(self, command: tuple) -> None:
        if command[0] == "add":
            _, rid, ids, params, priority, salt = command
            if rid not in self._streams:
                return
            try:
                self.engine.add_request(rid, ids, params, priority=priority, cache_salt=salt)
            except ValueError as e:
                self._deliver(rid, e)
        elif command[0] == "abort":
            out = self.engine.abort_request(command[1])
            self._stats = self.engine.stats()
            if out is not None:
                self._deliver(command[1], out)

    def _loop(self) -> None:
        try:
            while not self._stopped.is_set():
                idle = not self.engine.has_unfinished_requests()
                try:
                    self._handle(self._inbox.get(timeout=0.05) if idle else self._inbox.get_nowait())
                    while True:
                        self._handle(self._inbox.get_nowait())
                except queue.Empty:
                    pass
                outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
                self._stats = self.engine.stats()
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as e:
            log.exception("engine loop failed")
            self._error = e
            for rid in list(self._streams):
                self._deliver(rid, RuntimeError(f"engine failed: {e!r}"))

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()

"""How the front end talks to the engine core: in this process (direct calls), or to the core's own process
over ZeroMQ (ipc sockets, msgpack-encoded messages from engine/core/messages.py)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import torch
import zmq
from transformers import PreTrainedTokenizerBase

from conveyor.engine.core.kv_events import KVEventLog, KVEvents, Place
from conveyor.engine.core.messages import (
    AddRequest,
    Codec,
    CoreFailed,
    CoreMessage,
    CoreOutput,
    CoreOutputs,
    CoreReady,
    FinishRequests,
    ImportRequest,
    Shutdown,
)
from conveyor.engine.resolved_config import ResolvedConfig
from conveyor.engine.stats import EngineStats

READY_TIMEOUT_S = 300.0


class EngineCoreDied(RuntimeError):
    pass


class KVMirror:
    """The core process's prefix-cache keys and their places as its per-step KV events report them, drained
    here like the core's own KVEventLog (same contract: the first drain, or one after a reset, lists every key)."""

    def __init__(self) -> None:
        self.places: dict[bytes, Place] = {}
        self.log = KVEventLog(lambda key: self.places.get(key, "none"), lambda: list(self.places))
        self.lock = threading.Lock()

    def apply(self, events: KVEvents) -> None:
        """A reset from the core (its first drain, or its log overflowed) becomes the difference to the keys
        known here, so this side's reader sees ordinary events."""
        with self.lock:
            if events.reset:
                listed = set(events.stored) | set(events.offloaded)
                for key in [k for k in self.places if k not in listed]:
                    del self.places[key]
                    self.log.add(key)
            for keys, place in ((events.stored, "pool"), (events.offloaded, "lower")):
                for key in keys:
                    if self.places.get(key) != place:
                        self.places[key] = place
                        self.log.add(key)
            for key in events.evicted:
                if self.places.pop(key, None) is not None:
                    self.log.add(key)

    def drain(self, max_events: int | None = None) -> KVEvents:
        with self.lock:
            return self.log.drain(max_events)


class InprocClient:
    """The core runs in the caller's thread: get_outputs() is the core's step."""

    def __init__(
        self, config: ResolvedConfig, eos_token_ids: set[int], tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        from conveyor.engine.core.engine_core import EngineCore

        self.core = EngineCore(config, eos_token_ids, tokenizer)
        self.num_blocks = self.core.block_manager.num_blocks

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    def add_request(self, req: AddRequest) -> None:
        self.core.add_request(req)

    def import_request(self, req: ImportRequest) -> None:
        self.core.import_request(req.request_id, req.handoff)

    def finish_requests(
        self, request_ids: list[str], reason: str = "abort", stop_reasons: list[str | None] | None = None
    ) -> None:
        self.core.finish_requests(request_ids, reason, stop_reasons)

    def get_outputs(self, timeout_s: float | None = None) -> list[CoreOutput]:
        return self.core.step() if self.core.has_unfinished else []

    def stats(self) -> EngineStats:
        return self.core.stats()

    def drain_kv_events(self, max_events: int | None = None) -> KVEvents:
        return self.core.drain_kv_events(max_events)

    def request_kv_reset(self) -> None:
        self.core.request_kv_reset()

    def check_health(self) -> None:
        self.core.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()


class MPClient:
    """Starts the core process and exchanges messages with it. Sends may come from any thread (one lock);
    get_outputs belongs to one reader thread. The process's death is seen at once through a pidfd."""

    def __init__(
        self, config: ResolvedConfig, eos_token_ids: set[int], tokenizer: PreTrainedTokenizerBase | None = None
    ) -> None:
        self.codec, self.lock = Codec(), threading.Lock()
        self.dir = tempfile.mkdtemp(prefix="conveyor-core-")
        self.ctx = zmq.Context(1)
        self.inputs, self.outputs = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        in_addr, out_addr = f"ipc://{self.dir}/in", f"ipc://{self.dir}/out"
        self.inputs.bind(in_addr)
        self.outputs.bind(out_addr)
        options = config.engine_options()
        if config.max_model_len_from_model:
            options["max_model_len"] = None  # the core fits it to its KV cache, as this side does below
        spec = json.dumps({"options": options, "eos_token_ids": sorted(eos_token_ids)})
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "conveyor.engine.process.core_process",
                in_addr,
                out_addr,
                spec,
                str(os.getpid()),
                str(torch.get_num_threads()),
            ]
        )
        self.pidfd = os.pidfd_open(self.proc.pid)
        self.poller = zmq.Poller()
        self.poller.register(self.outputs, zmq.POLLIN)
        self.poller.register(self.pidfd, zmq.POLLIN)
        self.error: str | None = None
        self.kv = KVMirror()
        self._stats = EngineStats()
        self.num_unfinished = 0
        try:
            ready = self._recv(READY_TIMEOUT_S)
            if not isinstance(ready, CoreReady):
                raise EngineCoreDied(f"engine core did not start: {self.error or ready!r}")
        except BaseException:
            self.shutdown()
            raise
        self.num_blocks, self.core_pid, self._stats = ready.num_blocks, ready.pid, ready.stats
        config.fit_max_model_len(ready.num_blocks)

    @property
    def has_unfinished(self) -> bool:
        return False

    def _send(self, msg: object) -> None:
        if self.error is not None:
            raise EngineCoreDied(self.error)
        with self.lock:
            self.inputs.send(self.codec.encode(msg))

    def add_request(self, req: AddRequest) -> None:
        self._send(req)

    def import_request(self, req: ImportRequest) -> None:
        self._send(req)

    def finish_requests(
        self, request_ids: list[str], reason: str = "abort", stop_reasons: list[str | None] | None = None
    ) -> None:
        self._send(FinishRequests(request_ids, reason, stop_reasons or []))

    def _recv(self, timeout_s: float | None) -> CoreMessage | None:
        """One message, or None after timeout_s; raises EngineCoreDied once the process is gone."""
        if self.error is not None:
            raise EngineCoreDied(self.error)
        events = dict(self.poller.poll(None if timeout_s is None else int(1000 * timeout_s)))
        if self.outputs in events:
            msg = self.codec.messages.decode(self.outputs.recv())
            if isinstance(msg, CoreFailed):
                self.error = f"engine core failed:\n{msg.error}"
                raise EngineCoreDied(self.error)
            return msg
        if self.pidfd in events:
            self.error = f"engine core process {self.proc.pid} died (exit code {self.proc.wait()})"
            raise EngineCoreDied(self.error)
        return None

    def get_outputs(self, timeout_s: float | None = None) -> list[CoreOutput]:
        """Blocks for the next step's outputs (up to timeout_s), then takes every step already queued."""
        msg, outputs = self._recv(timeout_s), []
        while isinstance(msg, CoreOutputs):
            outputs += msg.outputs
            self._stats = msg.stats
            if msg.kv_events is not None:
                self.kv.apply(msg.kv_events)
            msg = self._recv(0)
        return outputs

    def stats(self) -> EngineStats:
        return self._stats

    def drain_kv_events(self, max_events: int | None = None) -> KVEvents:
        return self.kv.drain(max_events)

    def request_kv_reset(self) -> None:
        self.kv.log.request_reset()

    def check_health(self) -> None:
        if self.error is not None:
            raise EngineCoreDied(self.error)
        if self.proc.poll() is not None:
            raise EngineCoreDied(f"engine core process {self.proc.pid} exited (code {self.proc.returncode})")

    def shutdown(self) -> None:
        if self.ctx.closed:
            return
        if self.proc.poll() is None:
            try:
                with self.lock:
                    self.inputs.send(self.codec.encode(Shutdown()), zmq.NOBLOCK)
                self.proc.wait(timeout=5)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        os.close(self.pidfd)
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)

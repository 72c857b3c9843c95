"""The token channel: a stream's chunks go from the replica to the router over ZeroMQ, one message per router
per engine step, instead of one Ray streaming item per request per step (measured: Ray's per-item cost on
both sides was most of the router's and the replica's CPU with 64 streams on 2 cores).

The Serve handle call (one call, no handle stream) still carries the request and returns the number of chunks
sent or the replica's error, so a replica that dies mid-stream fails the stream; cancelling the call cancels
the request (client gone, drain)."""

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import msgspec
import ray
import zmq
import zmq.asyncio

from conveyor.deployments.protocol import Chunk
from conveyor.deployments.responses import merge_deltas

log = logging.getLogger("ray.serve")
MAX_QUEUED_MESSAGES = 10_000  # per router: minutes of engine steps; a router that far behind is gone
IDLE_CLOSE_S = 60.0  # a router's socket unused this long is closed (routers come and go; a live one reconnects)


class TokenInbox:
    """Router side: one PULL socket on the node's IP; chunks demultiplexed to per-request queues."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.socket = self.ctx.socket(zmq.PULL)
        self.socket.setsockopt(zmq.RCVHWM, MAX_QUEUED_MESSAGES)
        self.socket.setsockopt(zmq.LINGER, 0)
        host = f"tcp://{ray.util.get_node_ip_address()}"
        self.address = f"{host}:{self.socket.bind_to_random_port(host)}"
        self.queues: dict[str, asyncio.Queue] = {}
        self.decoder = msgspec.msgpack.Decoder()
        self.reader: asyncio.Task | None = None
        self.messages = 0

    def open(self, request_id: str) -> asyncio.Queue:
        if self.reader is None or self.reader.done():
            self.reader = asyncio.get_running_loop().create_task(self._read())
        queue = self.queues[request_id] = asyncio.Queue()
        return queue

    def close(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    async def _read(self) -> None:
        """Socket errors end the reader (the next open() starts another); a bad message is skipped."""
        while True:
            frame = await self.socket.recv(copy=False)
            try:
                for request_id, chunk in self.decoder.decode(frame):
                    queue = self.queues.get(request_id)
                    if queue is not None:
                        queue.put_nowait(chunk)
            except Exception as e:
                log.warning("token channel: unreadable message: %r", e)
                continue
            self.messages += 1

    def shutdown(self) -> None:
        if self.reader is not None:
            self.reader.cancel()
        self.socket.close(0)
        self.ctx.term()


class TokenOutbox:
    """Replica side: chunks buffered per router address and flushed once per event-loop turn, so one engine
    step's outputs (delivered to the loop in one call) leave as one message per router. A router's socket
    unused for IDLE_CLOSE_S is closed, with whatever a gone router left queued in it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.ctx = zmq.Context()
        self.sockets: dict[str, zmq.Socket] = {}
        self.used_at: dict[str, float] = {}
        self.pending: dict[str, list[tuple[str, Chunk]]] = {}
        self.encoder = msgspec.msgpack.Encoder()
        self.clock = clock
        self.swept_at = clock()

    def send(self, address: str, request_id: str, chunk: Chunk) -> None:
        if not self.pending:
            asyncio.get_running_loop().call_soon(self.flush)
        self.pending.setdefault(address, []).append((request_id, chunk))

    def flush(self) -> None:
        pending, self.pending, now = self.pending, {}, self.clock()
        for address, items in pending.items():
            self.used_at[address] = now
            try:
                self._socket(address).send(self.encoder.encode(items), zmq.NOBLOCK, copy=False)
            except zmq.ZMQError as e:  # a router gone or far behind: its handle calls end by cancellation
                log.warning("token channel to %s: %d chunks dropped (%r)", address, len(items), e)
        if now - self.swept_at >= IDLE_CLOSE_S / 4:
            self.swept_at = now
            for address in [a for a, t in self.used_at.items() if now - t >= IDLE_CLOSE_S]:
                del self.used_at[address]
                if (socket := self.sockets.pop(address, None)) is not None:
                    socket.close(0)

    def _socket(self, address: str) -> zmq.Socket:
        socket = self.sockets.get(address)
        if socket is None:
            socket = self.sockets[address] = self.ctx.socket(zmq.PUSH)
            socket.setsockopt(zmq.SNDHWM, MAX_QUEUED_MESSAGES)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
        return socket

    def shutdown(self) -> None:
        for socket in self.sockets.values():
            socket.close(0)
        self.ctx.term()


async def follow(call: Awaitable[Any], queue: asyncio.Queue, tail_timeout_s: float = 10.0) -> Any:
    """A channel stream's chunks up to the one marked `last`, while the handle call is watched: its error ends
    the stream; its result says how many chunks were sent, so chunks lost in transit end the stream with an
    error instead of a hang. Chunks that queued up while the reader was busy leave merged, as one chunk (one
    SSE write instead of several behind each other) that keeps the first's keys (its TTFT split) and takes the
    later ones' (emission time, `last`, stats)."""
    watcher = asyncio.get_running_loop().create_task(_watch(call, queue))
    received, sent, complete, held = 0, None, False, None
    try:
        while True:
            if held is not None:
                item, held = held, None
            else:
                item = await (queue.get() if sent is None else asyncio.wait_for(queue.get(), tail_timeout_s))
            if isinstance(item, BaseException):
                raise item
            if "sent" in item:
                sent = item["sent"]
                if received >= sent:
                    complete = True
                    return
                continue
            received += 1
            while not item.get("last") and not queue.empty():
                held = queue.get_nowait()
                if isinstance(held, BaseException) or "sent" in held:
                    break
                merged = {**item, **held, "deltas": merge_deltas(item["deltas"] + held["deltas"])}  # keeps first_s
                item, held, received = merged, None, received + 1
            yield item
            if item.get("last"):
                complete = True  # the watcher awaits the call's result; cancelling it would cancel the request
                return
    except asyncio.TimeoutError:
        raise RuntimeError(f"token channel: {sent - received} of the replica's {sent} chunks did not arrive") from None
    finally:
        if not complete:
            watcher.cancel()


async def _watch(call: Awaitable[Any], queue: asyncio.Queue) -> None:
    try:
        queue.put_nowait(await call)
    except asyncio.CancelledError:
        raise
    except BaseException as e:
        queue.put_nowait(e)

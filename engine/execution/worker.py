"""One tensor-parallel rank: a Ray actor that joins the torch.distributed group and wraps a ModelRunner.

Steps arrive over a plain TCP connection from the driver (length-prefixed pickles) and run on a loop thread,
so a waiting rank sleeps in recv() and the actor's main thread stays free for health pings."""

import os
import pickle
import socket
import struct
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch

from conveyor.engine.execution.executor import allocate_kv_cache, close_kv_tiers, runner_class
from conveyor.engine.resolved_config import ResolvedConfig

HEADER = struct.Struct("<Q")


@dataclass
class RankInfo:
    rank: int
    pid: int
    node_ip: str
    num_blocks: int = 0


@dataclass
class StepReply:
    rank: int
    output: object = None
    error: str | None = None


def pack(obj: object) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return buf


def recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    try:
        return _recv_exact(sock, n)
    except (ConnectionError, OSError):
        return None


def recv_msg(sock: socket.socket) -> object | None:
    """The next message, or None when the peer has gone (EOF or reset)."""
    try:
        head = _recv_exact(sock, HEADER.size)
        data = head and _recv_exact(sock, HEADER.unpack(head)[0])
    except (ConnectionError, OSError):
        return None
    return None if data is None else pickle.loads(data)


def connect(host: str, port: int, timeout_s: float) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(None)
    return sock


class Worker:
    def __init__(self, rank: int, world_size: int, threads: int) -> None:
        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(threads)
        self.store: torch.distributed.TCPStore | None = None
        self.runner = None
        self.sock: socket.socket | None = None

    def info(self) -> RankInfo:
        import ray

        return RankInfo(self.rank, os.getpid(), ray.util.get_node_ip_address())

    def open_store(self, host: str, timeout_s: float) -> int:
        """Rank 0 hosts the rendezvous store on a port the OS picks, so engines on one node never collide."""
        self.store = torch.distributed.TCPStore(
            host, 0, self.world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        return self.store.port

    def init_model(self, config: ResolvedConfig, host: str, port: int, timeout_s: float) -> RankInfo:
        import torch.distributed as dist

        if self.store is None:
            self.store = dist.TCPStore(
                host, port, self.world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
            )
        self.cuda = config.device == "cuda"
        if self.cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(
            "nccl" if self.cuda else "gloo",
            store=self.store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        self.runner = runner_class(config)(config)
        info = self.info()
        info.num_blocks = self.runner.available_blocks()
        return info

    def allocate_kv_cache(self, num_blocks: int) -> int:
        return allocate_kv_cache(self.runner, num_blocks)

    def start_loop(self, host: str, port: int, token: bytes, timeout_s: float) -> None:
        self.sock = connect(host, port, timeout_s)
        self.sock.sendall(token + struct.pack("<I", self.rank))
        self.thread = threading.Thread(target=self._loop, args=(self.sock,), name=f"tp-rank{self.rank}", daemon=True)
        self.thread.start()

    def _loop(self, sock: socket.socket) -> None:
        if self.cuda:
            torch.cuda.set_device(0)
        while (so := recv_msg(sock)) is not None:
            try:
                reply = StepReply(self.rank, self.runner.execute_model(so))
            except Exception as e:
                reply = StepReply(self.rank, error=f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}")
            try:
                sock.sendall(pack(reply))
            except OSError:
                break

    def run(self, fn: Callable[..., object], *args: object) -> object:
        return fn(self.runner, *args)

    def ping(self) -> int:
        return self.rank

    def close(self) -> None:
        import torch.distributed as dist

        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.thread.join(timeout=5)
            self.sock.close()
        if self.runner is not None:
            close_kv_tiers(self.runner)
        if dist.is_initialized():
            dist.destroy_process_group()

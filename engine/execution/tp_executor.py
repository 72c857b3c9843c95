"""TP>1 executor (driver side): one Ray actor per rank in a placement group, ranks in one torch.distributed group.

Ray starts, places, pings and stops the workers; steps bypass Ray: the driver writes the (already delta)
SchedulerOutput, pickled once, to a TCP connection per rank and reads rank 0's sampled tokens back."""

import contextlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import time
from collections.abc import Callable
from typing import TypeVar

import ray
from ray.util.placement_group import get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from conveyor.engine.execution.executor import allocate_kv_tiers
from conveyor.engine.execution.worker import RankInfo, StepReply, Worker, pack, recv_exact, recv_msg
from conveyor.engine.model.parallel import check_shardable
from conveyor.engine.resolved_config import ResolvedConfig
from conveyor.engine.step import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("conveyor")
T = TypeVar("T")


class TPExecutor:
    init_timeout_s: float = 180.0
    step_timeout_s: float = 300.0
    collective_timeout_s: float = 120.0
    health_timeout_s: float = 5.0
    worker_num_cpus: float = 1.0

    def __init__(self, config: ResolvedConfig) -> None:
        n = config.tensor_parallel_size
        check_shardable(config.hf_config, n)
        self.size, self.cuda = n, config.device == "cuda"
        self.workers: list = []
        self.conns: list[socket.socket] = []
        self.selector = selectors.DefaultSelector()
        self.error = self.pg = None
        self.own_ray = self.own_pg = False
        if not ray.is_initialized():
            local = {"num_cpus": max(os.cpu_count() or 1, n), "_node_ip_address": "127.0.0.1"}
            address = os.environ.get("RAY_ADDRESS") or "local"
            ray.init(address=address, include_dashboard=False, **(local if address == "local" else {}))
            self.own_ray = True
        try:
            self._start(config)
        except BaseException:
            self.shutdown()
            raise

    def _placement(self) -> list[tuple[int, dict[str, float]]]:
        """(bundle index, resources) per rank: the caller's own group (Serve replica, in bundle 0) or a new one."""
        n, pg = self.size, get_current_placement_group()
        if pg is None:
            res = {"CPU": self.worker_num_cpus, **({"GPU": 1.0} if self.cuda else {})}
            total = ray.cluster_resources()
            if any(total.get(k, 0) < v * n for k, v in res.items()):
                raise ValueError(
                    f"tensor_parallel_size={n} needs {n} x {res}, the Ray cluster has "
                    f"{ {k: total.get(k, 0) for k in res} }"
                )
            self.pg, self.own_pg = placement_group([res] * n, strategy="STRICT_PACK"), True
            try:
                ray.get(self.pg.ready(), timeout=self.init_timeout_s)
            except ray.exceptions.GetTimeoutError:
                raise RuntimeError(
                    f"tensor_parallel_size={n}: could not reserve {n} x {res} on one node within "
                    f"{self.init_timeout_s:.0f}s (available: {ray.available_resources()})"
                ) from None
            return [(r, res) for r in range(n)]
        self.pg, specs = pg, pg.bundle_specs
        offset = len(specs) - n
        if offset < 0:
            raise ValueError(
                f"tensor_parallel_size={n} needs {n} placement-group bundles, the replica's group has {len(specs)}"
            )
        placed = [(r + offset, dict(specs[r + offset]) if r + offset else {}) for r in range(n)]
        if self.cuda and any(res.get("GPU", 0) < 1 for _, res in placed):
            raise ValueError(
                f"tensor_parallel_size={n} on CUDA needs a GPU bundle per rank besides the replica's "
                f"own bundle 0; the replica's group has {specs} (give it {n + 1} bundles)"
            )
        return placed

    def _start(self, config: ResolvedConfig) -> None:
        remote = ray.remote(Worker)
        for rank, (bundle, res) in enumerate(self._placement()):
            cpus = res.get("CPU", 0.0)
            self.workers.append(
                remote.options(
                    num_cpus=cpus,
                    num_gpus=res.get("GPU", 0.0),
                    max_restarts=0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
                ).remote(rank, self.size, max(1, int(cpus)))
            )
        infos: list[RankInfo] = self._get([w.info.remote() for w in self.workers], "start")
        host = infos[0].node_ip
        port = self._get([self.workers[0].open_store.remote(host, self.collective_timeout_s)], "open a store")[0]
        infos = self._get(
            [w.init_model.remote(config, host, port, self.collective_timeout_s) for w in self.workers], "load the model"
        )
        self.num_blocks = min(i.num_blocks for i in infos)
        self.num_swap_blocks = min(
            self._get([w.allocate_kv_cache.remote(self.num_blocks) for w in self.workers], "allocate the KV cache")
        )
        self.kv_tiers = self._get([w.run.remote(allocate_kv_tiers) for w in self.workers], "allocate the KV tiers")[0]
        self._connect()
        log.info(
            "tensor parallel: %d ranks (pids %s) on %s, %d KV blocks",
            self.size,
            [i.pid for i in infos],
            host,
            self.num_blocks,
        )

    def _connect(self) -> None:
        host, token = ray.util.get_node_ip_address(), secrets.token_bytes(16)
        conns: dict[int, socket.socket] = {}
        with socket.create_server((host, 0), backlog=self.size) as server:
            port = server.getsockname()[1]
            self._get([w.start_loop.remote(host, port, token, self.init_timeout_s) for w in self.workers], "connect")
            server.settimeout(self.init_timeout_s)
            while len(conns) < self.size:
                conn, _ = server.accept()
                conn.settimeout(self.init_timeout_s)
                hello = recv_exact(conn, len(token) + 4)
                if hello is None or not hmac.compare_digest(bytes(hello[: len(token)]), token):
                    conn.close()
                    continue
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conn.settimeout(self.step_timeout_s)
                conns[struct.unpack("<I", hello[len(token) :])[0]] = conn
        self.conns = [conns[r] for r in range(self.size)]
        for rank, conn in enumerate(self.conns):
            self.selector.register(conn, selectors.EVENT_READ, rank)

    def _get(self, refs: list, what: str) -> list:
        try:
            return ray.get(refs, timeout=self.init_timeout_s)
        except Exception as e:
            dead = self._dead_ranks()
            self.error = RuntimeError(
                f"tensor-parallel worker rank {_names(dead)} died or is unresponsive ({what})"
                if dead
                else f"tensor-parallel workers failed to {what}: {e}"
            )
            raise self.error from e

    def _dead_ranks(self) -> list[int]:
        refs = [w.ping.remote() for w in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.health_timeout_s)
        dead = []
        for rank, ref in enumerate(refs):
            try:
                ray.get(ref, timeout=0) if ref in ready else dead.append(rank)
            except Exception:
                dead.append(rank)
        return dead

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if self.error is not None:
            raise self.error
        try:
            replies, dead = self._round_trip(pack(so))
        except BaseException:
            self.error = RuntimeError("a tensor-parallel step was interrupted; the workers' state is unknown")
            raise
        errors = {r: x.error for r, x in replies.items() if x.error}
        if not dead and not errors and len(replies) == self.size:
            return replies[0].output
        if dead:
            msg = f"tensor-parallel worker rank {_names(sorted(dead))} died (its connection closed)"
        elif errors:
            msg = "; ".join(f"tensor-parallel rank {r} failed: {e}" for r, e in sorted(errors.items()))
        else:
            late = [r for r in range(self.size) if r not in replies]
            msg = f"tensor-parallel worker rank {_names(late)} did not finish a step within {self.step_timeout_s}s"
        self.error = RuntimeError(msg)
        raise self.error

    def _round_trip(self, data: bytes) -> tuple[dict[int, StepReply], set[int]]:
        """Send one step to every rank, wait for every reply; after a failure give the others 1 s to report."""
        replies: dict[int, StepReply] = {}
        dead: set[int] = set()
        for rank, conn in enumerate(self.conns):
            try:
                conn.sendall(data)
            except OSError:
                dead.add(rank)
        deadline = time.monotonic() + self.step_timeout_s
        while len(replies) + len(dead) < self.size and (left := deadline - time.monotonic()) > 0:
            for key, _ in self.selector.select(left):
                reply: StepReply | None = recv_msg(key.fileobj)
                if reply is None:
                    self.selector.unregister(key.fileobj)
                    dead.add(key.data)
                else:
                    replies[key.data] = reply
                if dead or reply is not None and reply.error:
                    deadline = min(deadline, time.monotonic() + 1.0)
        return replies, dead

    def collective_rpc(self, fn: Callable[..., T], *args: object) -> list[T]:
        """fn(model_runner, *args) on every rank at once, between steps; each rank's result in rank order."""
        if self.error is not None:
            raise self.error
        return self._get([w.run.remote(fn, *args) for w in self.workers], f"run {getattr(fn, '__name__', fn)}")

    def check_health(self) -> None:
        if self.error is not None:
            raise self.error
        dead = self._dead_ranks()
        if dead:
            self.error = RuntimeError(f"tensor-parallel worker rank {_names(dead)} died or is unresponsive")
            raise self.error

    def shutdown(self) -> None:
        self.selector.close()
        for conn in self.conns:
            conn.close()
        self.conns = []
        if not ray.is_initialized():
            self.workers, self.pg = [], None
            return
        if self.workers and self.error is None:
            try:
                ray.get([w.close.remote() for w in self.workers], timeout=self.health_timeout_s)
            except Exception:
                pass
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self.own_pg and self.pg is not None:
            ray.util.remove_placement_group(self.pg)
        self.pg = None
        if self.own_ray:
            ray.shutdown()
            self.own_ray = False

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()


def _names(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))

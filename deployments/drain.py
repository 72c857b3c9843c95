"""Graceful drain, started by the launcher (deployments/launch.py) on SIGINT/SIGTERM: every Router refuses new
requests with 503 + Retry-After, lets the ones in flight finish, ends whatever is left at the drain timeout with
an explicit error, and reports back; only then does the launcher shut Serve down. Ray Serve 2.60's own
`serve.shutdown()` kills the HTTP proxy in the same controller tick as the replicas, so it cannot drain;
`serve.delete(app)` lets in-flight requests finish (up to graceful_shutdown_timeout_s) but drops the app's route
at once, so a new request gets the proxy's plain-text 404 (measured), not a refusal a client can act on."""

import asyncio
import logging
import time
from typing import Any

import ray
from ray.serve._private.constants import SERVE_NAMESPACE

from conveyor.deployments.api_error import APIError

DRAIN_SIGNAL = "conveyor_drain"
log = logging.getLogger("ray.serve")


class DrainSignal:
    """A named actor the launcher owns (so it dies with the launcher). Routers long-poll `wait`; `start`
    releases them all with the drain timeout, `expire` ends the drain early (a second signal); each router
    reports once it has no request left."""

    def __init__(self) -> None:
        self.started, self.expired = asyncio.Event(), asyncio.Event()
        self.timeout_s = 0.0
        self.watchers: set[str] = set()
        self.reports: dict[str, dict[str, int]] = {}

    async def wait(self, router_id: str) -> float:
        self.watchers.add(router_id)
        await self.started.wait()
        return self.timeout_s

    async def start(self, timeout_s: float) -> int:
        self.timeout_s = timeout_s
        self.started.set()
        return len(self.watchers)

    async def expire(self) -> None:
        self.expired.set()

    async def wait_expired(self) -> None:
        await self.expired.wait()

    async def drained(self, router_id: str, report: dict[str, int]) -> None:
        self.reports[router_id] = report

    async def progress(self) -> dict[str, Any]:
        return {"watchers": sorted(self.watchers), "reports": dict(self.reports)}


class Drain:
    """One router's side of the drain. `active` counts requests inside the router's handler, `live` the
    replica streams it is reading (a streaming response outlives its handler); a drain is over when both
    are empty. Without a DrainSignal actor (plain `serve run`) nothing here ever turns on."""

    def __init__(self) -> None:
        self.draining = self.expired = self.forced = False
        self.timeout_s = self.deadline = 0.0
        self.active = 0
        self.live: set[Any] = set()
        self.in_flight_at_start = self.ended_by_timeout = 0
        self.idle = asyncio.Event()
        self.task: asyncio.Task | None = None

    def watch(self, router_id: str) -> None:
        try:
            signal = ray.get_actor(DRAIN_SIGNAL, namespace=SERVE_NAMESPACE)
        except ValueError:
            return
        self.task = asyncio.create_task(self.run(signal, router_id))

    def in_flight(self) -> int:
        return max(self.active, len(self.live))

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        self.check()

    def track(self, gen: Any) -> None:
        self.live.add(gen)
        if self.expired:
            gen.cancel()

    def untrack(self, gen: Any) -> None:
        self.live.discard(gen)
        self.check()

    def check(self) -> None:
        if self.draining and self.active <= 0 and not self.live:
            self.idle.set()

    def refusal(self) -> APIError:
        left = max(1.0, self.deadline - time.monotonic())
        return APIError(
            f"the server is shutting down (draining in-flight requests, at most {left:.0f}s more); "
            "retry against another server or once it is back",
            status=503,
            type="service_unavailable",
            code="shutting_down",
            retry_after_s=left,
        )

    def timeout_error(self) -> APIError:
        why = "ended early by a second shutdown signal" if self.forced else f"timeout {self.timeout_s:g}s"
        return APIError(
            f"the server shut down before this request finished (drain {why})",
            status=503,
            type="service_unavailable",
            code="drain_timeout",
        )

    @staticmethod
    async def wait_expired(signal: Any) -> None:
        await signal.wait_expired.remote()

    async def run(self, signal: Any, router_id: str) -> None:
        try:
            self.timeout_s = await signal.wait.remote(router_id)
        except Exception as e:
            log.warning("drain signal unreachable, this router will not drain: %r", e)
            return
        self.draining, self.deadline = True, time.monotonic() + self.timeout_s
        self.in_flight_at_start = self.in_flight()
        log.info("draining: refusing new requests; %d in flight, timeout %gs", self.in_flight_at_start, self.timeout_s)
        self.check()
        idle, early = asyncio.ensure_future(self.idle.wait()), asyncio.ensure_future(self.wait_expired(signal))
        await asyncio.wait({idle, early}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        self.forced = early.done() and not idle.done()
        early.cancel()
        if not idle.done():
            idle.cancel()
            self.expired, self.ended_by_timeout = True, self.in_flight()
            log.warning(
                "drain %s: ending %d requests with an error",
                "forced" if self.forced else "timeout",
                self.ended_by_timeout,
            )
            for gen in list(self.live):
                gen.cancel()
            try:
                await asyncio.wait_for(self.idle.wait(), 10.0)
            except asyncio.TimeoutError:
                pass
        report = {
            "in_flight_at_start": self.in_flight_at_start,
            "ended_by_timeout": self.ended_by_timeout,
            "left": self.in_flight(),
        }
        await signal.drained.remote(router_id, report)

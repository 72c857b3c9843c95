"""The single-deployment topology: the OpenAI router and the engine replica in one Serve deployment, so a
request takes no deployment-handle hop (proxy -> this replica -> engine). The router's code is reused as is,
talking to an in-process LLMReplica through a handle-shaped adapter."""

import asyncio
import inspect
from typing import Any, AsyncIterator

from ray.serve.exceptions import RequestCancelledError

from conveyor.deployments.replica import LLMReplica
from conveyor.deployments.router import Router


class LocalStream:
    """What `handle.options(stream=True).method.remote()` returns, over a local async generator. As a Serve
    stream does, `cancel()` ends a read in progress with RequestCancelledError (the drain timeout relies on it);
    the generator's own `finally` runs first."""

    def __init__(self, gen: AsyncIterator[Any]) -> None:
        self.gen = gen
        self.reader: asyncio.Task | None = None
        self.cancelled = False

    def __aiter__(self) -> "LocalStream":
        return self

    async def __anext__(self) -> Any:
        if self.cancelled:
            raise RequestCancelledError("local stream")
        self.reader = asyncio.current_task()
        try:
            return await self.gen.__anext__()
        except asyncio.CancelledError:
            if not self.cancelled:
                raise
            getattr(self.reader, "uncancel", lambda: None)()
            raise RequestCancelledError("local stream") from None
        finally:
            self.reader = None

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        if self.reader is not None:
            self.reader.cancel()
        else:
            asyncio.get_running_loop().create_task(self.gen.aclose())


class LocalMethod:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        result = self.fn(*args, **kwargs)
        if inspect.isasyncgen(result):
            return LocalStream(result)
        if inspect.isawaitable(result):
            return asyncio.ensure_future(result)
        future = asyncio.get_running_loop().create_future()
        future.set_result(result)
        return future


class LocalHandle:
    """A DeploymentHandle-shaped view of an object in this process."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def options(self, **_: Any) -> "LocalHandle":
        return self

    def __getattr__(self, name: str) -> LocalMethod:
        return LocalMethod(getattr(self.target, name))


class LLMServer(Router.func_or_class):
    """Router + LLMReplica in one actor; Serve's health check and stats hooks reach the engine."""

    async def __init__(self, replica_args: dict[str, Any], *router_args: Any) -> None:
        replica = LLMReplica.func_or_class.__new__(LLMReplica.func_or_class)
        await replica.__init__(**replica_args)
        self.local = replica
        await super().__init__(LocalHandle(replica), *router_args)

    def check_health(self) -> None:
        self.local.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.local.record_routing_stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.local.record_autoscaling_stats()

    def __del__(self) -> None:
        local = getattr(self, "local", None)
        if local is not None:
            local.__del__()

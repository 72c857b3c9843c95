"""What one Ray Serve deployment-handle call costs, caller and callee CPU and latency: a handle stream of two
items (the router -> replica shape before the token channel carried every chunk) against one call with one
result (the shape now). No model: the callee sleeps 1 ms between items.

    python -m benchmarks.serve_handle --calls 2000 --concurrency 16 --rounds 3
"""

import argparse
import asyncio
import os
import time
from typing import Any, AsyncIterator

import psutil
import ray
from ray import serve

from conveyor.deployments.app import AppArgs


@serve.deployment(max_ongoing_requests=1024)
class Callee:
    async def stream(self, i: int) -> AsyncIterator[dict[str, Any]]:
        yield {"deltas": [i]}
        await asyncio.sleep(0.001)
        yield {"sent": 1}

    async def call(self, i: int) -> dict[str, Any]:
        await asyncio.sleep(0.001)
        return {"sent": 1}

    def pid(self) -> int:
        return os.getpid()


@serve.deployment(max_ongoing_requests=1024)
class Caller:
    def __init__(self, callee: Any) -> None:
        self.callee, self.streaming = callee, callee.options(stream=True)

    def pid(self) -> int:
        return os.getpid()

    async def callee_pid(self) -> int:
        return await self.callee.pid.remote()

    async def run(self, shape: str, calls: int, concurrency: int) -> tuple[float, float]:
        """(wall seconds, p50 latency) of `calls` calls with at most `concurrency` in flight."""
        gate, latencies = asyncio.Semaphore(concurrency), []

        async def one(i: int) -> None:
            async with gate:
                start = time.perf_counter()
                if shape == "stream":
                    async for _ in self.streaming.stream.remote(i):
                        pass
                else:
                    await self.callee.call.remote(i)
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(calls)))
        return time.perf_counter() - start, sorted(latencies)[len(latencies) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    ray.init(runtime_env={"env_vars": AppArgs().serve_env()})  # the Serve switches our router and replica run with
    handle = serve.run(Caller.bind(Callee.bind()))
    procs = {
        "caller": psutil.Process(handle.pid.remote().result()),
        "callee": psutil.Process(handle.callee_pid.remote().result()),
    }
    print(f"{args.calls} calls per shape and round, {args.concurrency} in flight; CPU ms per call (user + system)")
    for rnd in range(args.rounds):
        for shape in ("stream", "call"):
            before = {k: sum(p.cpu_times()[:2]) for k, p in procs.items()}
            wall, p50 = handle.run.remote(shape, args.calls, args.concurrency).result()
            cpu = {k: 1000 * (sum(p.cpu_times()[:2]) - before[k]) / args.calls for k, p in procs.items()}
            print(
                f"round {rnd} {shape:<6}: {args.calls / wall:7.1f} calls/s  p50 {1000 * p50:6.2f} ms  CPU caller "
                f"{cpu['caller']:.3f} callee {cpu['callee']:.3f} total {cpu['caller'] + cpu['callee']:.3f}",
                flush=True,
            )
    serve.shutdown()


if __name__ == "__main__":
    main()

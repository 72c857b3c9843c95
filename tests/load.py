"""Load for the serving tests. A burst of concurrent completions (streams and whole) in a background thread, each request's outcome recorded:
when it started and ended, its status, Retry-After, the replica that answered, and whether the answer was
complete (for the fault tests, which change the cluster while the burst is in flight); and a steady load of
clients sending long completions back to back (for the autoscaling tests)."""

import asyncio
import json
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Outcome:
    index: int
    stream: bool
    started: float = 0.0
    ended: float = 0.0
    status: int = 0
    retry_after: str | None = None
    replica: str = ""
    error: dict[str, Any] = field(default_factory=dict)  # the OpenAI error object (body, or a stream's error event)
    complete: bool = False  # every choice finished (length/stop); a stream also ended with [DONE]
    hung: bool = False  # the client's timeout ended it

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.complete and not self.error

    @property
    def explicit_error(self) -> bool:
        """Ended with an error the client can act on: 429/503 with Retry-After, or a stream's 503 error event."""
        if self.status in (429, 503):
            return self.retry_after is not None and bool(self.error)
        return self.status == 200 and self.stream and self.error.get("code") == 503


async def request(client: httpx.AsyncClient, out: Outcome, body: dict[str, Any], timeout_s: float) -> None:
    out.started = time.time()
    try:
        if out.stream:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}, timeout=timeout_s) as r:
                out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
                out.replica = r.headers.get("x-conveyor-replica", "")
                finished, done = False, False
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            out.error = event["error"]
                        elif any(c.get("finish_reason") for c in event.get("choices", [])):
                            finished = True
                    elif r.status_code != 200 and line.strip():
                        out.error = json.loads(line).get("error", {})
                out.complete = r.status_code == 200 and finished and done and not out.error
        else:
            r = await client.post("/v1/completions", json=body, timeout=timeout_s)
            out.status, out.retry_after = r.status_code, r.headers.get("retry-after")
            out.replica = r.headers.get("x-conveyor-replica", "")
            data = r.json()
            out.error = data.get("error", {}) if r.status_code != 200 else {}
            out.complete = r.status_code == 200 and all(c.get("finish_reason") for c in data.get("choices", [{}]))
    except httpx.TimeoutException:
        out.hung = True
    except httpx.HTTPError as e:
        out.error = {"message": repr(e)}
    out.ended = time.time()


class Burst:
    """`n` requests at once (every other one a stream), `max_tokens` each, started by `start()`."""

    def __init__(self, url: str, n: int, max_tokens: int, timeout_s: float, tag: str = "") -> None:
        self.url, self.timeout_s = url, timeout_s
        self.outcomes = [Outcome(i, stream=i % 2 == 0) for i in range(n)]
        self.bodies = [
            {"prompt": f"{tag} request {i}: " + "tell me a story " * (1 + i % 4), "max_tokens": max_tokens}
            | {"temperature": 0, "ignore_eos": True}
            for i in range(n)
        ]
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        limits = httpx.Limits(max_connections=len(self.outcomes) + 8)
        async with httpx.AsyncClient(base_url=self.url, limits=limits) as client:
            await asyncio.gather(*(request(client, o, b, self.timeout_s) for o, b in zip(self.outcomes, self.bodies)))

    def start(self) -> "Burst":
        self.thread.start()
        return self

    def in_flight(self) -> int:
        return sum(1 for o in self.outcomes if o.started and not o.ended)

    def join(self, timeout_s: float) -> list[Outcome]:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"the burst did not end within {timeout_s}s"
        return self.outcomes


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 8000) for _ in range(n)]


class Load:
    """`n` clients in a thread, each sending long greedy completions back to back; a 429/503 waits Retry-After.
    `codes` and `replicas` (the x-conveyor-replica of each 200) grow as answers come. An exception in the thread
    fails the test at `__exit__`."""

    def __init__(self, url: str, n: int, prompt_len: int, max_tokens: int) -> None:
        self.url, self.n, self.prompt_len, self.max_tokens = url, n, prompt_len, max_tokens
        self.stop, self.codes, self.replicas = threading.Event(), [], []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.main, daemon=True)

    def main(self) -> None:
        try:
            asyncio.run(self.run())
        except BaseException as e:
            self.error = e

    async def client(self, http: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            r = await http.post(
                "/v1/completions",
                json={"prompt": tokens(rng, self.prompt_len), "ignore_eos": True, "max_tokens": self.max_tokens},
            )
            self.codes.append(r.status_code)
            if r.status_code == 200:
                self.replicas.append(r.headers["x-conveyor-replica"])
            if r.status_code in (429, 503):  # a refusal must say when to come back (KeyError fails the test)
                await asyncio.sleep(float(r.headers["retry-after"]))

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as http:
            await asyncio.gather(*(self.client(http, i) for i in range(self.n)))

    def __enter__(self) -> "Load":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "a load client hung"
        if self.error is not None:
            raise AssertionError(f"a load client failed: {self.error!r}") from self.error

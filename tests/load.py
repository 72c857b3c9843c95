"""A burst of concurrent completions (streams and whole) in a background thread, each request's outcome recorded:
when it started and ended, its status, Retry-After, the replica that answered, and whether the answer was
complete. For the fault tests, which change the cluster while the burst is in flight."""

import asyncio
import json
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

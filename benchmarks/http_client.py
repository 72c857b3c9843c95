"""The benchmarks' one HTTP client. Load goes through aiohttp (as vLLM's serving benchmark does): on shared cores
the client's own CPU is part of the load, and aiohttp's stream reader costs less of it than httpx's.
`complete` sends one completion (whole or streamed) and returns what a client sees of it; one-shot control calls
made outside an event loop (models, /v1/cluster, warm-ups) use the standard library."""

import asyncio
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Completion:
    """One request as its client saw it. `status` -1: no HTTP answer (`error` says why). Times are perf_counter."""

    status: int
    sent: float
    done: float = 0.0  # the whole answer read (stream: its last event)
    chunks: list[float] = field(default_factory=list)  # arrival of each non-empty content delta
    tokens: int = 0  # usage.completion_tokens; a stream without usage: its content chunks
    retry_after: str | None = None
    server_timing: dict[str, float] = field(default_factory=dict)  # ms by name, from the Server-Timing header
    body: Any = None  # a whole answer's JSON, or an error answer's (None when it is not JSON)
    error: str = ""  # a refusal's text, a stream's error event, or the transport error

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def ttft_s(self) -> float | None:
        """Send to the first content delta (a whole answer: to the answer); None when a stream carried none."""
        if self.chunks:
            return self.chunks[0] - self.sent
        return self.done - self.sent if self.ok and self.body is not None else None

    @property
    def gaps_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]

    @property
    def error_code(self) -> Any:
        """The OpenAI error shape's `code` of a refusal, if its body has one."""
        return (self.body or {}).get("error", {}).get("code") if isinstance(self.body, dict) else None


def session(connections: int, timeout_s: float = 600.0, connect_s: float | None = None) -> aiohttp.ClientSession:
    """At most `connections` open at once; `timeout_s` bounds each wait for data, `connect_s` (default the same)
    a connection, waiting for a free one included."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_s or timeout_s, sock_read=timeout_s),
    )


def server_timing_ms(header: str) -> dict[str, float]:
    """The router's Server-Timing header as {name: ms}: `replica;dur=4.5, router;dur=12.3`."""
    parts = (part.strip().partition(";dur=") for part in header.split(",") if part.strip())
    return {name: float(dur) for name, _, dur in parts if dur}


async def complete(
    client: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Completion:
    """POST `body` to a completions or chat completions `url`; a streamed body (`stream`) is read event by event."""
    c = Completion(0, time.perf_counter())
    try:
        async with client.post(url, json=body, headers=headers) as r:
            c.status, c.retry_after = r.status, r.headers.get("retry-after")
            c.server_timing = server_timing_ms(r.headers.get("server-timing", ""))
            if r.status != 200:
                text = await r.text()
                c.error = f"HTTP {r.status}: {text[:200]}"
                try:
                    c.body = json.loads(text)
                except ValueError:
                    pass
            elif body.get("stream"):
                await read_stream(r, c, chat="messages" in body)
            else:
                c.body = json.loads(await r.text())
                c.tokens = c.body["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        c.status, c.error = -1, repr(e)
    except (ValueError, KeyError) as e:
        c.error = f"malformed answer: {e!r}"[:300]
    c.done = time.perf_counter()
    return c


async def read_stream(r: aiohttp.ClientResponse, c: Completion, chat: bool) -> None:
    usage = None
    async for raw in r.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            c.error = f"error event: {str(event['error'])[:200]}"
            continue
        usage = event.get("usage") or usage
        choice = (event.get("choices") or [{}])[0]
        if (choice.get("delta") or {}).get("content") if chat else choice.get("text"):
            c.chunks.append(time.perf_counter())
    c.tokens = usage["completion_tokens"] if usage else len(c.chunks)


async def first_event_s(client: aiohttp.ClientSession, url: str) -> float:
    """Seconds from a POST of `{}` to the first SSE data line (a bare streaming app's whole TTFT)."""
    start = time.perf_counter()
    async with client.post(url, json={}) as r:
        async for line in r.content:
            if line.startswith(b"data: "):
                return time.perf_counter() - start
    raise RuntimeError(f"{url}: no data")


async def fetch_json(client: aiohttp.ClientSession, url: str, timeout_s: float | None = None) -> Any:
    """A GET inside an event loop (`timeout_s`: the whole call's, default the session's)."""
    timeout = {"timeout": aiohttp.ClientTimeout(total=timeout_s)} if timeout_s else {}
    async with client.get(url, **timeout) as r:
        r.raise_for_status()
        return await r.json()


def get_json(url: str, timeout_s: float = 30.0) -> Any:
    """A one-shot GET outside an event loop; raises OSError (urllib's errors) when there is no 200 answer."""
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return json.load(r)


def post_json(url: str, body: dict[str, Any], timeout_s: float = 60.0) -> int:
    """A one-shot POST outside an event loop: its status (OSError when there is no HTTP answer)."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code

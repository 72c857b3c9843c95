import json
import time
from collections.abc import AsyncIterator
from typing import Any


async def read_completion_stream(
    lines: AsyncIterator[str], start: float, arrivals: list[float] | None = None
) -> tuple[float | None, int]:
    """Over an SSE body's lines (httpx `aiter_lines()`, aiohttp `aiohttp_lines()`): time to the first
    non-empty text delta since `start`, and completion tokens from usage; appends each content chunk's
    arrival time (perf_counter) to `arrivals` when given."""
    ttft, tokens = None, 0
    async for line in lines:
        line = line.strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0]["text"]:
            now = time.perf_counter()
            ttft = now - start if ttft is None else ttft
            if arrivals is not None:
                arrivals.append(now)
    return ttft, tokens


def server_timing_ms(header: str) -> dict[str, float]:
    """The router's Server-Timing header as {name: ms}: `replica;dur=4.5, router;dur=12.3`."""
    parts = (part.strip().partition(";dur=") for part in header.split(",") if part.strip())
    return {name: float(dur) for name, _, dur in parts if dur}


async def aiohttp_lines(response: Any) -> AsyncIterator[str]:
    async for raw in response.content:
        yield raw.decode()

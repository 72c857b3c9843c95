import json
import time

import httpx


async def read_completion_stream(r: httpx.Response, start: float) -> tuple[float | None, int]:
    """Time to the first non-empty text delta since `start`, and completion tokens from usage."""
    ttft, tokens = None, 0
    async for line in r.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif ttft is None and chunk["choices"] and chunk["choices"][0]["text"]:
            ttft = time.perf_counter() - start
    return ttft, tokens

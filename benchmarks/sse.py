import json
import time

import httpx


async def read_completion_stream(r: httpx.Response, start: float,
                                 arrivals: list[float] | None = None) -> tuple[float | None, int]:
    """Time to the first non-empty text delta since `start`, and completion tokens from usage; appends each
    content chunk's arrival time (perf_counter) to `arrivals` when given."""
    ttft, tokens = None, 0
    async for line in r.aiter_lines():
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

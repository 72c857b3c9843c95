"""A burst far past capacity over real HTTP: every request is counted, each one is served or refused with
429/503 + Retry-After, none hangs past the client's timeout, and the pool and the admission queue end empty."""

import asyncio
import json
import random
import time
from typing import Any

import httpx
import pytest

from tests.serve_app import SHARED_ARGS, App

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("conveyor_app", "pool_whole")]
PROMPT_TOKENS, MAX_TOKENS, BURST, CLIENT_TIMEOUT_S = 100, 32, 60, 60.0


async def one(client: httpx.AsyncClient, i: int) -> dict[str, Any]:
    body = {
        "prompt": [random.randrange(10, 8000) for _ in range(PROMPT_TOKENS)],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": i % 2 == 1,
    }
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            raw = await r.aread()
    except httpx.HTTPError as e:
        return {"i": i, "error": repr(e), "s": time.perf_counter() - t0}
    return {
        "i": i,
        "status": r.status_code,
        "headers": dict(r.headers),
        "raw": raw.decode(),
        "stream": body["stream"],
        "s": time.perf_counter() - t0,
    }


async def burst(app: App) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=app.url, timeout=CLIENT_TIMEOUT_S, limits=limits, headers=app.headers
    ) as client:
        return await asyncio.gather(*(one(client, i) for i in range(BURST)))


def completion_tokens(result: dict[str, Any]) -> int:
    if not result["stream"]:
        return json.loads(result["raw"])["usage"]["completion_tokens"]
    events = [line[6:] for line in result["raw"].splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and "error" not in events[-2], events[-3:]
    return json.loads(events[-2])["usage"]["completion_tokens"]


def test_burst_ten_times_capacity(conveyor_app: App) -> None:
    app = conveyor_app
    engine = SHARED_ARGS["engine"]
    per_request = -(-PROMPT_TOKENS // 16) + -(-MAX_TOKENS // 16)
    capacity = max(engine["max_num_seqs"], engine["num_blocks"] // per_request)
    assert BURST >= 10 * capacity
    base = app.pool_whole()
    results = asyncio.run(burst(app))
    assert len(results) == BURST and sorted(r["i"] for r in results) == list(range(BURST))
    assert not [r for r in results if "error" in r], "requests failed or hung past the client timeout"
    assert max(r["s"] for r in results) < CLIENT_TIMEOUT_S
    served = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] in (429, 503)]
    assert len(served) + len(refused) == BURST, sorted({r["status"] for r in results})
    assert served and refused, f"{len(served)} served, {len(refused)} refused: the burst did not overload"
    for r in refused:
        assert int(r["headers"]["retry-after"]) >= 1
        err = json.loads(r["raw"])["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] in (
            "rate_limit_error",
            "service_unavailable",
        )
    assert all(completion_tokens(r) == MAX_TOKENS for r in served)
    after = app.pool_whole()
    ran = (after["num_finished"] - after["num_aborted"]) - (base["num_finished"] - base["num_aborted"])
    assert ran == len(served), f"{ran} requests ran to their end, {len(served)} were served"
    assert after["num_aborted"] == base["num_aborted"]
    assert app.admission_queued() == 0
    print(
        f"burst {BURST} (capacity {capacity}): {len(served)} served, "
        f"{sum(r['status'] == 429 for r in results)} x 429, {sum(r['status'] == 503 for r in results)} x 503, "
        f"slowest {max(r['s'] for r in results):.1f}s"
    )

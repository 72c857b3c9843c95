"""A request's answer from its replica's chunks: one JSON body, or an SSE stream of OpenAI chunks ending in
[DONE]. A failure before the first chunk is the response's status; after it, an SSE error event. Both carry
Server-Timing: where the first token's time went (replica, router, admission, Serve's ingress and egress)."""

import time
from typing import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from conveyor.deployments.api_error import APIError
from conveyor.deployments.metrics import RouterMetrics
from conveyor.deployments.protocol import Chunk
from conveyor.deployments.replica_errors import LOST, cause, first_chunk_error, replica_lost
from conveyor.deployments.request_models import ChatCompletionRequest, SamplingRequest
from conveyor.deployments.responses import DONE, ResponseBuilder, sse_error


async def respond(
    metrics: RouterMetrics,
    req: SamplingRequest,
    stream: AsyncIterator[Chunk],
    builder: ResponseBuilder,
    start: float,
    admitted_s: float = 0.0,
) -> Response:
    """`start`: when the router received the request (perf_counter); `admitted_s`: how long admission took."""
    endpoint = "/v1/chat/completions" if isinstance(req, ChatCompletionRequest) else "/v1/completions"
    try:
        first = await anext(stream, Chunk(deltas=[]))
    except Exception as e:
        await stream.aclose()
        raise first_chunk_error(e) from None
    ttft, replica = time.perf_counter() - start, first.get("replica", "")
    egress = time.time() - first.get("emitted_at", time.time())
    phases = {
        "replica": first.get("first_s", 0.0),
        "router": ttft,
        "admission": admitted_s,
        "ingress": first.get("ingress_s", 0.0),
        "egress": egress,
    }
    timing = {
        "server-timing": ", ".join(f"{name};dur={1000 * s:.3f}" for name, s in phases.items()),
        "x-conveyor-replica": replica,
    }
    if not req.stream:
        builder.add(first["deltas"])
        last = first
        async for last in stream:
            builder.add(last["deltas"])
        response = JSONResponse(builder.response().model_dump(), headers=timing)
        metrics.serve_overhead(replica, "egress", time.time() - last.get("emitted_at", time.time()))
        metrics.request_done(endpoint, time.perf_counter() - start)
        return response
    usage = req.stream_options is not None and req.stream_options.include_usage

    async def sse() -> AsyncIterator[str]:
        try:
            yield "".join(builder.chunks(first["deltas"]))
            metrics.serve_overhead(replica, "egress", time.time() - first.get("emitted_at", time.time()))
            async for chunk in stream:
                yield "".join(builder.chunks(chunk["deltas"]))
                metrics.serve_overhead(replica, "egress", time.time() - chunk.get("emitted_at", time.time()))
            if usage:
                yield builder.usage_chunk()
        except APIError as e:
            yield sse_error(str(e), e.type, e.status)
        except Exception as e:
            lost = replica_lost(cause(e))
            yield sse_error(LOST, "service_unavailable", 503) if lost else sse_error(f"engine error: {cause(e)}")
        finally:
            await stream.aclose()
            metrics.request_done(endpoint, time.perf_counter() - start)
        yield DONE

    return StreamingResponse(sse(), media_type="text/event-stream", headers=timing)

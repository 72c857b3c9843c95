"""APIError: a request refused with an HTTP status, and the OpenAI error body it answers with."""

import math

from pydantic import BaseModel

from conveyor.cluster.admission_controller import Decision


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: int | str | None = None,
        retry_after_s: float = 1.0,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.type, self.retry_after_s = status, param, type, retry_after_s
        self.code = status if code is None else code

    def headers(self) -> dict[str, str]:
        """A refusal for load (429, 503) says when to come back, in whole seconds."""
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))} if self.status in (429, 503) else {}

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=str(self), type=self.type, param=self.param, code=self.code))


def queue_time_error(limit_s: float, wait_s: float, retry_after_s: float) -> APIError:
    """Admission's refusal when the shortest queue is longer than the queue-time objective (infinite: every batch
    slot is taken on replicas that have not finished a request yet, so their queues' speed is unknown)."""
    shortest = "unknown: every slot taken, no request finished yet" if math.isinf(wait_s) else f"{wait_s:.1f}s"
    return APIError(
        f"overloaded: every replica's queue is longer than the {limit_s:g}s objective (shortest "
        f"{shortest}); retry after {retry_after_s:g}s",
        status=429,
        type="rate_limit_error",
        code="queue_time",
        retry_after_s=retry_after_s,
    )


def admission_refusal(d: Decision, where: str, largest_blocks: int, max_queue_time_s: float) -> APIError:
    """The answer to a request admission refused (`d`); `where`: the request's prompt field."""
    if d.reason == "prompt_too_large":
        return APIError(f"the {where} needs {largest_blocks} KV-cache blocks, more than any replica has", param=where)
    if d.reason in ("no_replicas", "stale"):
        return APIError(
            f"no replica is reporting its load ({d.reason}); retry later",
            status=503,
            type="service_unavailable",
            code=d.reason,
            retry_after_s=d.retry_after_s,
        )
    if d.reason == "queue_time":
        return queue_time_error(max_queue_time_s, d.queue_time_s, d.retry_after_s)
    return APIError(
        f"overloaded: no replica has KV-cache room for this request ({d.reason}); retry after {d.retry_after_s:g}s",
        status=429,
        type="rate_limit_error",
        code=d.reason,
        retry_after_s=d.retry_after_s,
    )

"""What a failure on the way to or from a replica means for the client: the error a Serve call carries, a replica
that was lost (retryable), and the APIError a request's first chunk fails with."""

import re

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from conveyor.deployments.api_error import APIError

LOST = "the replica serving this request was lost (its process or node failed); retry"


def cause(e: BaseException) -> BaseException:
    return getattr(e, "cause", None) or e


def replica_lost(e: BaseException) -> bool:
    """The replica's actor died or cannot be reached (its process or node is gone): the request may be retried."""
    return isinstance(e, (RayActorError, ActorUnavailableError))


def param_of(message: str) -> str | None:
    """The request field an engine-side ValueError names."""
    m = re.search(r"(?:SamplingParams|EngineConfig)\.(\w+)", message)
    return m.group(1) if m else next((f for f in ("stop_token_ids", "max_tokens", "prompt") if f in message), None)


def first_chunk_error(e: BaseException) -> APIError:
    """The answer to a request whose first chunk failed: bad input 400, overload and lost replicas 503, else 500."""
    e = cause(e)
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(str(e), param=param_of(str(e)))
    if isinstance(e, (BackPressureError, DeploymentUnavailableError)):
        return APIError(f"overloaded: {e}", status=503, type="service_unavailable")
    if replica_lost(e):
        return APIError(LOST, status=503, type="service_unavailable", code="replica_lost")
    return APIError(f"engine error: {e}", status=500, type="internal_error")

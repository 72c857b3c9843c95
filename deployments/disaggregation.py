"""Prefill/decode disaggregation, the router's side (imports no torch). A request goes to a prefill replica
(chosen by the prefill deployment's KV-aware router: queue and prefix hits, after admission), which computes the
prompt's KV and first token and puts its KVHandoff in Ray's object store; the router streams that first token
and hands the object's reference to a decode replica (chosen by KV headroom), which fetches the KV straight
from the prefill replica's node, imports it and streams the rest. The client sees one stream.
Requests that cannot be handed off (n > 1, several prompts, structured outputs) run whole on a prefill replica.
A LoRA request's handoff names its adapter; the decode replica loads it from the same path.

A decode replica that refuses the handoff (HandoffRefused: its import check, its limits) or is lost before the
router has passed on any of its tokens is replaced: the same handoff (still in the object store) goes to another
decode replica, each replica tried at most once and MAX_DECODE_TRIES in all. Once a decode replica's tokens have
gone out, its loss ends the request (a retry could neither repeat nor skip them safely)."""

from typing import TYPE_CHECKING, Any, AsyncIterator, Literal

from pydantic import BaseModel, ConfigDict, Field

from conveyor.cluster.admission_controller import Decision
from conveyor.cluster.routing import RoutingHint
from conveyor.deployments.api_error import APIError
from conveyor.deployments.kv_autoscaling import KVAutoscaling
from conveyor.deployments.protocol import Chunk, GenerateRequest
from conveyor.deployments.replica_errors import cause, replica_lost
from conveyor.deployments.role_admission import decode_hint, handoff_ask, redecide

if TYPE_CHECKING:
    from conveyor.deployments.router import Router

MAX_DECODE_TRIES = 2
DECODE_ROUTER = {"affinity_weight": 0.0, "headroom_weight": 1.0, "queue_weight": 0.25}
# the decode role's admission (deployments/role_admission.py): ranks as the decode routing does, decides on KV room
DECODE_ADMISSION = {**DECODE_ROUTER, "placement": False, "max_queue_time_s": 0.0}


class Disaggregation(BaseModel):
    """App argument `disaggregation`: prefill and decode replicas instead of `num_replicas` colocated ones.
    transfer: how the KV moves (object_store: Ray's object store, fetched by the decode replica from the
    prefill replica's node). decode_engine: engine options of the decode replicas over `engine`. Each role has a
    fixed replica count or its own autoscaling."""

    model_config = ConfigDict(extra="forbid")
    prefill_replicas: int = Field(1, ge=1)  # replicas that compute prompts' KV and first tokens (admission's)
    decode_replicas: int = Field(1, ge=1)  # replicas that import the KV and stream the rest (routed by KV headroom)
    transfer: Literal["object_store"] = "object_store"  # Ray's object store, fetched from the prefill replica's node
    decode_engine: dict[str, Any] = {}  # engine options of the decode replicas over `args.engine`
    # prefill replicas autoscaled on the prompt tokens queued at them (policy: PrefillScalingConfig's fields), from
    # `min_replicas` instead of prefill_replicas
    prefill_autoscaling: KVAutoscaling | None = None
    # decode replicas autoscaled on KV demand, handoffs waiting for room included (policy: KVScalingConfig's
    # fields), from `min_replicas` instead of decode_replicas
    decode_autoscaling: KVAutoscaling | None = None


def can_hand_off(req: GenerateRequest) -> bool:
    return req.n == 1 and len(req.prompts) == 1 and req.sampling.structured is None


class HandoffFailed(APIError):
    def __init__(self, why: str) -> None:
        super().__init__(
            f"the KV handoff to a decode replica failed: {why}", status=503, type="service_unavailable", code="handoff"
        )


class HandoffRefused(RuntimeError):
    """A decode replica cannot take this handoff (raised there, before any of its tokens): another may."""

    def __init__(self, replica: str, why: str) -> None:
        super().__init__(f"decode replica {replica} refused the handoff: {why}")
        self.replica, self.why = replica, why

    def __reduce__(self) -> tuple[Any, ...]:
        return HandoffRefused, (self.replica, self.why)


def retry_reason(e: BaseException) -> str | None:
    """Why another decode replica may take the handoff ("refused", "lost"), or None when none can help."""
    if isinstance(e, HandoffRefused):
        return "refused"
    return "lost" if replica_lost(e) else None


async def disaggregated_stream(
    router: "Router", req: GenerateRequest, hint: RoutingHint, received_at: float, decode: Decision | None = None
) -> AsyncIterator[Chunk]:
    """The prefill replica's chunk (the first token, or the whole answer when that token finishes it), then the
    decode replica's. A failed prefill fails as a colocated request does; a decode replica lost or refusing before
    its first token is replaced (module docstring); a failed transfer, or a handoff no decode replica took, ends
    the request with HandoffFailed naming every try's error. Either way no blocks stay behind: the prefill replica
    freed its own when it exported them, and the decode replica's go with its request (or its process).
    `decode`: the decode role's admission decision; its reservation is withdrawn when the request does not get there
    (it ended on its prefill replica) or its decode replica refused or lost it."""
    call = router.replica.prefill.remote(req, routing_hint=hint, received_at=received_at)
    router.drain.track(call)
    try:
        first: Chunk = await call
    except BaseException:
        router.release_decode(decode)
        raise
    finally:
        router.drain.untrack(call)
    handoff = first.pop("handoff", None)
    router._observe(first)
    if handoff is None:
        router.release_decode(decode)
    yield first
    if handoff is None:
        return
    ask = handoff_ask(len(req.prompts[0]), router.block_size, req.sampling.max_tokens, req.lora and req.lora.name)
    refused: list[str] = []
    tried: list[str] = []  # decode replicas that held this request's reservation, or refused it
    errors: list[str] = []
    for attempt in range(MAX_DECODE_TRIES):
        # a try of its own on the token channel: a lost replica's chunks still in flight reach no one
        try_req = req if attempt == 0 else req.model_copy(update={"request_id": f"{req.request_id}-try{attempt}"})
        hint = decode_hint(router.decode_gate, decode, ask.blocks, refused, ask.lora)
        streamed = False
        try:
            async for chunk in router.follow(
                try_req, lambda: router.decode_replicas.decode_to.remote(try_req, handoff, routing_hint=hint)
            ):
                streamed = True
                yield chunk
            return
        except APIError:
            raise
        except Exception as e:
            e = cause(e)
            why = retry_reason(e)
            errors.append(repr(e))
            router.release_decode(decode)  # refused (not counted there) or lost: the reservation goes too
            tried += decode.replicas[:1] if decode is not None else []
            decode = None
            if streamed or why is None or attempt == MAX_DECODE_TRIES - 1:
                raise HandoffFailed("; ".join(errors)) from None
            if isinstance(e, HandoffRefused):
                refused.append(e.replica)
                tried.append(e.replica)
            router.metrics.handoff_retries.labels(reason=why).inc()
            decode = redecide(router.decode_gate, ask, tried)

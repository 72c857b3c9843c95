"""The replica of a disaggregated app (deployments/disaggregation.py): deployed twice, as the prefill and the
decode replicas. `prefill` runs a request prefill-only and returns its first token with a reference to its
KVHandoff in Ray's object store; `decode_to` fetches a handoff, imports it into its engine and streams the rest
of the request like generate_to. Both also serve whole requests (generate_to)."""

import time
from typing import Any

import msgspec
import ray
from ray import serve

from conveyor.cluster.routing import RoutingHint
from conveyor.deployments.disaggregation import HandoffRefused
from conveyor.deployments.protocol import Chunk, Delta, GenerateRequest
from conveyor.deployments.replica import LLMReplica
from conveyor.engine.core.kv_handoff import KVHandoff
from conveyor.engine.frontend.async_engine import RequestFailed


@serve.deployment(name="LLMDisaggregated", max_ongoing_requests=1024, health_check_period_s=5)
class DisaggregatedReplica(LLMReplica.func_or_class):
    async def __init__(self, **kwargs: Any) -> None:
        await super().__init__(**kwargs)
        self.handoffs: dict[str, tuple[KVHandoff, int]] = {}
        self.num_handoffs, self.handoff_bytes, self.handoff_fetch_s = 0, 0, 0.0
        self.num_imports, self.num_refused = 0, 0  # handoffs this replica took in / refused (decode role)

    async def prefill(
        self, req: GenerateRequest, routing_hint: RoutingHint | None = None, received_at: float | None = None
    ) -> Chunk:
        """The request's first chunk: its first token and `handoff` ({"ref": [ObjectRef of the KVHandoff],
        "text_len", "bytes"}), or the whole answer (`last`) when that token already finishes it."""
        start, sp = time.perf_counter(), msgspec.structs.replace(req.sampling, n=1)
        out = None
        async for out in self.engine.generate(
            req.prompts[0],
            sp,
            request_id=f"{req.request_id}-0",
            priority=req.priority,
            cache_salt=req.cache_salt,
            validated=True,
            prefill_only=True,
            lora_request=self.lora_request(req.lora),
        ):
            self.metrics.observe_output(out)
        c, handoff = out.outputs[0], out.kv_handoff
        delta = Delta(
            index=0,
            text=c.text,
            token_ids=list(c.token_ids),
            logprobs=list(c.logprobs) if c.logprobs is not None else None,
            finish_reason=None if handoff is not None else (c.finish_reason or "stop"),
        )
        chunk = Chunk(
            deltas=[delta], emitted_at=time.time(), first_s=time.perf_counter() - start, replica=self.replica_id
        )
        if handoff is None:
            chunk.update(last=True, stats=self.stats())
        else:
            self.num_handoffs += 1
            self.handoff_bytes += handoff.num_bytes
            chunk.update(handoff={"ref": [ray.put(handoff)], "text_len": len(c.text), "bytes": handoff.num_bytes})
        return chunk

    async def decode_to(
        self,
        req: GenerateRequest,
        handoff: dict[str, Any],
        routing_hint: RoutingHint | None = None,
        received_at: float | None = None,
    ) -> Chunk:
        """generate_to for a request a prefill replica started: its KV comes from the object store, a LoRA request
        runs with its adapter (registered here on first use, as generate_to does). HandoffRefused when this
        replica cannot take it (its import check or limits, an adapter it cannot load; or the router tried it
        already, named in `routing_hint.exclude`, and no other decode replica was left to route to)."""
        if self.replica_id in getattr(routing_hint, "exclude", ()):
            raise HandoffRefused(self.replica_id, "tried already for this request")
        start = time.perf_counter()
        h: KVHandoff = await handoff["ref"][0]
        self.handoff_fetch_s += time.perf_counter() - start
        rid = f"{req.request_id}-0"
        self.handoffs[rid] = (h, handoff["text_len"])
        self.num_imports += 1
        try:
            return await self.generate_to(req, routing_hint, received_at)
        except (ValueError, RequestFailed) as e:
            self.num_refused += 1
            raise HandoffRefused(self.replica_id, str(e)) from None
        finally:
            self.handoffs.pop(rid, None)

    def _resume(self, request_id: str) -> tuple[dict[str, Any], int, int]:
        if request_id not in self.handoffs:
            return {}, 0, 0
        h, text_len = self.handoffs[request_id]
        return {"handoff": h}, text_len, len(h.output_token_ids)

    def handoff_stats(self, routing_hint: RoutingHint | None = None) -> dict[str, Any]:
        """routing_hint: a caller may address a replica (`replicas=(id,)`); `decoding`: handoffs in progress;
        `engine`: the engine's stats."""
        return {
            "replica": self.replica_id,
            "handoffs": self.num_handoffs,
            "bytes": self.handoff_bytes,
            "fetch_s": self.handoff_fetch_s,
            "imports": self.num_imports,
            "refused": self.num_refused,
            "decoding": len(self.handoffs),
            "engine": self.stats(),
        }

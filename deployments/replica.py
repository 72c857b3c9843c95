import asyncio
import itertools
import logging
import time
from contextlib import aclosing
from dataclasses import asdict
from typing import Any, AsyncIterator

import msgspec
import ray
import torch
from ray import serve

from conveyor.cluster.nodes import node_of_this_process
from conveyor.cluster.routing import RoutingHint
from conveyor.cluster.stats import ReplicaStats, push_due
from conveyor.deployments.metrics import ReplicaMetrics, wall
from conveyor.deployments.protocol import Chunk, Delta, GenerateRequest, LoRAModule
from conveyor.deployments.responses import merge_deltas
from conveyor.deployments.serve_logs import flush_at_warning
from conveyor.deployments.token_channel import TokenOutbox
from conveyor.engine import AsyncEngine, EngineConfig, SamplingParams
from conveyor.engine.lora_request import LoRARequest

ADMISSION_ACTOR = "admission"
MAX_KV_EVENTS = 4096
METRICS_PUSH_S = 0.5  # Prometheus scrapes every 15 s by default; a dump measured ~0.6 ms (py-spy, idle replica)
log = logging.getLogger("ray.serve")


@serve.deployment(name="LLMReplica", max_ongoing_requests=1024, health_check_period_s=5)
class LLMReplica:
    """Owns one AsyncEngine (its core in a child process unless engine_core_process=False); streams small
    deltas per choice, one chunk per engine step at most, a stream's tokens batched by `stream_interval`;
    aborts on cancellation; pushes its load to the app's admission actor every `stats_push_s` (0: no
    admission) and at once on big changes; while idle and unchanged, every `heartbeat_s`."""

    async def __init__(
        self,
        engine_args: dict[str, Any],
        torch_threads: int | None = None,
        stream_interval: int = 1,
        stats_push_s: float = 0.0,
        engine_core_process: bool = True,
        heartbeat_s: float = 0.0,
        lora_modules: list[dict[str, str]] | None = None,
    ) -> None:
        flush_at_warning()
        self.stream_interval = stream_interval
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1.0)
        torch.set_num_threads(torch_threads or max(1, int(cpus)))
        config = EngineConfig(**engine_args)
        self.engine = AsyncEngine(config, engine_core_process=engine_core_process and config.tensor_parallel_size == 1)
        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            self.replica_id = "local"
        self.metrics = ReplicaMetrics(self.engine.model_name, self.replica_id)
        self.node = node_of_this_process()
        self.stats_push_s, self.heartbeat_s, self._actor = stats_push_s, heartbeat_s, None
        self.outbox = TokenOutbox()
        self._pusher = asyncio.create_task(self._push_loop()) if stats_push_s > 0 else None
        self.loras: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)
        for module in lora_modules or []:
            self.lora_request(LoRAModule(**module))

    def lora_request(self, module: LoRAModule | None) -> LoRARequest | None:
        """The engine's LoRARequest for the adapter the router names, registered (and checked: a ValueError
        names what is wrong) on first use here; a name whose path changed is registered anew."""
        if module is None:
            return None
        known = self.loras.get(module.name)
        if known is not None and known.path == module.path:
            return known
        lora = LoRARequest(module.name, next(self._lora_ids), module.path)
        if known is not None:
            self.engine.remove_lora(module.name)
        self.engine.add_lora(lora)
        self.loras[module.name] = lora
        return lora

    def check_lora(self, name: str, path: str) -> None:
        """POST /v1/load_lora_adapter's check, on one replica: raises the ValueError that names the problem."""
        self.lora_request(LoRAModule(name=name, path=path))

    def admission(self) -> Any:
        """The app's admission actor handle, resolved anew after it was recreated."""
        if self._actor is None and self.stats_push_s > 0:
            self._actor = serve.get_deployment_actor(ADMISSION_ACTOR)
        return self._actor

    async def _push_loop(self) -> None:
        """Stats with the KV events since the last push (at most `MAX_KV_EVENTS`; the rest go next time), and
        the metric families every `METRICS_PUSH_S` and when the engine falls idle. Events drained for a push
        that failed are lost: the next push lists every cached key instead."""
        last, last_at, metrics_at, metrics_finished = None, 0.0, float("-inf"), -1
        while True:
            await asyncio.sleep(self.stats_push_s / 5)
            current, now = ReplicaStats.from_engine(self.replica_id, self.engine.stats()), time.monotonic()
            if not push_due(last, current, last_at, now, self.stats_push_s, idle_interval_s=self.heartbeat_s):
                continue
            events = self.engine.drain_kv_events(MAX_KV_EVENTS)
            try:
                report = {**current.to_dict(), "kv_events": events.to_dict(), "node": self.node}
                if now - metrics_at >= METRICS_PUSH_S or (current.idle and current.num_finished != metrics_finished):
                    report["metrics"] = self.metrics.dump(self.engine.stats())
                    metrics_at, metrics_finished = now, current.num_finished
                answer = await asyncio.wait_for(self.admission().report.remote(report), timeout=2.0)
                last, last_at = current, now
                if (answer or {}).get("kv_reset"):
                    self.engine.request_kv_reset()
            except Exception as e:
                log.warning("stats push to the admission actor failed: %r", e)
                self.engine.request_kv_reset()
                self._actor, last, metrics_at = None, None, float("-inf")
                await asyncio.sleep(self.stats_push_s)

    def info(self) -> dict[str, Any]:
        return {
            "model": self.engine.model_name,
            "max_model_len": self.engine.max_model_len,
            "vocab_size": self.engine.vocab_size,
            "replica": self.replica_id,
            **self.node,
            "limits": asdict(self.engine.limits),
            "torch_threads": torch.get_num_threads(),
            "engine_core_pid": getattr(self.engine.engine.core, "core_pid", None),
        }

    def stats(self) -> dict[str, Any]:
        return self.engine.stats().to_dict()

    def record_routing_stats(self) -> dict[str, Any]:
        return self.stats()

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.stats().items() if isinstance(v, (int, float))}

    def check_health(self) -> None:
        self.engine.check_health()

    def _resume(self, request_id: str) -> tuple[dict[str, Any], int, int]:
        """More engine.generate arguments for the request, and the text and tokens of it already sent: none here
        (deployments/disaggregation.py continues requests handed off by a prefill replica)."""
        return {}, 0, 0

    async def _pump(
        self,
        index: int,
        request_id: str,
        prompt: list[int],
        sp: SamplingParams,
        priority: int,
        queue: asyncio.Queue,
        clock: dict[str, float],
        interval: int,
        cache_salt: str | None,
        lora: LoRARequest | None = None,
    ) -> None:
        extra, text_len, num_ids = self._resume(request_id)
        finish = None
        try:
            async for out in self.engine.generate(
                prompt_token_ids=prompt,
                sampling_params=sp,
                request_id=request_id,
                priority=priority,
                cache_salt=cache_salt,
                stream_interval=interval,
                validated=True,
                lora_request=lora,
                **extra,
            ):
                self.metrics.observe_output(out)
                clock["arrival"] = min(clock.get("arrival", float("inf")), wall(out.metrics.arrival_time))
                clock["output"] = wall(out.metrics.last_token_time) if out.metrics.last_token_time else time.time()
                c = out.outputs[0]
                finish = (c.finish_reason or "stop") if out.finished else None
                queue.put_nowait(
                    Delta(
                        index=index,
                        text=c.text[text_len:],
                        token_ids=list(c.token_ids[num_ids:]),
                        logprobs=list(c.logprobs[num_ids:]) if c.logprobs is not None else None,
                        finish_reason=finish,
                    )
                )
                text_len, num_ids = len(c.text), len(c.token_ids)
            if finish is None:
                queue.put_nowait(Delta(index=index, text="", token_ids=[], logprobs=None, finish_reason="abort"))
        except Exception as e:
            queue.put_nowait(e)

    async def chunks(self, req: GenerateRequest, received_at: float | None = None) -> AsyncIterator[Chunk]:
        """The request's chunks: one per engine step at most while streaming (the first carries the replica's
        TTFT, the last its stats and `last`), else one at the end. received_at: the router's time.time() at
        receipt, for the ingress share of serve_overhead."""
        samples = msgspec.structs.replace(req.sampling, n=req.n).fan_out()
        jobs = [
            (p * req.n + i, f"{req.request_id}-{p * req.n + i}", prompt, sp)
            for p, prompt in enumerate(req.prompts)
            for i, sp in enumerate(samples)
        ]
        queue: asyncio.Queue = asyncio.Queue()
        clock: dict[str, float] = {}
        interval = self.stream_interval if req.stream else 1 << 30
        lora = self.lora_request(req.lora)
        tasks = [
            asyncio.create_task(
                self._pump(idx, rid, prompt, sp, req.priority, queue, clock, interval, req.cache_salt, lora)
            )
            for idx, rid, prompt, sp in jobs
        ]
        live = {idx: rid for idx, rid, _, _ in jobs}
        start, first, pending = time.perf_counter(), True, []
        try:
            while live:
                new = [await queue.get()]
                while not queue.empty():
                    new.append(queue.get_nowait())
                for d in new:
                    if isinstance(d, BaseException):
                        raise d
                    if d["finish_reason"] is not None:
                        live.pop(d["index"], None)
                pending += new
                if req.stream or not live:
                    chunk = Chunk(
                        deltas=merge_deltas(pending), emitted_at=clock.get("output", time.time()), last=not live
                    )
                    if first:
                        chunk.update(first_s=time.perf_counter() - start, replica=self.replica_id)
                        if received_at is not None and "arrival" in clock:
                            chunk.update(ingress_s=clock["arrival"] - received_at)
                    if not live:
                        chunk.update(replica=self.replica_id, stats=self.stats())
                        if not self.stats_push_s:
                            chunk.update(metrics=self.metrics.dump(self.engine.stats()))
                    pending, first = [], False
                    yield chunk
        finally:
            for t in tasks:
                t.cancel()
            for rid in live.values():
                await self.engine.abort(rid)

    async def generate_to(
        self, req: GenerateRequest, routing_hint: RoutingHint | None = None, received_at: float | None = None
    ) -> Chunk:
        """The request in one call: a stream's chunks, its first included, go to `req.reply_to` over the token
        channel and the call returns how many were sent; a whole response is the call's result. The router has
        validated `req` (engine.limits, with this replica's info())."""
        to, sent, chunk = (req.reply_to or None) if req.stream else None, 0, Chunk(deltas=[])
        async with aclosing(self.chunks(req, received_at)) as chunks:
            async for chunk in chunks:
                if to is not None:
                    self.outbox.send(to, req.request_id, chunk)
                    sent += 1
        return chunk if to is None else Chunk(sent=sent)

    def __del__(self) -> None:
        pusher, actor, engine = (
            getattr(self, "_pusher", None),
            getattr(self, "_actor", None),
            getattr(self, "engine", None),
        )
        outbox = getattr(self, "outbox", None)
        self._pusher = self._actor = self.engine = self.outbox = None
        if outbox is not None:
            outbox.shutdown()
        if pusher is not None:
            pusher.cancel()
        if actor is not None:
            ray.wait([actor.forget.remote(self.replica_id)], timeout=1.0)
        if engine is not None:
            engine.shutdown()

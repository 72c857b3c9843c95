import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve
from ray.serve.handle import DeploymentHandle

from conveyor.cluster.admission_actor import AdmissionClient
from conveyor.cluster.admission_controller import Decision
from conveyor.cluster.admission_metrics import prometheus_text
from conveyor.cluster.nodes import node_of_this_process
from conveyor.cluster.routing import MAX_PREFIX_BLOCKS, RoutingHint
from conveyor.cluster.stats import block_hashes, num_blocks
from conveyor.deployments.api_error import APIError, admission_refusal
from conveyor.deployments.disaggregation import can_hand_off, disaggregated_stream
from conveyor.deployments.door import LOAD_REFUSALS, Door
from conveyor.deployments.drain import Drain
from conveyor.deployments.http_guard import GuardConfig, HTTPGuard
from conveyor.deployments.metrics import ResponseCounter, RouterMetrics
from conveyor.deployments.preprocessor import Preprocessor
from conveyor.deployments.protocol import Chunk, GenerateRequest, LoRAModule
from conveyor.deployments.replica_errors import cause
from conveyor.deployments.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    SamplingRequest,
    UnloadLoRAAdapterRequest,
)
from conveyor.deployments.responder import respond
from conveyor.deployments.response_models import ModelCard, ModelList
from conveyor.deployments.responses import ResponseBuilder, error_response, install_error_handlers
from conveyor.deployments.role_admission import Ask, decide_roles, handoff_ask
from conveyor.deployments.serve_logs import flush_at_warning
from conveyor.deployments.token_channel import TokenInbox, follow
from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.lora_request import lora_cache_key

log = logging.getLogger("ray.serve")
app = FastAPI(title="Conveyor")
install_error_handlers(app)
app.add_middleware(HTTPGuard)
app.add_middleware(ResponseCounter)


async def one(call: Any) -> AsyncIterator[Chunk]:
    yield await call


@dataclass(frozen=True)
class RouterArgs:
    """What a Router is built from (deployments/app.py): the model it tokenises for, and its HTTP front's options.
    admission: whether an admission actor decides (the replicas' deployment hosts it)."""

    model: str
    served_model_name: str | None = None
    admission: bool = False
    block_size: int = 16
    revision: str | None = None
    chat_template: str | None = None
    tool_call_parser: str = "hermes"
    guard: GuardConfig = field(default_factory=GuardConfig)
    lora_modules: tuple[LoRAModule, ...] = ()


@serve.deployment(name="Router", max_ongoing_requests=4096)
@serve.ingress(app)
class Router:
    """OpenAI-compatible HTTP front: validates and tokenises, asks admission, then streams deltas from the
    LLMReplica that the request router picks with the request's routing hint."""

    async def __init__(
        self, replica: DeploymentHandle, args: RouterArgs, decode: DeploymentHandle | None = None
    ) -> None:
        """decode: the decode replicas of a disaggregated app (`replica` then prefills: deployments/disaggregation.py)."""
        flush_at_warning()
        HTTPGuard.config = args.guard.with_env_key()
        self.replica, self.decode_replicas = replica, decode
        self.inbox = TokenInbox()
        self.model_name = args.served_model_name or args.model
        self.pre = Preprocessor(
            resolve_model(args.model, args.revision),
            self.model_name,
            args.chat_template,
            args.tool_call_parser,
            args.lora_modules,
        )
        try:
            router_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            router_id = "local"
        self.metrics = RouterMetrics(self.model_name, router_id, roles=args.admission and decode is not None)
        self.drain = Drain()
        self.drain.watch(router_id)
        self._metrics_actor: Any = None
        self._info: dict[str, Any] | None = None
        self.block_size = args.block_size
        self.static_loras = {m.name: m for m in args.lora_modules}
        self._runtime_loras: dict[str, str] | None = None
        self.gate = AdmissionClient(lambda: self.replica.admission.remote()) if args.admission else None
        self.door: Door | None = None
        if self.gate is not None:
            self.gate.start()
            self.door = HTTPGuard.door = Door(self.gate, lambda: self.metrics.admission_decided(False, "queue_time"))
            self.metrics.queued.set_function(lambda: self.gate.queued)
            self._metrics_pusher = asyncio.create_task(self._push_metrics())
        # the decode role's own admission (deployments/role_admission.py)
        self.decode_gate = None
        if args.admission and decode is not None:
            self.decode_gate = AdmissionClient(lambda: decode.admission.remote())
            self.decode_gate.start()

    async def metrics_actor(self) -> Any:
        if self._metrics_actor is None:
            self._metrics_actor = await self.replica.admission.remote()
        return self._metrics_actor

    async def _push_metrics(self, every_s: float = 0.5) -> None:
        """This router's series to the admission actor, so that every router's /metrics shows them."""
        while True:
            await asyncio.sleep(every_s)
            try:
                actor = await self.metrics_actor()
                await asyncio.wait_for(actor.report_metrics.remote(self.metrics.router, self.metrics.dump()), 2.0)
            except Exception as e:
                self._metrics_actor = None
                log.warning("metrics push to the admission actor failed: %r", e)

    async def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = await self.replica.info.remote()
        return self._info

    async def admit(
        self,
        prompts: list[list[int]],
        n: int,
        where: str,
        max_tokens: int = 0,
        salt: str | None = None,
        lora: LoRAModule | None = None,
        handoff: bool = False,
    ) -> tuple[RoutingHint, Decision | None]:
        """Admission's verdict for the whole request, before any replica sees it, and the decode role's decision
        for a request to be handed off (`handoff`, in a disaggregated app); raises the refusal."""
        adapter = (lora.name, lora_cache_key(lora.name, lora.path)) if lora is not None else None
        if self.gate is None:
            return RoutingHint.from_token_ids(prompts[0], self.block_size, salt=salt, lora=adapter), None
        sizes = [num_blocks(len(p), self.block_size) for p in prompts]
        keys = block_hashes(prompts[0], self.block_size, salt, MAX_PREFIX_BLOCKS, adapter and adapter[1])
        ask = Ask(sum(sizes) * n, max(sizes), keys, len(prompts) * n, max_tokens, lora and lora.name)
        handed = None
        if handoff and max_tokens > 1 and self.decode_gate is not None:  # prefill holds the prompt and first token
            handed = handoff_ask(len(prompts[0]), self.block_size, max_tokens, ask.lora)
            ask = replace(ask, output_tokens=1)
        roles = await decide_roles(self.gate, self.decode_gate, ask, handed, queue_time=not Door.judged())
        Door.decided()
        d = roles.refusal or roles.prefill
        if not d.admit and d.reason in LOAD_REFUSALS and self.door is not None:
            self.door.shed()
        for role, verdict in (("decode", roles.decode), ("prefill", roles.prefill)):  # a refusal counts for its role
            if verdict is not None and (d.admit or verdict is d):
                self.metrics.admission_decided(verdict.admit, verdict.reason, role)
        if d.admit:
            return RoutingHint.from_token_ids(
                prompts[0],
                self.block_size,
                d.replicas,
                self.gate.controller.kv_demands(self.gate.clock()),
                cached_blocks=d.cached_blocks,
                keys=keys,
                lora=adapter,
            ), roles.decode
        raise admission_refusal(d, where, max(sizes), self.gate.controller.config.max_queue_time_s)

    def release_decode(self, d: Decision | None) -> None:
        """A request admitted on the decode role that will not get there: withdraw its reservation."""
        if d is not None and self.decode_gate is not None:
            self.decode_gate.release(d)

    def stream(
        self, gen_req: GenerateRequest, hint: RoutingHint, received_at: float, decode: Decision | None = None
    ) -> AsyncIterator[Chunk]:
        if self.decode_replicas is not None and can_hand_off(gen_req):
            return disaggregated_stream(self, gen_req, hint, received_at, decode)
        return self.follow(
            gen_req, lambda: self.replica.generate_to.remote(gen_req, routing_hint=hint, received_at=received_at)
        )

    async def follow(self, gen_req: GenerateRequest, start: Callable[[], Any]) -> AsyncIterator[Chunk]:
        """The replica's chunks from one handle call (`start()`, a generate_to call): a stream's come over the token
        channel, a whole response is the call's result. The call carries errors, cancellation and drain for both."""
        if gen_req.stream:
            gen_req.reply_to = self.inbox.address
            queue = self.inbox.open(gen_req.request_id)
        call = start()
        chunks = follow(call, queue) if gen_req.stream else one(call)
        done = False
        self.drain.track(call)
        try:
            async for chunk in chunks:
                self._observe(chunk)
                yield chunk
            done = True
        except Exception:
            if self.drain.expired:
                raise self.drain.timeout_error() from None
            raise
        finally:
            if gen_req.reply_to is not None:
                self.inbox.close(gen_req.request_id)
            self.drain.untrack(call)
            if not done:
                call.cancel()

    def _observe(self, chunk: Chunk) -> None:
        if "ingress_s" in chunk:
            self.metrics.serve_overhead(chunk["replica"], "ingress", chunk["ingress_s"])
        if "metrics" in chunk:
            self.metrics.sources[chunk["replica"]] = chunk["metrics"]

    async def handle(self, req: SamplingRequest) -> Response:
        start = time.perf_counter()
        if self.drain.draining:
            return error_response(self.drain.refusal())
        self.drain.enter()
        try:
            self.adapters()
            lora = self.pre.check_model(req.model)
            structured, parser = req.structured(), None
            chat = isinstance(req, ChatCompletionRequest)
            if chat:
                prompts, structured, parser = self.pre.chat_prompt(req, structured)
                where, max_tokens = "messages", req.max_completion_tokens or req.max_tokens
            else:
                prompts, where, max_tokens = self.pre.tokenize_prompts(req.prompt), "prompt", req.max_tokens
            gen_req = self.pre.prepare(await self.info(), req, prompts, max_tokens, where, structured)
            gen_req.lora = lora
            handoff = self.decode_replicas is not None and can_hand_off(gen_req)
            hint, decode = await self.admit(
                prompts, req.n, where, gen_req.sampling.max_tokens, req.cache_salt, lora, handoff
            )
            builder = ResponseBuilder(
                chat,
                f"{'chatcmpl' if chat else 'cmpl'}-{gen_req.request_id}",
                self.model_name if lora is None else lora.name,
                len(prompts) * req.n,
                sum(map(len, prompts)),
                req.num_logprobs(),
                self.pre.decode,
                parser,
            )
            stream = self.stream(gen_req, hint, time.time() - (time.perf_counter() - start), decode)
            return await respond(self.metrics, req, stream, builder, start, time.perf_counter() - start)
        except APIError as e:
            return error_response(e)
        except Exception as e:
            return error_response(APIError(f"internal error: {cause(e)}", status=500, type="internal_error"))
        finally:
            self.drain.leave()

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest) -> Response:
        return await self.handle(req)

    @app.post("/v1/chat/completions")
    async def chat(self, req: ChatCompletionRequest) -> Response:
        return await self.handle(req)

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        info = await self.info()
        limit = info["max_model_len"]
        base = ModelCard(id=self.model_name, root=info["model"], max_model_len=limit)
        adapters = [
            ModelCard(id=m.name, root=m.path, parent=self.model_name, max_model_len=limit)
            for m in self.adapters().values()
        ]
        return ModelList(data=[base, *adapters])

    def adapters(self) -> dict[str, LoRAModule]:
        """The adapters this app serves by name: the app's lora_modules, then those loaded at run time. With
        admission, run-time loads are the admission actor's registry, as this router's last sync saw it, so a load
        or unload through any router holds on every router within one sync; without, this router's own."""
        runtime = self.gate.snapshot.get("loras") if self.gate is not None and self.gate.snapshot else None
        if runtime is not None and runtime is not self._runtime_loras:
            self._runtime_loras = runtime
            loaded = {n: LoRAModule(name=n, path=p) for n, p in runtime.items() if n not in self.static_loras}
            self.pre.loras = {**self.static_loras, **loaded}
        return self.pre.loras

    def _see_runtime_loras(self, runtime: dict[str, str]) -> None:
        """This router's own load or unload, before its next sync brings the registry back."""
        if self.gate is not None and self.gate.snapshot is not None:
            self.gate.snapshot["loras"] = runtime
        self.adapters()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> Response:
        """vLLM's endpoint: checks the adapter on a replica, then serves it under lora_name (on every router, with
        admission: `adapters`); replicas load it into a slot when a request first needs it."""
        name, adapters = req.lora_name, self.adapters()

        def taken(what: str) -> Response:
            message = f"The lora adapter '{name}' has already been loaded: it names {what}."
            return error_response(APIError(message, param="lora_name"))

        if name == self.model_name or name in adapters:
            return taken("the base model" if name == self.model_name else f"a loaded adapter ({adapters[name].path})")
        try:
            await self.replica.check_lora.remote(name, req.lora_path)
            if self.gate is not None:
                actor = await self.metrics_actor()
                if (path := await actor.register_lora.remote(name, req.lora_path)) is not None:
                    return taken(f"a loaded adapter ({path})")
        except Exception as e:
            e = cause(e)
            if isinstance(e, ValueError):
                return error_response(APIError(str(e), param="lora_path"))
            return error_response(APIError(f"loading the adapter failed: {e}", status=500, type="internal_error"))
        if self.gate is not None and self.gate.snapshot is not None:
            self._see_runtime_loras({**self.gate.snapshot.get("loras", {}), name: req.lora_path})
        else:
            self.pre.loras[name] = LoRAModule(name=name, path=req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> Response:
        """Run-time loads only: an adapter the app's lora_modules name stays (its config serves it on every router)."""
        name = req.lora_name
        if name in self.static_loras:
            message = f"The lora adapter '{name}' is one of the app's lora_modules; remove it from the app's config."
            return error_response(APIError(message, param="lora_name"))
        if self.gate is not None:
            try:
                actor = await self.metrics_actor()
                removed = await actor.unregister_lora.remote(name)
            except Exception as e:
                message = f"unloading the adapter failed: {cause(e)}"
                return error_response(APIError(message, status=503, type="service_unavailable"))
            if self.gate.snapshot is not None:
                self._see_runtime_loras({n: p for n, p in self.gate.snapshot.get("loras", {}).items() if n != name})
        else:
            removed = self.pre.loras.pop(name, None) is not None
        if not removed:
            message = f"The lora adapter '{name}' cannot be found."
            return error_response(APIError(message, status=404, param="lora_name", type="not_found_error"))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    @app.get("/health")
    async def health(self) -> Response:
        if self.drain.draining:
            return error_response(self.drain.refusal())
        try:
            await asyncio.wait_for(self.replica.check_health.remote(), timeout=10)
            if self.decode_replicas is not None:
                await asyncio.wait_for(self.decode_replicas.check_health.remote(), timeout=10)
        except Exception as e:
            return error_response(APIError(f"unhealthy: {cause(e)}", status=503, type="service_unavailable"))
        return Response(status_code=200)

    @app.get("/v1/cluster")
    async def cluster(self) -> Response:
        if self.gate is None:
            raise APIError("admission is off in this app", status=404, type="not_found_error")
        try:
            snapshot = await self.gate.refresh()
        except Exception as e:
            snapshot = self.gate.snapshot
            if snapshot is None:
                raise APIError(f"admission actor unavailable: {e!r}", status=503, type="service_unavailable") from None
        if self.decode_gate is not None:  # a disaggregated app: the decode role's view under "decode"
            try:
                decode = await self.decode_gate.refresh()
            except Exception:
                decode = self.decode_gate.snapshot
            snapshot = {**snapshot, "decode": decode}
        return JSONResponse({**snapshot, "router_node": node_of_this_process()})

    @app.get("/metrics")
    async def prometheus(self) -> Response:
        snapshot, sources = (self.gate.snapshot if self.gate is not None else None), None
        if self.gate is not None:
            try:
                actor = await self.metrics_actor()  # this router's series go first, so every router shows them
                await asyncio.wait_for(actor.report_metrics.remote(self.metrics.router, self.metrics.dump()), 2.0)
                sources = await asyncio.wait_for(actor.metrics.remote(), 2.0)
                if self.decode_gate is not None:  # the decode replicas push theirs to their role's actor
                    decode = await asyncio.wait_for(self.decode_replicas.admission.remote(), 2.0)
                    sources = {**sources, **await asyncio.wait_for(decode.metrics.remote(), 2.0)}
            except Exception as e:
                self._metrics_actor = None
                log.warning("cannot read the replicas' metrics from the admission actor: %r", e)
        roles = None
        if snapshot and self.decode_gate is not None and self.decode_gate.snapshot:
            roles = {"prefill": snapshot, "decode": self.decode_gate.snapshot}
        text = self.metrics.render(sources) + (prometheus_text(snapshot, roles=roles).encode() if snapshot else b"")
        return Response(text, media_type="text/plain; version=0.0.4")

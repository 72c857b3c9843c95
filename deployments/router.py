import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from transformers import PreTrainedTokenizerFast

from conveyor.cluster.admission_actor import AdmissionClient
from conveyor.cluster.admission_metrics import prometheus_text
from conveyor.cluster.nodes import node_of_this_process
from conveyor.cluster.routing import MAX_PREFIX_BLOCKS, RoutingHint
from conveyor.cluster.stats import block_hashes, num_blocks
from conveyor.deployments.api_error import APIError, queue_time_error
from conveyor.deployments.disaggregation import can_hand_off, disaggregated_stream
from conveyor.deployments.door import Door
from conveyor.deployments.drain import Drain
from conveyor.deployments.http_guard import GuardConfig, HTTPGuard
from conveyor.deployments.metrics import ResponseCounter, RouterMetrics
from conveyor.deployments.protocol import Chunk, GenerateRequest, LoRAModule
from conveyor.deployments.request_models import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    SamplingRequest,
    UnloadLoRAAdapterRequest,
)
from conveyor.deployments.response_models import ModelCard, ModelList
from conveyor.deployments.responses import DONE, ResponseBuilder, error_response, install_error_handlers, sse_error
from conveyor.deployments.serve_logs import flush_at_warning
from conveyor.deployments.token_channel import TokenInbox, follow
from conveyor.deployments.tool_parsers import TOOL_PARSERS
from conveyor.engine import SamplingParams
from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.frontend.chat_template import render_chat
from conveyor.engine.frontend.generation_defaults import SAMPLING_KEYS, load_generation_defaults
from conveyor.engine.frontend.limits import RequestLimits
from conveyor.engine.lora_request import lora_cache_key
from conveyor.engine.sampling_params import StructuredParams

log = logging.getLogger("ray.serve")
app = FastAPI(title="Conveyor")
install_error_handlers(app)
app.add_middleware(HTTPGuard)
app.add_middleware(ResponseCounter)


async def one(call: Any) -> AsyncIterator[Chunk]:
    yield await call


def cause(e: BaseException) -> BaseException:
    return getattr(e, "cause", None) or e


def replica_lost(e: BaseException) -> bool:
    """The replica's actor died or cannot be reached (its process or node is gone): the request may be retried."""
    return isinstance(e, (RayActorError, ActorUnavailableError))


LOST = "the replica serving this request was lost (its process or node failed); retry"


def param_of(message: str) -> str | None:
    m = re.search(r"(?:SamplingParams|EngineConfig)\.(\w+)", message)
    return m.group(1) if m else next((f for f in ("stop_token_ids", "max_tokens", "prompt") if f in message), None)


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
        path = resolve_model(args.model, args.revision)
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(path)  # AutoTokenizer would import torch
        self.generation_defaults = load_generation_defaults(path)
        if args.chat_template is not None:
            self.tokenizer.chat_template = args.chat_template
        self.tool_parser = TOOL_PARSERS[args.tool_call_parser]()
        try:
            router_id = serve.get_replica_context().replica_id.unique_id
        except Exception:
            router_id = "local"
        self.metrics = RouterMetrics(self.model_name, router_id)
        self.drain = Drain()
        self.drain.watch(router_id)
        self._metrics_actor: Any = None
        self._info: dict[str, Any] | None = None
        self.block_size = args.block_size
        # LoRA adapters by name (the request's `model`): the app's lora_modules, then this router's loads
        self.loras = {m.name: m for m in args.lora_modules}
        self.gate = AdmissionClient(lambda: self.replica.admission.remote()) if args.admission else None
        if self.gate is not None:
            self.gate.start()
            HTTPGuard.door = Door(self.gate, self.metrics.admission.labels(admitted="false", reason="queue_time").inc)
            self.metrics.queued.set_function(lambda: self.gate.queued)
            self._metrics_pusher = asyncio.create_task(self._push_metrics())

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

    def check_model(self, model: str | None) -> LoRAModule | None:
        """The adapter `model` names (None: the base model); a 404 for a name served by neither."""
        if model is None or model == self.model_name:
            return None
        if model in self.loras:
            return self.loras[model]
        raise APIError(
            f"The model `{model}` does not exist.",
            status=404,
            param="model",
            type="not_found_error",
            code="model_not_found",
        )

    def decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def tokenize_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        return [self.tokenizer(p).input_ids if isinstance(p, str) else list(p) for p in prompt]

    async def prepare(
        self,
        req: SamplingRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        where: str,
        structured: tuple[str, dict[str, Any]] | None = None,
    ) -> GenerateRequest:
        info = await self.info()
        limit = info["max_model_len"]
        for ids in prompts:
            if not ids:
                raise APIError(f"{where} must not be empty", param=where)
            need = len(ids) + (max_tokens or 1)
            if len(ids) >= limit or need > limit:
                raise APIError(
                    f"This model's maximum context length is {limit} tokens. However, you requested "
                    f"{need} tokens ({len(ids)} in the {where}, {need - len(ids)} in the completion, "
                    f"max_tokens). Please reduce the length of the {where} or completion.",
                    param=where if len(ids) >= limit else "max_tokens",
                )
        sampling = self.generation_defaults.apply(
            req.sampling(max_tokens or limit - max(len(p) for p in prompts)), set(SAMPLING_KEYS) - req.model_fields_set
        )
        if structured is not None:
            field, fields = structured
            try:
                sampling["structured"] = StructuredParams(**fields)
            except (ValueError, TypeError) as e:
                raise APIError(f"{field}: {e}", param=field) from None
        try:
            sp, limits = SamplingParams(**sampling), RequestLimits(**info["limits"])
            for ids in prompts:
                limits.check(ids, sp)
        except (ValueError, TypeError) as e:
            param = param_of(str(e))
            raise APIError(str(e), param=where if param == "prompt" else param) from None
        return GenerateRequest(
            request_id=uuid.uuid4().hex,
            prompts=prompts,
            n=req.n,
            sampling=sp,
            priority=req.priority,
            stream=req.stream,
            cache_salt=req.cache_salt,
        )

    async def admit(
        self,
        prompts: list[list[int]],
        n: int,
        where: str,
        max_tokens: int = 0,
        salt: str | None = None,
        lora: LoRAModule | None = None,
    ) -> RoutingHint:
        """Admission's verdict for the whole request, before any replica sees it; raises the refusal."""
        adapter = (lora.name, lora_cache_key(lora.name, lora.path)) if lora is not None else None
        if self.gate is None:
            return RoutingHint.from_token_ids(prompts[0], self.block_size, salt=salt, lora=adapter)
        sizes = [num_blocks(len(p), self.block_size) for p in prompts]
        keys = block_hashes(prompts[0], self.block_size, salt, MAX_PREFIX_BLOCKS, adapter and adapter[1])
        d = await self.gate.decide(sum(sizes) * n, max(sizes), keys, len(prompts) * n, max_tokens, lora and lora.name)
        Door.decided()
        self.metrics.admission.labels(admitted=str(d.admit).lower(), reason=d.reason).inc()
        if d.admit:
            return RoutingHint.from_token_ids(
                prompts[0],
                self.block_size,
                d.replicas,
                self.gate.controller.kv_demands(self.gate.clock()),
                cached_blocks=d.cached_blocks,
                keys=keys,
                lora=adapter,
            )
        if d.reason == "prompt_too_large":
            raise APIError(f"the {where} needs {max(sizes)} KV-cache blocks, more than any replica has", param=where)
        if d.reason in ("no_replicas", "stale"):
            raise APIError(
                f"no replica is reporting its load ({d.reason}); retry later",
                status=503,
                type="service_unavailable",
                code=d.reason,
                retry_after_s=d.retry_after_s,
            )
        if d.reason == "queue_time":
            raise queue_time_error(self.gate.controller.config.max_queue_time_s, d.queue_time_s, d.retry_after_s)
        raise APIError(
            f"overloaded: no replica has KV-cache room for this request ({d.reason}); retry after {d.retry_after_s:g}s",
            status=429,
            type="rate_limit_error",
            code=d.reason,
            retry_after_s=d.retry_after_s,
        )

    def stream(self, gen_req: GenerateRequest, hint: RoutingHint, received_at: float) -> AsyncIterator[Chunk]:
        if self.decode_replicas is not None and can_hand_off(gen_req):
            return disaggregated_stream(self, gen_req, hint, received_at)
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

    async def run(
        self,
        req: SamplingRequest,
        gen_req: GenerateRequest,
        hint: RoutingHint,
        builder: ResponseBuilder,
        start: float,
        admitted_s: float = 0.0,
    ) -> Response:
        stream = self.stream(gen_req, hint, time.time() - (time.perf_counter() - start))
        endpoint = "/v1/chat/completions" if isinstance(req, ChatCompletionRequest) else "/v1/completions"
        try:
            first = await anext(stream, Chunk(deltas=[]))
        except Exception as e:
            await stream.aclose()
            e = cause(e)
            if isinstance(e, APIError):
                raise e from None
            if isinstance(e, ValueError):
                raise APIError(str(e), param=param_of(str(e))) from None
            if isinstance(e, (BackPressureError, DeploymentUnavailableError)):
                raise APIError(f"overloaded: {e}", status=503, type="service_unavailable") from None
            if replica_lost(e):
                raise APIError(LOST, status=503, type="service_unavailable", code="replica_lost") from None
            raise APIError(f"engine error: {e}", status=500, type="internal_error") from None
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
            self.metrics.serve_overhead(replica, "egress", time.time() - last.get("emitted_at", time.time()))
            self.metrics.request_done(endpoint, time.perf_counter() - start)
            return response
        usage = req.stream_options is not None and req.stream_options.include_usage

        async def sse() -> AsyncIterator[str]:
            try:
                yield "".join(builder.chunks(first["deltas"]))
                self.metrics.serve_overhead(replica, "egress", time.time() - first.get("emitted_at", time.time()))
                async for chunk in stream:
                    yield "".join(builder.chunks(chunk["deltas"]))
                    self.metrics.serve_overhead(replica, "egress", time.time() - chunk.get("emitted_at", time.time()))
                if usage:
                    yield builder.usage_chunk()
            except APIError as e:
                yield sse_error(str(e), e.type, e.status)
            except Exception as e:
                lost = replica_lost(cause(e))
                yield sse_error(LOST, "service_unavailable", 503) if lost else sse_error(f"engine error: {cause(e)}")
            finally:
                await stream.aclose()
                self.metrics.request_done(endpoint, time.perf_counter() - start)
            yield DONE

        return StreamingResponse(sse(), media_type="text/event-stream", headers=timing)

    async def handle(self, endpoint: str, req: SamplingRequest) -> Response:
        start = time.perf_counter()
        if self.drain.draining:
            return error_response(self.drain.refusal())
        self.drain.enter()
        try:
            lora = self.check_model(req.model)
            structured, parser = req.structured(), None
            if isinstance(req, ChatCompletionRequest):
                prompts, structured, parser = self.chat_prompt(req, structured)
                where = "messages"
                gen_req = await self.prepare(
                    req, prompts, req.max_completion_tokens or req.max_tokens, where, structured
                )
                rid = f"chatcmpl-{gen_req.request_id}"
            else:
                prompts, where = self.tokenize_prompts(req.prompt), "prompt"
                gen_req = await self.prepare(req, prompts, req.max_tokens, where, structured)
                rid = f"cmpl-{gen_req.request_id}"
            gen_req.lora = lora
            max_tokens = gen_req.sampling.max_tokens
            hint = await self.admit(prompts, req.n, where, max_tokens, req.cache_salt, lora)
            builder = ResponseBuilder(
                isinstance(req, ChatCompletionRequest),
                rid,
                self.model_name if lora is None else lora.name,
                len(prompts) * req.n,
                sum(map(len, prompts)),
                req.num_logprobs(),
                self.decode,
                parser,
            )
            return await self.run(req, gen_req, hint, builder, start, time.perf_counter() - start)
        except APIError as e:
            return error_response(e)
        except Exception as e:
            return error_response(APIError(f"internal error: {cause(e)}", status=500, type="internal_error"))
        finally:
            self.drain.leave()

    def chat_prompt(
        self, req: ChatCompletionRequest, structured: tuple[str, dict[str, Any]] | None
    ) -> tuple[list[list[int]], tuple[str, dict[str, Any]] | None, Any]:
        """Prompt ids through the chat template (with tools), the output constraint (a forced tool choice
        constrains to one call), and the tool parser for the output (None without tools)."""
        forced = req.forced_tools()
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.uses_tools() else None
        try:
            text = render_chat(self.tokenizer, [m.render() for m in req.messages], tools, req.add_generation_prompt)
        except ValueError as e:
            raise APIError(str(e), param=str(e).split(":")[0]) from None
        if forced:
            if structured is not None:
                raise APIError(
                    f"tool_choice {req.tool_choice!r} constrains the output; it cannot be combined with "
                    f"{structured[0]}",
                    param="tool_choice",
                )
            structured = ("tool_choice", {"grammar": self.tool_parser.forced_grammar(forced)})
        prompts = [self.tokenizer(text, add_special_tokens=False).input_ids]
        return prompts, structured, self.tool_parser if tools else None

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest) -> Response:
        return await self.handle("completions", req)

    @app.post("/v1/chat/completions")
    async def chat(self, req: ChatCompletionRequest) -> Response:
        return await self.handle("chat", req)

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        info = await self.info()
        limit = info["max_model_len"]
        base = ModelCard(id=self.model_name, root=info["model"], max_model_len=limit)
        adapters = [
            ModelCard(id=m.name, root=m.path, parent=self.model_name, max_model_len=limit) for m in self.loras.values()
        ]
        return ModelList(data=[base, *adapters])

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> Response:
        """vLLM's endpoint: checks the adapter on a replica, then serves it under lora_name on this router;
        replicas load it into a slot when a request first needs it."""
        name = req.lora_name
        if name == self.model_name or name in self.loras:
            what = "the base model" if name == self.model_name else f"a loaded adapter ({self.loras[name].path})"
            return error_response(
                APIError(f"The lora adapter '{name}' has already been loaded: it names {what}.", param="lora_name")
            )
        try:
            await self.replica.check_lora.remote(name, req.lora_path)
        except Exception as e:
            e = cause(e)
            if isinstance(e, ValueError):
                return error_response(APIError(str(e), param="lora_path"))
            return error_response(APIError(f"loading the adapter failed: {e}", status=500, type="internal_error"))
        self.loras[name] = LoRAModule(name=name, path=req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> Response:
        if self.loras.pop(req.lora_name, None) is None:
            message = f"The lora adapter '{req.lora_name}' cannot be found."
            return error_response(APIError(message, status=404, param="lora_name", type="not_found_error"))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

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
        return JSONResponse({**snapshot, "router_node": node_of_this_process()})

    @app.get("/metrics")
    async def prometheus(self) -> Response:
        snapshot, sources = (self.gate.snapshot if self.gate is not None else None), None
        if self.gate is not None:
            try:
                actor = await self.metrics_actor()  # this router's series go first, so every router shows them
                await asyncio.wait_for(actor.report_metrics.remote(self.metrics.router, self.metrics.dump()), 2.0)
                sources = await asyncio.wait_for(actor.metrics.remote(), 2.0)
            except Exception as e:
                self._metrics_actor = None
                log.warning("cannot read the replicas' metrics from the admission actor: %r", e)
        text = self.metrics.render(sources) + (prometheus_text(snapshot).encode() if snapshot else b"")
        return Response(text, media_type="text/plain; version=0.0.4")

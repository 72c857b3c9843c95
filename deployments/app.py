import dataclasses
import re
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig, DeploymentActorConfig, RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from conveyor.cluster.admission_actor import AdmissionActor
from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.autoscaling import KVScalingConfig, PrefillScalingConfig
from conveyor.cluster.routing import RouterConfig
from conveyor.deployments.cluster_args import RANKING, AdmissionArgs, RequestRouterArgs
from conveyor.deployments.disaggregation import DECODE_ADMISSION, DECODE_ROUTER, Disaggregation
from conveyor.deployments.http_guard import GuardConfig
from conveyor.deployments.kv_autoscaling import KV_POLICY, PREFILL_POLICY, KVAutoscaling
from conveyor.deployments.node_placement import HEAD_PIN, replica_bundles
from conveyor.deployments.protocol import LoRAModule
from conveyor.deployments.replica import ADMISSION_ACTOR, LLMReplica
from conveyor.deployments.router import Router, RouterArgs
from conveyor.deployments.tool_parsers import TOOL_PARSERS
from conveyor.engine import EngineConfig

CHAT_TEMPLATES = Path(__file__).with_name("chat_templates")


def check_fields(name: str, cls: type, kwargs: dict[str, Any], exclude: tuple[str, ...] = ()) -> None:
    """Refuse unknown or invalid `name.*` options up front, naming the option."""
    known = {f.name for f in dataclasses.fields(cls)} - set(exclude)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"{name}.{unknown[0]}: unknown option (known: {', '.join(sorted(known))})")
    try:
        cls(**kwargs)
    except (TypeError, ValueError) as e:
        field, _, rule = str(e).partition(": ")
        raise ValueError(f"{name}.{field}: {rule}" if field in known else f"{name}: {e}") from None


def check_autoscaling(name: str, a: KVAutoscaling, policy_config: type) -> None:
    check_fields(f"{name}.policy", policy_config, a.policy, ("min_replicas", "max_replicas"))
    if a.max_replicas < a.min_replicas:
        raise ValueError(f"{name}.max_replicas: must be >= min_replicas")


class AppArgs(BaseModel):
    """Arguments of `build_app`; unknown or bad fields fail the deploy with a message naming them.

    host, port and route_prefix apply through `deploy()`; under `serve run`/`serve deploy` the config file's
    http_options and route_prefix decide."""

    model_config = ConfigDict(extra="forbid")
    model: str = "demo:tiny"
    revision: str | None = None
    served_model_name: str | None = None
    chat_template: str | None = None
    tool_call_parser: str = "hermes"
    engine: dict[str, Any] = {}
    num_replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingConfig | None = None
    kv_autoscaling: KVAutoscaling | None = None
    # the admission actor (a disaggregated app: one per role); `enabled: false`: none, every request goes straight to a
    # replica
    admission: AdmissionArgs = AdmissionArgs()
    # the KV-aware request router; `enabled: false`: Ray Serve's default router. Its ranking weights are admission's too
    request_router: RequestRouterArgs = RequestRouterArgs()
    request_routing_stats_period_s: float = Field(0.5, gt=0)
    stats_push_s: float = Field(0.1, gt=0, le=0.1)
    replica_num_cpus: float = Field(1.0, gt=0)
    worker_num_cpus: float = Field(1.0, gt=0)
    torch_threads: int | None = Field(None, ge=1)
    max_ongoing_requests: int = Field(1024, ge=1)
    stream_interval: int = Field(4, ge=1)
    engine_core_process: bool = True
    # HTTP processes; several share a burst's work, each door counting its own undecided requests once per router
    router_replicas: int = Field(1, ge=1)
    router_num_cpus: float = Field(0.5, ge=0)
    # a resource each replica-capable node declares as 1 (`ray start --resources`): at most one replica per node
    replica_node_resource: str | None = Field(None, min_length=1)
    # where the admission actor runs; by default on the head node (deployments/node_placement.py)
    admission_resources: dict[str, float] = dict(HEAD_PIN)
    # where the routers run; None: on the head node when router_replicas is 1, else spread by Serve
    router_resources: dict[str, float] | None = None
    api_key: str | None = Field(None, min_length=1, repr=False)
    # LoRA adapters served from the start, each under its name (the request's `model`); engine.max_loras sets the
    # slots (1 when unset here)
    lora_modules: list[LoRAModule] = []
    protect_health_metrics: bool = False
    max_body_bytes: int = Field(8 * 2**20, ge=1024)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    route_prefix: str = "/"
    # prefill and decode replicas instead of num_replicas colocated ones (deployments/disaggregation.py)
    disaggregation: Disaggregation | None = None

    @field_validator("admission", mode="before")
    @classmethod
    def _ranking_is_the_routers(cls, value: Any) -> Any:
        for name in RANKING:
            if isinstance(value, dict) and name in value:
                raise ValueError(f"admission.{name}: set it under request_router (admission ranks with its weights)")
        return value

    @model_validator(mode="after")
    def _check_engine(self) -> "AppArgs":
        self._check_engine_options("engine", self.engine)
        if self.disaggregation is not None:
            self._check_disaggregation(self.disaggregation)
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"tool_call_parser: unknown parser {self.tool_call_parser!r} (known: {sorted(TOOL_PARSERS)})"
            )
        if self.chat_template is not None and "{" not in self.chat_template and self.template_file() is None:
            raise ValueError(
                f"chat_template: {self.chat_template!r} is neither a template, a file, nor one of the "
                f"shipped templates ({', '.join(sorted(p.stem for p in CHAT_TEMPLATES.glob('*.jinja')))})"
            )
        if self.autoscaling is not None and self.kv_autoscaling is not None:
            raise ValueError("autoscaling: set autoscaling or kv_autoscaling, not both")
        if self.kv_autoscaling is not None:
            check_autoscaling("kv_autoscaling", self.kv_autoscaling, KVScalingConfig)
        check_fields("admission", AdmissionConfig, self.admission_config())
        check_fields("request_router", RouterConfig, self.router_config())
        return self

    def _check_engine_options(self, name: str, options: dict[str, Any]) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "revision"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"{name}.{unknown[0]}: unknown engine option (known: {', '.join(sorted(known))})")
        try:
            EngineConfig(**{**self.engine, **options, "model": self.model, "revision": self.revision})
        except (ValueError, TypeError) as e:
            m = re.match(r"EngineConfig\.(\w+) (.*)", str(e), re.S)
            if m and m.group(1) not in ("model", "revision"):
                raise ValueError(f"{name}.{m.group(1)}: {m.group(2)}") from None
            message = m.group(2) if m else str(e)
            raise ValueError(message if re.match(r"(model|revision):", message) else f"model: {message}") from None

    def _check_disaggregation(self, d: Disaggregation) -> None:
        self._check_engine_options("disaggregation.decode_engine", d.decode_engine)
        prefill = EngineConfig(**{**self.engine, "model": self.model, "revision": self.revision})
        decode = EngineConfig(**{**self.engine, **d.decode_engine, "model": self.model, "revision": self.revision})
        for name in ("block_size", "dtype", "attention_backend"):  # what a handoff's KV must share with its importer
            if getattr(decode, name) != getattr(prefill, name):
                raise ValueError(
                    f"disaggregation.decode_engine.{name}: must equal the prefill engine's ({getattr(prefill, name)!r}), "
                    f"got {getattr(decode, name)!r}: the decode replicas import its KV blocks as they are"
                )
        if self.autoscaling is not None or self.kv_autoscaling is not None:
            raise ValueError(
                "disaggregation: sets the replica counts; not with autoscaling or kv_autoscaling (use "
                "disaggregation.prefill_autoscaling and decode_autoscaling)"
            )
        if d.prefill_autoscaling is not None:
            check_autoscaling("disaggregation.prefill_autoscaling", d.prefill_autoscaling, PrefillScalingConfig)
        if d.decode_autoscaling is not None:
            check_autoscaling("disaggregation.decode_autoscaling", d.decode_autoscaling, KVScalingConfig)

    def template_file(self) -> Path | None:
        """chat_template as a file: the name of a template shipped in deployments/chat_templates, or a path."""
        t = self.chat_template
        if t is None or "{" in t:
            return None
        shipped = CHAT_TEMPLATES / f"{t}.jinja"
        return shipped if shipped.is_file() else Path(t) if Path(t).is_file() else None

    def template_text(self) -> str | None:
        """chat_template: a shipped template's name, a file path, or the template itself (vLLM's --chat-template)."""
        path = self.template_file()
        return path.read_text() if path is not None else self.chat_template

    @property
    def block_size(self) -> int:
        return int(self.engine.get("block_size", 16))

    def admission_config(self) -> dict[str, Any]:
        """AdmissionConfig's fields: admission's settings, request_router's ranking weights, engine's block_size."""
        ranking = {k: getattr(self.request_router, k) for k in RANKING}
        return {**self.admission.settings(), **ranking, "block_size": self.block_size}

    def router_config(self) -> dict[str, Any]:
        """RouterConfig's fields: request_router's settings and engine's block_size."""
        return {**self.request_router.settings(), "block_size": self.block_size}

    def engine_config(self) -> dict[str, Any]:
        loras = {"max_loras": 1} if self.lora_modules and "max_loras" not in self.engine else {}
        return {**loras, **self.engine, "model": self.model, "revision": self.revision}

    def use_gpu(self) -> bool:
        device = self.engine.get("device", "auto")
        if device != "auto":
            return device == "cuda"
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0

    def serve_env(self) -> dict[str, str]:
        """Ray Serve's per-process switches for the router and replica actors: our code runs on the replica's own
        event loop instead of a thread of its own (one cross-thread hop less per request and per streamed item) and
        access logs are buffered, two of the settings of Ray's RAY_SERVE_THROUGHPUT_OPTIMIZED, which as a whole
        also switches the cluster's ingress and transport (docs/decisions/12-user-code-on-replica-loop.md)."""
        return {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_REQUEST_PATH_LOG_BUFFER_SIZE": "1000"}

    def replica_options(self, engine: dict[str, Any] | None = None) -> dict[str, Any]:
        """A replica deployment's options; `engine`: options over `self.engine` (a disaggregated role's)."""
        gpu = self.use_gpu()
        tp = int({**self.engine, **(engine or {})}.get("tensor_parallel_size", 1))
        head = {"CPU": self.replica_num_cpus, **({"GPU": 1.0} if gpu and tp == 1 else {})}
        worker = {"CPU": self.worker_num_cpus, **({"GPU": 1.0} if gpu else {})}
        threads = str(self.torch_threads or max(1, int(self.replica_num_cpus)))
        opts: dict[str, Any] = dict(
            ray_actor_options={
                "num_cpus": head["CPU"],
                "num_gpus": head.get("GPU", 0),
                "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads, **self.serve_env()}},
            },
            placement_group_bundles=replica_bundles(head, worker, tp, self.replica_node_resource),
            placement_group_strategy="STRICT_PACK",
            max_ongoing_requests=self.max_ongoing_requests,
        )
        if self.autoscaling is not None or self.kv_autoscaling is not None:
            scaling = self.kv_autoscaling.config() if self.kv_autoscaling is not None else self.autoscaling
            opts.update(num_replicas="auto", autoscaling_config=scaling)
        else:
            opts["num_replicas"] = self.num_replicas
        if self.request_router.enabled:
            opts["request_router_config"] = RequestRouterConfig(
                request_router_class="conveyor.cluster.routing:KVAwareRequestRouter",
                request_router_kwargs=self.router_config(),
                request_routing_stats_period_s=self.request_routing_stats_period_s,
                request_routing_stats_timeout_s=max(2.0, 4 * self.request_routing_stats_period_s),
            )
        if self.admission.enabled:
            opts["deployment_actors"] = [
                DeploymentActorConfig(
                    name=ADMISSION_ACTOR,
                    actor_class=ray.remote(AdmissionActor),
                    actor_options={"num_cpus": 0, "resources": dict(self.admission_resources)},
                    init_kwargs={"config": self.admission_config()},
                )
            ]
        return opts


def role_replicas(count: int, scaling: KVAutoscaling | None, policy_function: str) -> dict[str, Any]:
    """A disaggregated role's replica options: its fixed count, or its own autoscaling."""
    if scaling is None:
        return {"num_replicas": count}
    return {"num_replicas": "auto", "autoscaling_config": scaling.config(policy_function)}


def build_app(args: AppArgs) -> Application:
    """Router -> (one deployment handle call per request) -> LLMReplica; a stream's chunks come back over the
    token channel (deployments/token_channel.py)."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    push = args.stats_push_s if args.admission.enabled else 0.0
    # an idle replica's last push, as a quiet router's view holds it (synced every staleness/3), stays under the
    # staleness bound with room for a late push
    admission = AdmissionConfig(**args.admission_config()) if args.admission.enabled else None
    heartbeat = admission.staleness_s / 4 if admission is not None and admission.quiet_when_idle else 0.0
    replica_args = dict(
        engine_args=args.engine_config(),
        torch_threads=args.torch_threads,
        stream_interval=args.stream_interval,
        stats_push_s=push,
        engine_core_process=args.engine_core_process,
        heartbeat_s=heartbeat,
        lora_modules=[m.model_dump() for m in args.lora_modules],
    )
    router_resources = args.router_resources
    if router_resources is None:
        router_resources = dict(HEAD_PIN) if args.router_replicas == 1 else {}
    decode = None
    if args.disaggregation is not None:
        d = args.disaggregation
        from conveyor.deployments.disaggregated_replica import DisaggregatedReplica  # imports the engine

        options = args.replica_options()
        prefill_options = {
            **options,
            "name": "LLMPrefill",
            **role_replicas(d.prefill_replicas, d.prefill_autoscaling, PREFILL_POLICY),
        }
        decode_options = {
            **args.replica_options(d.decode_engine),
            "name": "LLMDecode",
            **role_replicas(d.decode_replicas, d.decode_autoscaling, KV_POLICY),
        }
        if args.admission.enabled:  # the decode role's own admission actor (deployments/role_admission.py)
            decode_options["deployment_actors"] = [
                a.model_copy(update={"init_kwargs": {"config": {**args.admission_config(), **DECODE_ADMISSION}}})
                for a in decode_options["deployment_actors"]
            ]
        if args.request_router.enabled:
            decode_options["request_router_config"] = RequestRouterConfig(
                request_router_class="conveyor.cluster.routing:KVAwareRequestRouter",
                request_router_kwargs={**args.router_config(), **DECODE_ROUTER},
                request_routing_stats_period_s=args.request_routing_stats_period_s,
                request_routing_stats_timeout_s=max(2.0, 4 * args.request_routing_stats_period_s),
            )
        decode_args = {
            **replica_args,
            "engine_args": {**args.engine_config(), **d.decode_engine},
        }
        decode = DisaggregatedReplica.options(**decode_options).bind(**decode_args)
        replica = DisaggregatedReplica.options(**prefill_options).bind(**replica_args)
    else:
        replica = LLMReplica.options(**args.replica_options()).bind(**replica_args)
    router = Router.options(
        num_replicas=args.router_replicas,
        ray_actor_options={
            "num_cpus": args.router_num_cpus,
            "resources": router_resources,
            "runtime_env": {"env_vars": args.serve_env()},
        },
    )
    return router.bind(
        replica,
        RouterArgs(
            args.model,
            args.served_model_name,
            args.admission.enabled,
            args.block_size,
            args.revision,
            args.template_text(),
            args.tool_call_parser,
            GuardConfig(args.api_key, args.max_body_bytes, args.protect_health_metrics),
            tuple(args.lora_modules),
        ),
        decode=decode,
    )


def deploy(args: AppArgs | dict[str, Any], name: str = "default") -> DeploymentHandle:
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    serve.start(http_options={"host": args.host, "port": args.port})
    return serve.run(build_app(args), name=name, route_prefix=args.route_prefix)

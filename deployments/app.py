import dataclasses
import re
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.serve import Application
from ray.serve.config import AutoscalingConfig
from ray.serve.handle import DeploymentHandle

from deployments.replica import LLMReplica
from deployments.router import Router
from engine import EngineConfig


class AppArgs(BaseModel):
    """Arguments of `build_app`; unknown or bad fields fail the deploy with a message naming them.

    host, port and route_prefix apply through `deploy()`; under `serve run`/`serve deploy` the config file's
    http_options and route_prefix decide."""

    model_config = ConfigDict(extra="forbid")
    model: str = "demo:tiny"
    served_model_name: str | None = None
    engine: dict[str, Any] = {}
    num_replicas: int = Field(1, ge=1)
    autoscaling: AutoscalingConfig | None = None
    replica_num_cpus: float = Field(1.0, gt=0)
    worker_num_cpus: float = Field(1.0, gt=0)
    torch_threads: int | None = Field(None, ge=1)
    max_ongoing_requests: int = Field(1024, ge=1)
    stream_interval_s: float = Field(0.0, ge=0)
    stream_chunks_per_s: float = Field(200.0, ge=0)
    router_replicas: int = Field(1, ge=1)
    router_num_cpus: float = Field(0.5, ge=0)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    route_prefix: str = "/"

    @model_validator(mode="after")
    def _check_engine(self) -> "AppArgs":
        known = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "hf_config", "model_path"}
        unknown = sorted(set(self.engine) - known)
        if unknown:
            raise ValueError(f"engine.{unknown[0]}: unknown engine option (known: {', '.join(sorted(known))})")
        try:
            EngineConfig(**self.engine_config())
        except (ValueError, TypeError) as e:
            m = re.match(r"EngineConfig\.(\w+) (.*)", str(e), re.S)
            if m and m.group(1) != "model":
                raise ValueError(f"engine.{m.group(1)}: {m.group(2)}") from None
            raise ValueError(f"model: {m.group(2) if m else e}") from None
        return self

    def engine_config(self) -> dict[str, Any]:
        return {**self.engine, "model": self.model}

    def use_gpu(self) -> bool:
        device = self.engine.get("device", "auto")
        if device != "auto":
            return device == "cuda"
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0

    def replica_options(self) -> dict[str, Any]:
        gpu = self.use_gpu()
        tp = int(self.engine.get("tensor_parallel_size", 1))
        head = {"CPU": self.replica_num_cpus, **({"GPU": 1.0} if gpu and tp == 1 else {})}
        worker = {"CPU": self.worker_num_cpus, **({"GPU": 1.0} if gpu else {})}
        threads = str(self.torch_threads or max(1, int(self.replica_num_cpus)))
        opts: dict[str, Any] = dict(
            ray_actor_options={"num_cpus": head["CPU"], "num_gpus": head.get("GPU", 0),
                               "runtime_env": {"env_vars": {"OMP_NUM_THREADS": threads}}},
            placement_group_bundles=[head] + ([worker] * tp if tp > 1 else []), placement_group_strategy="STRICT_PACK",
            max_ongoing_requests=self.max_ongoing_requests)
        if self.autoscaling is not None:
            opts.update(num_replicas="auto", autoscaling_config=self.autoscaling)
        else:
            opts["num_replicas"] = self.num_replicas
        return opts


def build_app(args: AppArgs) -> Application:
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    replica = LLMReplica.options(**args.replica_options()).bind(args.engine_config(), args.torch_threads,
                                                                   args.stream_interval_s, args.stream_chunks_per_s)
    router = Router.options(num_replicas=args.router_replicas, ray_actor_options={"num_cpus": args.router_num_cpus})
    return router.bind(replica, args.model, args.served_model_name)


def deploy(args: AppArgs | dict[str, Any], name: str = "default") -> DeploymentHandle:
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    serve.start(http_options={"host": args.host, "port": args.port})
    return serve.run(build_app(args), name=name, route_prefix=args.route_prefix)

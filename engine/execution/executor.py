"""Runs a SchedulerOutput on the model. TP=1 runs in this process; TP>1 drives Ray workers."""

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

from conveyor.engine.resolved_config import ResolvedConfig
from conveyor.engine.step import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from conveyor.engine.execution.model_runner import ModelRunner

T = TypeVar("T")


def runner_class(config: ResolvedConfig) -> type["ModelRunner"]:
    """EngineConfig.model_runner_cls, imported in whichever process builds the runner (core, TP worker)."""
    module, _, name = config.model_runner_cls.partition(":")
    return getattr(importlib.import_module(module), name)


def allocate_kv_cache(runner: "ModelRunner", num_blocks: int) -> int:
    """Allocates the runner's KV cache (and its CPU swap space); returns the number of swap slots."""
    runner.allocate_kv_cache(num_blocks)
    cpu = runner.cpu_cache
    return cpu.shape[2] if cpu.dim() > 2 else 0


def allocate_kv_tiers(runner: "ModelRunner") -> list[tuple[str, int]]:
    """Allocates the runner's lower KV tiers (host, disk); returns their (name, slots)."""
    return runner.allocate_kv_tiers()


def close_kv_tiers(runner: "ModelRunner") -> None:
    """Waits for the runner's tier copies and removes its disk tier's file."""
    if runner.tier_store is not None:
        runner.tier_store.close()


class Executor(Protocol):
    num_blocks: int
    num_swap_blocks: int
    kv_tiers: list[tuple[str, int]]  # the lower KV tiers' (name, slots), engine/kv_offload.py

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput: ...

    def collective_rpc(self, fn: Callable[..., T], *args: object) -> list[T]:
        """fn(model_runner, *args) on every rank, between steps; each rank's result in rank order."""
        ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    def __init__(self, config: ResolvedConfig) -> None:
        self.runner = runner_class(config)(config)
        self.num_blocks = self.runner.available_blocks()
        self.num_swap_blocks = allocate_kv_cache(self.runner, self.num_blocks)
        self.kv_tiers = allocate_kv_tiers(self.runner)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(so)

    def collective_rpc(self, fn: Callable[..., T], *args: object) -> list[T]:
        return [fn(self.runner, *args)]

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        close_kv_tiers(self.runner)


def make_executor(config: ResolvedConfig) -> Executor:
    if config.tensor_parallel_size == 1:
        return LocalExecutor(config)
    from conveyor.engine.execution.tp_executor import TPExecutor

    return TPExecutor(config)

"""Runs a SchedulerOutput on the model. TP=1 runs in this process; TP>1 drives Ray workers."""
from typing import Protocol

from engine.config import EngineConfig
from engine.step import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    num_blocks: int
    num_swap_blocks: int

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None: ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    def __init__(self, config: EngineConfig) -> None:
        from engine.model_runner import ModelRunner
        self.runner = ModelRunner(config)
        self.num_blocks = self.runner.available_blocks()
        self.runner.allocate_kv_cache(self.num_blocks)
        self.num_swap_blocks = self.runner.cpu_cache.shape[2] if self.runner.cpu_cache.dim() > 2 else 0

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(so)

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_executor(config: EngineConfig) -> Executor:
    if config.tensor_parallel_size == 1:
        return LocalExecutor(config)
    from engine.tp_executor import TPExecutor
    return TPExecutor(config)

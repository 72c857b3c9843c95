"""A real ModelRunner whose steps take at least STEP_S: a request's duration is then bounded below by its
token count, whatever the machine's speed, so a drain-timeout test knows which requests cannot finish."""

import time

from conveyor.engine.execution.model_runner import ModelRunner
from conveyor.engine.step import ModelRunnerOutput, SchedulerOutput

STEP_S = 0.02
RUNNER = "tests.paced_runner:PacedRunner"


class PacedRunner(ModelRunner):
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        start = time.perf_counter()
        out = super().execute_model(so)
        time.sleep(max(0.0, STEP_S - (time.perf_counter() - start)))
        return out

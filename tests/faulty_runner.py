"""A real ModelRunner that raises after the step whose new requests include a MARKED prompt: the model-step
fault the engine must survive. Plugged in through EngineConfig.model_runner_cls (so it runs in the core
process too)."""

from conveyor.engine.execution.model_runner import ModelRunner
from conveyor.engine.step import ModelRunnerOutput, SchedulerOutput

MARK = [777, 778, 779]
RUNNER = "tests.faulty_runner:FaultyRunner"


class FaultyRunner(ModelRunner):
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        out = super().execute_model(so)  # the runner's own state has moved on, as in a late failure
        if any(r.prompt_token_ids[: len(MARK)] == MARK for r in so.new_requests):
            raise RuntimeError("injected model fault")
        return out

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestMetrics:
    """Engine timestamps (time.monotonic) of one request; last_token_time is that of the newest token."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    metrics: RequestMetrics | None = None
    kv_handoff: Any = None  # a prefill-only request's KVHandoff (finish_reason "handoff")

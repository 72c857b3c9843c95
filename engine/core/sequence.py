import time
from dataclasses import dataclass, field
from enum import Enum, auto

from conveyor.engine.lora_request import LoRARequest
from conveyor.engine.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    SWAPPED = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """One request's life in the engine: its tokens, how many are in the KV cache, its blocks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    lora: LoRARequest | None = None
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    seen_by_runner: bool = False
    enqueued_step: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    prefill_only: bool = False  # leaves after its first token with its KV (engine/core/kv_handoff.py)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

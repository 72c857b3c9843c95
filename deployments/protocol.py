"""The router <-> replica protocol: a GenerateRequest in, its stream of Chunks out."""

import uuid
from typing import Any, TypedDict

from pydantic import BaseModel, ConfigDict, Field

from conveyor.deployments.request_models import Strict
from conveyor.engine.sampling_params import SamplingParams


class LoRAModule(Strict):
    """A LoRA adapter served under `name` (the request's `model`): a PEFT adapter directory or Hub id."""

    name: str = Field(min_length=1, max_length=256)
    path: str = Field(min_length=1, max_length=4096)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    prompts: list[list[int]]
    n: int = 1
    sampling: SamplingParams = Field(default_factory=SamplingParams)  # validated by the router; n: the field above
    priority: int = 0
    stream: bool = True
    cache_salt: str | None = None
    lora: LoRAModule | None = None  # the adapter the request runs with (None: the base model)
    reply_to: str | None = None  # the router's token channel (deployments/token_channel.py); None: not streamed


class Delta(TypedDict):
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


class Chunk(TypedDict, total=False):
    deltas: list[Delta]
    first_s: float
    replica: str
    stats: dict[str, Any]
    emitted_at: float
    ingress_s: float
    metrics: list[dict[str, Any]]
    last: bool  # a request's final chunk
    sent: int  # the handle call's result for a stream sent over the token channel: how many chunks

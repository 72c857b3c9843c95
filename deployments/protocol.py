import json
import time
import uuid
from typing import Any, Literal, TypedDict

from pydantic import BaseModel, ConfigDict, Field, field_serializer, field_validator

from conveyor.engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20
IGNORED_FIELDS = ("user", "service_tier", "store", "metadata")
"""Request fields accepted and ignored on purpose (README, "Request fields"); every other unknown field is a 400."""


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: int | str | None = None,
        retry_after_s: float = 1.0,
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.type, self.retry_after_s = status, param, type, retry_after_s
        self.code = status if code is None else code

    def response(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=str(self), type=self.type, param=self.param, code=self.code))


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(Strict):
    include_usage: bool = False


class JsonSchemaFormat(Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` request field."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingRequest(Strict):
    model: str | None = None
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int = Field(0, ge=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    user: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None

    def structured(self) -> tuple[str, dict[str, Any]] | None:
        """(the request field it came from, StructuredParams fields) for the one constraint asked for."""
        asked: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(
                    "response_format.json_schema.schema is required for type json_schema", param="response_format"
                )
            asked.append(("response_format", {"json": rf.json_schema.schema_}))
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
            asked.append(("structured_outputs", fields))
        for name in ("json", "regex", "choice", "grammar"):
            if (value := getattr(self, f"guided_{name}")) is not None:
                asked.append((f"guided_{name}", {name: value}))
        if len(asked) > 1:
            raise APIError(f"only one output constraint per request, got {[a for a, _ in asked]}", param=asked[1][0])
        return asked[0] if asked else None

    def token_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(k): v for k, v in self.logit_bias.items()}
        except ValueError:
            raise APIError("logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None

    def num_logprobs(self) -> int | None:
        return None

    def sampling(self, max_tokens: int) -> dict[str, Any]:
        sp: dict[str, Any] = dict(
            n=1,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            logprobs=self.num_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.token_bias(),
        )
        for k in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(self, k) is not None:
                sp[k] = getattr(self, k)
        if sp.get("top_k") == 0:
            sp["top_k"] = -1
        return sp


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False
    suffix: None = None

    def num_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(Strict):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: FunctionName


class ChatMessageIn(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part type {kind!r} is not supported (this model reads text parts only)")
        return content

    def render(self) -> dict[str, Any]:
        """The message as chat templates expect it: tool-call arguments as objects, not JSON strings."""
        content = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _loads(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_names(self) -> list[str]:
        return [t.function.name for t in self.tools or []]

    def forced_tools(self) -> list[Tool] | None:
        """The tools the output must call (tool_choice required or named), or None when the model chooses."""
        choice = self.tool_choice
        if choice is not None and not self.tools and choice != "none":
            raise APIError("tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in self.tool_names():
                raise APIError(
                    f"tool_choice names function {choice.function.name!r}, which is not in tools {self.tool_names()}",
                    param="tool_choice",
                )
            return [t for t in self.tools if t.function.name == choice.function.name]
        return list(self.tools) if choice == "required" else None

    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = []


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None

    @field_serializer("delta")
    def _delta(self, delta: DeltaMessage) -> dict[str, Any]:
        return delta.model_dump(exclude_none=True)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "conveyor"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoRAModule(Strict):
    """A LoRA adapter served under `name` (the request's `model`): a PEFT adapter directory or Hub id."""

    name: str = Field(min_length=1, max_length=256)
    path: str = Field(min_length=1, max_length=4096)


class LoadLoRAAdapterRequest(Strict):
    """POST /v1/load_lora_adapter, vLLM's shape."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(Strict):
    """POST /v1/unload_lora_adapter, vLLM's shape (lora_int_id accepted and ignored: names are unique)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


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

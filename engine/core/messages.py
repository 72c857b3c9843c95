"""What crosses between the engine front end (tokenizer, detokeniser, stop strings, streams) and the engine
core (scheduler, KV cache, grammars, executor): typed msgspec structs, encoded as msgpack (no pickle)."""

import msgspec

from conveyor.engine.core.kv_events import KVEvents
from conveyor.engine.core.kv_handoff import KVHandoff
from conveyor.engine.lora_request import LoRARequest
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.stats import EngineStats


class AddRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    """params: decoded (and so validated again) by its own __post_init__ in the core process."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None
    cache_salt: str | None = None
    lora: LoRARequest | None = None
    prefill_only: bool = False


class ImportRequest(msgspec.Struct, tag="import", array_like=True):
    """A request another engine prefilled (engine/core/kv_handoff.py), continued here under request_id."""

    request_id: str
    handoff: KVHandoff


class FinishRequests(msgspec.Struct, tag="finish", array_like=True):
    """Abort (reason "abort") or stop-string finishes found by the front end (reason "stop")."""

    request_ids: list[str]
    reason: str = "abort"
    stop_reasons: list[str | None] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = AddRequest | ImportRequest | FinishRequests | Shutdown


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's news from one step: only the tokens it has not reported yet. finish_reason "error":
    the core failed the request (stop_reason says why: a refused add, a model step that raised)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    kv_handoff: KVHandoff | None = None


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True, omit_defaults=True):
    """One step: its outputs, the stats after it, and the KV cache's stored/evicted keys since the last one."""

    outputs: list[CoreOutput]
    stats: EngineStats
    kv_events: KVEvents | None = None


class CoreReady(msgspec.Struct, tag="ready", array_like=True):
    num_blocks: int
    num_swap_blocks: int
    pid: int
    stats: EngineStats


class CoreFailed(msgspec.Struct, tag="failed", array_like=True):
    error: str


CoreMessage = CoreOutputs | CoreReady | CoreFailed


class Codec:
    """One encoder and the two typed decoders; each side keeps its own instance (not thread-safe)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder()
        self.inputs = msgspec.msgpack.Decoder(CoreInput)
        self.messages = msgspec.msgpack.Decoder(CoreMessage)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self.encoder.encode(msg)

    def decode_input(self, data: bytes) -> CoreInput | CoreOutput:
        """The next input; an AddRequest or ImportRequest whose params fail their own checks as they decode comes
        back as that request's error output: the core refuses that request alone."""
        try:
            return self.inputs.decode(data)
        except msgspec.ValidationError as e:
            tag, request_id, *_ = msgspec.msgpack.decode(data)
            if tag not in ("add", "import"):
                raise
            return CoreOutput(request_id, [], finish_reason="error", stop_reason=str(e))

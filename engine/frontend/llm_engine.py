"""The synchronous engine: add_request / step / abort_request. The front end (tokenizer, validation,
detokenisation, stop strings) is here; the core (scheduler, KV cache, grammars, executor) runs in this thread
or, with engine_core_process=True, in a process of its own (engine/process/core_process.py)."""

import time

import msgspec
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from conveyor.engine.checkpoints.lora import read_adapter
from conveyor.engine.config import EngineConfig
from conveyor.engine.core.engine_core import EngineCore
from conveyor.engine.core.kv_events import KVEvents
from conveyor.engine.core.kv_handoff import KVHandoff
from conveyor.engine.core.messages import AddRequest, CoreOutput, ImportRequest
from conveyor.engine.frontend.generation_defaults import GenerationDefaults, load_generation_defaults
from conveyor.engine.frontend.limits import RequestLimits
from conveyor.engine.frontend.output_processor import OutputProcessor
from conveyor.engine.frontend.outputs import RequestOutput
from conveyor.engine.lora_request import LoRARequest
from conveyor.engine.process.core_client import InprocClient, MPClient
from conveyor.engine.process.heap import freeze_startup_heap
from conveyor.engine.resolved_config import ResolvedConfig, resolve
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.stats import EngineStats


def eos_token_ids(config: ResolvedConfig, tokenizer: PreTrainedTokenizerBase, defaults: GenerationDefaults) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(config.hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids | set(defaults.eos_token_ids)


class LLMEngine:
    def __init__(self, config: EngineConfig, engine_core_process: bool = False) -> None:
        """Resolves the config (engine/resolved_config.py: the model on disk, every "auto" decided): the one place
        in this process where a config does I/O."""
        self.config = config = resolve(config)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.generation_defaults = load_generation_defaults(config.model_path)
        self.vocab_size = config.hf_config.vocab_size
        eos = eos_token_ids(config, self.tokenizer, self.generation_defaults)
        self.core = MPClient(config, eos) if engine_core_process else InprocClient(config, eos, self.tokenizer)
        self.max_model_len = config.max_model_len  # fitted to the KV cache by the core's start
        self.num_blocks = self.core.num_blocks
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, config.block_size, self.num_blocks)
        self.processor = OutputProcessor(self.tokenizer)
        self.loras: dict[str, LoRARequest] = {}  # adapters checked against the model, by name
        freeze_startup_heap(self)

    @property
    def in_process(self) -> bool:
        return isinstance(self.core, InprocClient)

    @property
    def stream_outputs(self) -> bool:
        """False: step() returns finished requests only (offline generate)."""
        return self.processor.stream_outputs

    @stream_outputs.setter
    def stream_outputs(self, value: bool) -> None:
        self.processor.stream_outputs = value

    @property
    def local_core(self) -> EngineCore:
        """The engine core itself (scheduler, block manager, executor, step trace), for tests and benchmarks
        that look inside it: only where it runs in this process (engine_core_process=False)."""
        if not isinstance(self.core, InprocClient):
            raise AttributeError("the engine core runs in its own process: its parts are not in this one")
        return self.core.core

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the checkpoint's generation_config.json defaults, as vLLM applies them."""
        return SamplingParams(**self.generation_defaults.sampling)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.limits.check(prompt_token_ids, params)

    def add_lora(self, lora: LoRARequest) -> None:
        """Checks the adapter against the model (a ValueError names what is wrong) and registers it by name; the
        model runner loads it into a slot when a request first needs it. A name registered with another adapter
        is refused: unload it first."""
        if not self.config.max_loras:
            raise ValueError("lora_request: LoRA is off (EngineConfig.max_loras is 0)")
        known = self.loras.get(lora.name)
        if known is not None:
            if known != lora:
                raise ValueError(f"lora_request: an adapter named {lora.name!r} is already loaded ({known.path})")
            return
        read_adapter(lora.path, self.config.hf_config, self.config.max_lora_rank)
        self.loras[lora.name] = lora

    def adopt_lora(self, lora: LoRARequest) -> LoRARequest:
        """This engine's LoRARequest for an adapter another engine registered (its id is that engine's): the one
        registered here under the same name and path, else `lora`, checked and registered (add_lora)."""
        known = self.loras.get(lora.name)
        if known is not None and known.path == lora.path:
            return known
        self.add_lora(lora)
        return lora

    def remove_lora(self, name: str) -> bool:
        """Unregisters the adapter: new requests cannot name it; those running with it finish with it."""
        return self.loras.pop(name, None) is not None

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        validated: bool = False,
        output_interval: int = 1,
        lora_request: LoRARequest | None = None,
        prefill_only: bool = False,
    ) -> None:
        """validated: the caller (LLM.generate, AsyncEngine.generate) has checked the request already.
        output_interval: a streamed request's tokens per output (OutputProcessor.add).
        lora_request: the adapter it runs with (registered here first if it is not yet). prefill_only: the
        request finishes after its first token with finish_reason "handoff" and its RequestOutput.kv_handoff."""
        if not validated:
            self.validate(prompt_token_ids, params)
        if lora_request is not None:
            self.add_lora(lora_request)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.processor.add(request_id, prompt, list(prompt_token_ids), params, arrival_time, output_interval)
        try:
            self.core.add_request(
                AddRequest(
                    request_id,
                    list(prompt_token_ids),
                    params,
                    priority,
                    arrival_time,
                    cache_salt,
                    lora_request,
                    prefill_only,
                )
            )
        except BaseException:
            self.processor.requests.pop(request_id, None)
            raise

    def import_request(self, request_id: str, handoff: KVHandoff, output_interval: int = 1) -> None:
        """Continues a request another engine prefilled (a prefill-only request's kv_handoff). Its outputs hold
        the handoff's tokens too, but no output carries only those. A handoff's adapter runs here under this
        engine's registration of it (add_lora's checks; ValueError when they fail)."""
        self.validate(handoff.prompt_token_ids, handoff.params)
        if handoff.lora is not None:
            handoff = msgspec.structs.replace(handoff, lora=self.adopt_lora(handoff.lora))
        tokens = list(handoff.output_token_ids)
        self.processor.add(
            request_id, None, list(handoff.prompt_token_ids), handoff.params, time.monotonic(), output_interval
        )
        self.processor.process([CoreOutput(request_id, tokens, [None] * len(tokens))])
        try:
            self.core.import_request(ImportRequest(request_id, handoff))
        except BaseException:
            self.processor.requests.pop(request_id, None)
            raise

    def abort_request(self, request_id: str) -> RequestOutput | None:
        out = self.processor.abort(request_id)
        if out is not None:
            self.core.finish_requests([request_id])
        return out

    def has_unfinished_requests(self) -> bool:
        return self.processor.has_unfinished or self.core.has_unfinished

    def step(self, timeout_s: float | None = None) -> list[RequestOutput]:
        """One engine step's outputs (in process); from a core process: every step it has reported, waiting
        up to timeout_s for one when none is queued."""
        if not self.in_process and not self.processor.has_unfinished:
            return []
        return self.process_outputs(self.core.get_outputs(timeout_s))

    def process_outputs(self, core_outputs: list[CoreOutput]) -> list[RequestOutput]:
        """A request the core failed comes back finished with finish_reason "error" (stop_reason: why)."""
        outputs, stops = self.processor.process(core_outputs)
        if stops:
            self.core.finish_requests([r for r, _ in stops], "stop", [s for _, s in stops])
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    def drain_kv_events(self, max_events: int | None = None) -> KVEvents:
        """Thread-safe: prefix-cache keys stored/evicted since the last drain (engine.kv_events)."""
        return self.core.drain_kv_events(max_events)

    def request_kv_reset(self) -> None:
        self.core.request_kv_reset()

    def check_health(self) -> None:
        self.core.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()

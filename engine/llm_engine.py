"""The synchronous engine: add_request / step / abort_request. The front end (tokenizer, validation,
detokenisation, stop strings) is here; the core (scheduler, KV cache, executor) runs in this thread or,
with engine_core_process=True, in a process of its own (engine/core_process.py)."""
import time

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.core_client import InprocClient, MPClient
from engine.messages import AddRequest, CoreOutput
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats


def eos_token_ids(config: EngineConfig, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(config.hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


class LLMEngine:
    def __init__(self, config: EngineConfig, engine_core_process: bool = False) -> None:
        self.config = config
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.vocab_size = config.hf_config.vocab_size
        self.max_model_len = config.max_model_len
        client = MPClient if engine_core_process else InprocClient
        self.core = client(config, eos_token_ids(config, self.tokenizer))
        self.num_blocks = self.core.num_blocks
        self.processor = OutputProcessor(self.tokenizer)

    @property
    def in_process(self) -> bool:
        return isinstance(self.core, InprocClient)

    def __getattr__(self, name: str) -> object:
        if name in ("scheduler", "block_manager", "executor") and isinstance(self.__dict__.get("core"), InprocClient):
            return getattr(self.core.core, name)
        raise AttributeError(f"LLMEngine has no attribute {name!r} (the core's parts exist only in process)")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt is {n} tokens, max_model_len is {self.max_model_len} "
                             f"(the prompt must leave room for at least one generated token)")
        need = -(-min(n + params.max_tokens, self.max_model_len) // self.config.block_size)
        if need > self.num_blocks:
            raise ValueError(f"prompt + max_tokens ({n} + {params.max_tokens}) needs {need} KV blocks but the "
                             f"cache holds {self.num_blocks}")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be < vocab size {self.vocab_size}")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, prompt: str | None = None,
                    cache_salt: str | None = None) -> None:
        self.validate(prompt_token_ids, params)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.processor.add(request_id, prompt, list(prompt_token_ids), params, arrival_time)
        try:
            self.core.add_request(AddRequest(request_id, list(prompt_token_ids), params, priority, arrival_time,
                                             cache_salt))
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
        """A request the core refused comes back finished with finish_reason "error" (stop_reason: why)."""
        outputs, stops = self.processor.process(core_outputs)
        if stops:
            self.core.finish_requests([r for r, _ in stops], "stop", [s for _, s in stops])
        return outputs

    def stats(self) -> EngineStats:
        return self.core.stats()

    def check_health(self) -> None:
        self.core.check_health()

    def shutdown(self) -> None:
        self.core.shutdown()

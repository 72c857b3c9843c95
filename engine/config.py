"""What the user asks of the engine. Building an EngineConfig checks its own fields and nothing else: no file,
model or kernel is touched. The engine resolves it where it is built (engine/resolved_config.py: the model on disk,
every "auto" decided), and errors that need the model are raised there, naming the field all the same."""

import os
from dataclasses import asdict, dataclass, field, fields

import torch

from conveyor.engine.checkpoints.model_source import check_model_name
from conveyor.engine.kv_offload import KVOffloadConfig
from conveyor.engine.stats import DEFAULT_BLOCK_SIZE

# the core process's CPU priority against its front end (engine/process/core_priority.py)
PRIORITIES = ("auto", "high", "low")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _fail(name: str, message: str) -> None:
    raise ValueError(f"EngineConfig.{name} {message}")


SPEC_METHODS = ("ngram", "draft")


@dataclass
class SpeculativeConfig:
    """Speculative decoding (engine/core/spec_decode): a proposer guesses up to num_speculative_tokens next tokens
    of a decoding request, the target model checks them all in one step."""

    # "ngram": prompt lookup (the request's own tokens); "draft": a smaller model with the target's vocabulary
    method: str = "ngram"
    # method "draft": the draft checkpoint (a name as EngineConfig.model takes; the target's own name works too)
    model: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2  # shortest suffix n-gram matched against the request's earlier tokens
    prompt_lookup_max: int = 4  # longest suffix n-gram tried first
    # a request drafts only the positions whose recent chance of acceptance is at least this, and pauses (for 1, 2,
    # 4, ... 64 steps) while not even the first one's is; the cost of a draft token rises with the batch, so the bar
    # scales with the step's decodes
    min_acceptance_rate: float = 0.3

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            _fail("speculative.method", f"must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.method == "draft":
            if not isinstance(self.model, str) or not self.model:
                _fail("speculative.model", f"must name the draft checkpoint for method 'draft', got {self.model!r}")
            try:
                check_model_name(self.model)
            except ValueError as e:
                _fail("speculative.model", str(e))
        elif self.model is not None:
            _fail("speculative.model", f"is only for method 'draft', got method {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(f"speculative.{name}", f"must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            _fail("speculative.prompt_lookup_min", f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        if not 0 <= self.min_acceptance_rate < 1:
            _fail("speculative.min_acceptance_rate", f"must be in [0, 1), got {self.min_acceptance_rate!r}")


@dataclass
class EngineConfig:
    model: str = "demo:tiny"  # a built-in name (demo:*), a checkpoint directory, a .gguf file or a Hub id
    revision: str | None = None
    dtype: str = "auto"  # "auto": the checkpoint's (float32 where it names none)
    device: str = "auto"  # "auto": cuda where torch sees a GPU, else cpu
    max_model_len: int | None = None  # None: the model's limit, fitted to what the KV cache holds
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_memory: int | None = None
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    scheduling_policy: str = "continuous"
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 0
    # while any sequence decodes, a step carries at most this many prefill tokens (0: the whole budget): a step's
    # length is what every running stream waits on, so this bounds inter-token latency at some cost in TTFT
    max_prefill_tokens_while_decoding: int = 0
    preemption_mode: str = "recompute"
    swap_space: int = 0
    watermark: float = 0.01
    adaptive_watermark: bool = False
    aging_rate: float = 1.0
    tensor_parallel_size: int = 1
    # "auto": triton on cuda; on CPU the C++ kernels (cpu) for float32/bfloat16 where they build, else torch
    attention_backend: str = "auto"
    prepack_weights: bool = True  # CPU: linear weights in oneDNN's blocked layout (engine/model/linear.py)
    keep_freed_memory: bool = True  # CPU: glibc keeps freed activations for reuse (engine/execution/host_memory.py)
    cpu_threads_bind: str = "off"  # "auto": pin torch's intra-op thread i to the i-th allowed core, as vLLM does
    # the core process's CPU priority against its front end (engine_core_process=True only; engine/process/core_priority.py):
    # "high" (niceness 0), "low" (SCHED_IDLE), "auto": high while the node's cores leave a CPU to the rest
    core_process_priority: str = "auto"
    # a new request's likely output length until 16 requests have finished (engine/core/output_lengths.py): on a cold
    # replica, admission charges a request's output min(max_tokens, this), not an unset max_tokens
    cold_output_tokens: int = 256
    # lower KV tiers for the prefix cache: {host_gib, disk_path, disk_gib} (engine/kv_offload.py); None: none
    kv_offload: KVOffloadConfig | None = None
    seed: int = 0
    # speculative decoding: a SpeculativeConfig or a dict of its fields ({method: ngram, num_speculative_tokens: 4});
    # None: off
    speculative: SpeculativeConfig | dict | None = None
    max_loras: int = 0  # LoRA adapters resident at once (slots, LRU); 0: LoRA off (engine/model/lora.py)
    max_lora_rank: int = 16  # the largest adapter rank accepted; every slot holds this rank
    model_runner_cls: str = (
        "conveyor.engine.execution.model_runner:ModelRunner"  # "module:Class", a ModelRunner (sub)class
    )
    check_invariants: bool = field(default_factory=lambda: os.environ.get("CONVEYOR_CHECK_INVARIANTS") == "1")

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            _fail("model", f"must be a non-empty string, got {self.model!r}")
        try:
            check_model_name(self.model)
        except ValueError as e:
            _fail("model", str(e))
        if self.revision is not None and not isinstance(self.revision, str):
            _fail("revision", f"must be a string or None, got {self.revision!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                _fail(name, f"must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1) or self.block_size > 256:
            _fail("block_size", f"must be a power of two <= 256, got {self.block_size}")
        if self.kv_cache_memory is not None and self.num_blocks is not None:
            _fail("num_blocks", "and kv_cache_memory are mutually exclusive")
        for name in ("kv_cache_memory", "num_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                _fail(name, f"must be a positive integer or None, got {value!r}")
        if not isinstance(self.max_lora_rank, int) or isinstance(self.max_lora_rank, bool) or self.max_lora_rank < 1:
            _fail("max_lora_rank", f"must be a positive integer, got {self.max_lora_rank!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            _fail("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if not 0 <= self.watermark < 1:
            _fail("watermark", f"must be in [0, 1), got {self.watermark}")
        if self.core_process_priority not in PRIORITIES:
            _fail("core_process_priority", f"must be one of {PRIORITIES}, got {self.core_process_priority!r}")
        for name in (
            "swap_space",
            "long_prefill_token_threshold",
            "max_num_partial_prefills",
            "max_prefill_tokens_while_decoding",
            "cold_output_tokens",
            "max_loras",
        ):
            if getattr(self, name) < 0:
                _fail(name, f"must be >= 0, got {getattr(self, name)!r}")
        choices = {
            "scheduling_policy": ("continuous", "static"),
            "preemption_mode": ("recompute", "swap"),
            "attention_backend": ("auto", "torch", "cpu", "triton"),
            "device": ("auto", "cpu", "cuda"),
            "dtype": ("auto", *DTYPES),
            "cpu_threads_bind": ("off", "auto"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                _fail(name, f"must be one of {allowed}, got {getattr(self, name)!r}")
        self.kv_offload = KVOffloadConfig.of(self.kv_offload)
        self._check_speculative()
        if self.kv_offload is not None and not self.enable_prefix_caching:
            _fail("kv_offload", "needs enable_prefix_caching (its tiers hold prefix-cached blocks)")
        if not isinstance(self.model_runner_cls, str) or self.model_runner_cls.count(":") != 1:
            _fail("model_runner_cls", f"must be 'module:Class', got {self.model_runner_cls!r}")

    def _check_speculative(self) -> None:
        if isinstance(self.speculative, dict):
            known = {f.name for f in fields(SpeculativeConfig)}
            unknown = sorted(set(self.speculative) - known)
            if unknown:
                _fail(f"speculative.{unknown[0]}", f"is not a speculative option (known: {', '.join(sorted(known))})")
            self.speculative = SpeculativeConfig(**self.speculative)
        if self.speculative is None:
            return
        if not isinstance(self.speculative, SpeculativeConfig):
            _fail(
                "speculative", f"must be a SpeculativeConfig, a dict of its fields, or None, got {self.speculative!r}"
            )
        if self.scheduling_policy != "continuous":
            _fail("speculative", "needs scheduling_policy 'continuous'")
        if self.speculative.method == "draft":
            if self.tensor_parallel_size != 1:
                _fail("speculative.method", "'draft' is not implemented with tensor_parallel_size > 1")
            # the draft's KV cache lives beside the target's in the pool only: swap and the lower tiers copy the target's
            if self.preemption_mode != "recompute":
                _fail("speculative.method", "'draft' needs preemption_mode 'recompute'")
            if self.kv_offload is not None:
                _fail("speculative.method", "'draft' does not work with kv_offload")

    def engine_options(self) -> dict:
        """The fields as plain values (JSON): what rebuilds this config in another process."""
        options = {f.name: getattr(self, f.name) for f in fields(EngineConfig)}
        if self.speculative is not None:
            options["speculative"] = asdict(self.speculative)  # plain JSON for the core process
        if self.kv_offload is not None:
            options["kv_offload"] = self.kv_offload.to_dict()
        return options

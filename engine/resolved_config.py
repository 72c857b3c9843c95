"""The config the engine runs with: an EngineConfig whose model is on disk and whose "auto" values are decided.
`resolve` is the one step that does I/O for a config: it resolves the checkpoint (which may download or generate
it), reads its Hugging Face config, checks the fields against the model and picks the attention backend (on CPU,
building the C++ kernels). The engine calls it where it is built (LLMEngine, the core process); EngineCore, the
executor, workers and model runner take a ResolvedConfig."""

import logging
from dataclasses import dataclass, field, fields

import torch
from transformers import AutoConfig, PretrainedConfig

from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.config import DTYPES, EngineConfig, _fail
from conveyor.engine.model.llama import ARCHITECTURES
from conveyor.engine.model.parallel import check_shardable
from conveyor.engine.model.rotary import check_rope

log = logging.getLogger("conveyor")


def sliding_window_of(config: PretrainedConfig) -> int | None:
    """The attention window the config asks for (Mistral sliding_window; Qwen2/3 use_sliding_window with
    layer_types from max_window_layers), or None."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


@dataclass(kw_only=True)
class ResolvedConfig(EngineConfig):
    """Invariant: dtype, device and attention_backend are never "auto" and max_model_len is set; only the engine's
    start changes it afterwards (fit_max_model_len)."""

    hf_config: PretrainedConfig = field(repr=False)
    model_path: str = field(repr=False)  # the checkpoint directory (config.json, weights, tokenizer)
    max_model_len_from_model: bool = False  # max_model_len was unset: the engine may fit it to the KV cache
    draft_hf_config: PretrainedConfig | None = field(default=None, repr=False)  # speculative method "draft"
    draft_model_path: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        unresolved = [n for n in ("dtype", "device", "attention_backend") if getattr(self, n) == "auto"]
        if unresolved or self.max_model_len is None:
            raise ValueError(
                f"ResolvedConfig: {unresolved or ['max_model_len']} left unresolved; build it by resolve()"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def fit_max_model_len(self, num_blocks: int) -> None:
        """A max_model_len taken from the model shrinks to what the KV cache can hold for one sequence."""
        fits = num_blocks * self.block_size
        if self.max_model_len_from_model and fits < self.max_model_len:
            log.info(
                "max_model_len %d (the KV cache's %d blocks of %d tokens), below the model's %d",
                fits,
                num_blocks,
                self.block_size,
                self.max_model_len,
            )
            self.max_model_len = fits


def resolve(config: EngineConfig) -> ResolvedConfig:
    """The model resolved and checked, every "auto" decided; a ValueError names the field the model refuses.
    A ResolvedConfig comes back as it is."""
    if isinstance(config, ResolvedConfig):
        return config
    path = resolve_model(config.model, config.revision)
    hf = AutoConfig.from_pretrained(path)
    arch = (getattr(hf, "architectures", None) or ["?"])[0]
    if arch not in ARCHITECTURES:
        _fail("model", f"architecture {arch} is not supported (supported: {', '.join(ARCHITECTURES)})")
    try:
        check_shardable(hf, config.tensor_parallel_size)
    except ValueError as e:
        _fail("tensor_parallel_size", f"cannot shard {config.model}: {e}")
    try:
        check_rope(hf)
    except ValueError as e:
        _fail("model", f"{config.model}: {e}")
    dtype = config.dtype if config.dtype != "auto" else model_dtype(hf)
    device = config.device if config.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    backend = config.attention_backend
    if backend == "auto":
        backend = "triton" if device == "cuda" else cpu_backend(dtype)
    options = {f.name: getattr(config, f.name) for f in fields(EngineConfig)}
    decided = {
        "dtype": dtype,
        "device": device,
        "attention_backend": backend,
        "max_model_len": max_model_len(config, hf),
    }
    draft_path, draft_hf = resolve_draft(config, hf, path, decided["max_model_len"])
    return ResolvedConfig(
        **{**options, **decided},
        max_model_len_from_model=config.max_model_len is None,
        hf_config=hf,
        model_path=path,
        draft_hf_config=draft_hf,
        draft_model_path=draft_path,
    )


def resolve_draft(
    config: EngineConfig, hf: PretrainedConfig, path: str, max_len: int
) -> tuple[str | None, PretrainedConfig | None]:
    """The draft checkpoint of speculative method "draft", checked against the target: a supported architecture
    and the same vocabulary (the draft's token ids are the target's)."""
    spec = config.speculative
    if spec is None or spec.method != "draft":
        return None, None
    draft_path = path if spec.model == config.model else resolve_model(spec.model)
    draft = AutoConfig.from_pretrained(draft_path)
    arch = (getattr(draft, "architectures", None) or ["?"])[0]
    if arch not in ARCHITECTURES:
        _fail("speculative.model", f"architecture {arch} is not supported (supported: {', '.join(ARCHITECTURES)})")
    if draft.vocab_size != hf.vocab_size:
        _fail(
            "speculative.model",
            f"{spec.model} has vocab_size {draft.vocab_size}, the target {config.model} {hf.vocab_size}: "
            "a draft model needs the target's vocabulary",
        )
    try:
        check_rope(draft)
    except ValueError as e:
        _fail("speculative.model", f"{spec.model}: {e}")
    if max_len > draft.max_position_embeddings:
        _fail(
            "speculative.model",
            f"{spec.model} has max_position_embeddings {draft.max_position_embeddings}, below the target's "
            f"max_model_len {max_len}; set max_model_len",
        )
    return draft_path, draft


def model_dtype(hf: PretrainedConfig) -> str:
    """The checkpoint's dtype where it names one the engine runs, else float32."""
    name = str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32").removeprefix("torch.")
    return name if name in DTYPES else "float32"


def cpu_backend(dtype: str) -> str:
    """The C++ kernels for float32 and bfloat16 where they build here, else the torch reference."""
    from conveyor.kernels import cpu_ops

    return "cpu" if dtype in ("float32", "bfloat16") and cpu_ops.load() is not None else "torch"


def max_model_len(config: EngineConfig, hf: PretrainedConfig) -> int:
    """The asked max_model_len checked against the model's limits, or the model's own limit where none is asked."""
    limit, window = hf.max_position_embeddings, sliding_window_of(hf)
    if config.max_model_len is None:
        if window is not None and window < limit:
            log.info(
                "max_model_len %d: the model's sliding_window (sliding-window attention is not "
                "implemented; within one window attention is exact)",
                window,
            )
            return window
        return limit
    if config.max_model_len > limit:
        _fail("max_model_len", f"({config.max_model_len}) exceeds the model's max_position_embeddings ({limit})")
    if window is not None and config.max_model_len > window:
        _fail(
            "max_model_len",
            f"({config.max_model_len}) exceeds the model's sliding_window ({window}): "
            f"sliding-window attention is not implemented, so only sequences within one "
            f"window are served exactly; set max_model_len <= {window}",
        )
    return config.max_model_len

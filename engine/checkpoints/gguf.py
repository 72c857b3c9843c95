"""A GGUF file as a model: checked, then dequantised once by transformers into a safetensors checkpoint."""

import hashlib
import json
import logging
import os
from pathlib import Path

from conveyor.engine.checkpoints.model_cache import build_once, models_dir

log = logging.getLogger("conveyor")

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
GGUF_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)


def find_gguf(path: str | os.PathLike) -> Path:
    """`path` is a .gguf file or a directory holding exactly one."""
    p = Path(path)
    if p.is_file():
        return p
    found = sorted(p.glob("*.gguf"))
    if len(found) != 1:
        raise ValueError(
            f"model: {p} holds {len(found)} .gguf files; name the one to load: {', '.join(f.name for f in found)}"
        )
    return found[0]


def check_gguf(path: Path) -> str:
    """The GGUF architecture, after refusing what the engine cannot run; reads metadata only."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"model: {path} is not a readable GGUF file: {e}") from None
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else "?"
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"model: GGUF architecture {arch!r} of {path.name} is not supported "
            f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(GGUF_TENSOR_TYPES))
    if bad:
        raise ValueError(
            f"model: GGUF quantisation type {', '.join(bad)} in {path.name} is not supported "
            f"(supported: {', '.join(GGUF_TENSOR_TYPES)})"
        )
    return arch


def convert_gguf(path: Path, out: Path) -> Path:
    """Dequantise to a float32 checkpoint with tokenizer, chat template and generation config."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    check_gguf(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    config, arch = model.config, type(model).__name__
    if arch not in GGUF_ARCHITECTURES.values():
        raise ValueError(f"model: {path.name} loads as {arch}, which is not supported")
    config.architectures = [arch]
    out.mkdir(parents=True, exist_ok=True)
    tied = config.tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)
    config_dict = config.to_diff_dict()
    for key in ("quantization_config", "transformers_version", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config_dict["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n", "utf-8")
    tokenizer.save_pretrained(out)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)
    return out


def gguf_checkpoint(path: str | os.PathLike) -> str:
    """The cached safetensors checkpoint of a GGUF file (keyed by its path, size and mtime)."""
    gguf = find_gguf(path).resolve()
    check_gguf(gguf)
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    final = models_dir() / "gguf" / f"{gguf.stem}-{key}"
    if not (final / "config.json").is_file():
        log.info("dequantising %s into %s (once)", gguf, final)
    return str(build_once(final, lambda tmp: convert_gguf(gguf, tmp)))

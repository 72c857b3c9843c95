"""PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors): found, validated against the base model,
read; and random ones written for the test models."""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import PretrainedConfig

from conveyor.engine.checkpoints.hub import hub_checkpoint, is_hub_id

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class Adapter:
    """An adapter's weights per (layer, module): A [r, in], B [out, r]; scale multiplies B @ A."""

    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def adapter_dir(path: str) -> Path:
    """A local directory holding the adapter's two files, for a local path or a Hub id."""
    local = Path(path).expanduser()
    if not local.exists() and is_hub_id(path):
        local = Path(hub_checkpoint(path))
    if not (local / CONFIG_FILE).is_file() or not (local / WEIGHTS_FILE).is_file():
        raise ValueError(f"lora path {path!r}: not a PEFT adapter directory ({CONFIG_FILE} and {WEIGHTS_FILE})")
    return local


def _fail(path: Path, field: str, message: str) -> None:
    raise ValueError(f"lora adapter {path}: {field} {message}")


def _dims(hf: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target module of the base model."""
    hidden, inter = hf.hidden_size, hf.intermediate_size
    head_dim = getattr(hf, "head_dim", None) or hidden // hf.num_attention_heads
    q, kv = hf.num_attention_heads * head_dim, hf.num_key_value_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def read_adapter(path: str, hf: PretrainedConfig, max_lora_rank: int) -> Adapter:
    """The adapter at `path`, checked against the base model `hf`; a ValueError names the field it refuses."""
    where = adapter_dir(path)
    cfg = json.loads((where / CONFIG_FILE).read_text())
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1:
        _fail(where, "r", f"must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        _fail(where, "r", f"({rank}) exceeds max_lora_rank ({max_lora_rank})")
    if cfg.get("bias", "none") != "none":
        _fail(where, "bias", f"must be 'none', got {cfg.get('bias')!r}")
    for field in ("modules_to_save", "rank_pattern", "alpha_pattern"):
        if cfg.get(field):
            _fail(where, field, "is not supported")
    for field in ("use_dora", "fan_in_fan_out"):
        if cfg.get(field):
            _fail(where, field, "must be false")
    targets = cfg.get("target_modules")
    if isinstance(targets, list) and (unknown := sorted(set(targets) - set(TARGETS))):
        _fail(where, "target_modules", f"{unknown} not supported (supported: {', '.join(TARGETS)})")
    scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    dims, parts = _dims(hf), {}
    with safe_open(str(where / WEIGHTS_FILE), framework="pt", device="cpu") as f:
        for key in f.keys():
            m = _KEY.match(key)
            if m is None or m.group(2) not in TARGETS or int(m.group(1)) >= hf.num_hidden_layers:
                _fail(where, "weights", f"has {key!r}, not a LoRA A/B of {', '.join(TARGETS)} in this model")
            parts[(int(m.group(1)), m.group(2), m.group(3))] = f.get_tensor(key)
    weights = {}
    for layer, module, ab in sorted(parts):
        if ab == "B":
            continue
        a, b = parts[(layer, module, "A")], parts.get((layer, module, "B"))
        n_in, n_out = dims[module]
        if b is None or tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
            shapes = (tuple(a.shape), None if b is None else tuple(b.shape))
            _fail(
                where,
                "weights",
                f"layer {layer} {module}: A/B shapes {shapes}, expected {(rank, n_in)}, {(n_out, rank)}",
            )
        weights[(layer, module)] = (a, b)
    if not weights or len(weights) * 2 != len(parts):
        _fail(where, "weights", "hold no complete LoRA A/B pair per module")
    return Adapter(rank, float(scale), weights)


def write_random_adapter(
    out_dir: str | Path,
    hf: PretrainedConfig,
    base_model: str,
    rank: int,
    seed: int,
    targets: tuple[str, ...] = TARGETS,
    alpha: int | None = None,
    std: float = 0.05,
) -> Path:
    """A PEFT adapter with random A and B (PEFT itself starts B at zero, which changes nothing) for tests."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    g, dims, tensors = torch.Generator().manual_seed(seed), _dims(hf), {}
    for layer in range(hf.num_hidden_layers):
        for module in targets:
            n_in, n_out = dims[module]
            part = "self_attn" if module in TARGETS[:4] else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, n_in, generator=g) * std
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(n_out, rank, generator=g) * std
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha or 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return out

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
REFUSED = {
    "dynamic": "dynamic NTK: transformers recomputes its frequencies from each forward's sequence length, "
    "so cached keys depend on call history, which a paged KV cache cannot reproduce",
    "longrope": "longrope switches frequency sets on the sequence length of each forward",
}


def rope_parameters(config: PretrainedConfig) -> dict:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def check_rope(config: PretrainedConfig) -> None:
    kind = rope_parameters(config)["rope_type"]
    if kind not in ROPE_TYPES:
        why = REFUSED.get(kind, "unknown to this engine")
        raise ValueError(
            f"rope_scaling.rope_type {kind!r} is not supported ({why}); supported: {', '.join(ROPE_TYPES)}"
        )


def inverse_frequencies(config: PretrainedConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """transformers' inv_freq and attention scaling, computed in float32 on CPU whatever the default dtype."""
    params, default = rope_parameters(config), torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        if params["rope_type"] == "default":
            return 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
        return inv_freq.float(), float(scaling)
    finally:
        torch.set_default_dtype(default)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE: one cos/sin table per model, sized to the engine's max_model_len (not the
    checkpoint's max_position_embeddings), with transformers' own frequencies and attention scaling per rope type."""

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        check_rope(config)
        positions = torch.arange(max_positions, dtype=torch.float)
        inv_freq, scaling = inverse_frequencies(config, head_dim)
        freqs = positions[:, None] * inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions`: [T, 1, head_dim], computed once per step and shared by every layer."""
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, d], k: [T, kv_heads, d]."""

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)

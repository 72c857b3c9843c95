"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a flat packed batch of tokens."""

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from conveyor.engine.model.attention import Attention, AttentionMetadata
from conveyor.engine.model.embedding import ParallelLMHead, VocabParallelEmbedding
from conveyor.engine.model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from conveyor.engine.model.norm import RMSNorm
from conveyor.engine.model.rotary import RotaryEmbedding, apply_rotary
from conveyor.kernels import AttentionOps

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def head_dim_of(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def fused_rope(ops: AttentionOps, head_dim: int) -> ModuleType | None:
    return ops.fused if head_dim % 32 == 0 else None


class DecoderAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, ops: AttentionOps) -> None:
        super().__init__()
        arch = config.architectures[0]
        self.head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False) or arch == "Qwen2ForCausalLM"
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, config.num_attention_heads, config.num_key_value_heads, bias=bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=getattr(config, "attention_bias", False),
        )
        self.qk_norm = arch == "Qwen3ForCausalLM"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5, ops)
        self.fused_rope = fused_rope(ops, self.head_dim)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rope: this step's (cos, sin), or with the fused kernel (positions, the model's RotaryEmbedding).
        keep: K/V are stored for every token, the output computed only for the tokens at these indices."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_rope is not None:
            positions, table = rope
            self.fused_rope.rotary_embedding_(positions, q, k, table.cos, table.sin)  # in place on this step's q, k
        else:
            q, k = apply_rotary(q, k, *rope)
        if keep is not None:
            q, meta = q[keep], meta.sampled
        o = self.attn(q, k, v, meta)
        return self.o_proj(o.reshape(-1, q_size))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.fused = ops.fused
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [config.intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and gate_up.shape[-1] % 32 == 0:
            return self.down_proj(self.fused.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, ops: AttentionOps) -> None:
        super().__init__()
        self.self_attn = DecoderAttention(config, ops)
        self.mlp = MLP(config, ops)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops.fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops.fused)

    def forward(
        self,
        rope: tuple[torch.Tensor, torch.Tensor],
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta, keep)
        if keep is not None:
            residual = residual[keep]
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: PretrainedConfig, ops: AttentionOps, max_positions: int) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config, head_dim_of(config), max_positions)
        self.layers = nn.ModuleList(DecoderLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops.fused)
        self.fused_rope = fused_rope(ops, head_dim_of(config))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states of every token, or with keep (and meta.sampled) of the tokens at those indices
        only: past the last layer's K/V nothing else is read, so the rest of it (attention, o_proj, MLP)
        and the final norm run on the sampled tokens alone."""
        x, residual = self.embed_tokens(input_ids), None
        rope = (positions, self.rotary_emb) if self.fused_rope else self.rotary_emb(positions, x.dtype)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x, residual = layer(rope, x, residual, meta, keep if i == last else None)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

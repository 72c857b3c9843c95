"""Deterministic random-weight demo checkpoints in Hugging Face format (`demo:llama-tiny` ...)."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sysconfig
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from conveyor.engine.checkpoints.model_cache import build_once, cache_dir, models_dir

if TYPE_CHECKING:  # torch loads only to write weights: the HTTP router resolves demo names without it
    import torch

VOCAB_SIZE = 8192
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
INIT_STD = 0.2
NORM_STD = 0.1
BIAS_STD = 0.1
TOKENIZER_VERSION = "bpe-v1"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ARCHS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_SUFFIXES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SIZES = {"tiny": Size(256, 4, 4, 2, 768), "small": Size(768, 12, 12, 4, 2048)}


@dataclass(frozen=True)
class DemoSpec:
    arch: str = "llama"
    size: str = "tiny"
    dtype: str = "float32"
    tied: bool = False
    seed: int = 0
    layers: int = 0  # > 0: the model of the other fields cut to its first `layers` layers (a draft model for it)

    def __post_init__(self) -> None:
        for value, valid in ((self.arch, ARCHS), (self.size, SIZES), (self.dtype, DTYPES)):
            if value not in valid:
                raise ValueError(f"unknown demo option {value!r}; valid: {sorted(valid)}")
        if not 0 <= self.layers < SIZES[self.size].layers:
            raise ValueError(f"demo layers must be 0 (all) or in [1, {SIZES[self.size].layers}), got {self.layers}")

    @property
    def num_layers(self) -> int:
        return self.layers or SIZES[self.size].layers

    @property
    def name(self) -> str:
        suffix = {v: k for k, v in DTYPE_SUFFIXES.items()}[self.dtype]
        return (
            f"{self.arch}-{self.size}"
            + ("-tied" if self.tied else "")
            + ("" if suffix == "fp32" else f"-{suffix}")
            + (f"-l{self.layers}" if self.layers else "")
        )


def valid_demo_names() -> str:
    return (
        "demo:tiny, demo:small, demo:{"
        + ",".join(ARCHS)
        + "}-{"
        + ",".join(SIZES)
        + "}[-tied][-"
        + "|-".join(DTYPE_SUFFIXES)
        + "][-l<N>: the first N layers, a draft model]"
    )


def parse_demo_name(name: str) -> DemoSpec:
    parts = name.removeprefix("demo:").split("-")
    arch = "llama" if parts[0] in SIZES else parts.pop(0)
    size = parts.pop(0) if parts else ""
    tied = "tied" in parts
    dtypes = [DTYPE_SUFFIXES[p] for p in parts if p in DTYPE_SUFFIXES]
    layers = [int(p[1:]) for p in parts if p[:1] == "l" and p[1:].isdigit()]
    rest = [p for p in parts if p != "tied" and p not in DTYPE_SUFFIXES and not (p[:1] == "l" and p[1:].isdigit())]
    if (
        not name.startswith("demo:")
        or arch not in ARCHS
        or size not in SIZES
        or rest
        or len(dtypes) > 1
        or len(layers) > 1
        or parts.count("tied") > 1
        or (layers and not 0 < layers[0] < SIZES[size].layers)
    ):
        raise ValueError(f"unknown demo model {name!r}; valid: {valid_demo_names()}")
    return DemoSpec(arch, size, dtypes[0] if dtypes else "float32", tied, layers=layers[0] if layers else 0)


def corpus_files() -> list[Path]:
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"), key=lambda p: p.name)


def train_tokenizer() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((p.read_text("utf-8", errors="replace") for p in corpus_files()), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    assert tok.get_vocab_size() == VOCAB_SIZE and [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    return tok.to_str(pretty=True) + "\n"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def tokenizer_json() -> str:
    return _cached_tokenizer(str(cache_dir()))


@lru_cache(maxsize=None)
def _cached_tokenizer(cache_root: str) -> str:
    key = hashlib.sha256(TOKENIZER_VERSION.encode())
    for p in corpus_files():
        key.update(f"{p.name}:{p.stat().st_size}\n".encode())
    path = Path(cache_root) / "tokenizer" / f"{key.hexdigest()[:16]}.json"
    if path.is_file():
        return path.read_text("utf-8")
    _atomic_write(path, (text := train_tokenizer()).encode())
    return text


def tokenizer_files() -> dict[str, str]:
    specials = dict(zip(["unk_token", "bos_token", "eos_token", "pad_token"], SPECIAL_TOKENS))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": 2048,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    return {
        "tokenizer.json": tokenizer_json(),
        "tokenizer_config.json": _json(config),
        "special_tokens_map.json": _json(specials),
    }


def _json(obj: dict) -> str:
    return json.dumps(obj, indent=2, sort_keys=True) + "\n"


def model_config(spec: DemoSpec) -> dict:
    from transformers import AutoConfig

    s = SIZES[spec.size]
    qwen = {"use_sliding_window": False, "sliding_window": None, "max_window_layers": spec.num_layers}
    extra = {"mistral": {"sliding_window": None}, "qwen2": qwen, "qwen3": qwen}.get(spec.arch, {})
    cfg = AutoConfig.for_model(
        spec.arch,
        architectures=[ARCHS[spec.arch]],
        vocab_size=VOCAB_SIZE,
        hidden_size=s.hidden,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        intermediate_size=s.intermediate,
        hidden_act="silu",
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=spec.tied,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        dtype=spec.dtype,
        **extra,
    )
    d = json.loads(cfg.to_json_string(use_diff=True))
    d.pop("transformers_version", None)
    return {**d, "rope_theta": 10000.0, "torch_dtype": spec.dtype, "tie_word_embeddings": spec.tied}


def weight_shapes(spec: DemoSpec) -> list[tuple[str, tuple[int, ...]]]:
    s, hd = SIZES[spec.size], SIZES[spec.size].head_dim
    q, kv = s.heads * hd, s.kv_heads * hd
    shapes = [("model.embed_tokens.weight", (VOCAB_SIZE, s.hidden))]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (s.hidden,)),
            (p + "self_attn.q_proj.weight", (q, s.hidden)),
            (p + "self_attn.k_proj.weight", (kv, s.hidden)),
            (p + "self_attn.v_proj.weight", (kv, s.hidden)),
        ]
        if spec.arch == "qwen2":
            shapes += [
                (p + "self_attn.q_proj.bias", (q,)),
                (p + "self_attn.k_proj.bias", (kv,)),
                (p + "self_attn.v_proj.bias", (kv,)),
            ]
        if spec.arch == "qwen3":
            shapes += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        shapes += [
            (p + "self_attn.o_proj.weight", (s.hidden, q)),
            (p + "post_attention_layernorm.weight", (s.hidden,)),
            (p + "mlp.gate_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.up_proj.weight", (s.intermediate, s.hidden)),
            (p + "mlp.down_proj.weight", (s.hidden, s.intermediate)),
        ]
    shapes.append(("model.norm.weight", (s.hidden,)))
    return shapes if spec.tied else shapes + [("lm_head.weight", (VOCAB_SIZE, s.hidden))]


def init_std(name: str, shape: tuple[int, ...]) -> float:
    if name.endswith("bias"):
        return BIAS_STD
    if "embed_tokens" in name:
        return INIT_STD
    return INIT_STD * math.sqrt(256 / shape[1])


def make_weights(spec: DemoSpec) -> dict[str, torch.Tensor]:
    import torch

    seed = (
        int.from_bytes(
            hashlib.sha256(f"{spec.seed}/{spec.arch}/{spec.size}/{spec.tied}".encode()).digest()[:8], "little"
        )
        >> 1
    )
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in weight_shapes(spec):  # every layer drawn, so a cut model keeps the full one's weights
        w = torch.randn(shape, generator=g, dtype=torch.float32)
        w = 1 + NORM_STD * w if len(shape) == 1 and not name.endswith("bias") else w * init_std(name, shape)
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < spec.num_layers:
            out[name] = w.to(getattr(torch, spec.dtype)).contiguous()
    return out


def make_model(
    out_dir: str | os.PathLike,
    arch: str = "llama",
    size: str = "tiny",
    dtype: str = "float32",
    tied: bool = False,
    seed: int = 0,
    config: dict | None = None,
    generation_config: dict | None = None,
    layers: int = 0,
) -> Path:
    """`config` / `generation_config` entries override the generated ones (rope_scaling, sliding_window, ...)."""
    spec = DemoSpec(arch, size, dtype, tied, seed, layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gen = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, **(generation_config or {})}
    files = {
        **tokenizer_files(),
        "config.json": _json({**model_config(spec), **(config or {})}),
        "generation_config.json": _json(gen),
    }
    for fname, text in files.items():
        (out / fname).write_text(text, "utf-8")
    from safetensors.torch import save_file

    save_file(make_weights(spec), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def demo_checkpoint(name: str) -> str:
    """The demo checkpoint `name` (demo:...), generated once into the model cache."""
    spec = parse_demo_name(name)
    build = lambda tmp: make_model(  # noqa: E731
        tmp, spec.arch, spec.size, spec.dtype, spec.tied, spec.seed, layers=spec.layers
    )
    return str(build_once(models_dir() / spec.name, build))


def add_make_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)


def run_make_model(args: argparse.Namespace) -> int:
    print(make_model(args.out, args.arch, args.size, args.dtype, args.tied, args.seed))
    return 0

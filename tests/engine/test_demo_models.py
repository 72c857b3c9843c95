import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from conveyor.engine.checkpoints import demo
from conveyor.engine.checkpoints.demo import make_model
from conveyor.engine.checkpoints.model_source import resolve_model

ROOT = Path(__file__).resolve().parents[2]
FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}
TEXT = (
    "import os\nimport sys\n\ndef main(argv: list[str]) -> int:\n    parser = argparse.ArgumentParser()\n"
    "    for name in sorted(os.listdir('.')):\n        print(name, len(name))\n    return 0\n"
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("conveyor_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CONVEYOR_CACHE", str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield root


@pytest.fixture(scope="module")
def models(cache: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, bool], Path]:
    out = tmp_path_factory.mktemp("demo_models")
    return {(a, t): make_model(out / f"{a}-{t}", arch=a, tied=t) for a in demo.ARCHS for t in (False, True)}


def read_all(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def load(path: Path, **kw) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kw).eval()


def test_tokenizer_training_deterministic(cache: Path) -> None:
    first = demo.train_tokenizer()
    assert demo.train_tokenizer() == first == demo.tokenizer_json()
    tok = Tokenizer.from_str(first)
    assert tok.get_vocab_size() == 8192
    assert [tok.id_to_token(i) for i in range(4)] == ["<unk>", "<s>", "</s>", "<pad>"]
    assert tok.encode("def f(x):").ids[0] == 1
    assert list((cache / "tokenizer").glob("*.json"))


@pytest.mark.parametrize(
    "kw",
    [dict(arch="llama"), dict(arch="qwen2", tied=True, dtype="float16"), dict(arch="qwen3", dtype="bfloat16", seed=3)],
)
def test_rerun_byte_identical(cache: Path, tmp_path: Path, kw: dict) -> None:
    a, b = read_all(make_model(tmp_path / "a", **kw)), read_all(make_model(tmp_path / "b", **kw))
    assert set(a) == FILES and a == b
    other = read_all(make_model(tmp_path / "c", **{**kw, "seed": kw.get("seed", 0) + 1}))
    assert other["model.safetensors"] != a["model.safetensors"] and other["tokenizer.json"] == a["tokenizer.json"]


def test_fresh_process_byte_identical(cache: Path, tmp_path: Path) -> None:
    env = {**os.environ, "CONVEYOR_CACHE": str(tmp_path / "fresh_cache"), "RAYON_NUM_THREADS": "1"}
    code = f"from conveyor.engine.checkpoints.demo import make_model; make_model({str(tmp_path / 'sub')!r}, arch='qwen3', tied=True)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True, timeout=120)
    assert list((tmp_path / "fresh_cache" / "tokenizer").glob("*.json"))
    here = read_all(make_model(tmp_path / "here", arch="qwen3", tied=True))
    assert read_all(tmp_path / "sub") == here


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("arch", list(demo.ARCHS))
def test_transformers_loads(models: dict, arch: str, tied: bool) -> None:
    path = models[(arch, tied)]
    model, info = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, output_loading_info=True)
    assert not any(info.values()), info
    assert type(model).__name__ == demo.ARCHS[arch] and model.config.vocab_size == 8192
    assert model.config.tie_word_embeddings is tied
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) is tied
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) is not tied
    assert ("model.layers.0.self_attn.q_proj.bias" in keys) is (arch == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in keys) is (arch == "qwen3")
    assert set(model.state_dict()) - {"lm_head.weight"} == keys - {"lm_head.weight"}
    assert not torch.allclose(model.model.norm.weight, torch.ones(256))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 2048 and cfg["rope_theta"] == 10000.0 and cfg["rms_norm_eps"] == 1e-6
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["head_dim"],
    ) == (256, 4, 4, 2, 768, 64)
    if arch != "llama":
        assert cfg["sliding_window"] is None and cfg.get("use_sliding_window", False) is False
    with torch.no_grad():
        logits = model.eval()(torch.tensor([[1, 50, 600, 7000, 4]])).logits
    assert logits.shape == (1, 5, 8192) and logits.isfinite().all()


def test_transformers_tokenizer(models: dict) -> None:
    tok = AutoTokenizer.from_pretrained(models[("llama", False)], local_files_only=True)
    assert len(tok) == 8192 and tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<pad>"]
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    ids = tok(TEXT).input_ids
    assert ids[0] == 1 and 1 not in ids[1:] and tok.decode(ids, skip_special_tokens=True) == TEXT
    assert len(ids) < len(TEXT) / 2.5
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi there</s>\n<|assistant|>\n"
    assert not tok.apply_chat_template(msgs, tokenize=False).endswith("<|assistant|>\n")
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == 1 and ids.count(1) == 1 and ids.count(2) == 2


def greedy(model: AutoModelForCausalLM, ids: torch.Tensor, n: int = 10) -> list[list[int]]:
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=3
    )
    return out[:, ids.shape[1] :].tolist()


def changed_early(model: AutoModelForCausalLM, ids: torch.Tensor, n: int = 10) -> tuple[list[list[int]], int]:
    alt = ids.clone()
    alt[:, 1] = (alt[:, 1] + 1000) % 8188 + 4
    out = greedy(model, torch.cat([ids, alt]), n)
    base = out[: len(ids)]
    return base, sum(a != b for a, b in zip(base, out[len(ids) :]))


@pytest.mark.parametrize("arch,tied", [("llama", False), ("mistral", True), ("qwen2", False), ("qwen3", True)])
def test_greedy_depends_on_context(models: dict, arch: str, tied: bool) -> None:
    tok = AutoTokenizer.from_pretrained(models[(arch, tied)], local_files_only=True)
    text = tok(demo.corpus_files()[0].read_text(), add_special_tokens=False).input_ids
    ids = torch.tensor([[1] + text[k : k + 19] for k in range(100, 600, 100)])
    outs, changed = changed_early(load(models[(arch, tied)]), ids)
    assert changed >= 4 and len({tuple(o) for o in outs}) == len(outs)
    assert all(len(set(o)) >= 3 for o in outs)


def test_small(cache: Path, tmp_path: Path) -> None:
    path = make_model(tmp_path / "small", size="small", dtype="bfloat16")
    cfg = json.loads((path / "config.json").read_text())
    assert (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
    ) == (768, 12, 12, 4, 2048)
    assert cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    model = load(path)
    assert model.dtype == torch.bfloat16
    ids = torch.randint(4, 8192, (4, 20), generator=torch.Generator().manual_seed(0))
    alt = ids.clone()
    alt[:, 1] += 1
    with torch.no_grad():
        logits = model(torch.cat([ids, alt])).logits
    assert logits.isfinite().all()
    nxt = logits.argmax(-1)
    assert sum(a != b for a, b in zip(nxt[:4, -1].tolist(), nxt[4:, -1].tolist())) >= 3
    assert all(len(set(row.tolist())) >= 15 for row in nxt)


def test_resolve_model(cache: Path, tmp_path: Path) -> None:
    path = resolve_model("demo:tiny")
    assert path == str(cache / "models" / "llama-tiny") and resolve_model("demo:llama-tiny") == path
    mtime = (Path(path) / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("demo:tiny") == path and (Path(path) / "model.safetensors").stat().st_mtime_ns == mtime
    assert resolve_model(path) == path
    q = Path(resolve_model("demo:qwen2-tiny-tied-bf16"))
    cfg = json.loads((q / "config.json").read_text())
    assert q.name == "qwen2-tiny-tied-bf16" and cfg["tie_word_embeddings"] and cfg["dtype"] == "bfloat16"
    assert demo.parse_demo_name("demo:small") == demo.DemoSpec("llama", "small")
    assert demo.parse_demo_name("demo:qwen3-small-fp16").name == "qwen3-small-fp16"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="nowhere"):
        resolve_model(str(tmp_path / "nowhere"))
    for bad in [
        "demo:gpt2-tiny",
        "demo:llama-huge",
        "demo:",
        "demo:tiny-tied-tied",
        "demo:tiny-bf16-fp16",
        "demo:llama-tiny-x",
        "demo:qwen3",
    ]:
        with pytest.raises(ValueError, match="demo:tiny, demo:small"):
            resolve_model(bad)


def test_resolve_concurrent(cache: Path) -> None:
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(resolve_model, ["demo:mistral-tiny-fp16"] * 4))
    assert len(set(paths)) == 1 and set(os.listdir(paths[0])) == FILES
    assert not [p for p in os.listdir(cache / "models") if p.startswith(".")]
    assert load(Path(paths[0])).dtype == torch.float16


def test_cli(cache: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    demo.add_make_model_args(parser)
    args = parser.parse_args(["--arch", "qwen3", "--size", "tiny", "--tied", "--out", str(tmp_path / "cli")])
    assert demo.run_make_model(args) == 0
    assert read_all(tmp_path / "cli") == read_all(make_model(tmp_path / "api", arch="qwen3", tied=True))


def test_a_cut_demo_model_is_the_full_ones_first_layers() -> None:
    """demo:<size>-l<N> (a draft model for demo:<size>): the same weights, layers N and above left out."""
    spec = demo.parse_demo_name("demo:tiny-l1")
    assert spec == demo.DemoSpec("llama", "tiny", layers=1) and spec.name == "llama-tiny-l1"
    full, cut = demo.make_weights(demo.DemoSpec()), demo.make_weights(spec)
    assert set(cut) == {n for n in full if not n.startswith("model.layers.") or n.startswith("model.layers.0.")}
    assert all(torch.equal(cut[n], full[n]) for n in cut)
    assert demo.model_config(spec)["num_hidden_layers"] == 1
    for bad in ("demo:tiny-l4", "demo:tiny-l0", "demo:tiny-l1-l2"):
        with pytest.raises(ValueError, match="unknown demo model"):
            demo.parse_demo_name(bad)

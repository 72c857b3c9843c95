import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.model_source import resolve_model

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_sharded_checkpoint_loads_like_single_file(tmp_path: Path) -> None:
    src = Path(resolve_model("demo:qwen2-tiny"))
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, tmp_path / f.name)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, tmp_path / file)
        weight_map.update({n: file for n in part})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single = LLM(str(src)).generate("import os", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    sharded = LLM(str(tmp_path)).generate("import os", PARAMS, use_tqdm=False)[0].outputs[0].token_ids
    assert sharded == single


def test_missing_weight_is_a_clear_error(tmp_path: Path) -> None:
    src = Path(resolve_model("demo:llama-tiny"))
    for f in src.iterdir():
        shutil.copy(f, tmp_path / f.name)
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.mlp.down_proj.weight"):
        LLM(str(tmp_path))

"""Config objects do no I/O: building an EngineConfig or validating AppArgs neither fetches nor generates the model
nor builds or imports the C++ kernels, and still refuses bad fields naming them. The engine resolves the config where
it is built (engine/resolved_config.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

CODE = """
import json, os, sys
from pathlib import Path
from conveyor.deployments.app import AppArgs
from conveyor.engine import EngineConfig

def listing():
    return sorted(str(p) for root in (os.environ["CONVEYOR_CACHE"], os.environ["TORCH_EXTENSIONS_DIR"])
                  for p in Path(root).rglob("*"))

EngineConfig(model="demo:small", max_model_len=4096, tensor_parallel_size=1)
AppArgs(model="demo:small", engine={"max_num_seqs": 8, "attention_backend": "auto"})
AppArgs.model_validate({"model": "demo:small", "disaggregation": {"decode_engine": {"max_num_seqs": 4}}})
refused = []
for make in (
    lambda: EngineConfig(model="demo:small", block_size=12),
    lambda: EngineConfig(model="demo:huge"),
    lambda: AppArgs(model="demo:small", engine={"max_num_seqs": 0}),
    lambda: AppArgs(model="demo:small", engine={"no_such_option": 1}),
):
    try:
        make()
        refused.append(None)
    except ValueError as e:
        refused.append(str(e))
kernels = sorted(m for m in sys.modules if "cpu_ops" in m)
before = listing()
from conveyor.engine.checkpoints.model_source import resolve_model
resolve_model("demo:tiny")  # the control: what the listing sees when a model is generated
print("RESULT " + json.dumps({"before": before, "after": listing(), "kernels": kernels, "refused": refused}))
"""


def test_configs_touch_no_model_and_no_kernel(tmp_path: Path) -> None:
    env = {**os.environ, "CONVEYOR_CACHE": str(tmp_path / "cache"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    (tmp_path / "cache").mkdir()
    (tmp_path / "ext").mkdir()
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    assert result["before"] == [], "building the configs wrote to the model cache or built the kernels"
    assert any(p.endswith("llama-tiny/config.json") for p in result["after"]), "the listing sees a generated model"
    assert result["kernels"] == [], "building the configs imported the C++ kernels"
    block_size, model, max_num_seqs, unknown = result["refused"]
    assert block_size.startswith("EngineConfig.block_size must be a power of two")
    assert model.startswith("EngineConfig.model unknown demo model 'demo:huge'")
    assert "engine.max_num_seqs: must be a positive integer" in max_num_seqs
    assert "engine.no_such_option: unknown engine option" in unknown

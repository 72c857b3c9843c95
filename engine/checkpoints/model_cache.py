"""The local model cache: checkpoints built once (downloaded, converted) and renamed into place."""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """Conveyor's cache: $CONVEYOR_CACHE, else ~/.cache/conveyor."""
    return Path(os.environ.get("CONVEYOR_CACHE") or Path.home() / ".cache" / "conveyor")


def models_dir() -> Path:
    return cache_dir() / "models"


def build_once(final: Path, build: Callable[[Path], object], done: str = "config.json") -> Path:
    """Run `build` into a private temp dir, then rename it to `final`; a file lock keeps one builder per
    checkpoint across processes, and a finished one (holding `done`) is never rebuilt."""
    from filelock import FileLock

    if (final / done).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final) + ".lock"):
        if (final / done).is_file():
            return final
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}."))
        tmp.chmod(0o755)
        try:
            build(tmp)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final

"""The local model cache: checkpoints built once (downloaded, converted) and renamed into place."""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from conveyor.engine.checkpoints.demo import cache_dir


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

"""Conveyor: LLM serving on Ray Serve. Packages: conveyor.engine (offline `LLM`, the continuous-batching
engine), conveyor.kernels (attention and fused CPU kernels), conveyor.cluster (admission, routing, autoscaling
policies), conveyor.deployments (the Ray Serve application); `conveyor` on the command line is conveyor.cli.

In a source checkout (an editable install) the package folders sit at the repository's top level, under names
other distributions also use (`kernels`: Hugging Face's, which transformers imports). A process started in the
checkout (`python -m ...`, Ray workers, whose working directory is the driver's) has the checkout first on
sys.path, where those folders would shadow the installed distributions: importing conveyor moves it last.
"""

import sys
from pathlib import Path

__version__ = "0.2.0"


def _checkout_last() -> None:
    root = Path(__file__).resolve().parents[1]
    if not (root / "pyproject.toml").is_file() or not (root / "kernels" / "cpu_ops.py").is_file():
        return  # an installed wheel: nothing of ours sits at the top level
    others = [p for p in sys.path if Path(p or ".").resolve() != root]
    if len(others) < len(sys.path):
        sys.path[:] = others + [str(root)]


_checkout_last()

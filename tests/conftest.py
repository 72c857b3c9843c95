import os
import sys
from typing import Any, Iterator

import pytest
import torch

# conveyor first, before any test imports transformers: the checkout's root goes behind site-packages, so
# transformers finds Hugging Face's `kernels` distribution, not the checkout's kernels/ folder
import conveyor  # noqa: F401

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault(
    "CONVEYOR_CHECK_INVARIANTS", "1"
)  # engine/core/invariants.py after every step, Ray replicas included
# behind HAProxy, a stopping router replica stays open this long for a load balancer in front (an ALB) to
# deregister it: Serve's default 30 s outlasts serve.shutdown's own 30 s wait, and the tests have none in front
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "2")
SHARED = "conveyor_app"


@pytest.fixture
def conveyor_app() -> Any:
    """The Serve app the HTTP reliability modules share (tests/serve_app.py); started once for all of them."""
    from tests.serve_app import shared_app

    return shared_app()


@pytest.fixture
def pool_whole(request: pytest.FixtureRequest) -> Iterator[None]:
    """Ends an end-to-end test with the pool-whole assertion on its app: `conveyor_app`, or a module's own
    `server` / `app` (a tests.serve_app.App)."""
    from tests.serve_app import assert_pool_whole

    app = request.getfixturevalue(next(f for f in (SHARED, "server", "app") if f in request.fixturenames))
    yield
    assert_pool_whole(app)


def backends_line() -> str:
    from conveyor.kernels import cpu_ops

    isa = cpu_ops.isa() if cpu_ops.load() is not None else None
    cpp = (
        f"cpu (C++ kernels, {isa}; this CPU runs {', '.join(cpu_ops.supported_isas())})"
        if isa
        else "cpu unavailable (the C++ kernels cannot be built here)"
    )
    triton = "triton (CUDA)" if torch.cuda.is_available() else "triton (interpreter)"
    return f"CPU capability {torch.backends.cpu.get_cpu_capability()}; backends: torch (reference), {cpp}, {triton}"


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"conveyor: {backends_line()}"]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Names the ISA and the backends this run exercised, with tests/engine/test_backend_matrix.py's outcomes per
    backend (shown under -q too)."""
    counts: dict[str, dict[str, int]] = {}
    for outcome in ("passed", "failed", "skipped"):
        for report in terminalreporter.stats.get(outcome, []):
            nodeid = getattr(report, "nodeid", "")
            if "test_backend_matrix" not in nodeid or "[" not in nodeid:
                continue
            backend = next(
                (b for b in ("torch", "cpu", "triton") if b in nodeid.split("[")[1].rstrip("]").split("-")), "?"
            )
            counts.setdefault(backend, {}).setdefault(outcome, 0)
            counts[backend][outcome] += 1
    if not counts:
        return
    terminalreporter.write_sep("-", "attention backends")
    terminalreporter.write_line(backends_line())
    for backend, c in sorted(counts.items()):
        terminalreporter.write_line(
            f"backend matrix, {backend}: " + ", ".join(f"{n} {o}" for o, n in sorted(c.items()))
        )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules on the shared app run one after another, so it starts once per session."""
    shared = [i for i in items if SHARED in i.fixturenames]
    if shared:
        first, rest = items.index(shared[0]), [i for i in items if SHARED not in i.fixturenames]
        items[:] = rest[:first] + shared + rest[first:]


def pytest_runtest_setup(item: pytest.Item) -> None:
    module = sys.modules.get("tests.serve_app")
    if module is not None and SHARED not in item.fixturenames:
        module.release_shared_app()


def pytest_sessionfinish(session: pytest.Session) -> None:
    module = sys.modules.get("tests.serve_app")
    if module is not None:
        module.release_shared_app()

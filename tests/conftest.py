import os
import sys
from typing import Any, Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("CONVEYOR_CHECK_INVARIANTS", "1")  # engine/invariants.py after every step, Ray replicas included
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

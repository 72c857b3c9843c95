"""`cluster`: one Ray cluster and one 2-replica app (tests/e2e/faults.py) for a fault module; tests that replace
the app come last in theirs."""

from types import SimpleNamespace
from typing import Iterator

import httpx
import pytest
from ray import serve

from tests.e2e.faults import APP, eventually, fresh_replicas
from tests.paced_runner import RUNNER as PACED
from tests.serve_app import free_port, start_ray, stop_ray


@pytest.fixture(scope="module")
def cluster() -> Iterator[SimpleNamespace]:
    from conveyor.deployments.app import AppArgs, build_app

    address = start_ray()
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        paced = {**APP, "engine": {**APP["engine"], "model_runner_cls": PACED}}  # 700 tokens take >= 14 s
        serve.run(build_app(AppArgs(**paced, num_replicas=2)), name="faults", route_prefix="/faults")
        url = f"http://127.0.0.1:{port}"
        http = httpx.Client(base_url=f"{url}/faults", timeout=60)
        eventually(lambda: fresh_replicas(http) == 2, 60, "both replicas report to admission")
        yield SimpleNamespace(url=url, port=port, address=address, http=http)
    finally:
        serve.shutdown()
        stop_ray()

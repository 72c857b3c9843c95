"""Schemathesis against the router's own OpenAPI schema, over real HTTP: bounded examples, a client timeout on
every call, no 5xx, every error in the OpenAI shape, and the pool whole afterwards."""
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from tests.serve_app import App, shared_app

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("conveyor_app", "pool_whole")]
CALL_TIMEOUT_S = 60


@pytest.fixture
def router_schema(conveyor_app: App) -> Any:
    spec = httpx.get(f"{conveyor_app.url}/openapi.json", headers=conveyor_app.headers, timeout=30).json()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(spec["paths"])
    return schemathesis.openapi.from_dict(spec).include(path_regex="^/v1/(completions|chat/completions|models)$")


schema = schemathesis.pytest.from_fixture("router_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: Any) -> None:
    app = shared_app()
    r = case.call(base_url=app.url, headers=app.headers, timeout=CALL_TIMEOUT_S)
    assert r.status_code < 500, (case.body, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text[:500]

"""Schemathesis against the router's own OpenAPI schema, over real HTTP: bounded examples per operation, a
client timeout on every call, no 5xx, every error in the OpenAI shape, and the pool whole afterwards.
(Driven through hypothesis directly: schemathesis' pytest loader does not run under pytest 9.)"""

import time
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.serve_app import App

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("conveyor_app", "pool_whole")]
CALL_TIMEOUT_S = 60
MAX_EXAMPLES = 30
OPERATIONS = {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models"}
DEFAULT_MAX_TOKENS = 8
MAX_TOKENS_PER_CASE = 512


def bounded(case: Any) -> Any:
    """Keeps each example's work within the client timeout on 2 cores: a body that names no length (or null) gets
    8 tokens, not the rest of the context, and a valid length is cut so that n x length stays within
    MAX_TOKENS_PER_CASE (the app runs one sequence at a time). Every other field, and every invalid length,
    is sent as hypothesis generated it."""
    body = case.body
    if not isinstance(body, dict):
        return case
    keys = [k for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None]
    if not keys:
        body["max_tokens"] = DEFAULT_MAX_TOKENS
        keys = ["max_tokens"]
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
    for key in keys:
        length = body[key]
        if isinstance(length, int) and not isinstance(length, bool) and n * length > MAX_TOKENS_PER_CASE:
            body[key] = max(1, MAX_TOKENS_PER_CASE // n)
    return case


def test_no_server_errors(conveyor_app: App) -> None:
    spec = httpx.get(f"{conveyor_app.url}/openapi.json", headers=conveyor_app.headers, timeout=30).json()
    operations = [r.ok() for r in schemathesis.openapi.from_dict(spec).get_all_operations()]
    operations = [op for op in operations if op.label in OPERATIONS]
    assert {op.label for op in operations} == OPERATIONS
    statuses: Counter[tuple[str, int]] = Counter()
    start = time.perf_counter()
    runs = [
        (op, mode)
        for op in operations
        for mode in schemathesis.GenerationMode
        if mode == schemathesis.GenerationMode.POSITIVE or op.method.upper() == "POST"
    ]
    for op, mode in runs:

        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(mode).map(bounded))
        def run(case: Any) -> None:
            r = case.call(base_url=conveyor_app.url, headers=conveyor_app.headers, timeout=CALL_TIMEOUT_S)
            statuses[(f"{op.label} {mode.value}", r.status_code)] += 1
            assert r.status_code < 500, (op.label, case.body, r.text[:500])
            if r.status_code >= 400:
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text[:500]

        run()
    print(f"fuzzed {sum(statuses.values())} calls in {time.perf_counter() - start:.1f}s: {dict(statuses)}")
    assert sum(n for (label, _), n in statuses.items() if label.endswith("negative")) >= MAX_EXAMPLES
    assert sum(n for (label, status), n in statuses.items() if status == 200) >= MAX_EXAMPLES // 2

"""Security at the HTTP edge: API key, loopback bind, nothing secret in the logs, no code execution from client
bytes, and `cache_salt` keeping tenants' prefix-cache entries apart."""

import ast
import pickle
import random
import uuid
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from conveyor.deployments.api_error import APIError
from conveyor.deployments.app import AppArgs
from conveyor.deployments.http_guard import GuardConfig, HTTPGuard
from tests.serve_app import API_KEY, App

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("conveyor_app", "pool_whole")]
ROOT = Path(__file__).resolve().parents[2]
COMP = "/v1/completions"


def check_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "authentication_error"
    assert err["code"] == "invalid_api_key" and API_KEY not in r.text


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": f"Bearer {API_KEY}x"},
    ],
    ids=["none", "wrong", "no-scheme", "basic", "longer"],
)
def test_api_key_required(conveyor_app: App, headers: dict[str, str]) -> None:
    with httpx.Client(base_url=conveyor_app.url, timeout=30, headers=headers) as anon:
        check_401(anon.post(COMP, json={"prompt": "x", "max_tokens": 2}))
        check_401(anon.post("/v1/chat/completions", content=b"{not json"))  # refused before the body is read
        check_401(anon.get("/v1/models"))
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200


def test_api_key_accepted(conveyor_app: App) -> None:
    r = conveyor_app.http.post(COMP, json={"prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    lower = {"authorization": f"bearer {API_KEY}"}
    assert httpx.get(f"{conveyor_app.url}/v1/models", headers=lower).status_code == 200


def test_guard_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same checks the middleware runs, for the options the shared app does not use."""
    protected = GuardConfig(api_key="k", protect_health_metrics=True)
    for path in ("/health", "/metrics", "/v1/models"):
        with pytest.raises(APIError) as e:
            HTTPGuard.authorize(protected, path, {})
        assert e.value.status == 401
    HTTPGuard.authorize(protected, "/metrics", {b"authorization": b"Bearer k"})
    HTTPGuard.authorize(GuardConfig(api_key="k"), "/metrics", {})
    HTTPGuard.authorize(GuardConfig(), "/v1/completions", {})
    monkeypatch.setenv("CONVEYOR_API_KEY", "from-env")
    assert GuardConfig().with_env_key().api_key == "from-env"
    assert GuardConfig(api_key="arg").with_env_key().api_key == "arg"
    assert "from-env" not in repr(GuardConfig().with_env_key()) and "secret" not in repr(AppArgs(api_key="secret"))
    with pytest.raises(ValueError, match="max_body_bytes"):
        AppArgs(max_body_bytes=10)


def test_binds_loopback_only(conveyor_app: App) -> None:
    assert AppArgs().host == "127.0.0.1"
    assert yaml.safe_load((ROOT / "serve_config.yaml").read_text())["http_options"]["host"] == "127.0.0.1"
    port = int(conveyor_app.url.rsplit(":", 1)[1])
    listening = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}
    assert {psutil.Process(c.pid).name() for c in listening} == {"haproxy"}  # the README's ingress, not Serve's proxy


def test_prompts_and_keys_not_logged(conveyor_app: App) -> None:
    canary, wrong_key = f"zebra{uuid.uuid4().hex[:12]}", f"sk-wrong-{uuid.uuid4().hex[:12]}"
    http = conveyor_app.http
    assert http.post(COMP, json={"prompt": f"say {canary}", "max_tokens": 2}).status_code == 200
    assert (
        http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": canary}], "max_tokens": 2}
        ).status_code
        == 200
    )
    assert http.post(COMP, json={"prompt": canary, "temperature": -1}).status_code == 400
    check_401(
        httpx.post(
            f"{conveyor_app.url}{COMP}", json={"prompt": canary}, headers={"Authorization": f"Bearer {wrong_key}"}
        )
    )
    assert http.get("/metrics").status_code == 200  # after the requests were logged and counted
    logs = [p for p in Path(conveyor_app.temp_dir).rglob("*") if p.is_file() and "logs" in p.parts]
    assert any("serve" in p.parts for p in logs), "no Serve logs found to search"
    assert any(b"/v1/chat/completions" in p.read_bytes() for p in logs), "the requests' access logs were not found"
    found = [str(p) for p in logs for secret in (canary, wrong_key, API_KEY) if secret.encode() in p.read_bytes()]
    assert not found, found


def test_no_eval_or_pickle_of_client_input(conveyor_app: App) -> None:
    banned = {"eval", "exec", "compile", "__import__"}
    unsafe = {
        ("pickle", "loads"),
        ("pickle", "load"),
        ("marshal", "loads"),
        ("yaml", "load"),
        ("yaml", "unsafe_load"),
        ("dill", "loads"),
        ("cloudpickle", "loads"),
    }
    hits = []
    for path in [*(ROOT / "deployments").glob("*.py"), *(ROOT / "cluster").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Name) and f.id in banned:
                hits.append(f"{path.name}:{node.lineno} {f.id}")
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in unsafe:
                hits.append(f"{path.name}:{node.lineno} {f.value.id}.{f.attr}")
    assert not hits, hits
    payload = pickle.dumps({"prompt": "x"})
    r = conveyor_app.http.post(COMP, content=payload, headers={"content-type": "application/octet-stream"})
    assert r.status_code == 415
    r = conveyor_app.http.post(COMP, content=payload, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def hits_of(app: App, path: str, body: dict[str, Any]) -> int:
    before = app.pool_whole()["prefix_cache_hits"]
    r = app.http.post(path, json={**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return app.pool_whole()["prefix_cache_hits"] - before


@pytest.mark.parametrize("path", [COMP, "/v1/chat/completions"])
def test_cache_salt_separates_tenants(conveyor_app: App, path: str) -> None:
    words = " ".join(random.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(80))
    body = (
        {"prompt": [random.randrange(10, 8000) for _ in range(80)]}
        if path == COMP
        else {"messages": [{"role": "user", "content": words}]}
    )
    a, b = f"tenant-a-{uuid.uuid4().hex}", f"tenant-b-{uuid.uuid4().hex}"
    assert hits_of(conveyor_app, path, {**body, "cache_salt": a}) == 0
    assert hits_of(conveyor_app, path, {**body, "cache_salt": a}) >= 64, "the same salt did not share its prefix"
    assert hits_of(conveyor_app, path, {**body, "cache_salt": b}) == 0, "a second tenant hit the first's cache"
    template = 0 if path == COMP else 16  # the chat template's first block may be cached from earlier chats
    assert hits_of(conveyor_app, path, body) <= template, "an unsalted request hit a salted entry"
    assert hits_of(conveyor_app, path, {**body, "cache_salt": b}) >= 64

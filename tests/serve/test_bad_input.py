"""Bad input over real HTTP: every case gets its status in the OpenAI error shape naming the field, reaches no
engine, and leaves the server serving with its KV pool whole."""

import json
from typing import Any, Iterator

import httpx
import pytest

from tests.serve_app import SHARED_ARGS, App, shared_app

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("conveyor_app", "pool_whole")]
MAX_BODY = SHARED_ARGS["max_body_bytes"]
VOCAB = 8192
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def before() -> dict[str, Any]:
    return shared_app().stats()


@pytest.fixture
def app(conveyor_app: App, before: dict[str, Any]) -> App:
    return conveyor_app


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"1" + b"]" * depth + b"}"


JSON_CASES: list[tuple[str, dict[str, Any], int, str | None]] = [
    (COMP, {"max_tokens": 3}, 400, "prompt"),
    (COMP, {"prompt": 5}, 400, "prompt"),
    (COMP, {"prompt": {"text": "x"}}, 400, "prompt"),
    (COMP, {"prompt": []}, 400, "prompt"),
    (COMP, {"prompt": [[]]}, 400, "prompt"),
    (COMP, {"prompt": [1] * 600}, 400, "prompt"),
    (COMP, {"prompt": "word " * 2000}, 400, "prompt"),
    (COMP, {"prompt": [-1, 5]}, 400, "prompt"),
    (COMP, {"prompt": [VOCAB]}, 400, "prompt"),
    (COMP, {"prompt": [[1, 2], [99999]]}, 400, "prompt"),
    (COMP, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": 600}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    (COMP, {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    (COMP, {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    (COMP, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    (COMP, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    (COMP, {"prompt": "x", "top_k": -2}, 400, "top_k"),
    (COMP, {"prompt": "x", "n": 0}, 400, "n"),
    (COMP, {"prompt": "x", "n": 65}, 400, "n"),
    (COMP, {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    (COMP, {"prompt": "x", "logprobs": -1}, 400, "logprobs"),
    (COMP, {"prompt": "x", "stop": 5}, 400, "stop"),
    (COMP, {"prompt": "x", "stop": [1, 2]}, 400, "stop"),
    (COMP, {"prompt": "x", "stop": [""]}, 400, "stop"),
    (COMP, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    (COMP, {"prompt": "x", "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
    (COMP, {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (COMP, {"prompt": "x", "frequency_penalty": -2.5}, 400, "frequency_penalty"),
    (COMP, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (COMP, {"prompt": "x", "repetition_penalty": 3e300}, 400, "repetition_penalty"),  # beyond float32
    (COMP, {"prompt": "x", "temperature": 1e39}, 400, "temperature"),
    (COMP, {"prompt": "x", "logit_bias": {"abc": 1.0}}, 400, "logit_bias"),
    (COMP, {"prompt": "x", "seed": "x"}, 400, "seed"),
    (COMP, {"prompt": "x", "stream": [1]}, 400, "stream"),
    (COMP, {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    (COMP, {"prompt": "x", "best_of": 2}, 400, "best_of"),
    (COMP, {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    (CHAT, {"max_tokens": 3}, 400, "messages"),
    (CHAT, {"messages": []}, 400, "messages"),
    (CHAT, {"messages": "hi"}, 400, "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    (
        CHAT,
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}
            ]
        },
        400,
        "messages",
    ),
    (
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]},
        400,
        "messages",
    ),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 2000}]}, 400, "messages"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT, {"messages": USER, "max_tokens": 600}, 400, "max_tokens"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "top_logprobs": -1}, 400, "top_logprobs"),
    (CHAT, {"messages": USER, "temperature": -1}, 400, "temperature"),
    (CHAT, {"messages": USER, "n": 0}, 400, "n"),
    (CHAT, {"messages": USER, "presence_penalty": 9}, 400, "presence_penalty"),
    (CHAT, {"messages": USER, "stop": {"a": 1}}, 400, "stop"),
    (CHAT, {"model": "gpt-9", "messages": USER}, 404, "model"),
]


def check_error(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == param and err["message"] and err["type"], err
    return err


@pytest.mark.parametrize("path,body,status,param", JSON_CASES)
def test_bad_json_field(app: App, path: str, body: dict[str, Any], status: int, param: str) -> None:
    err = check_error(app.http.post(path, json=body), status, param)
    assert param in err["message"] or status == 404 or param in ("prompt", "messages"), err


RAW_CASES: list[tuple[str, str, bytes, dict[str, str], int, str | None]] = [
    ("POST", COMP, b'{"prompt": "x", ', {}, 400, None),
    ("POST", COMP, b"[1, 2]", {}, 400, None),
    ("POST", COMP, b'"just a string"', {}, 400, None),
    ("POST", COMP, b"null", {}, 400, None),
    ("POST", COMP, b'{"prompt": "x"}', {"content-type": "text/plain"}, 415, "content-type"),
    ("POST", CHAT, b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}, 415, "content-type"),
    ("POST", COMP, b'{"prompt": "\xff\xfe x"}', {}, 400, None),
    ("POST", CHAT, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', {}, 400, None),
    ("POST", COMP, nested(100), {}, 400, None),
    ("POST", COMP, nested(20000), {}, 400, None),
    ("POST", COMP, b'{"prompt": "' + b"a" * (MAX_BODY + 1) + b'"}', {}, 413, "body"),
    ("GET", COMP, b"", {}, 405, None),
    ("DELETE", CHAT, b"", {}, 405, None),
    ("POST", "/v1/models", b"{}", {}, 405, None),
    ("GET", "/v1/nothing", b"", {}, 404, None),
    ("POST", "/v2/completions", b'{"prompt": "x"}', {}, 404, None),
]


@pytest.mark.parametrize("method,path,content,headers,status,param", RAW_CASES)
def test_bad_request_bytes(
    app: App, method: str, path: str, content: bytes, headers: dict[str, str], status: int, param: str | None
) -> None:
    headers = {"content-type": "application/json", **headers} if content else headers
    check_error(app.http.request(method, path, content=content or None, headers=headers), status, param)


def test_oversized_chunked_body(app: App) -> None:
    """No Content-Length: the limit is enforced on the bytes as they arrive."""

    def body() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 4096 + 2):
            yield b"a" * 4096
        yield b'"}'

    r = app.http.post(COMP, content=body(), headers={"content-type": "application/json"})
    assert "content-length" not in r.request.headers
    check_error(r, 413, "body")


def test_body_under_the_limit_is_served(app: App) -> None:
    prompt = "a " * 200
    assert len(json.dumps({"prompt": prompt})) < MAX_BODY
    r = app.http.post(COMP, json={"prompt": prompt, "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_matrix_changed_nothing_and_server_serves(app: App, before: dict[str, Any]) -> None:
    after = app.stats()
    assert after["num_finished"] == before["num_finished"] + 1  # only the under-the-limit request ran
    assert after["num_aborted"] == before["num_aborted"]
    r = app.http.post(COMP, json={"prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    chat = app.http.post(CHAT, json={"messages": USER, "max_tokens": 3, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3

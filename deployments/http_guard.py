"""The HTTP edge: API key, body size, content type, UTF-8 and JSON depth are checked before FastAPI parses
anything, so a hostile body never reaches pydantic, the tokenizer or the engine. After the key, and before the
body is read, a generation request may be refused for load (`door`: the router's admission door)."""

import hmac
import json
import os
from dataclasses import dataclass, field
from typing import Any

from conveyor.deployments.api_error import APIError
from conveyor.deployments.door import Door

MAX_JSON_DEPTH = 64
OPEN_PATHS = ("/health", "/metrics")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True)
class GuardConfig:
    api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 8 * 2**20
    protect_health_metrics: bool = False

    def with_env_key(self) -> "GuardConfig":
        """The `CONVEYOR_API_KEY` of this process where no key was given."""
        key = self.api_key or os.environ.get("CONVEYOR_API_KEY") or None
        return GuardConfig(key, self.max_body_bytes, self.protect_health_metrics)


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value, without recursion."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            depth = max(depth, d)
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return depth


def check_body(body: bytes) -> None:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        parsed = json.loads(text)
    except RecursionError:
        raise APIError(f"JSON body nested deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError:
        return  # FastAPI answers malformed JSON with its own 400, naming the position
    if json_depth(parsed) > MAX_JSON_DEPTH:
        raise APIError(f"JSON body nested deeper than {MAX_JSON_DEPTH} levels")


class HTTPGuard:
    """ASGI middleware; `config` and `door` (with admission) are set by the Router of this process (one per
    Serve replica)."""

    config = GuardConfig()
    door: Door | None = None

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        try:
            await self.guard(scope, receive, send)
        finally:
            Door.decided()  # whatever way it ended, a request let in no longer counts as ahead

    async def guard(self, scope: dict, receive: Any, send: Any) -> None:
        cfg, headers = self.config, {k.lower(): v for k, v in scope.get("headers", [])}
        try:
            path, root = scope.get("path", ""), scope.get("root_path", "")
            path = path[len(root) :] if root and path.startswith(root) else path
            self.authorize(cfg, path, headers)
            if scope.get("method") not in ("POST", "PUT", "PATCH"):
                return await self.app(scope, receive, send)
            door = HTTPGuard.door if path in GENERATION_PATHS else None
            if door is not None:
                if (refusal := door.enter()) is not None:
                    raise refusal
                await door.hold()
            body = await self.read_body(cfg, headers, receive)
            if body is None:
                return  # the client left before its body arrived: nothing to answer
            check_body(body)
        except APIError as e:
            return await self.refuse(e, send)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    @staticmethod
    def authorize(cfg: GuardConfig, path: str, headers: dict[bytes, bytes]) -> None:
        if cfg.api_key is None or (path in OPEN_PATHS and not cfg.protect_health_metrics):
            return
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), cfg.api_key.encode()):
            raise APIError(
                "invalid or missing API key (send `Authorization: Bearer <key>`)",
                status=401,
                type="authentication_error",
                param="authorization",
                code="invalid_api_key",
            )

    @staticmethod
    async def read_body(cfg: GuardConfig, headers: dict[bytes, bytes], receive: Any) -> bytes | None:
        kind = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        if kind and kind != "application/json" and not kind.endswith("+json"):
            raise APIError(f"Content-Type must be application/json, got {kind!r}", status=415, param="content-type")
        size = headers.get(b"content-length")
        too_big = APIError(
            f"request body larger than {cfg.max_body_bytes} bytes", status=413, param="body", code="body_too_large"
        )
        if size is not None and size.isdigit() and int(size) > cfg.max_body_bytes:
            raise too_big
        chunks, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunks.append(message.get("body", b""))
            total += len(chunks[-1])
            if total > cfg.max_body_bytes:
                raise too_big
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def refuse(e: APIError, send: Any) -> None:
        body = json.dumps(e.response().model_dump()).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in e.headers().items()]
        if e.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

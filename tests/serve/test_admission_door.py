"""The router's door at the HTTP edge (deployments/door.py in deployments/http_guard.py): while admission would
refuse any request for queue time, a generation request is answered 429 + Retry-After in OpenAI's error shape
before its body is read; a request let in counts as undecided until admission decides it or it ends."""

import asyncio
import json
from typing import Any

from conveyor.cluster.admission_actor import AdmissionClient
from conveyor.deployments.door import Door
from conveyor.deployments.http_guard import HTTPGuard
from tests.cluster.test_door import controller


class Exchange:
    """One request through the guard: what the app saw, what was sent back, whether the body was read."""

    def __init__(self, door: Door, path: str, body: bytes = b'{"prompt": "x"}', decide: bool = False) -> None:
        self.door, self.path, self.body, self.decide = door, path, body, decide
        self.read, self.sent, self.undecided_inside = False, [], None

    async def app(self, scope: dict, receive: Any, send: Any) -> None:
        await receive()
        self.undecided_inside = self.door.undecided
        if self.decide:
            Door.decided()  # what Router.admit does once admission has decided
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive(self) -> dict:
        self.read = True
        return {"type": "http.request", "body": self.body, "more_body": False}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def run(self) -> "Exchange":
        scope = {
            "type": "http",
            "method": "POST",
            "path": self.path,
            "headers": [(b"content-type", b"application/json")],
        }
        asyncio.run(HTTPGuard(self.app)(scope, self.receive, self.send))
        return self

    @property
    def status(self) -> int:
        return self.sent[0]["status"]


def door_over(reserved: int) -> Door:
    c = controller()
    for rid in "ab":
        for _ in range(reserved):
            c.reserve(rid, 1, 0.1)

    async def no_actor() -> Any:
        raise AssertionError("the door decides from the local view")

    gate = AdmissionClient(no_actor, clock=lambda: 0.1)
    gate.controller = c
    return Door(gate)


def test_a_closed_door_refuses_generation_unread_with_retry_after(monkeypatch: Any) -> None:
    door = door_over(reserved=5)
    refused = []
    door.on_refusal = lambda: refused.append(1)
    monkeypatch.setattr(HTTPGuard, "door", door)
    for path in ("/v1/completions", "/v1/chat/completions"):
        ex = Exchange(door, path).run()
        assert ex.status == 429 and not ex.read
        headers = dict(ex.sent[0]["headers"])
        assert headers[b"retry-after"] == b"1"
        error = json.loads(ex.sent[1]["body"])["error"]
        assert error["code"] == "queue_time" and error["type"] == "rate_limit_error" and "2.2s" in error["message"]
    assert Exchange(door, "/v1/load_lora_adapter").run().status == 200  # only generation is shed
    assert len(refused) == 2 and door.undecided == 0


def test_an_open_door_counts_a_request_until_admission_decides_it(monkeypatch: Any) -> None:
    door = door_over(reserved=0)
    monkeypatch.setattr(HTTPGuard, "door", door)
    ex = Exchange(door, "/v1/completions", decide=True).run()
    assert ex.status == 200 and ex.read and ex.undecided_inside == 1 and door.undecided == 0
    ex = Exchange(door, "/v1/completions").run()  # ended without a decision (a validation error, say)
    assert ex.status == 200 and ex.undecided_inside == 1 and door.undecided == 0
    ex = Exchange(door, "/v1/completions", body=b"\xff").run()  # refused by the edge's own body checks
    assert ex.status == 400 and door.undecided == 0
    door.undecided = 8  # 8 let in and not yet decided: 4 more ahead on each replica, (3 + 4 + 1) / 4 = 2 s
    assert Exchange(door, "/v1/completions").run().status == 200
    door.undecided = 9
    assert Exchange(door, "/v1/completions").run().status == 429

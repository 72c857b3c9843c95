"""The router's door at the HTTP edge (deployments/door.py in deployments/http_guard.py): while admission would
refuse any request for queue time, a generation request is answered 429 + Retry-After in OpenAI's error shape
before its body is read; a request let in counts as undecided until admission decides it or it ends."""

import asyncio
import json
import time
from typing import Any

import pytest

from conveyor.cluster.admission_actor import AdmissionClient
from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.admission_controller import AdmissionController
from conveyor.deployments.door import Door
from conveyor.deployments.http_guard import HTTPGuard
from tests.cluster.test_door import controller, replica


class Exchange:
    """One request through the guard: what the app saw, what was sent back, whether the body was read."""

    def __init__(self, door: Door, path: str, body: bytes = b'{"prompt": "x"}', decide: bool = False) -> None:
        self.door, self.path, self.body, self.decide = door, path, body, decide
        self.read, self.sent, self.undecided_inside = False, [], None
        self.read_at, self.judged = 0.0, False
        self.disconnect = False

    async def app(self, scope: dict, receive: Any, send: Any) -> None:
        await receive()
        self.undecided_inside, self.judged = self.door.undecided, Door.judged()
        if self.decide:
            Door.decided()  # what Router.admit does once admission has decided
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def receive(self) -> dict:
        self.read, self.read_at = True, time.perf_counter()
        if self.disconnect:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": self.body, "more_body": False}

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def serve(self) -> "Exchange":
        scope = {
            "type": "http",
            "method": "POST",
            "path": self.path,
            "headers": [(b"content-type", b"application/json")],
        }
        await HTTPGuard(self.app)(scope, self.receive, self.send)
        return self

    def run(self) -> "Exchange":
        return asyncio.run(self.serve())

    @property
    def status(self) -> int:
        return self.sent[0]["status"]


def door_over(reserved: int, limit: float = 2.0) -> Door:
    """Two replicas with (3 + reserved + 1) / 4 s of queue each; the objective `limit`."""
    c = controller(limit)
    for rid in "ab":
        for _ in range(reserved):
            c.reserve(rid, 1, 0.1)

    async def no_actor() -> Any:
        raise AssertionError("the door decides from the local view")

    gate = AdmissionClient(no_actor, clock=lambda: 0.1)
    gate.controller = c
    return Door(gate, mark=lambda: None)


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


def test_a_cold_replica_with_every_slot_taken_is_refused_as_unknown_not_inf_seconds(monkeypatch: Any) -> None:
    cold = AdmissionController(AdmissionConfig(max_queue_time_s=2.0))
    cold.update(replica("a"), 0.0)  # one push: every slot running, 3 waiting, no request finished yet
    door = door_over(0)
    door.gate.controller = cold
    monkeypatch.setattr(HTTPGuard, "door", door)
    ex = Exchange(door, "/v1/completions").run()
    error = json.loads(ex.sent[1]["body"])["error"]
    assert ex.status == 429 and "(shortest unknown: every slot taken, no request finished yet)" in error["message"]


def test_an_open_door_counts_a_request_until_admission_decides_it(monkeypatch: Any) -> None:
    door = door_over(reserved=0, limit=0.0)  # no queue-time objective: nothing is refused or held
    monkeypatch.setattr(HTTPGuard, "door", door)
    ex = Exchange(door, "/v1/completions", decide=True).run()
    assert ex.status == 200 and ex.read and ex.undecided_inside == 1 and door.undecided == 0 and not ex.judged
    ex = Exchange(door, "/v1/completions").run()  # ended without a decision (a validation error, say)
    assert ex.status == 200 and ex.undecided_inside == 1 and door.undecided == 0
    ex = Exchange(door, "/v1/completions", body=b"\xff").run()  # refused by the edge's own body checks
    assert ex.status == 400 and door.undecided == 0
    ex = Exchange(door, "/v1/completions")
    ex.disconnect = True  # the client left before its body arrived
    assert not ex.run().sent and door.undecided == 0
    door.gate.controller.config = door_over(0).gate.controller.config  # the 2 s objective
    door.undecided = 8  # 8 let in and not yet decided: 4 more ahead on each replica, (3 + 4 + 1) / 4 = 2 s
    assert Exchange(door, "/v1/completions").run().status == 200
    door.undecided = 9
    assert Exchange(door, "/v1/completions").run().status == 429


def test_a_door_with_a_queue_lets_refusals_go_first(monkeypatch: Any) -> None:
    """What the door lets in waits unread for half its predicted wait, in arrival order, and admission does not judge
    its queue time again; past a quarter of the objective the node is marked shedding (at most every 0.1 s); a
    request cancelled while held no longer counts as undecided."""
    door = door_over(reserved=0)  # 1 s of queue on each replica, past 2 s / 4
    marks = []
    door.mark = lambda: marks.append(1)
    monkeypatch.setattr(HTTPGuard, "door", door)

    async def three() -> tuple[float, list[Exchange]]:
        start = time.perf_counter()
        return start, await asyncio.gather(*(Exchange(door, "/v1/completions", decide=True).serve() for _ in range(3)))

    start, done = asyncio.run(three())
    # the first waits 1 s / 2; the next two see one more ahead on each replica, 1.25 s / 2, and keep their order
    assert [ex.status for ex in done] == [200] * 3 and all(ex.judged for ex in done)
    reads = [ex.read_at - start for ex in done]
    assert reads == sorted(reads) and reads[0] == pytest.approx(0.5, abs=0.1)
    assert reads[2] == pytest.approx(0.625, abs=0.1)
    assert marks == [1] and door.undecided == 0

    async def cancelled() -> Exchange:
        ex = Exchange(door, "/v1/completions")
        task = asyncio.create_task(ex.serve())
        await asyncio.sleep(0.1)
        assert door.undecided == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return ex

    assert not asyncio.run(cancelled()).read and door.undecided == 0

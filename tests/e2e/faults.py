"""The fault tests' app (a paced 2-replica demo:tiny app with fast admission staleness) and their tools: long
completions in threads that record how they ended, polling, the app's /v1/cluster view."""

import json
import random
import threading
import time
from typing import Any, Callable

import httpx

ENGINE = dict(
    model="demo:tiny",
    dtype="float32",
    max_num_seqs=8,
    max_num_batched_tokens=256,
    block_size=16,
    num_blocks=256,
    max_model_len=1024,
)


ADMISSION = {"staleness_s": 0.5, "drop_after_s": 3.0}


APP = dict(
    model="demo:tiny",
    engine={k: v for k, v in ENGINE.items() if k != "model"},
    replica_num_cpus=0.25,
    router_num_cpus=0.1,
    torch_threads=1,
    admission=ADMISSION,
)


def eventually(check: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> float:
    start = time.time()
    while time.time() - start < timeout:
        try:
            if check():
                return time.time() - start
        except Exception:
            pass
        time.sleep(every)
    raise AssertionError(f"not within {timeout}s: {what}")


def view(http: httpx.Client) -> dict[str, Any]:
    return http.get("/v1/cluster").json()


def fresh_replicas(http: httpx.Client) -> int:
    return sum(r["fresh"] for r in view(http)["replicas"])


def pool_whole(http: httpx.Client, replicas: int) -> bool:
    rows = view(http)["replicas"]
    return len(rows) == replicas and all(
        r["fresh"] and r["num_running"] == r["num_waiting"] == 0 and r["kv_blocks_free"] == r["kv_blocks_total"]
        for r in rows
    )


class Request(threading.Thread):
    """One long completion in a thread, recording how it ended: status, replica, SSE events or body."""

    def __init__(self, url: str, stream: bool, max_tokens: int, seed: int) -> None:
        super().__init__(daemon=True)
        rng = random.Random(seed)
        self.url, self.stream, self.max_tokens = url, stream, max_tokens
        self.body = {
            "prompt": [rng.randrange(4, 8000) for _ in range(24)],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": stream,
        }
        self.status: int | None = None
        self.replica: str | None = None
        self.events: list[Any] = []
        self.json: dict[str, Any] | None = None
        self.transport_error: str | None = None
        self.started = threading.Event()

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=httpx.Timeout(90)) as c:
                if self.stream:
                    with c.stream("POST", "/v1/completions", json=self.body) as r:
                        self.status, self.replica = r.status_code, r.headers.get("x-conveyor-replica")
                        for line in r.iter_lines():
                            if line.startswith("data: "):
                                self.events.append("DONE" if line == "data: [DONE]" else json.loads(line[6:]))
                                self.started.set()
                else:
                    r = c.post("/v1/completions", json=self.body)
                    self.status, self.replica, self.json = r.status_code, r.headers.get("x-conveyor-replica"), r.json()
        except httpx.TransportError as e:
            self.transport_error = repr(e)
        finally:
            self.started.set()

    @property
    def completed(self) -> bool:
        if self.stream:
            finish = [
                e["choices"][0]["finish_reason"]
                for e in self.events
                if isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
            ]
            errors = [e for e in self.events if isinstance(e, dict) and "error" in e]
            return self.status == 200 and finish == ["length"] and not errors and self.events[-1] == "DONE"
        return (
            self.status == 200
            and self.json["choices"][0]["finish_reason"] == "length"
            and self.json["usage"]["completion_tokens"] == self.max_tokens
        )

    @property
    def errored(self) -> bool:
        """An explicit error: 5xx in the OpenAI error shape, or an SSE error event followed by [DONE]."""
        if self.stream:
            return (
                self.status == 200
                and len(self.events) >= 2
                and self.events[-1] == "DONE"
                and isinstance(self.events[-2], dict)
                and "error" in self.events[-2]
                and bool(self.events[-2]["error"]["message"])
            )
        return self.status is not None and self.status >= 500 and bool(self.json.get("error", {}).get("message"))


def start_requests(url: str, n_stream: int, n_plain: int, max_tokens: int) -> list[Request]:
    reqs = [Request(url, i < n_stream, max_tokens, seed=i) for i in range(n_stream + n_plain)]
    for r in reqs:
        r.start()
    return reqs


def join(reqs: list[Request], timeout: float) -> None:
    deadline = time.time() + timeout
    for r in reqs:
        r.join(max(0.0, deadline - time.time()))
    hung = [r.body["stream"] for r in reqs if r.is_alive()]
    assert not hung, f"{len(hung)} requests hung past {timeout}s"

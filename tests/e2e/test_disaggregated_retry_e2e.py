"""A failed handoff retried on another decode replica, over real Ray Serve and loopback HTTP with the openai client:
one prefill and two decode replicas. A decode replica lost before any of its tokens went out is replaced by the
other (tokens equal to a colocated run); a handoff every decode replica refuses is tried once on each, then ends
with the explicit 503 `handoff` error; no KV block stays behind."""

import re
import threading
from typing import Any, Iterator

import openai
import pytest
import ray
from ray import serve
from transformers import AutoTokenizer

from conveyor.cluster.routing import RoutingHint
from conveyor.deployments.protocol import GenerateRequest
from conveyor.engine import SamplingParams
from conveyor.engine.checkpoints.model_source import resolve_model
from tests.serve_app import App, serve_app, sse_events, wait_for

pytestmark = pytest.mark.slow

ARGS = {
    "model": "demo:tiny",
    # admission off: decode admission would refuse the undersized decode pools' requests up front, and these tests
    # are about refusals at the handoff (tests/e2e/test_role_admission_e2e.py: with admission)
    "admission": {"enabled": False},
    "disaggregation": {"prefill_replicas": 1, "decode_replicas": 2, "decode_engine": {"num_blocks": 16}},
}
LONG = " ".join(f"word{i}" for i in range(60))


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    with serve_app(ARGS) as a:
        yield a


def handle(role: str) -> Any:
    return serve.get_deployment_handle(f"LLM{role}", app_name="default")


def decode_replicas() -> dict[str, Any]:
    """The decode replicas' actors by replica id."""
    found = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#LLMDecode#" in a["name"]]
    return {a["name"].rsplit("#", 1)[1]: ray.get_actor(a["name"], namespace=a["namespace"]) for a in found}


def handoff_stats(replica: str) -> dict[str, Any]:
    """One decode replica's, addressed through the KV-aware router (a hint's replicas go first)."""
    s = handle("Decode").handoff_stats.remote(routing_hint=RoutingHint(replicas=(replica,))).result()
    assert s["replica"] == replica
    return s


def pool_whole(role: str, replica: str | None = None) -> bool:
    s = handoff_stats(replica)["engine"] if replica else handle(role).stats.remote().result()
    return not s["num_running"] and not s["num_waiting"] and s["kv_blocks_free"] == s["kv_blocks_total"]


def colocated_text(prompt: str, max_tokens: int) -> str:
    ids = AutoTokenizer.from_pretrained(resolve_model("demo:tiny"))(prompt).input_ids
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    chunk = handle("Prefill").generate_to.remote(GenerateRequest(prompts=[ids], sampling=sampling, stream=False))
    return "".join(d["text"] for d in chunk.result()["deltas"])


def retries(app: App, reason: str) -> float:
    text = app.http.get("/metrics").text
    m = re.search(rf'^conveyor_handoff_retries_total{{reason="{reason}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_handoff_every_decode_replica_refuses_is_tried_on_each_then_a_503(app: App) -> None:
    """The decode pools (16 blocks) cannot hold this request: the first decode replica refuses, the second is
    tried, refuses too, and the client gets the 503 (non-streaming) or an error event after the first token."""
    ids = sorted(decode_replicas())
    assert len(ids) == 2
    before = {r: handoff_stats(r)["refused"] for r in ids}
    retried = retries(app, "refused")
    body = {"model": "demo:tiny", "prompt": LONG, "max_tokens": 250, "temperature": 0, "ignore_eos": True}
    r = app.http.post("/v1/completions", json=body)
    assert r.status_code == 503 and r.json()["error"]["code"] == "handoff", r.text
    assert "refused" in r.json()["error"]["message"]
    assert {r: handoff_stats(r)["refused"] - before[r] for r in ids} == {ids[0]: 1, ids[1]: 1}
    assert retries(app, "refused") == retried + 1
    with app.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        events = sse_events(resp)
    assert events[-1] == "DONE" and "handoff" in events[-2]["error"]["message"]
    assert events[0]["choices"][0]["text"] == colocated_text(LONG, 1)
    assert retries(app, "refused") == retried + 2
    assert wait_for(lambda: pool_whole("Prefill") and all(pool_whole("Decode", r) for r in ids))


def test_a_decode_replica_lost_before_its_tokens_went_out_is_replaced(app: App) -> None:
    """A non-streaming request: the decode replica running it is killed mid-decode, before anything reached the
    client; the router hands the same KVHandoff to the other decode replica, and the answer equals a colocated
    run's."""
    ids = sorted(decode_replicas())
    imports = {r: handoff_stats(r)["imports"] for r in ids}
    lost = retries(app, "lost")
    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0, timeout=120)
    result: dict[str, Any] = {}

    def ask() -> None:
        result["out"] = client.completions.create(
            model="demo:tiny", prompt="count:", max_tokens=240, temperature=0, extra_body={"ignore_eos": True}
        )

    asker = threading.Thread(target=ask)
    asker.start()
    busy = wait_for(lambda: next((r for r in ids if handoff_stats(r)["decoding"]), None), timeout=60, every=0.01)
    assert busy, "no decode replica took the handoff"
    ray.kill(decode_replicas()[busy], no_restart=True)
    asker.join(120)
    out = result["out"]
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 240
    assert out.choices[0].text == colocated_text("count:", 240)
    survivor = next(r for r in ids if r != busy)
    assert handoff_stats(survivor)["imports"] == imports[survivor] + 1
    assert retries(app, "lost") == lost + 1
    assert wait_for(lambda: pool_whole("Prefill") and pool_whole("Decode", survivor))

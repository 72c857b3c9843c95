"""Per-role admission of a disaggregated app over real Ray Serve and loopback HTTP with the openai client: one prefill
and one decode replica whose pool holds only a few requests' predicted KV. A burst beyond it is answered 429 with
Retry-After up front (no prefill spent on those), every admitted request completes with a colocated replica's greedy
tokens, both roles' views show in /v1/cluster and /metrics, and both pools' blocks come back."""

import re
import threading
from typing import Any, Iterator

import openai
import pytest
from ray import serve
from transformers import AutoTokenizer

from conveyor.deployments.protocol import GenerateRequest
from conveyor.engine import SamplingParams
from conveyor.engine.checkpoints.model_source import resolve_model
from tests.serve_app import App, serve_app, wait_for

pytestmark = pytest.mark.slow

# a request: prompt and first token in 1 block, 96 output tokens in 6: 7 blocks of the decode replica's 21 below its
# high watermark (24 x 0.9): 3 fit at once
DECODE_BLOCKS, MAX_TOKENS, FITS = 24, 96, 3
ARGS = {
    "model": "demo:tiny",
    "disaggregation": {"prefill_replicas": 1, "decode_replicas": 1, "decode_engine": {"num_blocks": DECODE_BLOCKS}},
}


@pytest.fixture(scope="module")
def app() -> Iterator[App]:
    with serve_app(ARGS) as a:
        yield a


def handle(role: str) -> Any:
    return serve.get_deployment_handle(f"LLM{role}", app_name="default")


def colocated_text(prompt: str, max_tokens: int) -> str:
    """The same request run whole on the prefill replica (its generate_to: a colocated replica's path)."""
    ids = AutoTokenizer.from_pretrained(resolve_model("demo:tiny"))(prompt).input_ids
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    chunk = handle("Prefill").generate_to.remote(GenerateRequest(prompts=[ids], sampling=sampling, stream=False))
    return "".join(d["text"] for d in chunk.result()["deltas"])


def pools_whole() -> bool:
    for role in ("Prefill", "Decode"):
        s = handle(role).stats.remote().result()
        if s["num_running"] or s["num_waiting"] or s["kv_blocks_free"] != s["kv_blocks_total"]:
            return False
    return True


def client(app: App) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0, timeout=120)


def burst(app: App, prompts: list[str]) -> list[Any]:
    """The prompts sent at once (one thread each): per prompt its text, or the openai error."""
    out: list[Any] = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        c = client(app)
        start.wait()
        try:
            r = c.completions.create(
                model="demo:tiny",
                prompt=prompts[i],
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            out[i] = r.choices[0].text
        except openai.APIStatusError as e:
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def decode_view(app: App) -> dict[str, Any]:
    return app.http.get("/v1/cluster").json()["decode"]


def test_both_roles_report_to_their_own_admission(app: App) -> None:
    cluster = app.http.get("/v1/cluster").json()
    decode_id = handle("Decode").info.remote().result()["replica"]
    prefill_id = handle("Prefill").info.remote().result()["replica"]
    assert [r["replica_id"] for r in cluster["replicas"]] == [prefill_id]
    assert [r["replica_id"] for r in cluster["decode"]["replicas"]] == [decode_id]
    assert cluster["decode"]["replicas"][0]["kv_blocks_total"] == DECODE_BLOCKS
    assert cluster["decode"]["config"]["affinity_weight"] == 0.0  # ranks as the decode routing does
    text = app.http.get("/metrics").text
    assert re.search(rf'^conveyor_replica_kv_blocks_free{{role="decode",replica="{decode_id}"}} ', text, re.M)
    assert re.search(rf'^conveyor_replica_kv_blocks_free{{role="prefill",replica="{prefill_id}"}} ', text, re.M)


def decisions(app: App) -> dict[tuple[str, str, str], float]:
    """conveyor_admission_decisions_total by (role, admitted, reason)."""
    pattern = r'^conveyor_admission_decisions_total\{admitted="(\w+)",reason="(\w+)",role="(\w+)"\} (\S+)$'
    return {(r, a, why): float(n) for a, why, r, n in re.findall(pattern, app.http.get("/metrics").text, re.M)}


def test_a_burst_beyond_the_decode_pool_is_refused_up_front(app: App) -> None:
    prompts = [f"count {i} to ten:" for i in range(3 * FITS)]
    counted = decisions(app)
    prefill_before = handle("Prefill").handoff_stats.remote().result()
    added_before = prefill_before["engine"]["num_added"]
    got = burst(app, prompts)
    refused = [e for e in got if isinstance(e, openai.APIStatusError)]
    done = [(p, t) for p, t in zip(prompts, got) if isinstance(t, str)]
    assert len(refused) + len(done) == len(prompts)
    assert 1 <= len(done) <= len(prompts) - FITS and len(refused) >= FITS, got  # most of the burst cannot fit
    for e in refused:
        assert e.status_code == 429 and int(e.response.headers["retry-after"]) >= 1, e
        error = e.response.json()["error"]
        assert error["code"] == "no_room" and error["type"] == "rate_limit_error", error
    now = decisions(app)  # each refusal counts for the role that refused it, each admission for both roles

    def more(*key: str) -> float:
        return now.get(key, 0.0) - counted.get(key, 0.0)

    assert more("decode", "false", "no_room") == len(refused), now
    assert more("decode", "true", "ok") == more("prefill", "true", "ok") == len(done), now
    assert more("prefill", "false", "no_room") == 0, now
    prefill_after = handle("Prefill").handoff_stats.remote().result()
    assert prefill_after["handoffs"] - prefill_before["handoffs"] == len(done)  # the refused ones spent no prefill
    assert prefill_after["engine"]["num_added"] - added_before == len(done)
    assert wait_for(pools_whole)
    for prompt, text in done:
        assert text == colocated_text(prompt, MAX_TOKENS)
    # the admitted requests' decode reservations settled: the decode role's room is whole again
    assert wait_for(lambda: decode_view(app)["replicas"][0]["reserved_blocks"] == 0)
    again = burst(app, prompts[:FITS])
    assert all(isinstance(t, str) for t in again), again

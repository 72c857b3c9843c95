"""Prefill/decode disaggregation over real Ray Serve and loopback HTTP with the openai client: one prefill and one
decode replica; tokens equal to the same request run whole on a (colocated) replica; a refused handoff and a lost
decode replica end the request with an explicit error, and no KV block stays behind."""

from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
import ray
from ray import serve
from transformers import AutoConfig, AutoTokenizer

from conveyor.deployments.protocol import GenerateRequest
from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.lora import write_random_adapter
from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.lora_request import LoRARequest
from tests.serve_app import App, serve_app, sse_events, wait_for

pytestmark = pytest.mark.slow

ARGS = {
    "model": "demo:tiny",
    # admission off: decode admission would refuse the undersized decode pools' requests up front, and these tests
    # are about refusals at the handoff (tests/e2e/test_role_admission_e2e.py: with admission)
    "admission": {"enabled": False},
    "engine": {"max_num_batched_tokens": 32},  # a 100-token prompt prefills in chunks
    "disaggregation": {
        "prefill_replicas": 1,
        "decode_replicas": 1,
        "decode_engine": {"num_blocks": 12, "max_lora_rank": 8},
    },
}
LONG = " ".join(f"word{i}" for i in range(60))  # > 32 tokens


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> str:
    hf = AutoConfig.from_pretrained(resolve_model("demo:tiny"))
    return str(write_random_adapter(tmp_path_factory.mktemp("adapter") / "x", hf, "demo:tiny", rank=8, seed=0))


@pytest.fixture(scope="module")
def app(adapter: str) -> Iterator[App]:
    args = {**ARGS, "lora_modules": [{"name": "x", "path": adapter}], "engine": {**ARGS["engine"], "max_loras": 1}}
    with serve_app(args) as a:
        yield a


def handle(role: str) -> Any:
    return serve.get_deployment_handle(f"LLM{role}", app_name="default")


def colocated_text(app: App, prompt: str, max_tokens: int) -> str:
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
    return openai.OpenAI(base_url=f"{app.url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("prompt", ["def fibonacci(n):", LONG], ids=["short", "chunked-prefill"])
def test_completion_equals_colocated(app: App, prompt: str) -> None:
    before = handle("Prefill").handoff_stats.remote().result()["handoffs"]
    out = client(app).completions.create(
        model="demo:tiny", prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 40
    assert out.choices[0].text == colocated_text(app, prompt, 40)
    after = handle("Prefill").handoff_stats.remote().result()
    assert after["handoffs"] == before + 1 and after["bytes"] > 0
    assert wait_for(pools_whole)


def test_stream_is_one_stream(app: App) -> None:
    assert app.http.get("/health").status_code == 200
    stream = client(app).completions.create(
        model="demo:tiny", prompt=LONG, max_tokens=48, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == colocated_text(app, LONG, 48)
    chat = client(app).chat.completions.create(
        model="demo:tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=12, temperature=0, stream=True
    )
    assert [c.choices[0].finish_reason for c in chat][-1] in ("length", "stop")
    assert wait_for(pools_whole)


def test_a_lora_chat_is_handed_off_with_its_adapter(app: App, adapter: str, tmp_path: Path) -> None:
    """The handoff carries the adapter: the decode replica loads it from the same path and continues the chat with
    it, to the tokens of the engine run whole with the adapter; an adapter loaded at run time (POST
    /v1/load_lora_adapter, checked on a prefill replica only) is served by the decode replica as well."""
    chat = [{"role": "user", "content": "Tell me about the river."}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    y = str(
        write_random_adapter(
            tmp_path / "y", AutoConfig.from_pretrained(resolve_model("demo:tiny")), "demo:tiny", rank=8, seed=1
        )
    )
    llm = LLM("demo:tiny", dtype="float32", max_loras=1, max_lora_rank=8)
    want = {
        name: llm.chat(chat, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
        for name, lora in (("demo:tiny", None), ("x", LoRARequest("x", 1, adapter)), ("y", LoRARequest("y", 2, y)))
    }
    assert len(set(want.values())) == 3
    assert app.http.post("/v1/load_lora_adapter", json={"lora_name": "y", "lora_path": y}).status_code == 200
    for name in ("x", "y", "demo:tiny"):
        before = {role: handle(role).handoff_stats.remote().result() for role in ("Prefill", "Decode")}
        out = client(app).chat.completions.create(
            model=name, messages=chat, max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].message.content == want[name] and out.model == name
        after = {role: handle(role).handoff_stats.remote().result() for role in ("Prefill", "Decode")}
        assert after["Prefill"]["handoffs"] == before["Prefill"]["handoffs"] + 1
        assert after["Decode"]["imports"] == before["Decode"]["imports"] + 1 and after["Decode"]["refused"] == 0
        engine = after["Decode"]["engine"]
        assert engine["num_added"] == before["Decode"]["engine"]["num_added"] + 1
        if name != "demo:tiny":
            assert engine["lora_adapters"] == [name]  # max_loras 1: the decode replica's one slot holds it now
    assert wait_for(pools_whole)
    assert app.http.post("/v1/unload_lora_adapter", json={"lora_name": "y"}).status_code == 200


def test_an_adapter_the_decode_replica_cannot_load_is_an_explicit_error(app: App, tmp_path: Path) -> None:
    """A rank-16 adapter: the prefill replicas take it (max_lora_rank 16), the decode replica refuses the handoff
    (its max_lora_rank is 8) rather than continue on the base model; with no other decode replica the request ends
    with a 503 naming the handoff and the rank, and both pools are whole."""
    hf = AutoConfig.from_pretrained(resolve_model("demo:tiny"))
    big = str(write_random_adapter(tmp_path / "big", hf, "demo:tiny", rank=16, seed=2))
    assert app.http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": big}).status_code == 200
    refused = handle("Decode").handoff_stats.remote().result()["refused"]
    body = {"model": "big", "prompt": "hello", "max_tokens": 8, "temperature": 0}
    r = app.http.post("/v1/completions", json=body)
    assert r.status_code == 503 and "handoff" in r.text and "max_lora_rank" in r.text, r.text
    assert handle("Decode").handoff_stats.remote().result()["refused"] == refused + 1
    assert wait_for(pools_whole)
    assert app.http.post("/v1/unload_lora_adapter", json={"lora_name": "big"}).status_code == 200


def test_first_token_that_finishes_stays_on_the_prefill_replica(app: App) -> None:
    before = handle("Prefill").handoff_stats.remote().result()["handoffs"]
    out = client(app).completions.create(model="demo:tiny", prompt="hi", max_tokens=1, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.choices[0].text == colocated_text(app, "hi", 1)
    assert handle("Prefill").handoff_stats.remote().result()["handoffs"] == before


def test_refused_handoff_is_an_explicit_error_and_frees_both_pools(app: App) -> None:
    """The decode replicas' pool (12 blocks) is too small for this request: the prefill replica's first token goes
    out, then the stream ends with an error naming the handoff; non-streaming gets a 503."""
    body = {"model": "demo:tiny", "prompt": LONG, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    r = app.http.post("/v1/completions", json=body)
    assert r.status_code == 503 and "handoff" in r.json()["error"]["message"], r.text
    with app.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        events = sse_events(resp)
    assert events[-1] == "DONE" and "handoff" in events[-2]["error"]["message"]
    assert events[0]["choices"][0]["text"] == colocated_text(app, LONG, 1)
    assert wait_for(pools_whole)


def test_lost_decode_replica_ends_the_stream_with_an_error(app: App) -> None:
    replica_id = handle("Decode").info.remote().result()["replica"]
    body = {"model": "demo:tiny", "prompt": "count:", "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", f"{app.url}/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        lines = resp.iter_lines()
        got = [line for line, _ in zip(lines, range(3)) if line.startswith("data: ")]
        actor = next(
            ray.get_actor(a["name"], namespace=a["namespace"])
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith(replica_id)
        )
        ray.kill(actor, no_restart=True)
        rest = [line for line in lines if line.startswith("data: ")]
    assert got and rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]
    s = wait_for(lambda: (s := handle("Prefill").stats.remote().result())["kv_blocks_free"] == s["kv_blocks_total"])
    assert s, "the prefill replica's blocks came back"

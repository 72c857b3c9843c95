"""Multi-LoRA end to end: real Ray Serve, loopback HTTP, the real openai client. The request's `model` picks the
adapter; /v1/models lists the adapters with their parent; adapters load and unload at runtime behind the API key;
lora_modules load at start; the replica's stats report the resident adapters."""

import time
from pathlib import Path
from typing import Iterator

import httpx
import openai
import pytest
from transformers import AutoConfig

from conveyor.engine import LLM, SamplingParams
from conveyor.engine.checkpoints.lora import write_random_adapter
from conveyor.engine.checkpoints.model_source import resolve_model
from conveyor.engine.lora_request import LoRARequest
from tests.serve_app import App, serve_app

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("pool_whole")]

MODEL = "demo:llama-tiny"
KEY = "sk-lora-test-1f2e"
ASK = [{"role": "user", "content": "Tell me about the river."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    hf, root = AutoConfig.from_pretrained(resolve_model(MODEL)), tmp_path_factory.mktemp("adapters")
    return {name: str(write_random_adapter(root / name, hf, MODEL, rank=8, seed=i)) for i, name in enumerate("xy")}


@pytest.fixture(scope="module")
def server(adapters: dict[str, str]) -> Iterator[App]:
    args = {
        "model": MODEL,
        "api_key": KEY,
        "lora_modules": [{"name": "x", "path": adapters["x"]}],
        "engine": {"max_loras": 2, "max_lora_rank": 8},
        "router_replicas": 2,  # a load or unload through one router holds on both
    }
    with serve_app(args, headers={"Authorization": f"Bearer {KEY}"}) as app:
        yield app


def offline_chats(adapters: dict[str, str]) -> dict[str | None, str]:
    """The engine offline (checked against peft in tests/engine/test_lora.py) on the same chat."""
    llm = LLM(MODEL, dtype="float32", max_loras=2, max_lora_rank=8)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = {}
    for name in (None, "x", "y"):
        lora = LoRARequest(name, 1 + "xy".index(name), adapters[name]) if name else None
        out[name] = llm.chat(ASK, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    return out


def test_chat_with_adapters_load_and_unload(server: App, adapters: dict[str, str]) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "x"} and cards["x"].parent == MODEL and cards["x"].root == adapters["x"]

    def chat(model: str) -> openai.types.chat.ChatCompletion:
        return client.chat.completions.create(
            model=model, messages=ASK, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )

    expected = offline_chats(adapters)
    assert len(set(expected.values())) == 3
    base, x = chat(MODEL), chat("x")
    assert base.choices[0].message.content == expected[None]
    assert x.choices[0].message.content == expected["x"] and x.model == "x"
    assert "x" in server.stats()["lora_adapters"]

    with pytest.raises(openai.NotFoundError):
        chat("y")
    load = {"lora_name": "y", "lora_path": adapters["y"]}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=load).status_code == 401
    http = server.http
    assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
    time.sleep(1.0)  # the other router sees the admission actor's registry at its next sync
    for _ in range(8):  # Serve's proxy spreads these over both routers
        assert {m.id for m in client.models.list().data} == {MODEL, "x", "y"}
        assert chat("y").choices[0].message.content == expected["y"]
    stream = client.chat.completions.create(
        model="y", messages=ASK, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected["y"]

    again = http.post("/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(Path(adapters["y"]).parent)})
    assert bad.status_code == 400 and "not a PEFT adapter" in bad.json()["error"]["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "y"}).status_code == 200
    time.sleep(1.0)
    for _ in range(8):
        with pytest.raises(openai.NotFoundError):
            chat("y")
    static = http.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert static.status_code == 400 and "lora_modules" in static.json()["error"]["message"]
    missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "y"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    assert chat("x").choices[0].message.content == expected["x"]

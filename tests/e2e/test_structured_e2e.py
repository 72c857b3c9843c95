"""Structured outputs and tool calling end to end: real Ray Serve, loopback HTTP, the real openai client, and the
trained demo:smollm2 model served with serve_config.yaml's chat template, which renders tools."""

import json
import re
from pathlib import Path
from typing import Iterator, Literal

import jsonschema
import openai
import pytest
import yaml
from pydantic import BaseModel
from ray import serve

from tests.serve_app import App, app_at, free_port, sse_events, start_ray, stop_ray, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("pool_whole")]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "demo:smollm2"
ENGINE = dict(
    dtype="float32", max_num_seqs=8, max_num_batched_tokens=512, block_size=16, num_blocks=96, max_model_len=1024
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a time zone",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 24}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


class Capital(BaseModel):
    country: str
    capital: str
    population_millions: int
    continent: Literal["Europe", "Asia", "Africa", "America", "Oceania"]


@pytest.fixture(scope="module")
def server() -> Iterator[App]:
    from conveyor.deployments.app import deploy

    start_ray()
    port = free_port()
    try:
        shipped = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
        assert shipped["model"] == MODEL
        deploy(
            {
                "model": MODEL,
                "engine": ENGINE,
                "num_replicas": 1,
                "replica_num_cpus": 0.5,
                "router_num_cpus": 0.5,
                "torch_threads": 1,
                "port": port,
                "chat_template": shipped["chat_template"],
            }
        )  # the default's template
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 300)
        app = app_at(url, timeout=120)
        app.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        yield app
    finally:
        serve.shutdown()
        stop_ray()


def test_openai_parse_returns_a_parsed_object(server: App) -> None:
    messages = [{"role": "user", "content": "Give the capital of Japan as JSON."}]
    r = server.client.beta.chat.completions.parse(
        model=MODEL, messages=messages, response_format=Capital, max_tokens=60, temperature=0
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Capital) and r.choices[0].finish_reason == "stop"


def test_structured_outputs_on_completions_and_json_object(server: App) -> None:
    body = {"model": MODEL, "prompt": "The answer is", "max_tokens": 12, "temperature": 0.7, "seed": 1, "n": 2}
    r = server.http.post("/v1/completions", json={**body, "structured_outputs": {"regex": "[0-9]{2,4}"}})
    assert r.status_code == 200, r.text
    assert all(re.fullmatch("[0-9]{2,4}", c["text"]) for c in r.json()["choices"])
    r = server.http.post("/v1/completions", json={**body, "guided_choice": ["yes", "no"]})
    assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no"}
    r = server.http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "A JSON object about a cat"}],
            "max_tokens": 40,
            "temperature": 0,
            "response_format": {"type": "json_object"},
            "user": "someone",
        },
    )
    content = r.json()["choices"][0]["message"]["content"]
    assert content.startswith("{")
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)


def tool_args_valid(call: object, tool: dict) -> dict:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, tool["function"]["parameters"])
    return args


def test_required_tool_choice_returns_a_valid_call(server: App) -> None:
    r = server.client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required", max_tokens=60, temperature=0
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    tool_args_valid(call, tool)
    named = server.client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        max_tokens=60,
        temperature=0.8,
        seed=3,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"
    tool_args_valid(named.choices[0].message.tool_calls[0], TIME)


def test_streamed_tool_call_deltas_reassemble_to_the_same_call(server: App) -> None:
    kw = dict(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    whole = server.client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in server.client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                c["id"] += d.id or ""
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == (
        whole.function.name,
        json.loads(whole.function.arguments),
    )
    assert calls[0]["id"].startswith("call_")


def test_tool_messages_round_trip_through_the_template(server: App) -> None:
    first = (
        server.client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
        )
        .choices[0]
        .message
    )
    call = first.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})},
    ]
    r = server.client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=16, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    plain = server.client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=1)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 20


@pytest.mark.parametrize(
    "body,param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"10": 500}}, "logit_bias"),
        ({"functions": []}, "functions"),
    ],
)
def test_bad_constraints_are_400_and_the_engine_keeps_serving(server: App, body: dict, param: str) -> None:
    r = server.http.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    ok = server.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "guided_regex": "[a-c]{4}"}
    )
    assert ok.status_code == 200 and re.fullmatch("[a-c]{4}", ok.json()["choices"][0]["text"])


def test_streamed_json_schema_chat(server: App) -> None:
    schema = Capital.model_json_schema()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "France as JSON"}],
        "max_tokens": 60,
        "temperature": 0,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}},
    }
    with server.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        events = sse_events(resp)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    jsonschema.validate(json.loads(text), schema)

import asyncio
import json
from dataclasses import asdict

import pytest
from pydantic import ValidationError

import conveyor.deployments.app as apps
import conveyor.deployments.router as router_module
from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.routing import RouterConfig
from conveyor.deployments.api_error import APIError
from conveyor.deployments.protocol import Delta, GenerateRequest
from conveyor.deployments.replica_errors import param_of
from conveyor.deployments.request_models import ChatCompletionRequest, CompletionRequest
from conveyor.deployments.responses import DONE, ResponseBuilder, merge_deltas, sse_error


def delta(
    index: int, text: str, ids: list[int], finish: str | None = None, logprobs: list[dict[int, float]] | None = None
) -> Delta:
    return Delta(index=index, text=text, token_ids=ids, logprobs=logprobs, finish_reason=finish)


def parse(chunk: str) -> dict:
    assert chunk.startswith("data: ") and chunk.endswith("\n\n")
    return json.loads(chunk[len("data: ") :])


def test_completion_request_defaults_and_sampling() -> None:
    req = CompletionRequest(model="demo:tiny", prompt="hi", temperature=0, stop="x", seed=3, top_k=5, priority=2)
    assert req.max_tokens == 16 and req.n == 1 and not req.stream
    sp = req.sampling(req.max_tokens)
    assert sp["temperature"] == 0 and sp["top_k"] == 5 and sp["stop"] == "x" and sp["seed"] == 3
    assert "top_p" not in sp and sp["logprobs"] is None and sp["n"] == 1
    assert CompletionRequest(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert CompletionRequest(prompt=[[1, 2], [3]]).prompt == [[1, 2], [3]]
    assert CompletionRequest(prompt=["a", "b"], logprobs=2).sampling(4)["logprobs"] == 2
    assert CompletionRequest(prompt="x", top_k=0).sampling(4)["top_k"] == -1


@pytest.mark.parametrize(
    "body,field",
    [
        ({}, "prompt"),
        ({"prompt": "x", "temperature": -1}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "top_p": 1.5}, "top_p"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": {"a": 1}}, "prompt"),
        ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        ({"prompt": "x", "stream_options": {"include_usage": "maybe"}}, "stream_options"),
    ],
)
def test_completion_request_rejects(body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    assert e.value.errors()[0]["loc"][0] == field


def test_chat_request() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "logprobs": True,
            "top_logprobs": 3,
            "max_completion_tokens": 7,
        }
    )
    assert [m.render() for m in req.messages] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "ab"},
    ]
    assert req.num_logprobs() == 3 and req.max_tokens is None and req.max_completion_tokens == 7
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], logprobs=True).num_logprobs() == 0
    assert ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=3).num_logprobs() is None
    for bad in (
        {"messages": []},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": "hi"},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30},
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(bad)


def test_error_shape() -> None:
    e = APIError("bad temperature", param="temperature")
    assert e.response().model_dump() == {
        "error": {"message": "bad temperature", "type": "invalid_request_error", "param": "temperature", "code": 400}
    }
    nf = APIError("no such model", status=404, type="not_found_error", code="model_not_found").response()
    assert nf.error.code == "model_not_found" and nf.error.type == "not_found_error"
    assert parse(sse_error("boom"))["error"]["message"] == "boom"
    assert GenerateRequest(prompts=[[1]]).request_id


def test_merge_deltas() -> None:
    merged = merge_deltas(
        [
            delta(0, "a", [1], logprobs=[{1: -0.1}]),
            delta(1, "x", [9]),
            delta(0, "b", [2], "length", logprobs=[{2: -0.2}]),
        ]
    )
    assert merged[0] == delta(0, "ab", [1, 2], "length", [{1: -0.1}, {2: -0.2}])
    assert merged[1] == delta(1, "x", [9])


def decode(t: int) -> str:
    return f"<{t}>"


def test_completion_stream_and_usage() -> None:
    b = ResponseBuilder(False, "cmpl-1", "demo:tiny", 2, prompt_tokens=5, num_logprobs=None, decode=decode)
    chunks = b.chunks([delta(0, "He", [1, 2]), delta(1, "Yo", [7])]) + b.chunks(
        [delta(0, "llo", [3], "stop"), delta(1, "", [], "length")]
    )
    objs = [parse(c) for c in chunks]
    assert all(o["object"] == "text_completion" and o["id"] == "cmpl-1" and len(o["choices"]) == 1 for o in objs)
    assert "".join(o["choices"][0]["text"] for o in objs if o["choices"][0]["index"] == 0) == "Hello"
    assert [o["choices"][0]["finish_reason"] for o in objs] == [None, None, "stop", "length"]
    usage = parse(b.usage_chunk())
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert DONE == "data: [DONE]\n\n"


def test_chat_stream_role_then_content() -> None:
    b = ResponseBuilder(True, "chatcmpl-1", "m", 1, prompt_tokens=3, num_logprobs=1, decode=decode)
    first = parse(b.chunks([delta(0, "Hi", [5], logprobs=[{5: -0.5, 6: -1.0}])])[0])
    assert first["object"] == "chat.completion.chunk"
    choice = first["choices"][0]
    assert choice["delta"] == {"role": "assistant", "content": "Hi"} and choice["finish_reason"] is None
    assert choice["logprobs"]["content"][0]["token"] == "<5>"
    assert choice["logprobs"]["content"][0]["top_logprobs"] == [
        {"token": "<5>", "logprob": -0.5, "bytes": list(b"<5>")}
    ]
    last = parse(b.chunks([delta(0, "!", [6], "stop", logprobs=[{6: -0.25}])])[0])["choices"][0]
    assert last["delta"] == {"content": "!"} and last["finish_reason"] == "stop"
    assert parse(b.usage_chunk())["usage"]["completion_tokens"] == 2


def test_whole_responses_with_logprobs() -> None:
    b = ResponseBuilder(False, "cmpl-2", "m", 1, prompt_tokens=2, num_logprobs=2, decode=decode)
    b.add([delta(0, "ab", [1, 2], logprobs=[{1: -0.1, 3: -2.0}, {2: -0.3}])])
    b.add([delta(0, "c", [4], "length", logprobs=[{4: -0.7, 1: -0.2}])])
    r = b.response().model_dump()
    assert r["object"] == "text_completion" and r["usage"] == {
        "prompt_tokens": 2,
        "completion_tokens": 3,
        "total_tokens": 5,
    }
    c = r["choices"][0]
    assert c["text"] == "abc" and c["finish_reason"] == "length"
    assert c["logprobs"]["tokens"] == ["<1>", "<2>", "<4>"]
    assert c["logprobs"]["token_logprobs"] == [-0.1, -0.3, -0.7]
    assert c["logprobs"]["text_offset"] == [0, 3, 6]
    assert list(c["logprobs"]["top_logprobs"][2]) == ["<1>", "<4>"]

    chat = ResponseBuilder(True, "chatcmpl-2", "m", 2, prompt_tokens=4, num_logprobs=None, decode=decode)
    chat.add([delta(1, "x", [1], "stop"), delta(0, "y", [2])])
    chat.add([delta(0, "z", [3], "length")])
    r = chat.response().model_dump()
    assert r["object"] == "chat.completion"
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in r["choices"]] == [
        (0, "yz", "length"),
        (1, "x", "stop"),
    ]
    assert r["choices"][0]["message"]["role"] == "assistant" and r["usage"]["completion_tokens"] == 3


def test_router_error_handlers() -> None:
    from fastapi.exceptions import RequestValidationError

    try:
        CompletionRequest.model_validate({"prompt": "x", "temperature": -1})
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
    handler = router_module.app.exception_handlers[RequestValidationError]
    resp = asyncio.run(handler(None, RequestValidationError(errors)))
    body = json.loads(resp.body)
    assert resp.status_code == 400 and body["error"]["param"] == "temperature"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert param_of("SamplingParams.min_tokens must be in [0, max_tokens=3]") == "min_tokens"
    assert param_of("prompt + max_tokens (9 + 9) needs 2 KV blocks but the cache holds 1") == "max_tokens"
    assert param_of("prompt_token_ids: 9 is outside the vocabulary [0, 8)") == "prompt"


def test_app_args_fail_naming_the_field() -> None:
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary as build

    assert build(apps.build_app, {"engine": {"max_num_seqs": 4}}) is not None
    for bad, field in [
        ({"num_replicas": 0}, "num_replicas"),
        ({"engine": {"max_num_seqs": 0}}, "engine.max_num_seqs"),
        ({"engine": {"bogus": 1}}, "engine.bogus"),
        ({"model": "no/such/dir"}, "model"),
        ({"replicas": 2}, "replicas"),
        ({"port": 70000}, "port"),
        ({"autoscaling": {"max_replicas": 0}}, "max_replicas"),
        ({"admission": {"bogus": 1}}, "admission.bogus"),
        ({"admission": {"high_watermark": 0.5, "low_watermark": 0.8}}, "admission.low_watermark"),
        ({"admission": {"hot_fraction": 2}}, "admission.hot_fraction"),
        ({"request_router": {"affinity": 1}}, "request_router.affinity"),
        ({"request_router": {"block_size": 32}}, "request_router.block_size"),
        ({"admission": {"affinity_weight": 2.0}}, "admission.affinity_weight: set it under request_router"),
        ({"admission": None}, "admission"),
        ({"admission": {"enabled": "sometimes"}}, "admission.enabled"),
        ({"kv_autoscaling": {"policy": {"tolerance": 2}}}, "kv_autoscaling.policy.tolerance"),
        ({"kv_autoscaling": {"min_replicas": 3, "max_replicas": 2}}, "kv_autoscaling.max_replicas"),
        ({"kv_autoscaling": {}, "autoscaling": {"max_replicas": 2}}, "autoscaling"),
        ({"stats_push_s": 0.5}, "stats_push_s"),
    ]:
        with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
            build(apps.build_app, bad)


def test_replica_placement() -> None:
    opts = apps.AppArgs(engine={"tensor_parallel_size": 2, "device": "cpu"}, replica_num_cpus=0.5).replica_options()
    assert opts["placement_group_bundles"] == [{"CPU": 0.5}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert opts["placement_group_strategy"] == "STRICT_PACK" and opts["ray_actor_options"]["num_cpus"] == 0.5
    assert opts["ray_actor_options"]["runtime_env"]["env_vars"]["OMP_NUM_THREADS"] == "1"
    gpu = apps.AppArgs(engine={"device": "cuda"}, autoscaling={"min_replicas": 1, "max_replicas": 3}).replica_options()
    assert gpu["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 1.0}] and gpu["num_replicas"] == "auto"
    assert gpu["ray_actor_options"]["num_gpus"] == 1.0 and gpu["max_ongoing_requests"] >= 256
    tp = apps.AppArgs(engine={"tensor_parallel_size": 2, "device": "cuda"}).replica_options()
    assert tp["placement_group_bundles"] == [{"CPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}]
    assert tp["ray_actor_options"]["num_gpus"] == 0


def test_cluster_layer_options() -> None:
    from ray.serve._private.autoscaling_state import _resolve_policy_callable

    from conveyor.cluster.autoscaling import KVCacheAutoscalingPolicy

    opts = apps.AppArgs(
        engine={"block_size": 32},
        request_router={"affinity_weight": 2.0},
        kv_autoscaling={
            "min_replicas": 1,
            "max_replicas": 3,
            "initial_replicas": 2,
            "policy": {"target_kv_utilization": 0.6, "downscale_delay_s": 9},
        },
    ).replica_options()
    scaling = opts["autoscaling_config"]
    assert opts["num_replicas"] == "auto" and (scaling.min_replicas, scaling.max_replicas) == (1, 3)
    assert scaling.upscale_delay_s == scaling.downscale_delay_s == 0  # the policy's own delays apply instead
    policy = _resolve_policy_callable(scaling.policy)
    assert isinstance(policy, KVCacheAutoscalingPolicy) and policy.config.target_kv_utilization == 0.6
    router = opts["request_router_config"]
    assert router.request_router_class == "conveyor.cluster.routing:KVAwareRequestRouter"
    assert router.request_router_kwargs == {**asdict(RouterConfig()), "affinity_weight": 2.0, "block_size": 32}
    (actor,) = opts["deployment_actors"]
    admission = {**asdict(AdmissionConfig()), "affinity_weight": 2.0, "block_size": 32}
    assert actor.name == "admission" and actor.init_kwargs == {"config": admission}
    slo = apps.AppArgs(admission={"max_queue_time_s": 2.0}).replica_options()["deployment_actors"][0]
    assert slo.init_kwargs["config"]["max_queue_time_s"] == 2.0
    off = {"enabled": False}
    bare = apps.AppArgs(admission=off, request_router=off).replica_options()
    assert "request_router_config" not in bare and "deployment_actors" not in bare and bare["num_replicas"] == 1
    # admission ranks with request_router's weights, whether or not the KV-aware router is on
    blind = apps.AppArgs(request_router={"enabled": False, "queue_weight": 0.9, "lora_affinity": False})
    (actor,) = blind.replica_options()["deployment_actors"]
    assert actor.init_kwargs["config"]["queue_weight"] == 0.9 and actor.init_kwargs["config"]["lora_affinity"] is False

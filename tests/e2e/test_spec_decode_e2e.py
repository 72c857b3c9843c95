"""A speculative-decoding deployment end to end: real Ray Serve, loopback HTTP, the real openai client,
demo:smollm2 with n-gram drafts, then with a draft model (SmolLM2 itself: every greedy draft accepted). A request
asking for logprobs decodes without drafts (engine/core/spec_decode), so the same server gives the
non-speculative output to compare with."""

from typing import Iterator

import openai
import pytest
from ray import serve

from tests.serve_app import App, app_at, assert_pool_whole, free_port, start_ray, stop_ray, wait_ready

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("pool_whole")]

MODEL = "demo:smollm2"
ENGINE = dict(
    dtype="float32",
    max_num_seqs=8,
    max_num_batched_tokens=256,
    block_size=16,
    num_blocks=96,
    max_model_len=1024,
)
SPECULATIVE = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "draft": {"method": "draft", "model": MODEL, "num_speculative_tokens": 4},
}
PASSAGE = (
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
    "members agreed to increase funding for the library and to reduce spending on travel."
)
ASK = [{"role": "user", "content": f"Rewrite this passage, replacing 'Tuesday' with 'Friday':\n\n{PASSAGE}"}]


@pytest.fixture(scope="module", params=list(SPECULATIVE))
def server(request: pytest.FixtureRequest) -> Iterator[App]:
    from conveyor.deployments.app import deploy

    start_ray()
    port = free_port()
    try:
        deploy(
            {
                "model": MODEL,
                "engine": {**ENGINE, "speculative": SPECULATIVE[request.param]},
                "num_replicas": 1,
                "replica_num_cpus": 0.5,
                "router_num_cpus": 0.5,
                "torch_threads": 1,
                "port": port,
            }
        )
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, 300)
        app = app_at(url, timeout=120)
        app.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        yield app
    finally:
        serve.shutdown()
        stop_ray()


def test_speculative_chat_equals_plain_decoding(server: App) -> None:
    kw = dict(model=MODEL, messages=ASK, max_tokens=48, temperature=0)
    spec = server.client.chat.completions.create(**kw)
    plain = server.client.chat.completions.create(**kw, logprobs=True)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert "Friday" in spec.choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in server.client.chat.completions.create(**kw, stream=True) if c.choices
    )
    assert streamed == spec.choices[0].message.content
    sampled = server.client.chat.completions.create(**{**kw, "temperature": 0.8, "max_tokens": 24})
    assert sampled.usage.completion_tokens == 24 or sampled.choices[0].finish_reason == "stop"
    s = server.stats()
    assert 0 < s["spec_decode_num_accepted_tokens"] <= s["spec_decode_num_draft_tokens"]
    metrics = server.http.get("/metrics").text
    assert "conveyor:spec_decode_num_accepted_tokens_total" in metrics
    assert_pool_whole(server)

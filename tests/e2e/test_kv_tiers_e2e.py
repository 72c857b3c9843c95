"""The KV tier over HTTP: a replica whose pool holds a fraction of its conversations' histories, with a host
tier (`engine.kv_offload` in the app arguments), serves a multi-turn workload to the real openai client with
the same greedy text as an engine without the tier, loading the evicted histories back from the tier."""

import openai
import pytest

from conveyor.engine import LLM, SamplingParams
from tests.serve_app import assert_pool_whole, serve_app

pytestmark = pytest.mark.slow
POOL = dict(dtype="float32", num_blocks=24, block_size=8, max_num_batched_tokens=64, max_model_len=256)


def turns(n: int = 4, rounds: int = 2) -> list[list[list[int]]]:
    return [
        [[(17 * c + 5 * r + i) % 200 + 10 for i in range(64 if r == 0 else 6)] for r in range(rounds)] for c in range(n)
    ]


def test_multi_turn_chat_over_http_hits_the_host_tier_with_identical_text() -> None:
    convs = turns()
    reference = LLM("demo:tiny", **POOL)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with serve_app({"engine": {**POOL, "kv_offload": {"host_gib": 0.001}}}) as app:
        # a 24-block pool: admission may answer 429 until the replica's stats settle its reservations; the client
        # retries after Retry-After, as a user's would
        client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=10)
        history: list[list[int]] = [[] for _ in convs]
        for r in range(len(convs[0])):
            for i, conv in enumerate(convs):
                prompt = history[i] + conv[r]
                got = client.completions.create(
                    model="demo:tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
                )
                want = reference.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
                assert got.choices[0].text == want.text
                history[i] = prompt + list(want.token_ids)
        stats = app.stats()  # the replica engine's own, read at once
        assert stats["kv_tier_hits"]["host"] > 0 and stats["kv_tier_loads"] == stats["kv_tier_hits"]["host"]
        assert_pool_whole(app)

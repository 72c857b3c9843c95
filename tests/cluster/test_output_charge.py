"""What admission charges a request's outputs: growth to max_tokens, or the replica's likely output length (the
quantile of recent outputs, a prior while cold), as the engine reports it."""

import math
import time

import pytest

from conveyor.cluster.admission_controller import AdmissionController
from conveyor.cluster.stats import ReplicaStats
from tests.cluster.replica_stats import stats


def test_admission_charges_max_tokens_growth():
    c = AdmissionController()  # 2 running with 30 + 50 tokens left: 5 more blocks at 16 tokens each
    c.update(ReplicaStats.from_dict({**stats("a", free=40, running=2), "tokens_left": [30, 50]}), 0.0)
    assert c.room("a") == 35 and not c.decide(10, 0.0, output_tokens=480).admit
    d = c.decide(10, 0.0, output_tokens=240)  # 35 room less 10 kept above the 0.90 high watermark
    assert d.admit and d.new_blocks == 25
    assert not c.decide(10, 0.0, output_tokens=241).admit
    assert not c.decide(10, 0.0, output_tokens=120, num_seqs=2).admit  # 2 sequences of 8 blocks each


def test_admission_charges_the_likely_output_not_an_unset_max_tokens():
    """A client that leaves max_tokens unset asks for the rest of the context (2048 - prompt here): charged that,
    one request takes a whole replica. Once the replica reports how long outputs run, it is charged that instead,
    and never more than its own max_tokens."""
    c = AdmissionController()
    c.update(ReplicaStats.from_dict(stats("a", free=60, running=1)), 0.0)
    assert c.decide(2, 0.0, output_tokens=2000).reason == "no_room"
    c.update(ReplicaStats.from_dict({**stats("a", free=60, running=1, ts=0.1), "likely_output_tokens": 150}), 0.1)
    d = c.decide(2, 0.1, output_tokens=2000)
    assert d.admit and d.new_blocks == 2 + 10
    assert c.decide(2, 0.1, output_tokens=20).new_blocks == 2 + 2


def test_output_lengths_quantile_of_the_longer_recent_outputs():
    from conveyor.engine.core.output_lengths import OutputLengths

    lengths = OutputLengths(window=20, quantile=0.9, min_samples=10)
    for n in range(1, 10):
        lengths.add(n * 10)
    assert lengths.typical() == 0 and lengths.likely_total(0, 500) == 500  # too few to say
    lengths.add(100)  # 10, 20, ..., 100
    assert lengths.typical() == 90
    assert lengths.likely_total(0, 500) == 90 and lengths.likely_total(0, 40) == 40
    assert lengths.likely_total(75, 500) == 100  # of those longer than 75: 80, 90, 100
    assert lengths.likely_total(100, 500) == 500  # longer than all seen: charged in full
    for _ in range(20):
        lengths.add(5)  # the window forgets the old lengths
    assert sorted(lengths.recent) == lengths.sorted == [5] * 20 and lengths.typical() == 5
    with pytest.raises(ValueError):
        OutputLengths(quantile=0.0)
    cold = OutputLengths(min_samples=10, prior=64)  # before 10 have finished: the prior, at most max_tokens
    assert cold.typical() == 64 and cold.likely_total(0, 500) == 64 and cold.likely_total(0, 40) == 40
    assert cold.likely_total(64, 500) == 500  # outlived the prior: charged in full


def test_a_cold_replica_expects_its_prior_not_an_unset_max_tokens():
    """Before 16 requests have finished, a request that asks for the rest of the context is expected to run
    EngineConfig.cold_output_tokens (256), and the replica reports that as a new request's likely length, so
    admission charges 16 blocks, not 125; cold_output_tokens 0 charges max_tokens as before."""
    from conveyor.engine import LLM, SamplingParams

    for prior, likely, left in ((256, 256, 255), (0, 0, 1999)):
        llm = LLM(
            "demo:tiny",
            dtype="float32",
            num_blocks=256,
            block_size=16,
            max_num_batched_tokens=512,
            cold_output_tokens=prior,
        )
        llm.engine.add_request("r", list(range(5, 25)), SamplingParams(max_tokens=2000, ignore_eos=True))
        llm.engine.step()
        s = llm.engine.stats()
        assert (s.likely_output_tokens, s.tokens_left) == (likely, [left])
        c = AdmissionController()
        c.update(ReplicaStats.from_engine("r", s), 0.0)
        assert c.output_blocks("r", 2000) == (16 if prior else 125)
        llm.shutdown()


def test_growth_blocks_count_running_and_waiting_requests_to_max_tokens():
    """The engine's stat that admission charges: every request's blocks still to come if it runs to
    max_tokens, waiting ones included (before, only running requests' tokens_left were summed)."""
    from conveyor.engine import LLM, SamplingParams

    llm = LLM("demo:tiny", dtype="float32", num_blocks=64, block_size=16, max_num_seqs=1, max_num_batched_tokens=64)
    engine = llm.engine
    for i, (prompt, out) in enumerate([(20, 30), (40, 100)]):
        engine.add_request(str(i), list(range(5, 5 + prompt)), SamplingParams(max_tokens=out, ignore_eos=True))
    engine.step()  # request 0 runs (its 20 prompt tokens in 2 blocks, 1 sampled), request 1 waits (one sequence)
    s = engine.stats()
    assert (s.num_running, s.num_waiting) == (1, 1)
    running = math.ceil((20 + 30) / 16) - 2  # 4 blocks at max_tokens, 2 held
    waiting = math.ceil((40 + 100) / 16) - math.ceil(40 / 16)  # its prompt's 3 blocks are in num_waiting_tokens
    assert s.num_growth_blocks == running + waiting == 2 + 6
    assert s.demand_blocks() == s.kv_blocks_used + math.ceil(s.num_waiting_tokens / 16) + 8  # autoscaling's metric
    c = AdmissionController()
    c.update(ReplicaStats.from_engine("r", s), 0.0)
    assert c.room("r") == s.kv_blocks_free - math.ceil(s.num_waiting_tokens / 16) - 8
    core = engine.core.core  # the EngineCore, in process; the recount is rate-limited while the same requests run...
    assert core.growth_blocks(every_s=1e9) == 8
    while engine.has_unfinished_requests():
        engine.step()
    assert core.growth_blocks(every_s=1e9) == 0  # ...but not once they leave: no phantom growth on an idle replica


def test_engine_bounds_growth_by_how_long_outputs_run():
    """Requests that ask for 200 tokens but stop at 12 (max_tokens here stands for a stop): once 16 have finished,
    a new one's growth and tokens_left count 12 tokens, not 200, and the replica reports 12 as a new request's
    likely length. A request that outlives every finished one is charged its max_tokens again."""
    from conveyor.engine import LLM, SamplingParams

    llm = LLM("demo:tiny", dtype="float32", num_blocks=256, block_size=16, max_num_seqs=16, max_num_batched_tokens=512)
    llm.generate(
        [{"prompt_token_ids": [5 + i] * 20} for i in range(16)], SamplingParams(max_tokens=12, ignore_eos=True)
    )
    core = llm.engine.core.core
    assert core.stats().likely_output_tokens == 12
    engine = llm.engine
    engine.add_request("long", list(range(5, 25)), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    s = engine.stats()
    assert s.tokens_left == [12 - 1] and s.num_growth_blocks == math.ceil(32 / 16) - 2  # 20 + 12 in 2 blocks
    for _ in range(12):
        engine.step()
    time.sleep(0.05)  # while the same requests run, the growth count may be up to 20 ms old (EngineCore.growth_blocks)
    s = engine.stats()
    assert s.tokens_left == [200 - 13] and s.num_growth_blocks == math.ceil(220 / 16) - s.kv_blocks_used

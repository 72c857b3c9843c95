"""LoRA-aware routing without a Ray cluster: replicas reporting the adapter resident are preferred (by the
KV-aware request router and by admission's ranking) unless their queue is much longer; otherwise the adapter
goes to the best-scored, least-loaded replica."""

import asyncio
from types import SimpleNamespace

from conveyor.cluster.admission_controller import AdmissionController
from conveyor.cluster.routing import RoutingHint
from conveyor.cluster.score import LORA_MAX_IMBALANCE, prefer_resident
from conveyor.cluster.stats import ReplicaStats
from conveyor.engine.stats import EngineStats
from tests.cluster.fake_replicas import FakeReplica, _router


def es(running: int, adapters: list[str]) -> dict:
    return EngineStats(num_running=running, kv_blocks_total=100, kv_blocks_free=90, lora_adapters=adapters).to_dict()


def test_prefer_resident_keeps_order_and_bounds_imbalance() -> None:
    assert prefer_resident(["a", "b", "c"], {"c"}, {"a": 0, "c": 3}) == ["c", "a", "b"]
    assert prefer_resident(["a", "b"], set(), {}) == ["a", "b"]
    assert prefer_resident(["a", "b"], {"b"}, {"a": 0, "b": LORA_MAX_IMBALANCE + 1}) == ["a", "b"]


def test_request_router_prefers_the_replica_holding_the_adapter() -> None:
    router = _router()
    reps = [FakeReplica("r1", es(0, [])), FakeReplica("r2", es(3, ["x"]))]

    def first(lora: str | None) -> str:
        hint = RoutingHint.from_token_ids(list(range(20)), 16, lora=(lora, f"{lora}\x00/p") if lora else None)
        pr = SimpleNamespace(args=[], kwargs={"routing_hint": hint}, routing_context=SimpleNamespace())
        return asyncio.run(router.choose_replicas(reps, pr))[0][0].replica_id.unique_id, pr

    assert first(None)[0] == "r1"  # base model: the idle replica
    assert first("x")[0] == "r2"  # the adapter is resident on r2
    rid, pr = first("y")  # resident nowhere: the least loaded, which then counts as holding it
    assert rid == "r1"
    router.on_request_routed(pr, reps[0].replica_id, None)
    reps[0].routing_stats = es(5, [])
    assert first("y")[0] == "r1"
    reps[1].routing_stats = es(3 + LORA_MAX_IMBALANCE + 5, ["x"])  # overloaded: x loads elsewhere
    assert first("x")[0] == "r1"


def test_admission_ranks_replicas_holding_the_adapter_first() -> None:
    c = AdmissionController()
    stats = {"a": es(0, []), "b": es(2, ["x"])}
    for rid, d in stats.items():
        c.update(ReplicaStats.from_dict({**d, "replica_id": rid}), now=0.0)
    assert c.decide(2, 0.0).replicas[0] == "a"
    assert c.decide(2, 0.0, lora="x").replicas == ["b", "a"]
    assert c.decide(2, 0.0, lora="z").replicas[0] == "a"

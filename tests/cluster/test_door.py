"""The admission door (cluster/door.py): it closes exactly when `decide` would refuse any request for queue
time, counting the requests a router has let in but not decided as queued ahead."""

import random

import pytest

from conveyor.cluster.admission_config import AdmissionConfig
from conveyor.cluster.admission_controller import AdmissionController
from conveyor.cluster.door import past_objective, shortest_queue_time
from conveyor.cluster.stats import ReplicaStats


def door_wait(c: AdmissionController, now: float, undecided: int = 0) -> float | None:
    """What the router's door (deployments/door.py) refuses on: the shortest queue time, once past the objective."""
    wait = shortest_queue_time(c, now, undecided)
    return wait if past_objective(c, wait) else None


def replica(rid: str, waiting: int = 3, busy: float = 0.0, finished: int = 0, ts: float = 0.0) -> ReplicaStats:
    return ReplicaStats(
        rid,
        num_running=8,
        num_waiting=waiting,
        kv_blocks_total=1000,
        kv_blocks_free=900,
        num_finished=finished,
        max_num_seqs=8,
        busy_time_s=busy,
        num_prefill_tokens=4000 if busy else 0,
        timestamp=ts,
    )


def controller(limit: float = 2.0, replicas: str = "ab") -> AdmissionController:
    """Replicas full of running requests, 3 waiting each, finishing 4 requests per second: a request sent now
    waits (3 + reserved + 1) / 4 s."""
    c = AdmissionController(AdmissionConfig(max_queue_time_s=limit, queue_time_safety=1.0))
    for rid in replicas:
        c.update(replica(rid), 0.0)
        c.update(replica(rid, busy=1.0, finished=4, ts=1), 0.1)
    return c


def test_the_door_closes_when_every_queue_is_past_the_objective() -> None:
    c = controller()
    assert door_wait(c, 0.1) is None  # 1 s of queue on each
    for rid in "ab":
        for _ in range(5):
            c.reserve(rid, 1, 0.1)
    assert door_wait(c, 0.1) == pytest.approx(2.25)
    d = c.decide(1, 0.1)
    assert (d.admit, d.reason, d.queue_time_s) == (False, "queue_time", pytest.approx(2.25))


def test_undecided_requests_count_as_queued_spread_over_the_open_replicas() -> None:
    c = controller()
    assert door_wait(c, 0.1, undecided=8) is None  # 4 more on each: (3 + 4 + 1) / 4 = 2.0, within
    assert door_wait(c, 0.1, undecided=9) == pytest.approx(2.25)  # 5 on one of them, 4 on the other
    one = controller(replicas="a")
    assert door_wait(one, 0.1, undecided=4) is None and door_wait(one, 0.1, undecided=5) == pytest.approx(2.25)


def test_with_several_routers_a_routers_undecided_count_once_per_router() -> None:
    """The ingress spreads a burst evenly: while this router has let in 4, each of the others has too."""
    c = controller()
    c.num_routers = 2
    assert door_wait(c, 0.1, undecided=4) is None  # 8 in all: 4 more on each, within
    assert door_wait(c, 0.1, undecided=5) == pytest.approx(2.25)  # 10 in all: 5 on one of them


def test_the_door_stays_open_without_a_fresh_view_or_an_objective() -> None:
    c = controller()
    for rid in "ab":
        for _ in range(5):
            c.reserve(rid, 1, 0.1)
    assert door_wait(c, 0.1 + c.config.drop_after_s + 1) is None  # nothing fresh: `decide` answers
    assert door_wait(controller(limit=0.0), 0.1, undecided=100) is None  # no queue-time objective
    assert door_wait(AdmissionController(AdmissionConfig(max_queue_time_s=2.0)), 0.0, undecided=100) is None


def test_whenever_the_door_is_closed_decide_refuses_every_size() -> None:
    rng = random.Random(0)
    closed = 0
    for _ in range(200):
        c = controller(limit=rng.choice([0.5, 1.0, 2.0, 3.0]))
        for rid in "ab":
            for _ in range(rng.randrange(0, 10)):
                c.reserve(rid, rng.randrange(0, 4), 0.1)
        wait = door_wait(c, 0.1)
        if wait is None:
            continue
        closed += 1
        for blocks in (1, 8, 64):
            d = c.decide(blocks, 0.1, output_tokens=rng.randrange(0, 64))
            assert not d.admit and d.reason == "queue_time" and d.queue_time_s == pytest.approx(wait)
    assert 20 < closed < 200

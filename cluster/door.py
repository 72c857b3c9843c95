"""Refusing at the door: while every replica's queue is past the queue-time objective, admission refuses any
request whatever its size, so a router can refuse a generation request before reading or parsing its body.
The requests a router has let in but not yet decided are ahead of the next one: they count as queued (one
request each, their prompts unread), so under a burst the door closes once enough are inside to fill the
queues, not only after admission has worked through them. A router's own undecided count once per router, as
its own reservations do (ReplicaView.reserved): the others, balanced evenly by the ingress, let in as many
meanwhile, and a sync is far slower than a burst.

Past a quarter of the objective (`queueing`) the replicas are queueing for real: a router then marks its node
so that the node's engine cores yield the CPU to it (deployments/door.py)."""

from conveyor.cluster.admission_controller import AdmissionController
from conveyor.engine.stats import cdiv

QUEUEING_SHARE = 0.25


def shortest_queue_time(controller: AdmissionController, now: float, undecided: int = 0) -> float | None:
    """The shortest queue time over the fresh, open replicas, with `undecided` requests (this router's; counted
    once per router) spread evenly over them; None while the objective is off or no replica is fresh and open
    (`decide` answers those: it waits for a view, or queues the request for room)."""
    open_ = [rid for rid, e in controller.replicas.items() if controller.open(e, now)]
    if controller.config.max_queue_time_s <= 0 or not open_:
        return None
    ahead = cdiv(undecided * controller.num_routers, len(open_))
    return min(controller.queue_time(rid, extra_requests=ahead) for rid in open_)


def past_objective(controller: AdmissionController, wait: float | None) -> bool:
    return wait is not None and wait > controller.config.max_queue_time_s


def queueing(controller: AdmissionController, wait: float | None) -> bool:
    return wait is not None and wait > QUEUEING_SHARE * controller.config.max_queue_time_s

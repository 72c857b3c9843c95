"""Refusing at the door: while every replica's queue is past the queue-time objective, admission refuses any
request whatever its size, so a router can refuse a generation request before reading or parsing its body.
The requests a router has let in but not yet decided are ahead of the next one: they count as queued (one
request each, their prompts unread), so under a burst the door closes once enough are inside to fill the
queues, not only after admission has worked through them."""

from conveyor.cluster.admission_controller import AdmissionController
from conveyor.engine.stats import cdiv


def door_wait(controller: AdmissionController, now: float, undecided: int = 0) -> float | None:
    """The shortest queue time, with `undecided` requests spread evenly over the fresh, open replicas, while it
    is past `max_queue_time_s`; None otherwise, also while no replica is fresh and open (`decide` answers
    those: it waits for a view, or queues the request for room)."""
    limit = controller.config.max_queue_time_s
    open_ = [rid for rid, e in controller.replicas.items() if controller.open(e, now)]
    if limit <= 0 or not open_:
        return None
    ahead = cdiv(undecided, len(open_))
    best = min(controller.queue_time(rid, extra_requests=ahead) for rid in open_)
    return best if best > limit else None

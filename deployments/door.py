"""The router's door: a generation request is refused before its body is read while admission would refuse any
request (cluster/door.py), counting those let in and not yet decided as ahead of it. A request is undecided
from the door until admission's verdict, or until it ends without one (a validation error, a client gone).

Refusals go first. A request the door lets in while the replicas have a queue waits, body unread, for half its
predicted wait (at most MAX_HOLD_S; released in arrival order): a burst's refusals are answered meanwhile, not
after every admitted request ahead of them has been read, tokenised and sent. Its queue time is not judged again
by admission (the door judged it, counting it as ahead of those after it). While the replicas are queueing for
real (cluster.door.queueing), or admission refuses for load, the router marks its node shedding, so the node's
engine cores yield the CPU to it (core_priority.mark_shedding). The evidence:
docs/decisions/18-door-first-under-a-burst.md."""

import asyncio
import contextvars
from typing import Callable

from conveyor.cluster.admission_actor import AdmissionClient
from conveyor.cluster.door import past_objective, queueing, shortest_queue_time
from conveyor.cluster.queue_time import retry_after_s
from conveyor.deployments.api_error import APIError, queue_time_error
from conveyor.engine.process.core_priority import mark_shedding

MAX_HOLD_S = 1.0
MARK_EVERY_S = 0.1
LOAD_REFUSALS = ("queue_time", "no_room", "saturated")  # admission's refusals for load: the node sheds


class Ticket:
    def __init__(self, door: "Door", hold_s: float) -> None:
        self.door: Door | None = door
        self.hold_s = hold_s

    def decided(self) -> None:
        if self.door is not None:
            self.door.undecided -= 1
            self.door = None


_ticket: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("door_ticket", default=None)


class Door:
    def __init__(
        self,
        gate: AdmissionClient,
        on_refusal: Callable[[], None] = lambda: None,
        mark: Callable[[], None] = mark_shedding,
    ) -> None:
        self.gate, self.on_refusal, self.mark = gate, on_refusal, mark
        self.undecided = 0
        self.released_at = float("-inf")  # when the last held request goes on
        self.marked_at = float("-inf")

    def enter(self) -> APIError | None:
        """The refusal for a generation request arriving now, or None: it is let in and undecided until
        `decided()` (in the same task); `hold()` next."""
        controller, now = self.gate.controller, self.gate.clock()
        wait = shortest_queue_time(controller, now, self.undecided)
        if queueing(controller, wait):
            self.shed()
        if past_objective(controller, wait):
            self.on_refusal()
            limit, retry = controller.config.max_queue_time_s, controller.config.retry_after_s
            return queue_time_error(limit, wait, retry_after_s(wait, limit, retry))
        self.undecided += 1
        hold = min(wait / controller.config.queue_time_safety / 2, MAX_HOLD_S) if wait else 0.0
        _ticket.set(Ticket(self, hold))
        return None

    def shed(self) -> None:
        """Mark the node shedding (at most every MARK_EVERY_S): its replicas are queueing, or admission refused a
        request for load."""
        now = self.gate.clock()
        if now - self.marked_at >= MARK_EVERY_S:
            self.marked_at = now
            self.mark()

    async def hold(self) -> None:
        """Wait out the current task's hold, in arrival order."""
        ticket = _ticket.get()
        if ticket is None or ticket.hold_s <= 0:
            return
        now = self.gate.clock()
        self.released_at = max(self.released_at, now + ticket.hold_s)
        await asyncio.sleep(self.released_at - now)

    @staticmethod
    def judged() -> bool:
        """The door judged the current task's queue time (it was held): admission need not."""
        ticket = _ticket.get()
        return ticket is not None and ticket.hold_s > 0

    @staticmethod
    def decided() -> None:
        """Admission has decided the current task's request (or it ended): it no longer counts as ahead."""
        ticket = _ticket.get()
        if ticket is not None:
            ticket.decided()

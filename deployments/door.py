"""The router's door: a generation request is refused before its body is read while admission would refuse any
request (cluster/door.py), counting those let in and not yet decided as ahead of it. A request is undecided
from the door until admission's verdict, or until it ends without one (a validation error, a client gone)."""

import contextvars
from typing import Callable

from conveyor.cluster.admission_actor import AdmissionClient
from conveyor.cluster.door import door_wait
from conveyor.cluster.queue_time import retry_after_s
from conveyor.deployments.api_error import APIError, queue_time_error


class Ticket:
    def __init__(self, door: "Door") -> None:
        self.door: Door | None = door

    def decided(self) -> None:
        if self.door is not None:
            self.door.undecided -= 1
            self.door = None


_ticket: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("door_ticket", default=None)


class Door:
    def __init__(self, gate: AdmissionClient, on_refusal: Callable[[], None] = lambda: None) -> None:
        self.gate, self.on_refusal = gate, on_refusal
        self.undecided = 0

    def enter(self) -> APIError | None:
        """The refusal for a generation request arriving now, or None: it is let in and undecided until
        `decided()` (in the same task) or `leave()`."""
        controller = self.gate.controller
        wait = door_wait(controller, self.gate.clock(), self.undecided)
        if wait is not None:
            self.on_refusal()
            limit, retry = controller.config.max_queue_time_s, controller.config.retry_after_s
            return queue_time_error(limit, wait, retry_after_s(wait, limit, retry))
        self.undecided += 1
        _ticket.set(Ticket(self))
        return None

    @staticmethod
    def decided() -> None:
        """Admission has decided the current task's request (or it ended): it no longer counts as ahead."""
        ticket = _ticket.get()
        if ticket is not None:
            ticket.decided()

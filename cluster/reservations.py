"""Reservations: requests admitted to a replica that its stats cannot include yet.

A router reserves an admitted request at once and hands it to the admission actor with its next sync (`take`;
`untake` when the send failed); from then on the actor counts it for every router. A replica that counts the
requests it took in (`num_added`) settles reservations on arrival, oldest first; an arrival counted before its
reservation reached the actor settles it within `arrival_credit_s`, and a reservation whose request never
arrives goes after `settle_max_s`. From a replica without the counter, a reservation settles once stats
received `settle_s` after it arrive. A reservation settled on arrival keeps its prefix keys pending for
`settle_s`: the KV events of its prefill may come later.
"""

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Reservation:
    """An admitted request not yet in its replica's stats. `at`: when this process learnt of it. `prefill_blocks`:
    of its `blocks`, the prompt blocks the replica will compute (the rest is output it will grow into): what it
    queues ahead of the next request's prefill."""

    replica_id: str
    at: float
    blocks: int
    requests: int = 1
    keys: tuple[bytes, ...] = ()
    prefill_blocks: int = 0

    def report(self, now: float) -> "ReservationReport":
        age = max(0.0, now - self.at)
        return ReservationReport(self.replica_id, age, self.blocks, self.requests, self.keys, self.prefill_blocks)


@dataclass(frozen=True)
class ReservationReport:
    """A reservation as a router hands it to the admission actor: its age, not a time on the router's clock."""

    replica_id: str
    age_s: float
    blocks: int
    requests: int = 1
    keys: tuple[bytes, ...] = ()
    prefill_blocks: int = 0


@dataclass(frozen=True)
class SettleRule:
    settle_s: float = 0.3
    settle_max_s: float = 2.0
    arrival_credit_s: float = 0.5


class ReservationBook:
    def __init__(self) -> None:
        self.held: dict[str, list[Reservation]] = {}
        self.inflight: list[Reservation] = []  # sent to the actor, not yet in a snapshot (router side)
        self.arrived: dict[str, list[list[float]]] = {}  # per replica: [time, sequences] no reservation claimed

    def own(self, replica_id: str) -> list[Reservation]:
        return self.held.get(replica_id, []) + [r for r in self.inflight if r.replica_id == replica_id]

    def add(self, r: Reservation) -> None:
        self.held.setdefault(r.replica_id, []).append(r)

    def _credit(self, replica_id: str, now: float, credit_s: float) -> list[list[float]]:
        """Arrivals counted in the last `credit_s` that no reservation has claimed yet."""
        credit = [c for c in self.arrived.get(replica_id, ()) if now - c[0] <= credit_s]
        self.arrived[replica_id] = credit
        return credit

    def count_arrivals(self, replica_id: str, sequences: int, now: float, credit_s: float) -> None:
        if sequences > 0:
            self._credit(replica_id, now, credit_s).append([now, sequences])

    def _take_arrivals(self, replica_id: str, sequences: int, now: float, credit_s: float) -> bool:
        credit = self._credit(replica_id, now, credit_s)
        if sum(c[1] for c in credit) < sequences:
            return False
        while sequences:
            used = min(sequences, credit[0][1])
            credit[0][1] -= used
            sequences -= used
            if not credit[0][1]:
                credit.pop(0)
        return True

    def settle(self, replica_id: str, received_at: float, by_arrival: bool, now: float, rule: SettleRule) -> None:
        """Drop the replica's reservations its stats (received at `received_at`) include; `by_arrival`: the
        replica counts arrivals."""
        limit = rule.settle_max_s if by_arrival else rule.settle_s
        left = []
        for r in sorted(self.held.get(replica_id, ()), key=lambda r: r.at):
            if by_arrival and r.requests and self._take_arrivals(replica_id, r.requests, now, rule.arrival_credit_s):
                # counted in the stats now; its keys stay pending
                r = replace(r, blocks=0, requests=0, prefill_blocks=0)
            if received_at < r.at + (limit if r.requests else rule.settle_s):
                left.append(r)
        if left:
            self.held[replica_id] = left
        else:
            self.held.pop(replica_id, None)

    def release(self, r: Reservation) -> bool:
        """Withdraw a reservation this process holds (its request will not go there): True when it had not been
        sent yet; else the holder of the shared one must `withdraw` it too."""
        self.inflight = [x for x in self.inflight if x is not r]
        held = self.held.get(r.replica_id, [])
        kept = [x for x in held if x is not r]
        if len(kept) == len(held):
            return False
        if kept:
            self.held[r.replica_id] = kept
        else:
            self.held.pop(r.replica_id, None)
        return True

    def withdraw(self, report: "ReservationReport", now: float) -> bool:
        """Actor side: drop the reservation a router withdrew (`report`, as it sent it before), if not settled yet."""
        at = now - max(0.0, report.age_s)
        same = [
            r
            for r in self.held.get(report.replica_id, ())
            if (r.blocks, r.requests, r.keys) == (report.blocks, report.requests, report.keys)
        ]
        if not same:
            return False
        r = min(same, key=lambda r: abs(r.at - at))
        if kept := [x for x in self.held[report.replica_id] if x is not r]:
            self.held[report.replica_id] = kept
        else:
            self.held.pop(report.replica_id)
        return True

    def forget(self, replica_id: str) -> None:
        self.held.pop(replica_id, None)
        self.arrived.pop(replica_id, None)

    def take(self) -> list[Reservation]:
        """Router side: this process's reservations, to send to the actor; counted as in flight until the
        next snapshot (which includes them: `shared`) or `untake` (the send failed)."""
        taken = [r for rs in self.held.values() for r in rs]
        self.held = {}
        self.inflight += taken
        return taken

    def untake(self, taken: list[Reservation]) -> None:
        """The send failed: the reservations still in flight are held again (not those released meanwhile)."""
        ids = {id(r) for r in self.inflight}
        self.inflight = [r for r in self.inflight if id(r) not in {id(t) for t in taken}]
        for r in taken:
            if id(r) in ids:
                self.add(r)

    def shared(self) -> None:
        self.inflight = []

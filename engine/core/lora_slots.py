"""The model runner's LoRA adapter slots as the scheduler assigns them: at most max_loras adapters are resident,
the least recently used one that no running request needs is replaced. The scheduler admits a request only while
the running requests' distinct adapters fit the slots, so every scheduled chunk finds its adapter a slot."""

from collections import OrderedDict

from conveyor.engine.core.sequence import Sequence
from conveyor.engine.lora_request import LoRARequest
from conveyor.engine.step import SchedulerOutput


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.resident: OrderedDict[LoRARequest, int] = OrderedDict()  # least recently used first
        self.free = list(range(max_loras - 1, -1, -1))
        self.num_loads = 0

    @staticmethod
    def in_use(running: list[Sequence]) -> set[LoRARequest]:
        return {s.lora for s in running if s.lora is not None}

    def admits(self, seq: Sequence, running: list[Sequence]) -> bool:
        """Whether seq may join the running requests without their adapters outnumbering the slots."""
        return seq.lora is None or self.fits(seq.lora, running)

    def fits(self, lora: LoRARequest, running: list[Sequence]) -> bool:
        """Whether a request with this adapter may run beside `running` (an imported KV handoff's check)."""
        used = self.in_use(running)
        return lora in used or len(used) < self.max_loras

    def assign(self, out: SchedulerOutput, requests: dict[str, Sequence], running: list[Sequence]) -> None:
        """Gives each chunk of an adapter's request its slot, queueing the loads the step needs first."""
        used = None
        for chunk in out.chunks:
            lora = requests[chunk.req_id].lora
            if lora is None:
                continue
            slot = self.resident.get(lora)
            if slot is None:
                used = self.in_use(running) if used is None else used
                slot = self._take(used)
                self.resident[lora] = slot
                out.lora_loads.append((slot, lora))
                self.num_loads += 1
            self.resident.move_to_end(lora)
            chunk.lora_slot = slot

    def _take(self, used: set[LoRARequest]) -> int:
        if self.free:
            return self.free.pop()
        victim = next(lora for lora in self.resident if lora not in used)
        return self.resident.pop(victim)

    def names(self) -> list[str]:
        return [lora.name for lora in self.resident]

"""The small data objects that cross between scheduler, executor and model runner each step."""

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from conveyor.engine.lora_request import LoRARequest
from conveyor.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from conveyor.engine.execution.sampler import GrammarBitmask


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_ids_for_min_tokens: list[int]


@dataclass(slots=True)
class ScheduledChunk:
    req_id: str
    token_ids: list[int]
    start: int
    new_block_ids: list[int]
    reset_blocks: bool
    sample: bool
    lora_slot: int = -1  # the adapter slot its tokens run with (-1: the base model)


KVCopy = tuple[int, int, int, int]  # (source tier, slot, destination tier, slot); tier 0 is the pool (slot: block id)


@dataclass
class KVTransfer:
    """A step's copies between the pool and the lower KV tiers (engine/core/kv_tiers.py), each list in order."""

    before: list[KVCopy]  # before the step's forward: stores of blocks the pool evicts now, and loads
    after: list[KVCopy]  # beside the forward, on the runner's copy thread; done before the next step's copies
    num_loads: int = 0


@dataclass
class SchedulerOutput:
    new_requests: list[NewRequestData] = field(default_factory=list)
    chunks: list[ScheduledChunk] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    grammar: "GrammarBitmask | None" = None
    # speculative decoding: a request's draft tokens, which its chunk carries after its last token
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)  # adapters to load into slots first
    kv_transfer: KVTransfer | None = None
    # speculative method "draft": the requests the draft model proposes for after this step (their sampled token
    # goes in next); each one's blocks hold num_speculative_tokens slots past its chunk for the draft's K/V
    lookahead_req_ids: list[str] = field(default_factory=list)

    @cached_property
    def num_tokens(self) -> int:
        """Read once the chunks are final (after schedule())."""
        return sum(map(len, [c.token_ids for c in self.chunks]))


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    # speculative decoding: a drafting request's accepted draft tokens, which come before its entry in token_ids
    accepted: dict[str, list[int]] = field(default_factory=dict)
    kv_load_s: float = 0.0  # time the step's copies before its forward took (rank 0)
    # speculative method "draft": request -> (its number of tokens the proposals follow, the draft's next tokens)
    proposals: dict[str, tuple[int, list[int]]] = field(default_factory=dict)

"""Draft-model proposals. The draft model runs in the model runner (engine/execution/draft_runner.py): after each
step it proposes k greedy tokens for the requests the scheduler named (SchedulerOutput.lookahead_req_ids), and the
step's output hands them back (ModelRunnerOutput.proposals). This proposer only keeps them until the request's
next schedule, tagged with the number of tokens they follow: a request that has moved on since (preempted,
stopped) gets none.

EAGLE / MTP would fit the same path with what is missing here: the runner handing the target's last hidden
states of each request to a head model (EAGLE's one-layer decoder over [embedding, hidden], MTP's extra layers of
the target) instead of a full draft forward, and the head's weights loaded beside the target's."""

from conveyor.engine.core.sequence import Sequence


class DraftModelProposer:
    def __init__(self) -> None:
        self.proposals: dict[str, tuple[int, list[int]]] = {}

    def store(self, proposals: dict[str, tuple[int, list[int]]]) -> None:
        self.proposals.update(proposals)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        num_tokens, tokens = self.proposals.pop(seq.request_id, (-1, []))
        return tokens[:k] if num_tokens == seq.num_tokens else []

    def forget(self, req_id: str) -> None:
        self.proposals.pop(req_id, None)

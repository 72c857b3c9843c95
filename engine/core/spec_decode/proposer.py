"""The proposer interface. A proposer sees the request's tokens (prompt + output so far) and returns up to
`k` draft tokens that would follow them; the target model verifies them in the next step.

Point-mass proposers (n-gram lookup, a greedy draft model) need nothing else: the runner accepts a draft
token when the token it samples from the target distribution equals it (engine/execution/rejection_sampler.py).
A sampling draft model, EAGLE or MTP heads would also hand over their draft distributions q, for which the
runner's rejection sampler lacks the general acceptance test, and need the target's hidden states of the last step, which the runner does
not return yet."""

from typing import Protocol

from conveyor.engine.core.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k draft tokens to follow seq.token_ids (possibly none)."""
        ...

    def forget(self, req_id: str) -> None:
        """The request left: drop what was kept for it."""
        ...

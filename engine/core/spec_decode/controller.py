"""Which decoding requests speculate this step, with how many drafts, and what came of it.

A draft token costs a row of compute that every request of the step waits on, while an accepted one saves a
whole step of its request: with few decodes in a step the step's fixed cost (reading the weights) dominates and
almost any acceptance pays; with many, the bar rises to `min_acceptance_rate` (EngineConfig.speculative).
Draft length: each request keeps, per draft position, a moving average of how often the target accepted the
token there when it had accepted the ones before; a request drafts the longest run of positions whose chance of
being accepted (the product of those averages) is at least the bar. A run accepted whole lets the next position
try again. Back-off: where not even the first position clears the bar, the request decodes plainly for 1, 2, 4,
... 64 steps, then probes again with one draft token or more."""

import sys
from dataclasses import dataclass, field

from conveyor.engine.config import SpeculativeConfig
from conveyor.engine.core.sequence import Sequence
from conveyor.engine.core.spec_decode.draft_model import DraftModelProposer
from conveyor.engine.core.spec_decode.ngram import NgramProposer
from conveyor.engine.core.spec_decode.proposer import Proposer

_MAX_PAUSE = 64
_EMA = 0.5  # weight of the latest step in a request's acceptance average


@dataclass
class _Track:
    accept: list[float]  # per draft position: moving average of "accepted, given the positions before it were"
    paused_until: int = 0  # scheduler step before which the request does not speculate
    pause: int = 1

    def length(self, bar: float) -> int:
        """Draft positions whose chance of acceptance is at least `bar`."""
        chance = 1.0
        for n, a in enumerate(self.accept):
            chance *= a
            if chance < bar:
                return n
        return len(self.accept)


@dataclass
class SpecCounters:
    """Cumulative, with vLLM's metric names (spec_decode_num_*): drafts are speculating request-steps."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating request-step emits: 1 + accepted drafts per draft."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecController:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.proposer: Proposer = (
            DraftModelProposer()
            if config.method == "draft"
            else NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        )
        self.tracks: dict[str, _Track] = {}
        self.counters = SpecCounters(accepted_per_pos=[0] * self.k)

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Requests whose sampling depends on their earlier output token by token (penalties, a seed, min_tokens,
        a grammar, logit bias) or that ask for logprobs decode without speculation: their outputs are the
        non-speculative ones."""
        p = seq.params
        return not (
            p.has_penalties
            or p.seed is not None
            or p.logprobs is not None
            or p.min_tokens
            or p.structured is not None
            or p.logit_bias
        )

    def bar(self, num_decodes: int) -> float:
        """Acceptance a request needs to speculate in a step with `num_decodes` decoding requests. A draft model's
        proposals cost k draft forwards in any batch: its bar is min_acceptance_rate throughout."""
        if self.config.method == "draft":
            return self.config.min_acceptance_rate
        return self.config.min_acceptance_rate * min(1.0, (num_decodes - 1) / 7)

    def propose(self, seq: Sequence, step: int, max_tokens: int, num_decodes: int) -> list[int]:
        """Up to min(k, max_tokens) drafts for a decoding request, or none while it is backed off."""
        track = self.tracks.get(seq.request_id)
        if track is None:
            paused_until = 0 if self.eligible(seq) else sys.maxsize
            track = self.tracks[seq.request_id] = _Track([1.0] * self.k, paused_until)
        if step < track.paused_until or max_tokens < 1:
            return []
        bar = self.bar(num_decodes)
        if (n := track.length(bar)) == 0:
            track.paused_until, track.pause = step + track.pause, min(2 * track.pause, _MAX_PAUSE)
            track.accept[0] = bar  # the probe after the pause drafts at least one token
            return []
        return self.proposer.propose(seq, min(n, max_tokens))

    def lookahead(self, seq: Sequence, step: int) -> bool:
        """Method "draft": whether the draft model should propose for seq after this step (it is eligible and
        not paused next step)."""
        if self.config.method != "draft":
            return False
        track = self.tracks.get(seq.request_id)
        return self.eligible(seq) if track is None else step + 1 >= track.paused_until

    def observe(self, req_id: str, num_draft: int, num_accepted: int) -> None:
        c, track = self.counters, self.tracks.get(req_id)
        c.num_drafts += 1
        c.num_draft_tokens += num_draft
        c.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            c.accepted_per_pos[i] += 1
        if track is None:
            return
        a = track.accept
        for i in range(num_accepted):
            a[i] += _EMA * (1.0 - a[i])
        if num_accepted < num_draft:
            a[num_accepted] *= 1 - _EMA
        elif num_accepted < self.k:  # every draft accepted: the next position earns a try
            a[num_accepted] += _EMA * (1.0 - a[num_accepted])
        if num_accepted:
            track.pause = 1

    def forget(self, req_id: str) -> None:
        self.tracks.pop(req_id, None)
        self.proposer.forget(req_id)

"""How long requests' outputs turn out, for admission's KV charge and queue estimate.

`max_tokens` bounds an output but says little about it: an OpenAI client that leaves it unset gets up to the
context length, and a request charged that holds a replica's cache for one or two requests. The likely
length of a request that has produced `done` tokens is the q-quantile of the recent finished requests that
ran longer than `done`, at most its `max_tokens`; with none that long it is `max_tokens` (an outlier is charged
in full). Before `min_samples` have finished, a request is expected to run `prior` tokens (at most its
`max_tokens`; in full once it outlives the prior), so a cold replica does not hold its cache for requests that
left max_tokens unset; prior 0 charges max_tokens then."""

import bisect
from collections import deque


class OutputLengths:
    def __init__(self, window: int = 256, quantile: float = 0.9, min_samples: int = 16, prior: int = 0) -> None:
        if not 0.0 < quantile <= 1.0 or window < 1 or min_samples < 1 or prior < 0:
            raise ValueError("OutputLengths needs 0 < quantile <= 1, window >= 1, min_samples >= 1, prior >= 0")
        self.quantile, self.min_samples, self.prior = quantile, min_samples, prior
        self.recent: deque[int] = deque(maxlen=window)
        self.sorted: list[int] = []

    def add(self, num_tokens: int) -> None:
        if len(self.recent) == self.recent.maxlen:
            del self.sorted[bisect.bisect_left(self.sorted, self.recent[0])]
        self.recent.append(num_tokens)
        bisect.insort(self.sorted, num_tokens)

    def likely_total(self, done: int, max_tokens: int) -> int:
        """The output length to expect of a request with `done` tokens out, in [done, max_tokens]."""
        if len(self.sorted) < self.min_samples:
            return min(max_tokens, self.prior) if self.prior > done else max_tokens
        longer = bisect.bisect_right(self.sorted, done)
        if longer == len(self.sorted):
            return max_tokens
        i = longer + int(self.quantile * (len(self.sorted) - longer - 1) + 0.5)
        return min(max_tokens, self.sorted[i])

    def typical(self) -> int:
        """A new request's likely length (0: not known): the q-quantile of the recent lengths, or the prior."""
        n = len(self.sorted)
        return self.prior if n < self.min_samples else self.sorted[int(self.quantile * (n - 1) + 0.5)]

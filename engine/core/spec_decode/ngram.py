"""N-gram prompt lookup: the request's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are
looked up among its earlier tokens; the tokens that followed the latest earlier occurrence are the drafts.
Each request keeps an index n-gram -> end position of its latest occurrence, extended as tokens arrive, so a
lookup costs O(n) per step whatever the length of the prompt."""

from dataclasses import dataclass, field

from conveyor.engine.core.sequence import Sequence


@dataclass
class _Index:
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> end index of its latest occurrence
    upto: int = 0  # n-grams ending before this index are in `ends`


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.index: dict[str, _Index] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens, length = seq.token_ids, len(seq.token_ids)
        idx = self.index.get(seq.request_id)
        if idx is None:
            idx = self.index[seq.request_id] = _Index()
        ends, lo, hi = idx.ends, self.min_n, self.max_n
        for end in range(max(idx.upto, lo), length):  # n-grams ending at index end - 1, all but the current suffix
            for n in range(lo, min(hi, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        idx.upto = max(idx.upto, length)
        for n in range(min(hi, length - 1), lo - 1, -1):
            end = ends.get(tuple(tokens[length - n :]))
            if end is not None:
                return tokens[end : min(end + k, length)]
        return []

    def forget(self, req_id: str) -> None:
        self.index.pop(req_id, None)

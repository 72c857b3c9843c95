from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase

from conveyor.engine.sampling_params import SamplingParams


class IncrementalDetokenizer:
    """Turns generated ids into text one token at a time, waiting out incomplete UTF-8 sequences,
    and finds stop strings across token boundaries. deferred: no stop strings and nobody reads the text
    before the end, so flush() decodes the ids once (one decode of 100 ids costs about what 10 DecodeStream
    steps do)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, params: SamplingParams, deferred: bool = False) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.deferred = deferred and not params.stop_strings
        self.token_ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.text = ""
        self.holdback = max((len(s) for s in params.stop_strings), default=1) - 1
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens) if self.backend else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, token_id: int, num_output_tokens: int) -> str | None:
        """Append one token; returns the stop string that ended the text, if any."""
        self.token_ids.append(token_id)
        if self.deferred:
            return None
        if self.stream is not None:
            new = self.stream.step(self.backend, token_id)  # None while a UTF-8 sequence is incomplete
            if not new:
                return None
            self.read_offset = len(self.token_ids)
        else:
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.token_ids[self.prefix_offset :])
            if len(full) <= len(prefix) or full.endswith("\ufffd"):
                return None
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            new = full[len(prefix) :]
        old_len = len(self.text)
        self.text += new
        if num_output_tokens < self.params.min_tokens:
            return None
        return self._find_stop(old_len)

    def flush(self) -> None:
        if self.read_offset < len(self.token_ids) and (self.stream is not None or self.deferred):
            self.text += self._decode(self.token_ids[self.read_offset :])
            self.read_offset = len(self.token_ids)
        elif self.read_offset < len(self.token_ids):
            prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.token_ids[self.prefix_offset :])[len(prefix) :]
            self.read_offset = len(self.token_ids)

    def _find_stop(self, old_len: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.params.stop_strings:
            idx = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop) if self.params.include_stop_str_in_output else idx]
        return stop

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: a tail that may still become a stop string is held back."""
        if finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

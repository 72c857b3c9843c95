"""Structured outputs over xgrammar: validation, a bounded cache of compiled grammars (compiled on a worker
thread, off the engine loop), and one matcher per request that yields the step's token bitmask."""

import json
import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from conveyor.engine.execution.sampler import GrammarBitmask
from conveyor.engine.sampling_params import StructuredParams

log = logging.getLogger("conveyor")

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def choice_ebnf(choices: list[str]) -> str:
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_of(kind: str, text: str) -> xgr.Grammar:
    """Tokenizer-independent grammar; JSON is compact (no free whitespace), so a constrained output cannot
    spend its token budget on blanks."""
    if kind in ("json", "json_object"):
        return xgr.Grammar.from_json_schema(text or '{"type": "object"}', any_whitespace=False, strict_mode=True)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
    return xgr.Grammar.from_ebnf(text)


def tagged_json_grammar(schema: dict, prefix: str, suffix: str) -> str:
    """EBNF text for `prefix`, one JSON value under `schema`, then `suffix` (e.g. a tool call between tags)."""
    tag = lambda text: xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")  # noqa: E731
    return str(xgr.Grammar.concat(tag(prefix), grammar_of("json", json.dumps(schema)), tag(suffix)))


def check_constraint(kind: str, text: str) -> str | None:
    """None when xgrammar accepts the constraint, else its error message (without the C++ source location)."""
    try:
        grammar_of(kind, text)
    except (RuntimeError, ValueError, TypeError) as e:
        lines = [_LOCATION.sub("", line) for line in str(e).strip().splitlines() if line.strip()]
        return lines[-1] if lines else type(e).__name__
    return None


class StructuredOutputManager:
    """Engine-side: compile futures keyed by constraint text (LRU, `cache_size` entries), matchers keyed by
    request id. Matchers live beside the scheduler's sequences, so preemption (the sequence keeps its output
    tokens) and chunked prefill (only sampled positions produce tokens) need nothing special."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        vocab_size: int,
        stop_token_ids: list[int],
        cache_size: int = 128,
        compile_threads: int = 2,
    ) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, sorted(stop_token_ids)
        self.cache_size, self.compile_threads = cache_size, compile_threads
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.matchers: dict[str, xgr.GrammarMatcher] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="conveyor-grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        if self._compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(
                self.tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.compile_threads, cache_enabled=False)
        return self._compiler.compile_grammar(grammar_of(kind, text))

    def compile(self, sp: StructuredParams) -> Future:
        fut = self.cache.get(sp.key)
        if fut is not None and not (fut.done() and fut.exception() is not None):
            self.cache.move_to_end(sp.key)
            return fut
        fut = self.cache[sp.key] = self._pool.submit(self._compile, *sp.key)
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return fut

    def add(self, request_id: str, compiled: xgr.CompiledGrammar) -> None:
        self.matchers[request_id] = xgr.GrammarMatcher(compiled)

    def release(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)

    def bitmask(self, req_ids: list[str]) -> GrammarBitmask | None:
        """Allowed-token bits for the constrained requests among this step's sampled ones."""
        live = [(r, m) for r in req_ids if (m := self.matchers.get(r)) is not None and not m.is_terminated()]
        if not live:
            return None
        bits = xgr.allocate_token_bitmask(len(live), self.vocab_size)
        self._batch.batch_fill_next_token_bitmask([m for _, m in live], bits)
        return GrammarBitmask([r for r, _ in live], bits)

    def accept(self, req_ids: list[str], tokens: list[int]) -> list[str]:
        """Advance each request's matcher by its sampled token; returns the requests whose grammar ended."""
        pairs = [
            (r, m, t)
            for r, t in zip(req_ids, tokens)
            if (m := self.matchers.get(r)) is not None and not m.is_terminated()
        ]
        if not pairs:
            return []
        ok = self._batch.batch_accept_token([m for _, m, _ in pairs], [t for _, _, t in pairs])
        for (r, _, t), good in zip(pairs, ok):
            if not good:
                log.warning("request %s: token %d rejected by its grammar", r, t)
        return [r for r, m, _ in pairs if m.is_terminated()]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

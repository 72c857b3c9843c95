"""Front-end half of the engine: turns the core's token deltas into RequestOutputs (incremental text,
stop strings, logprobs, metrics). A stop string ends the request here; the core is told afterwards."""

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from conveyor.engine.core.messages import CoreOutput
from conveyor.engine.frontend.detokenizer import IncrementalDetokenizer
from conveyor.engine.frontend.outputs import CompletionOutput, RequestMetrics, RequestOutput
from conveyor.engine.sampling_params import SamplingParams


@dataclass
class RequestState:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    arrival_time: float
    interval: int = 1
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    last: CoreOutput | None = None
    sent: int = 0


class OutputProcessor:
    """stream_outputs False (offline generate; set before requests are added): process() hands out finished
    requests only. A request with stop strings is still detokenised delta by delta, so they end it as early
    as when streaming; the others are decoded once, when they finish."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.stream_outputs = True

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        output_interval: int = 1,
    ) -> None:
        """output_interval: while streaming, a request's first token comes out at once, then an output whenever
        it has that many new tokens, and its finish (vLLM's stream_interval)."""
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        detok = IncrementalDetokenizer(self.tokenizer, params, deferred=not self.stream_outputs)
        self.requests[request_id] = RequestState(
            prompt, prompt_token_ids, params, detok, arrival_time, max(1, output_interval)
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        st = self.requests.pop(request_id, None)
        if st is None:
            return None
        st.detok.flush()
        last = st.last or CoreOutput(request_id, [])
        return self._output(
            request_id,
            st,
            CoreOutput(
                request_id,
                [],
                None,
                "abort",
                None,
                last.first_scheduled_time,
                last.first_token_time,
                None,
                time.monotonic(),
                last.num_preemptions,
                last.num_cached_tokens,
            ),
        )

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, str]]]:
        """Returns the outputs to hand out and the (request_id, stop string) finishes the core must learn."""
        results, stops = [], []
        for out in outputs:
            st = self.requests.get(out.request_id)
            if st is None:
                continue
            st.last, stop = out, None
            if st.detok.deferred and st.params.logprobs is None:
                st.detok.token_ids += out.new_token_ids
            else:
                stop = self._add_tokens(st, out)
            if stop is not None and out.finish_reason is None:
                out.finish_reason, out.stop_reason, out.finish_time = "stop", stop, time.monotonic()
                stops.append((out.request_id, stop))
            elif out.finish_reason is not None and not isinstance(out.stop_reason, str):
                st.detok.flush()
            if out.finish_reason is not None:
                self.requests.pop(out.request_id)
            elif not self.stream_outputs:
                continue
            else:
                n = len(st.detok.token_ids)
                if not n or (st.sent and n - st.sent < st.interval):
                    continue
                st.sent = n
            results.append(self._output(out.request_id, st, out))
        return results, stops

    @staticmethod
    def _add_tokens(st: RequestState, out: CoreOutput) -> str | None:
        """Returns the stop string the new text ends with, if any (the tokens after it are dropped)."""
        for i, token in enumerate(out.new_token_ids):
            if out.new_logprobs is not None and st.params.logprobs is not None:
                st.logprobs.append(out.new_logprobs[i] if i < len(out.new_logprobs) else None)
            stop = st.detok.add(token, len(st.detok.token_ids) + 1)
            if stop is not None:
                return stop
        return None

    @staticmethod
    def _output(rid: str, st: RequestState, out: CoreOutput) -> RequestOutput:
        done = out.finish_reason is not None
        logprobs = list(st.logprobs) if st.params.logprobs is not None else None
        completion = CompletionOutput(
            0, st.detok.visible_text(done), list(st.detok.token_ids), out.finish_reason, out.stop_reason, logprobs
        )
        metrics = RequestMetrics(
            st.arrival_time,
            out.first_scheduled_time,
            out.first_token_time,
            out.last_token_time,
            out.finish_time,
            out.num_preemptions,
            out.num_cached_tokens,
        )
        return RequestOutput(rid, st.prompt, st.prompt_token_ids, [completion], done, metrics, out.kv_handoff)

import time
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from conveyor.deployments.api_error import APIError, ErrorInfo, ErrorResponse
from conveyor.deployments.protocol import Delta
from conveyor.deployments.request_models import FunctionCall, ToolCall
from conveyor.deployments.response_models import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from conveyor.deployments.tool_parsers import HermesToolParser, ParsedCall, ToolStream

DONE = "data: [DONE]\n\n"


def sse(obj: BaseModel) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


def sse_error(message: str, type: str = "internal_error", code: int = 500) -> str:
    return sse(ErrorResponse(error=ErrorInfo(message=message, type=type, code=code)))


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.response().model_dump(), status_code=e.status, headers=e.headers() or None)


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in the OpenAI error shape; 429/503 carry Retry-After."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request", "type": ""}
        if err.get("type") == "json_invalid":
            return error_response(APIError(f"invalid JSON body: {err.get('ctx', {}).get('error', err['msg'])}"))
        loc = [str(x) for x in err["loc"] if x != "body"]
        param = loc[0] if loc else None
        where = ".".join(loc)
        msg = "unknown field, not supported by this server" if err.get("type") == "extra_forbidden" else err["msg"]
        return error_response(APIError(f"{where}: {msg}" if where else str(msg), param=param))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(str(e.detail), status=e.status_code, type=kind))


def merge_deltas(deltas: list[Delta]) -> list[Delta]:
    merged: dict[int, Delta] = {}
    for d in deltas:
        m = merged.get(d["index"])
        if m is None:
            merged[d["index"]] = Delta(
                index=d["index"],
                text=d["text"],
                token_ids=list(d["token_ids"]),
                logprobs=list(d["logprobs"]) if d["logprobs"] is not None else None,
                finish_reason=d["finish_reason"],
            )
            continue
        m["text"] += d["text"]
        m["token_ids"] += d["token_ids"]
        if d["logprobs"] is not None:
            m["logprobs"] = (m["logprobs"] or []) + d["logprobs"]
        m["finish_reason"] = d["finish_reason"] or m["finish_reason"]
    return list(merged.values())


class ChoiceState:
    def __init__(self) -> None:
        self.text: list[str] = []
        self.num_tokens = 0
        self.offset = 0
        self.finish_reason: str | None = None
        self.started = False
        self.logprobs: Any = None
        self.tools: ToolStream | None = None
        self.num_calls = 0


class ResponseBuilder:
    """Turns replica deltas into OpenAI completion / chat responses, streamed or whole."""

    def __init__(
        self,
        chat: bool,
        request_id: str,
        model: str,
        num_choices: int,
        prompt_tokens: int,
        num_logprobs: int | None,
        decode: Callable[[int], str],
        tool_parser: HermesToolParser | None = None,
    ) -> None:
        self.chat, self.id, self.model = chat, request_id, model
        self.created = int(time.time())
        self.prompt_tokens, self.num_logprobs, self.decode = prompt_tokens, num_logprobs, decode
        self.tool_parser = tool_parser
        self.choices = [ChoiceState() for _ in range(num_choices)]
        for c in self.choices:
            c.tools = tool_parser.stream() if tool_parser is not None else None

    def usage(self) -> UsageInfo:
        completion = sum(c.num_tokens for c in self.choices)
        return UsageInfo(
            prompt_tokens=self.prompt_tokens, completion_tokens=completion, total_tokens=self.prompt_tokens + completion
        )

    def _logprobs(self, c: ChoiceState, d: Delta) -> Any:
        if self.num_logprobs is None or d["logprobs"] is None:
            return None
        if self.chat:
            out = ChatLogprobs()
            for tid, lps in zip(d["token_ids"], d["logprobs"]):
                top = sorted(lps.items(), key=lambda kv: -kv[1])[: self.num_logprobs]
                out.content.append(
                    TokenLogprob(
                        **self._top(tid, lps[tid]).model_dump(), top_logprobs=[self._top(t, lp) for t, lp in top]
                    )
                )
            return out
        out = CompletionLogprobs()
        for tid, lps in zip(d["token_ids"], d["logprobs"]):
            tok = self.decode(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(lps[tid])
            out.top_logprobs.append({self.decode(t): lp for t, lp in sorted(lps.items(), key=lambda kv: -kv[1])})
            out.text_offset.append(c.offset)
            c.offset += len(tok)
        return out

    def _top(self, tid: int, lp: float) -> TopLogprob:
        tok = self.decode(tid)
        return TopLogprob(token=tok, logprob=max(lp, -9999.0), bytes=list(tok.encode("utf-8")))

    def add(self, deltas: list[Delta]) -> None:
        for d in deltas:
            c = self.choices[d["index"]]
            c.text.append(d["text"])
            c.num_tokens += len(d["token_ids"])
            c.finish_reason = d["finish_reason"] or c.finish_reason
            lp = self._logprobs(c, d)
            if lp is not None:
                if c.logprobs is None:
                    c.logprobs = lp
                elif self.chat:
                    c.logprobs.content += lp.content
                else:
                    for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        getattr(c.logprobs, k).extend(getattr(lp, k))

    @staticmethod
    def _finish(reason: str | None, num_calls: int) -> str | None:
        return "tool_calls" if num_calls and reason == "stop" else reason

    def _message(self, c: ChoiceState) -> tuple[ChatMessageOut, str | None]:
        text = "".join(c.text)
        if self.tool_parser is None:
            return ChatMessageOut(content=text), c.finish_reason
        content, calls = self.tool_parser.parse(text)
        tool_calls = [ToolCall(id=k.id, function=FunctionCall(name=k.name, arguments=k.arguments)) for k in calls]
        return ChatMessageOut(content=content, tool_calls=tool_calls or None), self._finish(c.finish_reason, len(calls))

    def response(self) -> CompletionResponse | ChatCompletionResponse:
        if self.chat:
            choices = [
                ChatChoice(index=i, message=m, logprobs=c.logprobs, finish_reason=f)
                for i, c in enumerate(self.choices)
                for m, f in [self._message(c)]
            ]
            return ChatCompletionResponse(
                id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage()
            )
        choices = [
            CompletionChoice(index=i, text="".join(c.text), logprobs=c.logprobs, finish_reason=c.finish_reason)
            for i, c in enumerate(self.choices)
        ]
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage()
        )

    def chunks(self, deltas: list[Delta]) -> list[str]:
        out = []
        for d in merge_deltas(deltas):
            c = self.choices[d["index"]]
            c.num_tokens += len(d["token_ids"])
            c.finish_reason = d["finish_reason"]
            lp = self._logprobs(c, d)
            if self.chat:
                text, calls = d["text"], []
                if c.tools is not None:
                    text, calls = c.tools.feed(text)
                    text += c.tools.finish() if d["finish_reason"] is not None else ""
                delta = DeltaMessage(
                    content=text if text or not calls else None,
                    role=None if c.started else "assistant",
                    tool_calls=[self._call_delta(c, k) for k in calls] or None,
                )
                choice: Any = ChatStreamChoice(
                    index=d["index"],
                    delta=delta,
                    logprobs=lp,
                    finish_reason=self._finish(d["finish_reason"], c.num_calls),
                )
                out.append(
                    sse(ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice]))
                )
            else:
                choice = CompletionChoice(
                    index=d["index"], text=d["text"], logprobs=lp, finish_reason=d["finish_reason"]
                )
                out.append(
                    sse(CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice]))
                )
            c.started = True
        return out

    @staticmethod
    def _call_delta(c: ChoiceState, k: ParsedCall) -> DeltaToolCall:
        c.num_calls += 1
        return DeltaToolCall(
            index=c.num_calls - 1,
            id=k.id,
            type="function",
            function=DeltaFunctionCall(name=k.name, arguments=k.arguments),
        )

    def usage_chunk(self) -> str:
        cls = ChatCompletionChunk if self.chat else CompletionResponse
        return sse(cls(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage()))

"""Tool-call parsers: turn generated text into OpenAI tool calls, whole or as a stream, and say which output
form a forced tool choice must take. Hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`) covers
Qwen2/2.5/3, Hermes and SmolLM-family templates; another format is one more class with the same methods."""

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from conveyor.deployments.request_models import Tool


@dataclass
class ParsedCall:
    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


class HermesToolParser:
    begin, end = "<tool_call>", "</tool_call>"

    def call_schema(self, tools: list[Tool]) -> dict[str, Any]:
        """JSON schema of the body between the tags, for the forced (required / named) case."""
        bodies = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "arguments": t.function.parameters or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
            for t in tools
        ]
        return bodies[0] if len(bodies) == 1 else {"anyOf": bodies}

    def forced_grammar(self, tools: list[Tool]) -> str:
        """EBNF for exactly one call to one of `tools`, in this parser's form."""
        from conveyor.engine.core.structured_output import tagged_json_grammar

        return tagged_json_grammar(self.call_schema(tools), f"{self.begin}\n", f"\n{self.end}")

    def _call(self, body: str) -> ParsedCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content outside the calls or None, the calls); text with a malformed call stays content."""
        calls, content, pos = [], [], 0
        while (start := text.find(self.begin, pos)) != -1:
            stop = text.find(self.end, start)
            call = self._call(text[start + len(self.begin) : stop]) if stop != -1 else None
            if call is None:
                break
            content.append(text[pos:start])
            calls.append(call)
            pos = stop + len(self.end)
        if not calls:
            return text, []
        rest = "".join(content) + text[pos:]
        return (rest if rest.strip() else None), calls

    def stream(self) -> "ToolStream":
        return ToolStream(self)


class ToolStream:
    """Incremental form of `parse`: content passes through at once except a tail that may open a call; a call is
    emitted whole when its closing tag arrives."""

    def __init__(self, parser: HermesToolParser) -> None:
        self.parser, self.buffer, self.inside, self.calls = parser, "", False, 0

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        content, calls = [], []
        p = self.parser
        while True:
            if self.inside:
                stop = self.buffer.find(p.end)
                if stop == -1:
                    break
                call = p._call(self.buffer[:stop])
                body, self.buffer, self.inside = self.buffer[:stop], self.buffer[stop + len(p.end) :], False
                if call is None:
                    content.append(p.begin + body + p.end)
                else:
                    calls.append(call)
                continue
            start = self.buffer.find(p.begin)
            if start == -1:
                keep = next(
                    (
                        k
                        for k in range(min(len(p.begin) - 1, len(self.buffer)), 0, -1)
                        if p.begin.startswith(self.buffer[-k:])
                    ),
                    0,
                )
                content.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            content.append(self.buffer[:start])
            self.buffer, self.inside = self.buffer[start + len(p.begin) :], True
        self.calls += len(calls)
        return "".join(content), calls

    def finish(self) -> str:
        """What is left at the end of the output (an unclosed call stays text)."""
        rest = (self.parser.begin if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        return rest


TOOL_PARSERS = {"hermes": HermesToolParser}

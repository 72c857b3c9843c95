import json

import pytest

from conveyor.deployments.request_models import ChatCompletionRequest, NamedToolChoice, Tool
from conveyor.deployments.tool_parsers import HermesToolParser

TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


def test_parse_whole_text() -> None:
    content, calls = HermesToolParser().parse(TEXT)
    assert content.strip() == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"zone": "CET"}),
    ]
    assert len({c.id for c in calls}) == 2
    assert HermesToolParser().parse("plain <tool_call> broken") == ("plain <tool_call> broken", [])


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_stream_matches_whole_parse(step: int) -> None:
    stream = HermesToolParser().stream()
    content, calls = "", []
    for i in range(0, len(TEXT), step):
        text, new = stream.feed(TEXT[i : i + step])
        content, calls = content + text, calls + new
    content += stream.finish()
    whole_content, whole_calls = HermesToolParser().parse(TEXT)
    assert content == TEXT[: TEXT.index("<tool_call>")] + "\n"
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_unclosed_call_stays_text_in_the_stream() -> None:
    stream = HermesToolParser().stream()
    text, calls = stream.feed('hi <tool_call>\n{"name": "f", "argu')
    assert (text, calls) == ("hi ", [])
    assert stream.finish() == '<tool_call>\n{"name": "f", "argu'


def test_forced_tool_choice_grammar_names_the_function() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    req = ChatCompletionRequest(
        messages=[{"role": "user", "content": "x"}],
        tools=[tool, {**tool, "function": {"name": "g"}}],
        tool_choice={"type": "function", "function": {"name": "g"}},
    )
    assert isinstance(req.tool_choice, NamedToolChoice)
    forced = req.forced_tools()
    assert [t.function.name for t in forced] == ["g"]
    grammar = HermesToolParser().forced_grammar([Tool(**tool)])
    assert "<tool_call>" in grammar and '\\"f\\"' in grammar

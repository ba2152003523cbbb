"""Tool-call parsers: llama3_json on Llama 3.1/3.2 outputs in their model cards' JSON format,
hermes on Qwen2.5-style outputs. Whole outputs and the same outputs streamed in pieces of
several sizes give the same content and calls; malformed calls stay text."""
from __future__ import annotations

import json

import pytest

from liteinfer.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    json_calls,
)

WEATHER = '{"name": "get_current_weather", "parameters": {"location": "San Francisco, CA", ' \
          '"unit": "celsius"}}'
CALLS = [
    (WEATHER, [("get_current_weather", {"location": "San Francisco, CA", "unit": "celsius"})]),
    ('<|python_tag|>{"name": "get_user_info", "arguments": {"user_id": 7, "special": "black"}}',
     [("get_user_info", {"user_id": 7, "special": "black"})]),
    ('{"name": "f", "parameters": {"s": "a } ; { \\" b"}}; {"name": "g", "parameters": {}}\n',
     [("f", {"s": 'a } ; { " b'}), ("g", {})]),
    (('\n\n{"name": "search", "parameters": {"q": ["x", {"y": null}]}} ; '
     '{"name": "search", "parameters": {"q": []}};'),
     [("search", {"q": ["x", {"y": None}]}), ("search", {"q": []})]),
]
TEXTS = [
    "The weather in Paris is sunny.",
    # Llama 3.1's built-in tools are Python calls, not JSON: text for this parser.
    '<|python_tag|>brave_search.call(query="current weather in Menlo Park")',
    '{"name": "f", "parameters": {"x": 1}} and then some words',
    '{"name": "f", "parameters": {"x": 1}',  # cut off
    '{"name": "f"}',  # no parameters
    '{"name": 3, "parameters": {}}',
    '{"name": "f", "parameters": [1]}',
    '{"name": "f", "parameters": {"x": 1}} {"name": "g", "parameters": {}}',  # no ";"
    '{"a": 1, "b": }',
    "[1, 2]",
    "",
]


def calls_of(tool_calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def stream(text: str, piece: int, parser_cls=Llama3JsonToolParser):
    parser = parser_cls()
    content, calls = "", []
    pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
    so_far = ""
    for i, p in enumerate(pieces):
        so_far += p
        delta = parser.extract_tool_calls_streaming(so_far, i == len(pieces) - 1)
        content += delta.get("content", "")
        for c in delta.get("tool_calls", []):
            assert c["index"] == len(calls) and c["type"] == "function"
            assert c["id"].startswith("chatcmpl-tool-")
            calls.append(c)
    return content, calls, parser.saw_tool_calls


def test_registry():
    assert TOOL_PARSERS["llama3_json"] is Llama3JsonToolParser
    assert TOOL_PARSERS["hermes"] is HermesToolParser


@pytest.mark.parametrize("text, expected", CALLS)
def test_calls_whole_and_streamed(text, expected):
    content, tool_calls = Llama3JsonToolParser().extract_tool_calls(text)
    assert content is None
    assert calls_of(tool_calls) == expected
    assert len({c["id"] for c in tool_calls}) == len(tool_calls)
    for piece in (1, 3, 7, len(text)):
        content, calls, saw = stream(text, piece)
        assert content == "" and saw
        assert calls_of(calls) == expected


@pytest.mark.parametrize("text", TEXTS)
def test_malformed_calls_stay_text(text):
    assert Llama3JsonToolParser().extract_tool_calls(text) == (text, [])
    for piece in (1, 4, max(len(text), 1)):
        content, calls, saw = stream(text, piece)
        if not calls:
            assert content == text and not saw
            continue
        # A stream cannot take back a complete call sent before the text went wrong: the
        # rest comes as content.
        first = '{"name": "f", "parameters": {"x": 1}}'
        assert text.startswith(first) and calls_of(calls) == [("f", {"x": 1})] and saw
        assert content == text[len(first):]


def test_streamed_text_is_not_held_back():
    parser = Llama3JsonToolParser()
    assert parser.extract_tool_calls_streaming("  ", False) == {}
    assert parser.extract_tool_calls_streaming("  Hi", False) == {"content": "  Hi"}
    assert parser.extract_tool_calls_streaming("  Hi there", False) == {"content": " there"}
    tagged = Llama3JsonToolParser()
    assert tagged.extract_tool_calls_streaming("<|python", False) == {}
    assert tagged.extract_tool_calls_streaming("<|python_tag|>{\"na", False) == {}


QWEN_CALL = ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": '
             '"San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>')
HERMES_CALLS = [
    (QWEN_CALL, None,
     [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"})]),
    ("Let me check both.\n" + QWEN_CALL + "\n" + QWEN_CALL.replace("San Francisco", "Paris"),
     "Let me check both.\n",
     [("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
      ("get_current_temperature", {"location": "Paris, CA, USA", "unit": "celsius"})]),
    ('<tool_call>{"name": "f", "arguments": {"s": "</tool_call>"}}</tool_call>\n', None,
     [("f", {"s": "</tool_call>"})]),
]
HERMES_TEXTS = [
    "No tools needed: 2 < 3 and <tool is not a tag.",
    QWEN_CALL[:-5],  # cut off in the closing tag
    '<tool_call>\n{"name": "f"}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_cal>',
    QWEN_CALL + " and a trailing remark",
]


@pytest.mark.parametrize("text, content, expected", HERMES_CALLS)
def test_hermes_calls_whole_and_streamed(text, content, expected):
    whole_content, tool_calls = HermesToolParser().extract_tool_calls(text)
    assert whole_content == content and calls_of(tool_calls) == expected
    for piece in (1, 2, 5, len(text)):
        streamed, calls, saw = stream(text, piece, HermesToolParser)
        assert streamed == (content or "") and saw
        assert calls_of(calls) == expected


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_malformed_calls_stay_text(text):
    assert HermesToolParser().extract_tool_calls(text) == (text, [])
    for piece in (1, 3, len(text)):
        content, calls, _ = stream(text, piece, HermesToolParser)
        if not calls:
            assert content == text
        else:  # the complete call was sent before the remark came
            assert text.startswith(QWEN_CALL) and content == text[len(QWEN_CALL):]


@pytest.mark.parametrize("parser_cls, layout", [
    (Llama3JsonToolParser, "{}"), (HermesToolParser, "<tool_call>\n{}\n</tool_call>")])
def test_long_argument_is_read_once(parser_cls, layout, monkeypatch):
    """A call with a long argument, streamed a few characters at a time, is decoded once, when
    it closes (not again on every piece), and its deltas' arguments concatenate to its
    arguments."""
    decoded = []

    class CountingDecoder(json.JSONDecoder):
        def raw_decode(self, s, idx=0):
            decoded.append(idx)
            return super().raw_decode(s, idx)

    monkeypatch.setattr(json_calls, "_DECODER", CountingDecoder())
    arguments = {"text": 'a "quoted" {brace} [list] \\ end; ' * 1000, "n": 1}
    text = layout.format(json.dumps({"name": "write", "arguments": arguments}))
    content, calls, saw = stream(text, 3, parser_cls)
    assert content == "" and saw and len(decoded) == 1
    streamed: dict[int, str] = {}
    for c in calls:
        streamed[c["index"]] = streamed.get(c["index"], "") + c["function"]["arguments"]
    assert list(streamed) == [0] and json.loads(streamed[0]) == arguments

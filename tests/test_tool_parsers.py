"""Tool-call parsers: llama3_json on Llama 3.1/3.2 outputs in their model cards' JSON format,
hermes on Qwen2.5-style outputs, qwen3_coder on Qwen3-Coder's XML format, mistral on both of
Mistral's `[TOOL_CALLS]` layouts, pythonic on Llama 3.2 / Llama 4 Python lists. Whole outputs
and the same outputs streamed in pieces of several sizes give the same content and calls;
streamed, each call comes as vLLM streams it (its name first, then its arguments in
fragments as they are written, which concatenate to the whole output's arguments text);
malformed calls stay text."""
from __future__ import annotations

import json

import pytest

from liteinfer.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
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


class Streamed:
    """What a client makes of a stream of `text` fed to a new parser `piece` characters at a
    time: the content, the calls accumulated from their deltas, how many deltas carried
    arguments of each call, and whether the parser saw a complete call. Each delta is
    checked to have vLLM's shape: a call's first with its index, id, type and name, the
    others with its index and a fragment of its arguments only."""

    def __init__(self, text: str, piece: int, parser_cls=None, parser=None):
        parser = parser or (parser_cls or Llama3JsonToolParser)()
        self.content, self.calls, self.fragments = "", [], []
        pieces = [text[i:i + piece] for i in range(0, len(text), piece)] or [""]
        so_far = ""
        for i, p in enumerate(pieces):
            so_far += p
            delta = parser.extract_tool_calls_streaming(so_far, i == len(pieces) - 1)
            self.content += delta.get("content", "")
            for d in delta.get("tool_calls", []):
                arguments = d["function"]["arguments"]
                if d["index"] == len(self.calls):
                    assert set(d) == {"index", "id", "type", "function"}
                    assert d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
                    assert d["function"]["name"]
                    self.calls.append(d)
                    self.fragments.append(int(bool(arguments)))
                    continue
                assert d == {"index": len(self.calls) - 1, "function": {"arguments": arguments}}
                assert arguments
                self.calls[-1]["function"]["arguments"] += arguments
                self.fragments[-1] += 1
        self.saw = parser.saw_tool_calls


def stream(text: str, piece: int, parser_cls=Llama3JsonToolParser):
    streamed = Streamed(text, piece, parser_cls)
    return streamed.content, streamed.calls, streamed.saw


def check_incremental(text: str, parser, whole_calls: list[dict]) -> None:
    """Streamed a character at a time, every call's arguments come in several fragments, and
    they concatenate to the arguments of the output read whole."""
    streamed = Streamed(text, 1, parser)
    assert [c["function"] for c in streamed.calls] == [c["function"] for c in whole_calls]
    for call, fragments in zip(whole_calls, streamed.fragments):
        assert fragments > 1 or call["function"]["arguments"] == "{}"


def test_registry():
    expected = {"llama3_json": Llama3JsonToolParser, "hermes": HermesToolParser,
                "qwen3_coder": Qwen3CoderToolParser, "mistral": MistralToolParser,
                "pythonic": PythonicToolParser}
    assert dict(TOOL_PARSERS) == expected


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
    check_incremental(text, Llama3JsonToolParser, tool_calls)


@pytest.mark.parametrize("text", TEXTS)
def test_malformed_calls_stay_text(text):
    assert Llama3JsonToolParser().extract_tool_calls(text) == (text, [])
    for piece in (1, 4, max(len(text), 1)):
        content, calls, saw = stream(text, piece)
        if not saw:
            # A call begun is not taken back (its arguments stop where they were), and all
            # of the text comes as content.
            assert content == text and all(c["function"]["arguments"] in text for c in calls)
            continue
        # Nor is a complete call sent before the text went wrong: the rest comes as content.
        first = '{"name": "f", "parameters": {"x": 1}}'
        assert text.startswith(first) and calls_of(calls) == [("f", {"x": 1})]
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
    check_incremental(text, HermesToolParser, tool_calls)


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_malformed_calls_stay_text(text):
    assert HermesToolParser().extract_tool_calls(text) == (text, [])
    for piece in (1, 3, len(text)):
        content, _, saw = stream(text, piece, HermesToolParser)
        if not saw:
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
    streamed = Streamed(text, 3, parser_cls)
    assert streamed.content == "" and streamed.saw and len(decoded) == 1
    assert calls_of(streamed.calls) == [("write", arguments)] and streamed.fragments[0] > 1000


def check_whole_and_streamed(parser, text, content, expected, pieces=(1, 2, 5, 13)):
    """`parser()` reads `text` as `content` and the calls `expected`, whole and streamed."""
    whole_content, tool_calls = parser().extract_tool_calls(text)
    assert whole_content == content and calls_of(tool_calls) == expected
    for piece in (*pieces, len(text)):
        streamed, calls, saw = stream(text, piece, parser)
        assert streamed == (content or "") and saw == bool(expected)
        assert [c["function"] for c in calls] == [c["function"] for c in tool_calls]
    check_incremental(text, parser, tool_calls)


def check_stays_text(parser, text, pieces=(1, 3)):
    """`parser()` leaves `text` as it is, whole and streamed (where a call begun streamed stays
    as far as it was sent)."""
    assert parser().extract_tool_calls(text) == (text, [])
    for piece in (*pieces, max(len(text), 1)):
        content, calls, saw = stream(text, piece, parser)
        assert (content, saw) == (text, False) and len(calls) <= 1


# Qwen3-Coder's chat template: "<tool_call>\n<function=example_function_name>\n<parameter=
# example_parameter_1>\nvalue_1\n</parameter>\n...</function>\n</tool_call>".
CODER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=location>\nSan Francisco, CA\n"
              "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")
CODER_WEATHER = ("get_weather", {"location": "San Francisco, CA", "unit": "celsius"})
CODER_WRITE = ("<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
               "<parameter=content>\ndef f(x):\n    return x < 3  # </tool_call> in a string\n"
               "</parameter>\n<parameter=mode>\n420\n</parameter>\n<parameter=options>\n"
               '{"backup": true, "tags": ["a"]}\n</parameter>\n</function>\n</tool_call>')
CODER_TOOLS = {"write_file": {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"type": "integer"},
    "options": {"type": "object"}}}}


def coder() -> Qwen3CoderToolParser:
    return Qwen3CoderToolParser(CODER_TOOLS)


@pytest.mark.parametrize("text, content, expected", [
    (CODER_CALL, None, [CODER_WEATHER]),
    ("I will check the weather in both cities.\n" + CODER_CALL + "\n"
     + CODER_CALL.replace("San Francisco, CA", "Tokyo"),
     "I will check the weather in both cities.\n",
     [CODER_WEATHER, ("get_weather", {"location": "Tokyo", "unit": "celsius"})]),
    # Typed by the tool's schema: a string stays one even where it would parse as JSON.
    (CODER_WRITE, None, [("write_file", {
        "path": "src/a.py", "content": "def f(x):\n    return x < 3  # </tool_call> in a string",
        "mode": 420, "options": {"backup": True, "tags": ["a"]}})]),
    ("<tool_call>\n<function=list_files>\n</function>\n</tool_call>", None,
     [("list_files", {})]),
])
def test_qwen3_coder_calls(text, content, expected):
    check_whole_and_streamed(coder, text, content, expected)


@pytest.mark.parametrize("text", [
    "No call here, though 1 < 2 and <tool is not a tag.",
    QWEN_CALL,  # hermes' JSON in the tags: another format
    CODER_CALL[:-len("</function>\n</tool_call>")],  # cut off
    CODER_CALL.replace("</parameter>\n<parameter=unit>", "<parameter=unit>"),
    CODER_CALL.replace("<function=get_weather>", "<function=>"),
    CODER_CALL.replace("</function>", "</func>"),
])
def test_qwen3_coder_malformed_calls_stay_text(text):
    check_stays_text(coder, text)


# Mistral's function calling docs (v0.3 tokenizer): "[TOOL_CALLS] [{"name": ..., "arguments":
# {...}}]"; v11 and later (Mistral Small 3.2, Devstral): "[TOOL_CALLS]name[ARGS]{...}".
MISTRAL_CALLS = [
    ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France",'
     ' "format": "celsius"}}]', None,
     [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]),
    ('[TOOL_CALLS][{"name": "retrieve_payment_status", "arguments": {"transaction_id": "T1001"}'
     '}, {"name": "retrieve_payment_date", "arguments": {"transaction_id": "T1001"}}]', None,
     [("retrieve_payment_status", {"transaction_id": "T1001"}),
      ("retrieve_payment_date", {"transaction_id": "T1001"})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": [1, 2]}', None,
     [("get_weather", {"city": "Paris", "days": [1, 2]})]),
    ('Let me look both up.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time'
     '[ARGS]{"tz": "CET [ARGS] ]"}', "Let me look both up.",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET [ARGS] ]"})]),
]


@pytest.mark.parametrize("text, content, expected", MISTRAL_CALLS)
def test_mistral_calls(text, content, expected):
    check_whole_and_streamed(MistralToolParser, text, content, expected)
    assert not MistralToolParser.skip_special_tokens  # [TOOL_CALLS] is a special token


@pytest.mark.parametrize("text", [
    "The weather in Paris is [probably] sunny.",
    '[TOOL_CALLS] [{"name": "f"}]',  # no arguments
    '[TOOL_CALLS] [{"name": "f", "arguments": {}}',  # never closed
    "[TOOL_CALLS]get weather[ARGS]{}",
    "[TOOL_CALLS]get_weather{}",
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"',
])
def test_mistral_malformed_calls_stay_text(text):
    check_stays_text(MistralToolParser, text)


# Llama 3.2's model card ("[func_name1(params_name1=params_value1, ...), func_name2(params)]")
# and Llama 4's, between <|python_start|> and <|python_end|> where special tokens are kept.
PYTHONIC_CALLS = [
    ("[get_user_info(user_id=7, special='black')]",
     [("get_user_info", {"user_id": 7, "special": "black"})]),
    ('[get_weather(location="San Francisco, CA", days=3), get_time(timezone="PST")]',
     [("get_weather", {"location": "San Francisco, CA", "days": 3}),
      ("get_time", {"timezone": "PST"})]),
    ("<|python_start|>[search(query='a], b(', filters={'year': [2024, 2025]}, exact=True, "
     "limit=None, scale=-1.5, pair=(1, 2))]<|python_end|>",
     [("search", {"query": "a], b(", "filters": {"year": [2024, 2025]}, "exact": True,
                  "limit": None, "scale": -1.5, "pair": [1, 2]})]),
    ("\n[tools.clock.now()]", [("tools.clock.now", {})]),
]


@pytest.mark.parametrize("text, expected", PYTHONIC_CALLS)
def test_pythonic_calls(text, expected):
    check_whole_and_streamed(PythonicToolParser, text, None, expected)


@pytest.mark.parametrize("text", [
    "The answer is [1, 2].",
    "get_weather(location='Paris')",  # not a list
    "[get_weather('Paris')]",  # positional
    "[get_weather(location=open('x'))]",  # not a literal
    "[get_weather(location='Paris'",
    "[1, 2]",
    "[]",
])
def test_pythonic_malformed_calls_stay_text(text):
    check_stays_text(PythonicToolParser, text)


@pytest.mark.parametrize("parser, call, expected", [
    (coder, CODER_CALL, [CODER_WEATHER]),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "f", "arguments": {}}]', [("f", {})]),
    (MistralToolParser, "[TOOL_CALLS]f[ARGS]{}", [("f", {})]),
    (PythonicToolParser, "[f(x=1)]", [("f", {"x": 1})]),
])
def test_call_then_remark(parser, call, expected):
    """Text after the calls makes a whole output text. Streamed, a call that was complete
    before the text came stays sent, and the text follows as content."""
    text = call + " and a remark"
    assert parser().extract_tool_calls(text) == (text, [])
    content, calls, saw = stream(text, 1, parser)
    assert calls_of(calls) == expected and saw and content.strip() == "and a remark"


# Per parser: an output of two calls in its model family's format, a text inside the first
# call's arguments, what of them is written once the text ends there, and a text inside the
# second call.
TWO_CALLS = [
    (Llama3JsonToolParser, CALLS[2][0], '"a } ;', "a } ;", '"parameters": {'),
    (HermesToolParser, HERMES_CALLS[1][0], '"San Franc', "San Franc", '"Paris, C'),
    (coder, "I will check.\n" + CODER_CALL + "\n" + CODER_CALL.replace("San Francisco", "Oslo"),
     "San Franc", "San Franc", "Os"),
    (MistralToolParser, MISTRAL_CALLS[3][0], '"Par', "Par", '"CET [AR'),
    (MistralToolParser, MISTRAL_CALLS[1][0], '"T10', "T10", '"retrieve_payment_da'),
    (PythonicToolParser, PYTHONIC_CALLS[1][0], 'CA",', '"location": "San Francisco, CA"',
     "timezone="),
]


@pytest.mark.parametrize("parser, text, inside, written, second", TWO_CALLS)
def test_arguments_stream_as_written(parser, text, inside, written, second):
    """The first call's name goes out before its arguments, and its arguments as far as they
    are written (for pythonic, an argument at a time), long before the call closes."""
    streamed = Streamed(text[:text.index(inside) + len(inside)], 1, parser)
    assert len(streamed.calls) == 1 and not streamed.saw
    arguments = streamed.calls[0]["function"]["arguments"]
    whole = parser().extract_tool_calls(text)[1][0]["function"]["arguments"]
    assert whole.startswith(arguments) and streamed.fragments[0] > 1 and written in arguments


@pytest.mark.parametrize("parser, text, inside, written, second", TWO_CALLS)
def test_unfinished_call_at_the_end(parser, text, inside, written, second):
    """A stream that ends inside its second call: the first call stays complete, the second
    as far as it was sent, and the text from the end of the first is content (all of Mistral's
    array, whose calls are not done with until it closes)."""
    content, whole = parser().extract_tool_calls(text)
    cut = text.index(second, text.index(inside) + len(inside)) + len(second)
    array = text.startswith("[TOOL_CALLS][")
    for piece in (1, 4):
        streamed = Streamed(text[:cut], piece, parser)
        assert streamed.saw != array and streamed.calls[0]["function"] == whole[0]["function"]
        if array:
            assert streamed.content == text[:cut]
            continue
        assert len(streamed.calls) <= 2
        if len(streamed.calls) == 2:
            partial = streamed.calls[1]["function"]
            assert partial["name"] == whole[1]["function"]["name"]
            assert whole[1]["function"]["arguments"].startswith(partial["arguments"])
        assert streamed.content.startswith(content or "")
        rest = streamed.content[len(content or ""):]
        assert rest.strip() and text[:cut].endswith(rest)


@pytest.mark.parametrize("parser, text", [
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": {"x": 1}} oops</tool_call>'),
    (Llama3JsonToolParser, '{"name": "f", "parameters": {"x": [1, 2}}'),
    (coder, "<tool_call>\n<function=f>\n<parameter=x>\n1\n<parameter=y>\n2\n</parameter>"),
    (MistralToolParser, '[TOOL_CALLS]f[ARGS]{"x": 1, "y": }'),
    (PythonicToolParser, "[f(x=1, y=open('z'))]"),
])
def test_malformed_after_a_call_began(parser, text):
    """A call that goes wrong after its name and some arguments were sent: nothing is taken
    back, the call is not complete (the choice does not finish "tool_calls"), and all of the
    text is content, whole and streamed."""
    assert parser().extract_tool_calls(text) == (text, [])
    streamed = Streamed(text, 1, parser)
    assert streamed.content == text and not streamed.saw
    assert [c["function"]["name"] for c in streamed.calls] == ["f"]


def test_pythonic_trailing_commas():
    """Python's trailing commas, in a call's arguments and in the list."""
    check_whole_and_streamed(PythonicToolParser, "[f(x=1, ), g(),]", None,
                             [("f", {"x": 1}), ("g", {})])

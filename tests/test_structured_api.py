"""The API's structured-output and tool fields translated without a server: constraints from
each field, forced tool schemas (each tool's $defs hoisted), and tool turns rendered through a
chat template that takes `tools` and assistant `tool_calls` (arguments as objects)."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from pydantic import BaseModel

from liteinfer import SamplingParams
from liteinfer.engine import processor as processor_module
from liteinfer.entrypoints.openai.protocol import ChatCompletionRequest
from liteinfer.entrypoints.openai.structured import (
    NamedToolChoice,
    Tool,
    ToolCalls,
    forced_tool_schema,
)
from liteinfer.structured_output import StructuredOutputsParams
from liteinfer.structured_output.backend import XgrammarBackend, tokenizer_info
from test_structured_output import Color, Point

# Llama 3.1's way of rendering tools and tool turns, cut down.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }}"
    "({{ t.function.parameters | tojson }});{% endfor %}|{% endif %}"
    "{% for m in messages %}{{ m.role }}: "
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} "
    "{{ c.function.arguments.city }}{% endfor %}"
    "{% elif m.role == 'tool' %}RESULT {{ m.tool_call_id }} {{ m.content }}"
    "{% else %}{{ m.content }}{% endif %}|{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


class Trip(BaseModel):
    start: Point
    color: Color


TOOLS = [Tool.model_validate({"type": "function", "function": {
    "name": n, "parameters": m.model_json_schema()}}) for n, m in (("trip", Trip),
                                                                   ("point", Point))]


def test_constraint_from_each_field():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    schema = Point.model_json_schema()
    cases = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "p", "schema": schema, "strict": True}}},
         {"json": schema}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
         {"regex": "a+", "disable_any_whitespace": True}),
        ({"guided_json": json.dumps(schema)}, {"json": json.dumps(schema)}),
        ({"guided_grammar": 'root ::= "x"'}, {"grammar": 'root ::= "x"'}),
        ({"tools": [t.model_dump() for t in TOOLS],
          "tool_choice": {"type": "function", "function": {"name": "point"}}},
         {"json": schema}),
        ({"tools": [t.model_dump() for t in TOOLS]}, None),  # auto: nothing forced
    ]
    for fields, expected in cases:
        constraint = ChatCompletionRequest.model_validate({**base, **fields}).output_constraint()
        if expected is None:
            assert constraint is None
        else:
            assert {k: v for k, v in vars(constraint).items() if v not in (None, False)} \
                == expected


@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema_hoists_defs(tiny_llm, parallel):
    schema = forced_tool_schema(TOOLS, "required", parallel)
    assert set(schema["$defs"]) == {"tool0_Point", "tool0_Color"}  # Point alone has none
    assert ("maxItems" in schema) != parallel
    engine = tiny_llm.engine
    backend = XgrammarBackend(tokenizer_info(engine.tokenizer, engine.model_config.vocab_size,
                                             engine.core.eos_token_ids))
    # Every reference resolves, and the grammar takes the calls and nothing else.
    grammar = backend.compile(StructuredOutputsParams(json=schema))

    def accepts(text: str) -> bool:
        return xgr.GrammarMatcher(grammar).accept_string(text)

    calls_made = [{"name": "trip", "parameters": {"start": {"x": 1, "y": 2},
                                                     "color": "red"}},
                     {"name": "point", "parameters": {"x": 0, "y": -3}}]
    text = json.dumps(calls_made if parallel else calls_made[:1])
    assert accepts(text)
    assert accepts(json.dumps(calls_made)) == parallel
    assert not accepts(json.dumps([{"name": "trip", "parameters": {"x": 0, "y": 0}}]))
    assert not accepts("[]")
    content, calls = ToolCalls(TOOLS, "required", None).final(text)
    assert content is None and [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                for c in calls] == [(c["name"], c["parameters"])
                                                    for c in json.loads(text)]
    named = ToolCalls(TOOLS, NamedToolChoice.model_validate({"function": {"name": "point"}}),
                      None)
    assert named.final('{"x": 1, "y": 2}')[1][0]["function"]["name"] == "point"
    assert named.final('{"x": 1, "y"') == ('{"x": 1, "y"', [])


def test_tool_turns_render_through_the_template(tiny_llm):
    processor = tiny_llm.engine.processor
    tokenizer = processor.tokenizer
    tokenizer.chat_template, saved = TOOLS_TEMPLATE, tokenizer.chat_template
    try:
        body = ChatCompletionRequest.model_validate({"tools": [t.model_dump() for t in TOOLS],
                                                     "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call-1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call-1", "content": "sunny"}]})
        ids = processor.apply_chat_template(body.conversation(), True, tools=body.tool_dicts())
    finally:
        tokenizer.chat_template = saved
    text = tokenizer.decode(ids)
    assert text.startswith("TOOLS:trip(") and ";point(" in text
    assert text.endswith("|user: Weather in Paris?|assistant: CALL get_weather Paris|"
                         "tool: RESULT call-1 sunny|assistant:")


@pytest.mark.parametrize("tool_choice, text", [
    ("required", json.dumps([{"name": "point", "parameters": {"x": 1, "y": 2}},
                             {"name": "point", "parameters": {"x": 3, "y": 4}}])),
    ({"function": {"name": "point"}}, json.dumps({"x": 1, "y": 2}))])
def test_streamed_forced_calls(tool_choice, text):
    """A forced call streams as a parsed one: its name first, then its arguments as they are
    written, which concatenate to the arguments of the whole output. Cut off, its text is
    content (the call begun stays as far as it was sent)."""
    choice = tool_choice if isinstance(tool_choice, str) else \
        NamedToolChoice.model_validate(tool_choice)
    _, whole = ToolCalls(TOOLS, choice, None).final(text)
    tools = ToolCalls(TOOLS, choice, None)
    streamed: dict[int, dict] = {}
    for end in range(1, len(text) + 1):
        delta, sent = tools.delta(0, text[end - 1:end], text[:end], end == len(text))
        assert "content" not in delta
        for d in delta.get("tool_calls", []):
            if "id" in d:
                streamed[d["index"]] = {**d["function"], "fragments": 1}
            else:
                streamed[d["index"]]["arguments"] += d["function"]["arguments"]
                streamed[d["index"]]["fragments"] += 1
    assert sent and [{"name": c["name"], "arguments": c["arguments"]}
                     for c in streamed.values()] == [c["function"] for c in whole]
    assert all(c["fragments"] > 1 for c in streamed.values())
    cut = text[:len(text) // 2]
    cut_tools = ToolCalls(TOOLS, choice, None)
    assert cut_tools.delta(1, cut, cut, True)[0]["content"] == cut


def test_choices_share_one_constraint_parsed_once(tiny_llm, monkeypatch):
    """A request's n choices share the one constraint built from its fields, and the front end
    parses its grammar (to refuse a bad one) once for them all."""
    body = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "hi"}], "n": 3, "seed": 5,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "p", "schema": Point.model_json_schema()}}})
    choices = body.sampling_params({}, 20, None)
    constraint = choices[0].structured_outputs
    assert [p.seed for p in choices] == [5, 6, 7] and constraint is not None
    assert all(p.structured_outputs is constraint for p in choices)
    parsed = []
    build_grammar = processor_module.build_grammar
    monkeypatch.setattr(processor_module, "build_grammar",
                        lambda c: parsed.append(c) or build_grammar(c))
    requests = tiny_llm.engine.processor.process(
        [(f"r{i}", [1, 2, 3], p) for i, p in enumerate(choices)])
    assert [r.sampling_params.seed for r in requests] == [5, 6, 7]
    assert parsed == [constraint]


def test_offline_choices_parse_their_constraint_once(tiny_llm, monkeypatch):
    """Offline, a prompt's n choices are queued together: the grammar they share is parsed
    once, and every choice still follows it."""
    constraint = StructuredOutputsParams(json=Point.model_json_schema(),
                                         disable_any_whitespace=True)
    parsed = []
    build_grammar = processor_module.build_grammar
    monkeypatch.setattr(processor_module, "build_grammar",
                        lambda c: parsed.append(c) or build_grammar(c))
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=40,
                            structured_outputs=constraint)
    [out] = tiny_llm.generate(["A point:"], params, use_tqdm=False)
    assert parsed == [constraint] and len(out.outputs) == 3
    for choice in out.outputs:
        if choice.finish_reason == "stop":
            Point.model_validate_json(choice.text)

"""Structured outputs and tool calls over real HTTP with the official openai client: .parse()
with pydantic models, json_object, vLLM's structured_outputs and guided_* fields, forced tool
calls (named and "required", streamed and not) that validate against the function's
parameters, the follow-up turn with tool results, and 400s for bad constraints. The tiny
random model writes noise, so what parses is the grammar's doing; SmolLM2 shows a real model
under the default (any-whitespace) JSON grammar."""
from __future__ import annotations

import json
import re

import openai
import pytest
from pydantic import BaseModel, Field

from fixtures import serve
from liteinfer.engine.async_llm import AsyncLLM
from test_server import assert_engine_idle
from test_structured_output import Color, Order, Path

# Small models emit runs of whitespace where JSON allows it; the tiny one is held to none.
TIGHT = {"structured_outputs": {"disable_any_whitespace": True}}
MESSAGES = [{"role": "user", "content": "Hello world! How are you today?"}]


class Weather(BaseModel):
    city: str = Field(pattern=r"^[A-Z][a-z]{1,8}$")
    unit: Color
    days: int = Field(ge=1, le=7)


class Stock(BaseModel):
    ticker: str = Field(pattern=r"^[A-Z]{3,4}$")


def tool(name: str, model: type[BaseModel]) -> dict:
    return {"type": "function", "function": {"name": name, "description": f"{name} tool",
                                             "parameters": model.model_json_schema()}}


TOOLS = [tool("get_weather", Weather), tool("get_stock", Stock)]
PARAMETERS = {"get_weather": Weather, "get_stock": Stock}


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    engine = AsyncLLM.from_args(str(tiny_llama_dir), dtype="float32", device="cpu",
                                max_model_len=512)
    with serve(engine, "tiny") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        assert_engine_idle(url)
    engine.shutdown()


@pytest.mark.parametrize("model", [Order, Path])
def test_parse_returns_pydantic_objects(client, model):
    completion = client.chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=model, max_tokens=150,
        temperature=1.0, seed=2, n=2, extra_body=TIGHT)
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model)
        assert choice.message.parsed == model.model_validate_json(choice.message.content)


def test_json_object_and_vllm_fields(client):
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format={"type": "json_object"},
        max_tokens=60, extra_body=TIGHT)
    assert out.choices[0].message.content.startswith("{")
    regex = client.completions.create(model="tiny", prompt="The quick", max_tokens=20,
                                      extra_body={"guided_regex": r"\d{3}-[xy]{2}"})
    assert re.fullmatch(r"\d{3}-[xy]{2}", regex.choices[0].text)
    for body in ({"guided_choice": ["yes", "no"]},
                 {"structured_outputs": {"choice": ["yes", "no"]}}):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                             temperature=1.0, extra_body=body)
        assert out.choices[0].message.content in ("yes", "no")
    stream = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=150, stream=True,
        extra_body={"structured_outputs": {"json": Path.model_json_schema(),
                                           "disable_any_whitespace": True}})
    Path.model_validate_json("".join(c.choices[0].delta.content or "" for c in stream))


@pytest.mark.parametrize("body, message", [
    ({"guided_regex": "a(b"}, "invalid regex for structured outputs"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     'Unsupported type "objectx"'),
    ({"structured_outputs": {"grammar": 'root ::= "a" |'}}, "EBNF parser error"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "exactly one"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "one constraint"),
    ({"structured_outputs": {"json": {}, "whitespace_pattern": " "}}, "whitespace_pattern"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not one of the tools"),
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "cannot be combined"),
    ({"reasoning_effort": "high"}, "reasoning_effort is not supported"),
])
def test_bad_constraints_are_400s(client, body, message):
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=5,
                                       extra_body=body)


def check_calls(calls, names):
    assert [c.function.name for c in calls] and all(c.type == "function" for c in calls)
    assert {c.function.name for c in calls} <= set(names)
    for c in calls:
        PARAMETERS[c.function.name].model_validate_json(c.function.arguments)


def streamed_calls(stream):
    """Tool calls accumulated from delta.tool_calls as clients do, and the finish reason."""
    calls: dict[int, dict] = {}
    reason = None
    for chunk in stream:
        choice = chunk.choices[0]
        assert not choice.delta.content
        for d in choice.delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        reason = choice.finish_reason or reason
    return [openai.types.chat.ChatCompletionMessageToolCall(
        id=c["id"], type="function", function={"name": c["name"], "arguments": c["arguments"]})
        for c in calls.values()], reason


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_calls(client, stream):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice, names, reason in ((named, ["get_weather"], "stop"),
                                       ("required", ["get_weather", "get_stock"], "tool_calls")):
        kwargs = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice,
                      "max_tokens": 200, "temperature": 1.0, "seed": 4, "extra_body": TIGHT}
        if stream:
            calls, finish = streamed_calls(client.chat.completions.create(stream=True,
                                                                          **kwargs))
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            calls, finish = choice.message.tool_calls, choice.finish_reason
            assert choice.message.content is None
        check_calls(calls, names)
        assert finish == reason
        if tool_choice == named:
            assert len(calls) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_calls_are_parsed(client, stream):
    """tool_choice "auto": an output in the Llama-3 JSON call format (here held to it by a
    schema, as the random model would not write one) comes back as tool calls."""
    call = {"type": "object", "properties": {"name": {"enum": ["get_stock"]},
                                             "parameters": Stock.model_json_schema()},
            "required": ["name", "parameters"], "additionalProperties": False}
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=100,
                  extra_body={"structured_outputs": {"json": call,
                                                     "disable_any_whitespace": True}})
    if stream:
        calls, finish = streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
        assert choice.message.content is None
    check_calls(calls, ["get_stock"])
    assert len(calls) == 1 and finish == "tool_calls"


def test_tool_results_turn(client):
    # Seeded: unseeded, the tiny model's string arguments now and then ran past max_tokens.
    first = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
        parallel_tool_calls=False, temperature=1.0, seed=4, extra_body=TIGHT).choices[0].message
    assert len(first.tool_calls) == 1
    call = first.tool_calls[0]
    follow_up = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": 21})}]
    out = client.chat.completions.create(model="tiny", messages=follow_up, tools=TOOLS,
                                         max_tokens=8)
    assert out.choices[0].finish_reason in ("stop", "length")
    # tool_choice "auto": the tiny model's noise is content, not a call.
    assert out.choices[0].message.tool_calls is None


class Person(BaseModel):
    name: str
    age: int


def test_smollm2_parse(smollm2_path):
    engine = AsyncLLM.from_args(str(smollm2_path), dtype="float32", device="cpu",
                                max_model_len=512)
    try:
        with serve(engine, "smollm2") as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            completion = client.chat.completions.parse(
                model="smollm2", response_format=Person, max_tokens=40, temperature=0.0,
                messages=[{"role": "user", "content": "Give the name and age of a person as "
                                                       "JSON: Alice is 30 years old."}])
            person = completion.choices[0].message.parsed
            assert isinstance(person, Person) and person.age == 30, completion
            assert_engine_idle(url)
    finally:
        engine.shutdown()

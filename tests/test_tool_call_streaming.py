"""Streamed tool calls over real HTTP with the official clients, on SmolLM2 held by a grammar
to write two calls in each parser's format (the model would not write them itself): the
chat stream, the Responses API's function_call_arguments events and Anthropic's
input_json_delta events carry each call's arguments in several fragments, as the model
writes them, and what the clients accumulate equals the calls of the same request
unstreamed."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from fixtures import API_KEY, serve

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}},
         {"type": "function", "function": {
             "name": "get_time", "description": "The time in a time zone",
             "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                            "required": ["timezone"]}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
EXPECTED = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"timezone": "CET"})]
# Two calls in each parser's format, as its model family writes them.
OUTPUTS = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
                   '{"name": "get_time", "parameters": {"timezone": "CET"}}',
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
              '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": '
              '"CET"}}\n</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
                   "<function=get_time>\n<parameter=timezone>\nCET\n</parameter>\n</function>\n"
                   "</tool_call>",
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time'
               '[ARGS]{"timezone": "CET"}',
    "pythonic": '[get_weather(city="Paris", days=3), get_time(timezone="CET")]',
}


@pytest.fixture(scope="module")
def engine(smollm2_path):
    from liteinfer.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_args(str(smollm2_path), dtype="float32", device="cpu",
                                max_model_len=1024)
    yield engine
    engine.shutdown()


def served(engine, parser: str):
    from liteinfer.entrypoints.openai.cli_args import ServerArgs

    return serve(engine, "smollm2", ServerArgs(api_key=API_KEY, tool_call_parser=parser))


def written(text: str) -> dict:
    """The request field that holds the output to `text` (an EBNF grammar of that string)."""
    return {"structured_outputs": {"grammar": "root ::= " + json.dumps(text)}}


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


@pytest.mark.parametrize("parser", sorted(OUTPUTS))
def test_chat_stream_of_each_parser(engine, parser):
    with served(engine, parser) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        request = dict(model="smollm2", messages=MESSAGES, tools=TOOLS, temperature=0,
                       max_tokens=300, extra_body=written(OUTPUTS[parser]))
        whole = client.chat.completions.create(**request).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        assert calls_of(whole.message.tool_calls) == EXPECTED
        with client.chat.completions.stream(**request) as stream:
            events = list(stream)
            final = stream.get_final_completion().choices[0]
    # What the client accumulated: the same calls, arguments text for text.
    assert final.finish_reason == "tool_calls" and not final.message.content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(c.id.startswith("chatcmpl-tool-") for c in final.message.tool_calls)
    fragments = [e for e in events if e.type == "tool_calls.function.arguments.delta"]
    for index, call in enumerate(whole.message.tool_calls):
        mine = [e.arguments_delta for e in fragments if e.index == index]
        assert len(mine) > 1 and "".join(mine) == call.function.arguments
    # The first delta of each call names it; the others carry its index and arguments only.
    deltas = [d for e in events if e.type == "chunk" and e.chunk.choices
              for d in e.chunk.choices[0].delta.tool_calls or ()]
    for index in range(len(EXPECTED)):
        first, *rest = [d for d in deltas if d.index == index]
        assert first.id and first.type == "function" and first.function.name
        assert rest and all(d.id is None and d.function.name is None for d in rest)


# One call in llama3_json's format, as a JSON schema the Responses and Messages APIs take.
ONE_CALL = {"type": "object", "properties": {
    "name": {"const": "get_weather"},
    "parameters": {"type": "object", "properties": {"city": {"const": "Paris"},
                                                    "days": {"const": 3}},
                   "required": ["city", "days"], "additionalProperties": False}},
    "required": ["name", "parameters"], "additionalProperties": False}


def test_responses_and_messages_streams(engine):
    """With the llama3_json parser, an output held to one call by a JSON schema: the Responses
    stream's function_call_arguments deltas and the Messages stream's input_json_delta events
    come in several fragments that make the call's arguments."""
    with served(engine, "llama3_json") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
        tools = [{"type": "function", **t["function"]} for t in TOOLS]
        request = dict(model="smollm2", input=MESSAGES, tools=tools, temperature=0,
                       max_output_tokens=100, text={"format": {
                           "type": "json_schema", "name": "call", "schema": ONE_CALL}})
        whole = client.responses.create(**request)
        [call] = [i for i in whole.output if i.type == "function_call"]
        assert (call.name, json.loads(call.arguments)) == EXPECTED[0]
        with client.responses.stream(**request) as stream:
            events = list(stream)
            [streamed] = [i for i in stream.get_final_response().output
                          if i.type == "function_call"]
        fragments = [e.delta for e in events
                     if e.type == "response.function_call_arguments.delta"]
        assert len(fragments) > 1 and "".join(fragments) == streamed.arguments == call.arguments
        [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert done.arguments == call.arguments

        claude = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
        # The SDK no longer takes sampling parameters: the temperature goes in the body.
        request = dict(model="smollm2", max_tokens=100, messages=MESSAGES,
                       tools=[{"name": t["function"]["name"],
                               "description": t["function"]["description"],
                               "input_schema": t["function"]["parameters"]} for t in TOOLS],
                       extra_body={"temperature": 0, "output_config": {"format": {
                           "type": "json_schema", "schema": ONE_CALL}}})
        message = claude.messages.create(**request)
        [use] = [b for b in message.content if b.type == "tool_use"]
        assert message.stop_reason == "tool_use" and (use.name, use.input) == EXPECTED[0]
        with claude.messages.stream(**request) as stream:
            events = list(stream)
            final = stream.get_final_message()
        partial = [e.delta.partial_json for e in events
                   if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        assert len(partial) > 1 and json.loads("".join(partial)) == use.input
        assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [
            (use.name, use.input)]

"""OpenAI's Responses API over real HTTP with the official openai client: SmolLM2 answers as
the same conversation does through chat completions, whole and streamed; a forced function
call and its follow-up with the function's output; a JSON schema through .parse(). A tiny
scripted Qwen3 with the real Qwen3 tokenizer (see conftest's `qwen3_url`) shows the prompts
of instructions and of a follow-up by previous_response_id, and returns its reasoning as a
reasoning item. Bad input gets OpenAI's error shape."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from fixtures import API_KEY, QWEN3_ANSWER, QWEN3_REASONING

GREEDY = {"temperature": 0, "max_output_tokens": 8}
QUESTION = "What is the capital of France?"
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {
                    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}},
                    "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(smollm2_url):
    return openai.OpenAI(base_url=smollm2_url + "/v1", api_key=API_KEY, max_retries=0)


def chat_text(client, messages) -> str:
    return client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                          max_tokens=8).choices[0].message.content


def test_text_whole_and_streamed_match_chat(client):
    question = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    response = client.responses.create(model="smollm2", input=question, **GREEDY)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output_text and response.output_text == chat_text(
        client, [{"role": "user", "content": QUESTION}])
    assert 0 < response.usage.output_tokens <= 8
    with client.responses.stream(model="smollm2", input=QUESTION, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed" and "response.output_text.done" in types
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == response.output_text == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens == response.usage.output_tokens


@pytest.fixture(scope="module")
def qwen3(qwen3_url):
    return openai.OpenAI(base_url=qwen3_url + "/v1", api_key=API_KEY, max_retries=0)


def prompt_tokens(base_url: str, messages: list[dict]) -> int:
    """The prompt's tokens as the chat template renders `messages` (vLLM's /tokenize)."""
    response = httpx.post(base_url + "/tokenize", json={"messages": messages},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    return response.json()["count"]


def test_instructions_and_previous_response_id(qwen3, qwen3_url):
    """Each response's prompt is the conversation it continues: the instructions (not carried
    over), the earlier turns with the earlier response's answer, the new input."""
    first = qwen3.responses.create(model="qwen3", instructions="Be brief.",
                                   input="My name is Ada.", temperature=0)
    assert first.usage.input_tokens == prompt_tokens(qwen3_url, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "My name is Ada."}])
    second = qwen3.responses.create(model="qwen3", input="What is my name?",
                                    previous_response_id=first.id, temperature=0)
    assert second.previous_response_id == first.id and second.output_text == QWEN3_ANSWER
    assert second.usage.input_tokens == prompt_tokens(qwen3_url, [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": QWEN3_ANSWER},
        {"role": "user", "content": "What is my name?"}])
    with qwen3.responses.stream(model="qwen3", input="What is my name?",
                                previous_response_id=first.id, temperature=0) as stream:
        streamed = stream.get_final_response()
    assert streamed.previous_response_id == first.id and streamed.output_text == QWEN3_ANSWER
    assert streamed.usage.input_tokens == second.usage.input_tokens
    assert qwen3.responses.retrieve(first.id).output_text == first.output_text
    unstored = qwen3.responses.create(model="qwen3", input="Hi", store=False)
    for gone in (unstored.id, "resp_unknown"):
        with pytest.raises(openai.NotFoundError, match="kept in memory"):
            qwen3.responses.create(model="qwen3", input="Hi", previous_response_id=gone)


def check_weather_call(response):
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    return calls[0]


def test_function_call_and_its_output(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = client.responses.create(model="smollm2", input=question, tools=[WEATHER_TOOL],
                                       tool_choice="required", temperature=0,
                                       max_output_tokens=60)
    call = check_weather_call(response)
    with client.responses.stream(model="smollm2", input=question, tools=[WEATHER_TOOL],
                                 tool_choice="required", temperature=0,
                                 max_output_tokens=60) as stream:
        events = list(stream)
        streamed = check_weather_call(stream.get_final_response())
    assert streamed.arguments == call.arguments == "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta")
    follow_up = client.responses.create(
        model="smollm2", tools=[WEATHER_TOOL], **GREEDY,
        input=question + [call.model_dump(exclude_none=True),
                          {"type": "function_call_output", "call_id": call.call_id,
                           "output": "Sunny, 24 C"}])
    assert follow_up.output_text and not [i for i in follow_up.output
                                          if i.type == "function_call"]
    assert follow_up.usage.input_tokens > response.usage.input_tokens


class Capital(BaseModel):
    city: str = Field(pattern=r"^[A-Z][a-z]{1,9}$")
    country: str = Field(pattern=r"^[A-Z][a-z]{1,9}$")


def test_json_schema(client):
    response = client.responses.parse(model="smollm2", input=QUESTION, text_format=Capital,
                                      temperature=0, max_output_tokens=60)
    assert isinstance(response.output_parsed, Capital)
    assert Capital.model_validate_json(response.output_text) == response.output_parsed
    with client.responses.stream(model="smollm2", input=QUESTION, text_format=Capital,
                                 temperature=0, max_output_tokens=60) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_parsed == response.output_parsed


def test_reasoning_items(qwen3):
    response = qwen3.responses.create(model="qwen3", input="Is the sky blue?", temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == QWEN3_REASONING
    assert message.type == "message" and response.output_text == QWEN3_ANSWER
    with qwen3.responses.stream(model="qwen3", input="Is the sky blue?",
                                temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events
                   if e.type == "response.reasoning_text.delta") == QWEN3_REASONING
    assert final.output[0].content[0].text == QWEN3_REASONING
    assert final.output_text == QWEN3_ANSWER


@pytest.mark.parametrize("body, message", [
    ({"input": 3}, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": "Hi", "tool_choice": "required"}, "needs tools"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema"}}, "temperature": -1},
     "temperature"),
])
def test_bad_requests_get_openai_errors(qwen3_url, body, message):
    response = httpx.post(qwen3_url + "/v1/responses", json={"model": "qwen3", **body},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and message in error["message"]
    broken = httpx.post(qwen3_url + "/v1/responses", content=b"{not json",
                        headers={"Authorization": f"Bearer {API_KEY}"})
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]


def test_previous_response_id_on_another_api_server(tiny_llama_dir):
    """Two API servers on one core (front ends 0 and 1, as `--api-server-count 2` runs them),
    of the tiny random Llama: a response made through one is continued and retrieved through
    the other, since the core keeps the stored responses."""
    from fixtures import serve
    from liteinfer.config import EngineConfig
    from liteinfer.engine.async_llm import AsyncLLM
    from liteinfer.entrypoints.openai.cli_args import ServerArgs

    engine_args = dict(dtype="float32", device="cpu", max_model_len=256)
    first = AsyncLLM.from_args(str(tiny_llama_dir), num_clients=2, **engine_args)
    second = AsyncLLM(str(tiny_llama_dir), EngineConfig(**engine_args), first.core_handle,
                      client_index=1)
    try:
        with serve(first, "tiny", ServerArgs(api_key=API_KEY)) as one, \
                serve(second, "tiny", ServerArgs(api_key=API_KEY)) as two:
            a, b = (openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0)
                    for url in (one, two))
            made = a.responses.create(model="tiny", input="My name is Ada.", **GREEDY)
            follow = b.responses.create(model="tiny", input="What is my name?",
                                        previous_response_id=made.id, **GREEDY)
            assert follow.previous_response_id == made.id
            assert follow.usage.input_tokens == prompt_tokens(two, [
                {"role": "user", "content": "My name is Ada."},
                {"role": "assistant", "content": made.output_text},
                {"role": "user", "content": "What is my name?"}])
            assert b.responses.retrieve(made.id).output_text == made.output_text
            assert a.responses.retrieve(follow.id).output_text == follow.output_text
            with pytest.raises(openai.NotFoundError, match="kept in memory"):
                b.responses.create(model="tiny", input="Hi",
                                   previous_response_id="resp_unknown")
    finally:
        second.shutdown()
        first.shutdown()

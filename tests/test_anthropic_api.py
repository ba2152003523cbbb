"""Anthropic's Messages API over real HTTP with the official anthropic client (which sends
its key as x-api-key): SmolLM2 answers a system prompt and a multi-turn conversation as the
same messages do through chat completions, whole and streamed, and makes a forced tool_use
whose tool_result it then reads; count_tokens counts what create's usage reports. A tiny
scripted Qwen3 with the real Qwen3 tokenizer (see conftest's `qwen3_url`) returns thinking
blocks, stops at stop_sequences, and answers without thinking when it is disabled. Bad input
and a bad key get Anthropic's error shape, never a 500."""
from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from fixtures import API_KEY, QWEN3_ANSWER, QWEN3_PLAIN, QWEN3_REASONING

SYSTEM = "You are a geography teacher."
CONVERSATION = [{"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Paris."}]},
                {"role": "user", "content": [{"type": "text", "text": "And of Italy?"}]}]
# The SDK no longer takes sampling parameters; older clients (and the API) still send them.
GREEDY = {"temperature": 0}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city",
                "input_schema": {"type": "object", "properties": {
                    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"}},
                    "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(smollm2_url):
    return anthropic.Anthropic(base_url=smollm2_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def qwen3(qwen3_url):
    return anthropic.Anthropic(base_url=qwen3_url, api_key=API_KEY, max_retries=0)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_system_and_turns_match_chat_whole_and_streamed(client, smollm2_url):
    message = client.messages.create(model="claude-sonnet-4-5", system=SYSTEM,
                                     messages=CONVERSATION, max_tokens=8, extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason in ("end_turn", "max_tokens")
    chat = openai.OpenAI(base_url=smollm2_url + "/v1", api_key=API_KEY).chat.completions.create(
        model="smollm2", temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": SYSTEM},
                  {"role": "user", "content": "What is the capital of France?"},
                  {"role": "assistant", "content": "Paris."},
                  {"role": "user", "content": "And of Italy?"}])
    assert text_of(message) == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens == client.messages.count_tokens(
        model="any", system=SYSTEM, messages=CONVERSATION).input_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    with client.messages.stream(model="claude-sonnet-4-5", system=SYSTEM,
                                messages=CONVERSATION, max_tokens=8, extra_body=GREEDY) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == text_of(final) == text_of(message)
    assert (final.stop_reason, final.usage.output_tokens) == (message.stop_reason,
                                                              message.usage.output_tokens)


def test_tool_use_and_tool_result(client):
    question = {"role": "user", "content": "What is the weather in Paris?"}
    forced = {"type": "tool", "name": "get_weather"}
    message = client.messages.create(model="m", messages=[question], tools=[WEATHER_TOOL],
                                     tool_choice=forced, max_tokens=40, extra_body=GREEDY)
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and set(call.input) == {"city"}
    assert message.stop_reason == "tool_use"
    with client.messages.stream(model="m", messages=[question], tools=[WEATHER_TOOL],
                                tool_choice=forced, max_tokens=40, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", call.input)]
    turns = [question, {"role": "assistant", "content": message.content},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": "Sunny, 24 C"}]}]
    answer = client.messages.create(model="m", messages=turns, tools=[WEATHER_TOOL],
                                    max_tokens=8, extra_body=GREEDY)
    assert text_of(answer) and answer.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(model="m", messages=turns, tools=[WEATHER_TOOL])
    assert answer.usage.input_tokens == counted.input_tokens > message.usage.input_tokens


def test_thinking_blocks_whole_and_streamed(qwen3):
    ask = {"model": "m", "max_tokens": 32, "extra_body": GREEDY,
           "messages": [{"role": "user", "content": "Is the sky blue?"}]}
    message = qwen3.messages.create(**ask)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in message.content] == [("thinking", QWEN3_REASONING), ("text", QWEN3_ANSWER)]
    assert message.stop_reason == "end_turn"
    with qwen3.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.content[0].thinking == QWEN3_REASONING and text_of(final) == QWEN3_ANSWER
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                   and e.delta.type == "thinking_delta") == QWEN3_REASONING
    plain = qwen3.messages.create(**ask, thinking={"type": "disabled"})
    assert [b.type for b in plain.content] == ["text"] and text_of(plain) == QWEN3_PLAIN


def test_stop_sequences(qwen3):
    ask = {"model": "m", "max_tokens": 32, "stop_sequences": ["nothing", " is"],
           "messages": [{"role": "user", "content": "Is the sky blue?"}]}
    message = qwen3.messages.create(**ask)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " is")
    assert text_of(message) == "The answer"
    with qwen3.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == (
        "stop_sequence", " is", "The answer")
    short = qwen3.messages.create(**{**ask, "max_tokens": 2, "stop_sequences": []})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def post(url: str, body: bytes | dict, key: str = API_KEY) -> httpx.Response:
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(url + "/v1/messages", headers={"x-api-key": key}, **kwargs)


@pytest.mark.parametrize("body, message", [
    (b"{not json", "not valid JSON"),
    ({"model": "m", "messages": [{"role": "user", "content": "Hi"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 8, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}]}, "messages.0"),
    ({"model": "m", "max_tokens": 8, "messages": [{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]}, "tool_result"),
    ({"model": "m", "max_tokens": 8, "tool_choice": {"type": "any"},
      "messages": [{"role": "user", "content": "Hi"}]}, "needs tools"),
    ({"model": "m", "max_tokens": 8, "temperature": 1.5,
      "messages": [{"role": "user", "content": "Hi"}]}, "temperature"),
    ({"model": "m", "max_tokens": 8, "thinking": {"type": "enabled", "budget_tokens": -1},
      "messages": [{"role": "user", "content": "Hi"}]}, "budget_tokens"),
])
def test_bad_requests_get_anthropic_errors(qwen3_url, body, message):
    response = post(qwen3_url, body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert message in error["error"]["message"]


def test_api_key(qwen3, qwen3_url):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=qwen3_url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.body["error"]["type"] == "authentication_error"
    bearer = httpx.post(qwen3_url + "/v1/messages/count_tokens",
                        headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    assert bearer.json()["input_tokens"] == qwen3.messages.count_tokens(
        model="m", messages=[{"role": "user", "content": "Hi"}]).input_tokens > 0

"""Reasoning models: the qwen3 and deepseek_r1 parsers split an output into reasoning and
answer, whole and streamed in pieces of every size, and tool calls are read from the answer
only. Over HTTP with the official openai client, a tiny Qwen3 with the real Qwen3 tokenizer
and chat template, scripted to write its think block (see conftest's `qwen3_url`), answers
with `reasoning_content` (and `reasoning`) beside `content`, whole and streamed;
`chat_template_kwargs` reaches the template and `include_reasoning: false` drops the
reasoning."""
from __future__ import annotations

import json

import anthropic
import openai
import pytest

from fixtures import API_KEY, QWEN3_ANSWER, QWEN3_PLAIN, QWEN3_REASONING, QWEN3_TOKENIZER
from liteinfer.entrypoints.openai.chat_output import ChatOutput
from liteinfer.entrypoints.openai.reasoning_parsers import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from liteinfer.entrypoints.openai.structured import Tool, ToolCalls

QWEN3_OUTPUTS = [  # (output, reasoning, content)
    ("<think>\nThe user greets me.\n\nI greet back.\n</think>\n\nHello! How can I help?\n",
     "The user greets me.\n\nI greet back.", "Hello! How can I help?\n"),
    ("<think>\n\n</think>\n\nNo thinking here.", None, "No thinking here."),
    ("Hello without a think block: 2 < 3.", None, "Hello without a think block: 2 < 3."),
    ("<think>\nStill thinking when the tokens ran out  ",
     "Still thinking when the tokens ran out", None),
    ("<think>a</think>", "a", None),
    ("Before. <think> a </think> after", "a", "Before. after"),
]
DEEPSEEK_OUTPUTS = [  # the template opened the block: reasoning from the first token
    ("The user wants 1 + 1. That is 2.\n</think>\n\nThe answer is 2.",
     "The user wants 1 + 1. That is 2.", "The answer is 2."),
    ("<think>\nOpened again by the model.\n</think>\n\nOK.", "Opened again by the model.",
     "OK."),
    ("Thinking until the end", "Thinking until the end", None),
]


def streamed(parser_cls, text: str, piece: int) -> tuple[str, str]:
    parser = parser_cls()
    reasoning = content = ""
    for end in range(piece, len(text) + piece, piece):
        r, c = parser.extract_reasoning_streaming(text[:end], end >= len(text))
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize("parser_cls, text, reasoning, content",
                         [(Qwen3ReasoningParser, *o) for o in QWEN3_OUTPUTS]
                         + [(DeepSeekR1ReasoningParser, *o) for o in DEEPSEEK_OUTPUTS])
def test_reasoning_split_whole_and_streamed(parser_cls, text, reasoning, content):
    assert parser_cls().extract_reasoning(text) == (reasoning, content)
    for piece in (1, 2, 3, 7, len(text)):
        assert streamed(parser_cls, text, piece) == (reasoning or "", content or "")


def test_marker_beginnings_are_held_back():
    parser = Qwen3ReasoningParser()
    assert parser.extract_reasoning_streaming("Hi <thi", False) == ("", "Hi ")
    assert parser.extract_reasoning_streaming("Hi <think>ab \n</th", False) == ("ab", "")
    assert parser.extract_reasoning_streaming("Hi <think>ab \n</th>", True) == (" \n</th>", "")
    r1 = DeepSeekR1ReasoningParser()
    assert r1.extract_reasoning_streaming("<th", False) == ("", "")
    assert r1.extract_reasoning_streaming("<think>x</", False) == ("x", "")
    assert r1.extract_reasoning_streaming("<think>x</think>\n", False) == ("", "")
    assert r1.extract_reasoning_streaming("<think>x</think>\ny", False) == ("", "y")
    assert set(REASONING_PARSERS) == {"qwen3", "deepseek_r1"}


WEATHER = Tool.model_validate({"function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}})
TOOL_OUTPUT = ('<think>\nI could write <tool_call>{"name": "get_weather", "arguments": '
               '{"city": "Rome"}}</tool_call> but first I think.\n</think>\n\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_tool_calls_are_read_from_the_answer_only():
    """A call written inside the reasoning is reasoning; the answer's call is the call."""
    def output(include_reasoning=True):
        return ChatOutput(ToolCalls([WEATHER], "auto", "hermes"), Qwen3ReasoningParser,
                          include_reasoning)

    message, calls = output().final(TOOL_OUTPUT)
    assert calls and message["content"] is None
    assert "Rome" in message["reasoning_content"] == message["reasoning"]
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [
        {"city": "Paris"}]
    for piece in (1, 5, len(TOOL_OUTPUT)):
        chat, reasoning, args = output(), "", {}
        for end in range(piece, len(TOOL_OUTPUT) + piece, piece):
            delta, saw = chat.delta(0, "", TOOL_OUTPUT[:end], end >= len(TOOL_OUTPUT))
            reasoning += delta.get("reasoning_content", "")
            for c in delta.get("tool_calls", []):  # a call's arguments come in fragments
                args[c["index"]] = args.get(c["index"], "") + c["function"]["arguments"]
            assert not delta.get("content", "").strip()
        assert saw and reasoning == message["reasoning_content"]
        assert [json.loads(a) for a in args.values()] == [{"city": "Paris"}]
    hidden, _ = output(include_reasoning=False).final(TOOL_OUTPUT)
    assert "reasoning_content" not in hidden and hidden["tool_calls"]


@pytest.fixture(scope="module")
def client(qwen3_url):
    return openai.OpenAI(base_url=qwen3_url + "/v1", api_key=API_KEY, max_retries=0)


MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]


def test_chat_splits_reasoning(client):
    message = client.chat.completions.create(model="qwen3", messages=MESSAGES,
                                             temperature=0).choices[0].message
    extra = message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == QWEN3_REASONING
    assert message.content == QWEN3_ANSWER


def test_chat_streams_reasoning_then_content(client):
    chunks = client.chat.completions.create(model="qwen3", messages=MESSAGES, temperature=0,
                                            stream=True)
    kinds, reasoning, content = [], "", ""
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta.model_extra or {}
            if delta.get("reasoning_content"):
                assert delta["reasoning"] == delta["reasoning_content"]
                reasoning += delta["reasoning_content"]
                kinds.append("reasoning")
            if choice.delta.content:
                content += choice.delta.content
                kinds.append("content")
    assert (reasoning, content) == (QWEN3_REASONING, QWEN3_ANSWER)
    assert kinds == sorted(kinds, reverse=True) and len(kinds) > 2  # reasoning first, in pieces


def test_template_kwargs_and_include_reasoning(client):
    """enable_thinking: false has the template close the think block in the prompt: the model
    answers at once. include_reasoning: false drops the reasoning, not the answer."""
    plain = client.chat.completions.create(
        model="qwen3", messages=MESSAGES, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert plain.content == QWEN3_PLAIN and plain.model_extra["reasoning_content"] is None
    hidden = client.chat.completions.create(
        model="qwen3", messages=MESSAGES, temperature=0,
        extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content == QWEN3_ANSWER and "reasoning_content" not in hidden.model_extra
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="qwen3", messages=MESSAGES, extra_body={
            "chat_template_kwargs": {"add_generation_prompt": "twice"}})


VERDICT = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
           "additionalProperties": False}
TIGHT = {"structured_outputs": {"disable_any_whitespace": True}}


def test_constraints_hold_the_answer_after_the_reasoning(client):
    """The model thinks freely; its grammar begins after </think> (the scripted answer is not
    JSON: the grammar writes it). With the think block closed in the prompt, at once."""
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT}}
    ask = {"model": "qwen3", "messages": MESSAGES, "temperature": 0, "max_tokens": 40,
           "response_format": fmt}
    message = client.chat.completions.create(**ask, extra_body=TIGHT).choices[0].message
    assert message.model_extra["reasoning_content"] == QWEN3_REASONING
    assert set(json.loads(message.content)) == {"ok"}
    plain = client.chat.completions.create(**ask, extra_body={
        **TIGHT, "chat_template_kwargs": {"enable_thinking": False}}).choices[0].message
    assert plain.model_extra["reasoning_content"] is None
    assert set(json.loads(plain.content)) == {"ok"}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}}}
    forced = client.chat.completions.create(
        model="qwen3", messages=MESSAGES, temperature=0, max_tokens=100, tools=[weather],
        tool_choice="required", parallel_tool_calls=False, extra_body=TIGHT).choices[0]
    assert forced.message.model_extra["reasoning_content"] == QWEN3_REASONING
    assert [c.function.name for c in forced.message.tool_calls or ()] == ["get_weather"], forced
    assert forced.finish_reason == "tool_calls"


def test_thinking_token_budget(client, qwen3_url):
    """vLLM's thinking_token_budget: after that many tokens of reasoning the engine writes
    </think>, and the scripted model answers after it. Anthropic's thinking budget_tokens is
    the same budget. Within budget, or with thinking off, nothing changes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(QWEN3_TOKENIZER))
    words = [tokenizer.decode(t)
             for t in tokenizer.encode(QWEN3_REASONING, add_special_tokens=False)]
    assert len(words) > 2
    full = client.chat.completions.create(model="qwen3", messages=MESSAGES, temperature=0)
    for budget, reasoning in ((0, None), (1, words[0]), (2, "".join(words[:2])),
                              (len(words), QWEN3_REASONING), (100, QWEN3_REASONING)):
        ask = dict(model="qwen3", messages=MESSAGES, temperature=0,
                   extra_body={"thinking_token_budget": budget})
        completion = client.chat.completions.create(**ask)
        choice = completion.choices[0]
        assert choice.message.model_extra["reasoning_content"] == reasoning
        assert choice.message.content == QWEN3_ANSWER and choice.finish_reason == "stop"
        # Written out all the same: <think>, the reasoning left, </think>, the answer.
        assert completion.usage.completion_tokens == (
            full.usage.completion_tokens - len(words) + min(budget, len(words)))
        chunks = client.chat.completions.create(**ask, stream=True)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) \
            == (reasoning or "")
        assert "".join(d.content or "" for d in deltas) == QWEN3_ANSWER
    plain = client.chat.completions.create(
        model="qwen3", messages=MESSAGES, temperature=0, extra_body={
            "thinking_token_budget": 0, "chat_template_kwargs": {"enable_thinking": False}})
    assert plain.choices[0].message.content == QWEN3_PLAIN
    claude = anthropic.Anthropic(base_url=qwen3_url, api_key=API_KEY, max_retries=0)
    message = claude.messages.create(model="qwen3", max_tokens=50, messages=MESSAGES,
                                     thinking={"type": "enabled", "budget_tokens": 1},
                                     extra_body={"temperature": 0})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
            for b in message.content] == [("thinking", words[0]), ("text", QWEN3_ANSWER)]
    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        client.chat.completions.create(model="qwen3", messages=MESSAGES,
                                       extra_body={"thinking_token_budget": -1})


def test_thinking_token_budget_needs_think_tokens(smollm2_url):
    """SmolLM2's tokenizer has no think markers: a budget is a bad request."""
    smollm2 = openai.OpenAI(base_url=smollm2_url + "/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="needs a reasoning model"):
        smollm2.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=4,
                                        extra_body={"thinking_token_budget": 8})


def test_thinking_budget_reads_the_section():
    """The engine's count: from the output's opening marker (Qwen3) or from the start when the
    prompt opened the section (DeepSeek-R1); a sequence whose output does not reason, or
    whose reasoning has closed, has nothing more to enforce and overlaps its steps again."""
    from liteinfer.engine.sequence import Sequence
    from liteinfer.engine.thinking_budget import ThinkingBudget
    from liteinfer.sampling_params import SamplingParams

    start, end = 7, 8
    qwen3 = ThinkingBudget(2, start, end, [1, 2])
    assert [qwen3.must_end([1, 2, start, 5, 6][:n]) for n in range(2, 6)] == [
        False, False, False, True]
    assert not qwen3.must_end([1, 2, start, 5, 6, end]) and qwen3.over
    r1 = ThinkingBudget(1, start, end, [1, start, 3])
    assert not r1.must_end([1, start, 3]) and r1.must_end([1, start, 3, 4])
    closed = [1, start, 2, end, 3]  # enable_thinking off: the template closed it
    plain = ThinkingBudget(0, start, end, closed)
    assert not plain.must_end(closed + [9]) and plain.over
    seq = Sequence("r", [1, 2], SamplingParams(thinking_token_budget=1,
                                               think_token_ids=(start, end)))
    assert seq.reads_outputs
    seq.append_token(start)
    seq.append_token(end)
    assert not seq.thinking.must_end(seq.token_ids) and not seq.reads_outputs
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=True)

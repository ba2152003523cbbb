"""Anthropic Messages API request bodies, their translation into a chat completion request
(what the server runs), and Anthropic's error shape. Fields a client may send that change
nothing here (metadata, service_tier, cache_control on blocks) are ignored; content this
server cannot take (images, documents, server tools) is refused with a 400."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from liteinfer.entrypoints.openai.protocol import PositiveCount

ANTHROPIC_PATH = "/v1/messages"  # the routes answering with Anthropic's error shape
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                       "message": message}}


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(b.text for b in self.content)


class ThinkingBlock(_Block):
    """Earlier reasoning sent back: chat templates drop it from past turns, as Anthropic does."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
                         Field(discriminator="type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["custom"] | None = None  # server tools (web search, ...) are not served
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    """Whether the model thinks (its chat template's switch), and at most how many tokens
    (the engine's thinking_token_budget)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = Field(None, ge=0)


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")  # effort: no budget is enforced

    format: OutputFormat | None = None


class CountTokensRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None

    def chat_request(self, **sampling: Any) -> dict[str, Any]:
        """The chat completion request (as a body) that runs this one. The model is the served
        one whatever its name here: Anthropic clients send their own models' names."""
        choice = self.tool_choice
        body: dict[str, Any] = {"messages": self._messages(), **sampling}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "description": t.description, "parameters": t.input_schema}}
                for t in self.tools]
        if choice is not None:
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                   if choice.type == "tool" else
                                   {"auto": "auto", "any": "required", "none": "none"}[
                                       choice.type])
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        if self.thinking is not None:  # Qwen3's template switch; others ignore it
            enabled = self.thinking.type != "disabled"
            body["chat_template_kwargs"] = {"enable_thinking": enabled}
            body["include_reasoning"] = enabled
            if enabled and self.thinking.budget_tokens is not None:
                body["thinking_token_budget"] = self.thinking.budget_tokens
        output = self.output_config
        if output is not None and output.format is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": output.format.json_schema}}
        return body

    def _messages(self) -> list[dict[str, Any]]:
        system = self.system
        messages = []
        if system:
            text = system if isinstance(system, str) else "".join(b.text for b in system)
            messages.append({"role": "system", "content": text})
        for m in self.messages:
            if isinstance(m.content, str):
                messages.append({"role": m.role, "content": m.content})
                continue
            text, calls = [], []
            for block in m.content:
                if isinstance(block, TextBlock):
                    text.append(block.text)
                elif isinstance(block, ToolUseBlock):
                    if m.role != "assistant":
                        raise ValueError("tool_use blocks belong to assistant messages")
                    calls.append({"id": block.id, "type": "function", "function": {
                        "name": block.name, "arguments": json.dumps(block.input)}})
                elif isinstance(block, ToolResultBlock):
                    if m.role != "user":
                        raise ValueError("tool_result blocks belong to user messages")
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                     "content": block.text()})
            if text or calls or m.role == "assistant":
                messages.append({"role": m.role, "content": "".join(text),
                                 **({"tool_calls": calls} if calls else {})})
        return messages


class MessagesRequest(CountTokensRequest):
    max_tokens: PositiveCount
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)

    def chat_completion(self) -> dict[str, Any]:
        return self.chat_request(
            max_tokens=self.max_tokens, stop=self.stop_sequences, stream=self.stream,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


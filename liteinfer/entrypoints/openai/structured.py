"""Structured outputs and tools in API requests: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields become one StructuredOutputsParams;
`tool_choice` "required" or a named function becomes a JSON schema the output is held to, and
that output becomes the response's tool calls."""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from liteinfer.structured_output import StructuredOutputsParams
from liteinfer.structured_output.backend import build_grammar


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    # `schema` shadows a BaseModel attribute, hence the alias.
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's `structured_outputs` request field."""

    model_config = ConfigDict(extra="forbid")

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def structured_outputs_params(
        response_format: ResponseFormat | None = None,
        structured_outputs: StructuredOutputsRequest | None = None,
        guided_json: str | dict[str, Any] | None = None, guided_regex: str | None = None,
        guided_choice: list[str] | None = None, guided_grammar: str | None = None,
) -> StructuredOutputsParams | None:
    """The request's one constraint, checked (ValueError with the compiler's message), or
    None."""
    given: list[StructuredOutputsParams] = []
    if response_format is not None and response_format.type == "json_object":
        given.append(StructuredOutputsParams(json_object=True))
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        given.append(StructuredOutputsParams(json=response_format.json_schema.json_schema))
    if structured_outputs is not None:
        fields = structured_outputs.model_dump(exclude_none=True)
        fields["json"] = fields.pop("json_", None)
        given.append(StructuredOutputsParams(**fields))
    guided = {"json": guided_json, "regex": guided_regex, "choice": guided_choice,
              "grammar": guided_grammar}
    if any(v is not None for v in guided.values()):
        given.append(StructuredOutputsParams(**guided))
    if len(given) > 1:
        raise ValueError("give at most one of response_format, structured_outputs and the "
                         "guided_* fields")
    if not given:
        return None
    build_grammar(given[0])
    return given[0]


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> None:
    if tool_choice in (None, "none", "auto"):
        return
    if not tools:
        raise ValueError(f"tool_choice {_choice_label(tool_choice)} needs tools")
    if isinstance(tool_choice, NamedToolChoice) and not any(
            t.function.name == tool_choice.function.name for t in tools):
        raise ValueError(f"tool_choice names {tool_choice.function.name!r}, which is not one "
                         "of the tools")


def _choice_label(tool_choice: ToolChoice) -> str:
    return (repr(tool_choice) if isinstance(tool_choice, str)
            else f"function {tool_choice.function.name!r}")


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_tool_schema(tools: list[Tool], tool_choice: ToolChoice,
                       parallel_tool_calls: bool = True) -> dict[str, Any] | None:
    """The JSON schema the output must match when a tool call is forced: a named function's
    arguments, or for "required" a non-empty array of {"name", "parameters"} calls of any of
    the tools (one call at most without parallel_tool_calls). None when nothing is forced."""
    if isinstance(tool_choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return _parameters(tool)
    if tool_choice != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """An OpenAI tool call; `arguments` as a JSON text."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                   ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": text}}


def forced_tool_calls(text: str, tool_choice: ToolChoice) -> list[dict[str, Any]]:
    """The tool calls of an output held to `forced_tool_schema`; a ValueError if the output
    is not complete (it stopped at its length limit)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the forced tool call is incomplete: {e}") from None
    if isinstance(tool_choice, NamedToolChoice):
        return [tool_call(tool_choice.function.name, value)]
    return [tool_call(c["name"], c["parameters"]) for c in value]


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as HF chat templates take it: an assistant's tool call arguments as
    objects (OpenAI sends them as JSON text)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    converted = []
    for call in calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments) if arguments else {}
            except json.JSONDecodeError:
                raise ValueError(f"tool call arguments are not JSON: {arguments!r}") from None
        converted.append({**call, "function": function})
    return {**message, "tool_calls": converted}

"""Structured outputs and tools in API requests: OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*` fields become one StructuredOutputsParams;
`tool_choice` "required" or a named function becomes a JSON schema the output is held to, and
that output becomes the response's tool calls."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from liteinfer.entrypoints.openai.tool_parsers import TOOL_PARSERS, ToolParser
from liteinfer.entrypoints.openai.tool_parsers.forced_calls import (
    NamedCallParser,
    RequiredCallsParser,
)
from liteinfer.structured_output import StructuredOutputsParams


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
    """The request's one constraint, or None. `structured_outputs` may also carry options
    alone (disable_any_whitespace) for a constraint given as response_format or guided_*."""
    constraints: list[dict[str, Any]] = []
    if response_format is not None and response_format.type == "json_object":
        constraints.append({"json_object": True})
    elif response_format is not None and response_format.type == "json_schema":
        if response_format.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        constraints.append({"json": response_format.json_schema.json_schema})
    options: dict[str, Any] = {}
    if structured_outputs is not None:
        fields = structured_outputs.model_dump(exclude_none=True, by_alias=True)
        options["disable_any_whitespace"] = fields.pop("disable_any_whitespace")
        if fields:
            constraints.append(fields)
    guided = {"json": guided_json, "regex": guided_regex, "choice": guided_choice,
              "grammar": guided_grammar}
    if any(v is not None for v in guided.values()):
        constraints.append({k: v for k, v in guided.items() if v is not None})
    if len(constraints) > 1:
        raise ValueError("give one constraint: response_format, structured_outputs or "
                         "guided_*")
    return StructuredOutputsParams(**constraints[0], **options) if constraints else None


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
    calls, defs = [], {}
    for i, t in enumerate(tools):
        parameters, tool_defs = _hoist_defs(_parameters(t), f"tool{i}_")
        defs.update(tool_defs)
        calls.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if defs:
        schema["$defs"] = defs
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def _hoist_defs(schema: dict[str, Any], prefix: str) -> tuple[Any, dict[str, Any]]:
    """A tool's parameters without their `$defs` (or `definitions`), which move to the root of
    the schema they are embedded in, renamed with `prefix` (references follow)."""
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    schema = {k: v for k, v in schema.items() if k not in ("$defs", "definitions")}

    def rename(node: Any) -> Any:
        if isinstance(node, list):
            return [rename(n) for n in node]
        if not isinstance(node, dict):
            return node
        out = {k: rename(v) for k, v in node.items()}
        ref = out.get("$ref")
        if isinstance(ref, str):
            for root in ("#/$defs/", "#/definitions/"):
                if ref.startswith(root):
                    out["$ref"] = "#/$defs/" + prefix + ref[len(root):]
        return out

    return rename(schema), {prefix + k: rename(v) for k, v in defs.items()}


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


class ToolCalls:
    """How the choices of one chat request turn their text into tool calls: held to a schema
    when forced (named function or "required"), parsed from what the model wrote with "auto",
    left as text with "none" or no tools."""

    def __init__(self, tools: list[Tool] | None, tool_choice: ToolChoice | None,
                 parser_name: str | None):
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        self.tool_choice = tool_choice
        self._parser: type[ToolParser] | None = None
        if tools and tool_choice == "auto":
            if parser_name is None:
                raise ValueError('tool_choice "auto" needs a tool-call parser for this model')
            self._parser = TOOL_PARSERS[parser_name]
        self._schemas = {t.function.name: _parameters(t) for t in tools or []}
        self._streams: dict[int, ToolParser] = {}

    @property
    def skip_special_tokens(self) -> bool:
        """Whether the output's text may leave out special tokens (a call marker may be one)."""
        return self._parser is None or self._parser.skip_special_tokens

    def final(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool calls) of a whole choice; a forced call's output that is not complete
        (it stopped at its length limit) is content."""
        parser = self._new_parser()
        return (text, []) if parser is None else parser.extract_tool_calls(text)

    def _new_parser(self) -> ToolParser | None:
        """A parser of one choice's calls: what the model writes, or what a forced choice's
        schema holds it to; None where calls are not read."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return NamedCallParser(self.tool_choice.function.name, self._schemas)
        if self.tool_choice == "required":
            return RequiredCallsParser(self._schemas)
        return None if self._parser is None else self._parser(self._schemas)

    def finish_reason(self, calls: bool, reason: str) -> str:
        """OpenAI's: "tool_calls" when the model chose to call tools (auto, required); a
        named function's call finishes "stop"."""
        if calls and reason == "stop" and not isinstance(self.tool_choice, NamedToolChoice):
            return "tool_calls"
        return reason

    def delta(self, choice: int, new_text: str, text: str, finished: bool
              ) -> tuple[dict[str, Any], bool]:
        """A streamed choice's delta for `new_text`, the end of its output so far `text`, and
        whether it has sent tool calls."""
        parser = self._streams.get(choice)
        if parser is None:
            parser = self._new_parser()
            if parser is None:
                return {"content": new_text} if new_text else {}, False
            self._streams[choice] = parser
        delta = parser.extract_tool_calls_streaming(text, finished)
        return delta, parser.saw_tool_calls

"""Request bodies of the OpenAI API (completions, chat completions), with vLLM's extra sampling
fields, and their translation into SamplingParams. Fields a client may send that liteinfer does
not use are ignored, as vLLM does; fields that would change the answer and are not supported are
refused with a 400 rather than ignored."""
from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    field_validator,
)

from liteinfer.entrypoints.openai.structured import (
    ResponseFormat,
    StructuredOutputsRequest,
    Tool,
    ToolChoice,
    check_tools,
    forced_tool_schema,
    structured_outputs_params,
    template_message,
)
from liteinfer.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, choice_seed
from liteinfer.structured_output import StructuredOutputsParams
from liteinfer.utils import ints_below

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit
MAX_N = 16
# Counts (tokens, ids) fit in 32 bits: anything larger is refused here, before it can overflow
# an encoder or a tensor; the engine then checks them against the model.
COUNT_MAX = 2**31 - 1
Count = Annotated[int, Field(ge=0, le=COUNT_MAX)]
PositiveCount = Annotated[int, Field(ge=1, le=COUNT_MAX)]
TokenId = Count


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """What both endpoints share. Sampling fields left out take the model's
    generation_config.json defaults (as vLLM's server does), then OpenAI's."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # vLLM's: signed or unsigned 64-bit
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Count = 0
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's: at most this many tokens of reasoning, then the end of reasoning is forced.
    thinking_token_budget: int | None = Field(None, ge=0)
    # Structured outputs: OpenAI's, vLLM's and vLLM's older fields.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Fields that would change the answer and are not implemented: refused unless they hold
    # their neutral value (a request that sets them expects what they do).
    functions: list[Any] | None = None
    function_call: Any = None
    prompt_logprobs: int | None = None
    use_beam_search: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None

    def unsupported(self) -> list[str]:
        """Names of the fields set that this server does not implement."""
        names = [name for name in ("functions", "allowed_token_ids", "bad_words",
                                   "prompt_logprobs", "truncate_prompt_tokens")
                 if getattr(self, name) not in (None, [])]
        if self.use_beam_search:
            names.append("use_beam_search")
        if self.function_call not in (None, "none"):
            names.append("function_call")
        return names

    def check_supported(self) -> None:
        names = self.unsupported()
        if names:
            raise ValueError(f"not supported by this server: {', '.join(names)}")
        if self.logit_bias and not all(k.isdigit() and len(k) < 10 for k in self.logit_bias):
            raise ValueError("logit_bias keys must be token ids")

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None,
                        logprobs: int | None) -> list[SamplingParams]:
        """The params of each of the n choices, which share one output constraint (ValueError
        for conflicting fields): a seeded request's choices draw from seed, seed + 1, ... so
        that they differ and each can be reproduced."""
        given = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                                "repetition_penalty")
                 if getattr(self, k) is not None}
        constraint = self.output_constraint()
        return [SamplingParams(
            **{**defaults, **given}, max_tokens=max_tokens, logprobs=logprobs,
            seed=choice_seed(self.seed, choice), stop=self.stop or [],
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, skip_special_tokens=self.skip_special_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=constraint, thinking_token_budget=self.thinking_token_budget)
            for choice in range(self.n)]

    def output_constraint(self) -> StructuredOutputsParams | None:
        """What the output must match (ValueError for conflicting fields)."""
        return structured_outputs_params(self.response_format, self.structured_outputs,
                                         self.guided_json, self.guided_regex,
                                         self.guided_choice, self.guided_grammar)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage



class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Count | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A flat list of in-range ints (a token-id prompt) is what the union would make of it;
        checked at C speed here, in less than half the time of the union's member-by-member
        matching (journal item 71). Anything else goes through the union (and its errors)."""
        if type(value) is list and value and ints_below(value, COUNT_MAX + 1):
            return value
        return handler(value)

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.suffix:
            names.append("suffix")
        if self.best_of is not None and self.best_of != self.n:
            names.append("best_of (other than n)")
        if not self.add_special_tokens:
            names.append("add_special_tokens")
        return names

    def sampling_params(self, defaults: dict[str, Any], max_tokens: int | None,
                        logprobs: int | None) -> list[SamplingParams]:
        """Echoed prompts with logprobs get their prompt tokens' logprobs too."""
        params = super().sampling_params(defaults, max_tokens, logprobs)
        if self.echo and logprobs is not None:
            params = [dataclasses.replace(p, prompt_logprobs=logprobs) for p in params]
        return params

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # which call a tool message answers

    def text(self) -> str:
        """The message's text; a list of content parts may hold text parts only."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them."""
    return [template_message({"role": m.role, "content": m.text(),
                              **m.model_dump(include={"name", "tool_calls", "tool_call_id"},
                                             exclude_none=True)})
            for m in messages]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None  # default: the rest of the context
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    best_of: int | None = None
    echo: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None
    include_reasoning: bool = True  # vLLM's: False drops a reasoning model's reasoning
    # A reasoning model's end-of-thinking token, once the prompt is rendered: the output
    # constraint holds what follows it (None: all of the output).
    _answer_starts_after: int | None = PrivateAttr(None)

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        names += [name for name in ("best_of", "chat_template", "documents")
                  if getattr(self, name) is not None]
        names += [name for name in ("echo", "continue_final_message") if getattr(self, name)]
        return names

    def check_supported(self) -> None:
        super().check_supported()
        check_tools(self.tools, self.tool_choice)
        if self.reasoning_effort is not None:
            raise ValueError("reasoning_effort is not supported: liteinfer serves no "
                             "reasoning models")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")

    def output_constraint(self) -> StructuredOutputsParams | None:
        """A forced tool call's schema (a constraint of its own beside none other), held to
        the answer after the reasoning."""
        schema = (forced_tool_schema(self.tools, self.tool_choice, self.parallel_tool_calls)
                  if self.tools and self.tool_choice is not None else None)
        constraint = super().output_constraint()
        if schema is not None:
            if constraint is not None:
                raise ValueError("a forced tool call cannot be combined with response_format "
                                 "or structured outputs")
            constraint = StructuredOutputsParams(json=schema)
        if constraint is None or self._answer_starts_after is None:
            return constraint
        return dataclasses.replace(constraint, reasoning_end_token_id=self._answer_starts_after)

    def answer_starts_after(self, token_id: int | None) -> None:
        """The output constraint holds what follows `token_id` (a reasoning model's end of
        thinking)."""
        self._answer_starts_after = token_id

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as chat templates take them."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens if self.max_completion_tokens is None else \
            self.max_completion_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        return conversation(self.messages)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered as
    /v1/chat/completions renders them."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[TokenId]

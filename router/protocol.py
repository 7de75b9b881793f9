"""The OpenAI request models: what /v1/chat/completions and /v1/completions accept.

Request models accept what OpenAI's API and vLLM's extensions (top_k, min_p, repetition_penalty,
ignore_eos, min_tokens, stop_token_ids, ...) accept, and chat's tools (router.tools). A field
either API defines that the router does not implement is a 400 naming it (router.unsupported:
bad_words, beam search, ...); informational fields (user, metadata, ...)
and names neither API knows are ignored, as vLLM does. Types are checked by pydantic (-> 400
via router.errors); values by `SamplingParams` (its ValueError -> 400 with the reason).

Structured output (response_format, structured_outputs, guided_*, and chat's tool_choice
"required" or a named function) becomes SamplingParams.structured_outputs (router.structured);
logit_bias's keys become token ids, checked against the vocabulary like allowed_token_ids.

Integers: every one a request carries is range-checked here, before anything is encoded: `Int64`
at parse time (router.request_fields), then the semantic range: top_k -1, 0 (off) or at most the
vocabulary, token ids (prompt, stop_token_ids, logit_bias, allowed_token_ids) in the vocabulary
(`check_token_ids`), seed int64 (OpenAI's range), the counts by SamplingParams. Strings must be
valid Unicode (`lone_surrogate_at`: a lone surrogate is a 400).

max_tokens (like vLLM): chat defaults to the room left in the context, completions to 16 (an
explicit null: the room); asking for more than the room, or a prompt that leaves no room, is a 400.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator

from pdserve.sampling.params import MAX_LOGPROBS, SamplingParams
from router.chat_output import ChatParsingConfig
from router.errors import OpenAIError
from router.request_fields import (
    Content,
    Int64,
    Prompt,
    Stop,
    StreamOptions,
    check_token_ids,
    lone_surrogate_at,
)
from router.structured import (
    guided_specs,
    one_spec,
    response_format_spec,
    tool_call_spec,
    vllm_spec,
    with_reasoning,
)
from router.tools import REQUEST_CHAT_PARSING, ChatTool, forced_function, tool_choice_kind
from router.unsupported import refuse_unsupported

_OPTIONAL_SAMPLING = (  # None: SamplingParams' default
    "temperature", "top_p", "top_k", "min_p", "seed",
    "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip
FLOAT32_MIN_NORMAL = 2.0**-126  # the sampler works in float32: a smaller top_p would round to 0
_PASSED_ON = (
    "min_tokens", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output",
    "prompt_logprobs", "allowed_token_ids",
)  # fmt: skip
NULL_IS_DEFAULT = ("n", "stream", "logprobs", "echo")  # nullable in OpenAI's API, not null-typed here
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class OpenAIRequest(BaseModel):
    """Fields both endpoints share."""

    # strict: a JSON type other than the declared one is a 400 ("n": 2.0, "stream": 0, "echo": 1),
    # not silently coerced; an integer where a number is declared stays fine
    model_config = ConfigDict(extra="ignore", strict=True)
    endpoint: ClassVar[str] = ""  # "chat" or "completions": the fields router.unsupported refuses
    min_max_tokens: ClassVar[int] = 1  # completions: 0 (a log-likelihood: the prompt's logprobs only)

    model: str | None = None  # None: the served model (vLLM's leniency; OpenAI requires it)
    user: str | None = None  # informational, ignored; a string in OpenAI's API and vLLM's (else a 400)
    n: Int64 = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Stop = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Int64 | None = None  # OpenAI's range
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: Int64 = 0
    stop_token_ids: list[int] | None = None  # in the vocabulary: check_token_ids
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Int64 | None = None  # vLLM's: logprobs of the prompt tokens (range: SamplingParams)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    allowed_token_ids: list[int] | None = None  # vLLM's
    response_format: dict[str, Any] | None = None  # router.structured: text, json_object, json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check_raw_body(cls, data: Any) -> Any:
        if (where := lone_surrogate_at(data)) is not None:
            raise ValueError(f"{where} is not valid Unicode (a lone surrogate)")
        refuse_unsupported(data, cls.endpoint)  # an OpenAIError: pydantic passes it on as it is
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in NULL_IS_DEFAULT):
            # OpenAI's API (and vLLM's Optional fields) take null for these: the default, as if unsent
            data = {k: v for k, v in data.items() if not (k in NULL_IS_DEFAULT and v is None)}
        if (
            isinstance(data, dict)
            and data.get("stream_options") is not None
            and data.get("stream") is not True
        ):
            raise OpenAIError("stream_options can only be set when stream is true", param="stream_options")
        return data

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's continuous_usage_stats: every chunk of a choice carries that choice's usage so far."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def requested_max_tokens(self) -> int | None:
        raise NotImplementedError

    def num_logprobs(self) -> int | None:
        raise NotImplementedError

    def max_tokens_for(self, prompt_len: int, max_model_len: int) -> int:
        """The output budget of a prompt of `prompt_len` tokens, or a 400 naming the limit."""
        requested = self.requested_max_tokens()
        if requested is not None and requested < self.min_max_tokens:
            raise OpenAIError(
                f"max_tokens must be at least {self.min_max_tokens}, got {requested}", param="max_tokens"
            )
        room = max_model_len - prompt_len
        if room < (0 if requested == 0 else 1) or (requested is not None and requested > room):
            asked = prompt_len + (requested or 0)
            raise OpenAIError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{asked} tokens ({prompt_len} in the prompt, {requested or 0} for the completion). "
                "Please reduce the length of the prompt or of the completion.",
                param="messages" if isinstance(self, ChatCompletionRequest) else "prompt",
            )
        return room if requested is None else requested

    def structured_field(self) -> str | None:
        """The field the request's structured output came from (None: none, or a tool grammar)."""
        fields = ("response_format", "structured_outputs", *GUIDED_FIELDS)
        text = isinstance(self.response_format, dict) and self.response_format.get("type") == "text"
        given = [name for name in fields if getattr(self, name) is not None]
        return next((name for name in given if not (name == "response_format" and text)), None)

    def structured_outputs_spec(self, chat_parsing: ChatParsingConfig | None) -> dict[str, Any] | None:
        """The one structured output the request asks for (router.structured), or None."""
        return one_spec(
            [
                ("response_format", response_format_spec(self.response_format)),
                ("structured_outputs", vllm_spec(self.structured_outputs)),
                *guided_specs({name: getattr(self, name) for name in GUIDED_FIELDS}),
            ]
        )

    def token_bias(self, vocab_size: int) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        bad = [k for k in self.logit_bias if not k.isdigit()]
        if bad:
            raise OpenAIError(f"logit_bias keys must be token ids, got {bad[0]!r}", param="logit_bias")
        bias = {int(k): v for k, v in self.logit_bias.items()}
        check_token_ids(list(bias), vocab_size, "logit_bias")
        return bias

    def sampling_params(
        self, max_tokens: int, vocab_size: int, chat_parsing: ChatParsingConfig | None = None
    ) -> SamplingParams:
        """The request's sampling parameters (n included); raises ValueError on a bad value.
        `chat_parsing`: the router's output-parsing flags (chat; by default those that
        router.tools.resolve_tools recorded for this request)."""
        check_token_ids(self.stop_token_ids or [], vocab_size, "stop_token_ids")
        check_token_ids(self.allowed_token_ids or [], vocab_size, "allowed_token_ids")
        if self.top_k is not None and self.top_k > vocab_size:
            raise OpenAIError(
                f"top_k must be -1 or 0 (off) or in [1, {vocab_size}] (the vocabulary), got {self.top_k}",
                param="top_k",
            )
        given = {k: v for k in _OPTIONAL_SAMPLING if (v := getattr(self, k)) is not None}
        if 0 < given.get("top_p", 1) < FLOAT32_MIN_NORMAL:  # what it asks for: the top token only
            given["top_p"] = FLOAT32_MIN_NORMAL
        given.update({k: getattr(self, k) for k in _PASSED_ON})
        spec = self.structured_outputs_spec(chat_parsing or REQUEST_CHAT_PARSING.get())
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            logprobs=self.num_logprobs(),
            logit_bias=self.token_bias(vocab_size),
            structured_outputs=spec,
            **given,
        )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: handed to the chat template
    role: str
    content: Content = None


class ChatCompletionRequest(OpenAIRequest):
    endpoint = "chat"
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    tools: list[ChatTool] | None = None
    tool_choice: Any = None  # "none", "auto", ... (router.tools reads it)
    parallel_tool_calls: bool | None = None  # None: true
    include_reasoning: bool = True  # vLLM's: false drops reasoning_content (--reasoning-parser)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def structured_outputs_spec(self, chat_parsing: ChatParsingConfig | None) -> dict[str, Any] | None:
        """As for completions, and a tool call when tool_choice forces one; with the reasoning
        tags of --reasoning-parser."""
        spec = super().structured_outputs_spec(chat_parsing)
        parsing = chat_parsing or ChatParsingConfig()
        if tool_choice_kind(self.tool_choice, bool(self.tools)) in ("required", "named"):
            if spec is not None:
                raise OpenAIError(
                    "a forced tool call (tool_choice) cannot be combined with another structured output",
                    param="tool_choice",
                )
            if parsing.tool_call_parser is None:
                raise OpenAIError("tool_choice forcing a call needs --tool-call-parser", param="tool_choice")
            tools = [tool.model_dump(exclude_unset=True) for tool in self.tools or ()]
            forced = forced_function(self.tool_choice)
            spec = tool_call_spec(
                tools, forced, parsing.tool_call_parser, self.parallel_tool_calls is not False
            )
        return with_reasoning(spec, parsing.reasoning_parser)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise OpenAIError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
        if not self.logprobs:
            if self.top_logprobs:
                raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the chat template takes them: text content only, parts joined."""
        out = []
        for i, message in enumerate(self.messages):
            content = message.content
            if isinstance(content, list):
                if any(part.type != "text" or part.text is None for part in content):
                    raise OpenAIError("only text content parts are supported", param=f"messages.{i}.content")
                content = "".join(part.text for part in content)
            out.append({**message.model_dump(exclude_none=True), "content": content or ""})
        return out


class CompletionRequest(OpenAIRequest):
    endpoint = "completions"
    min_max_tokens = 0
    prompt: Prompt
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: bool = False

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_params(
        self, max_tokens: int, vocab_size: int, chat_parsing: ChatParsingConfig | None = None
    ) -> SamplingParams:
        params = super().sampling_params(max_tokens, vocab_size, chat_parsing)
        if self.echo and self.logprobs is not None and params.prompt_logprobs is None:
            params.prompt_logprobs = self.logprobs  # vLLM's: an echoed prompt brings its logprobs
        return params

"""The request side of tools: the `tools` a chat request declares and what its `tool_choice` means.

`tools` is a list of `{"type": "function", "function": {"name", "description", "parameters",
"strict"}}`; the chat template gets them as the client sent them. `tool_choice` (OpenAI's
default: "auto" with tools, "none" without):
  "none"                       tools are rendered, the output is not parsed for calls (vLLM's way)
  "auto"                       the model may call them; needs --enable-auto-tool-choice and a
                               --tool-call-parser, as in vLLM (else a 400 that says so)
  "required", {"type": "function", "function": {"name"}}
                               the output is a tool call (one or more / exactly one of that
                               function), enforced by constrained decoding: a grammar of calls in
                               the --tool-call-parser's format, arguments valid against the tool's
                               schema (router.structured); needs --tool-call-parser
`parallel_tool_calls: false` keeps the first call only (router.tool_parsers), and makes a
"required" grammar stop after one call.

`resolve_tools` records the router's ChatParsingConfig for the request being handled
(`REQUEST_CHAT_PARSING`, a context variable: one per request task), so that the request's
`sampling_params` (router.protocol) builds the tool-call grammar in the parser's format
without the handler passing the config again.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.chat_output import ChatParsingConfig
from router.errors import OpenAIError

TOOL_CHOICES = ("none", "auto", "required")
REQUEST_CHAT_PARSING: ContextVar[ChatParsingConfig | None] = ContextVar("request_chat_parsing", default=None)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


def tool_choice_kind(tool_choice: Any, has_tools: bool) -> str:
    """ "none", "auto", "required" or "named" (a 400 for anything else)."""
    if tool_choice is None:
        return "auto" if has_tools else "none"
    if isinstance(tool_choice, str) and tool_choice in TOOL_CHOICES:
        return tool_choice
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return "named"
    raise OpenAIError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def forced_function(tool_choice: Any) -> str | None:
    """The function a named tool_choice names, else None."""
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        return tool_choice["function"].get("name")
    return None


def resolve_tools(
    tools: list[ChatTool] | None, tool_choice: Any, config: ChatParsingConfig
) -> tuple[list[dict] | None, bool]:
    """(the tools for the chat template, whether the output is parsed for tool calls)."""
    REQUEST_CHAT_PARSING.set(config)
    kind = tool_choice_kind(tool_choice, bool(tools))
    if kind in ("required", "named"):
        what = '"required"' if kind == "required" else "a named function"
        if not tools:
            raise OpenAIError(f"tool_choice {what} needs tools", param="tool_choice")
        if config.tool_call_parser is None:
            raise OpenAIError(
                f"tool_choice {what} needs the router started with --tool-call-parser (e.g. qwen3_coder): "
                "the call is generated in that parser's format",
                param="tool_choice",
            )
        name = forced_function(tool_choice)
        if kind == "named" and name not in {t.function.name for t in tools}:
            raise OpenAIError(
                f"tool_choice names the function {name!r}, which is not among the tools",
                param="tool_choice",
            )
    if not tools:
        if tool_choice is not None and kind != "none":
            raise OpenAIError(f'tool_choice "{kind}" needs tools', param="tool_choice")
        return None, False
    names = [tool.function.name for tool in tools]
    if len(set(names)) < len(names):
        raise OpenAIError("tools must have distinct function names", param="tools")
    declared = [tool.model_dump(exclude_unset=True) for tool in tools]
    if kind == "none":
        return declared, False
    if kind == "auto" and not config.enable_auto_tool_choice:
        raise OpenAIError(
            'tool_choice "auto" (the default with tools) needs the router started with '
            "--enable-auto-tool-choice and --tool-call-parser (e.g. qwen3_coder); "
            'or send tool_choice "none"',
            param="tool_choice",
        )
    return declared, True

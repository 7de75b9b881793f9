"""The request side of tools: the `tools` a chat request declares and what its `tool_choice` means.

`tools` is a list of `{"type": "function", "function": {"name", "description", "parameters",
"strict"}}`; the chat template gets them as the client sent them. `tool_choice` (OpenAI's
default: "auto" with tools, "none" without):
  "none"                       tools are rendered, the output is not parsed for calls (vLLM's way)
  "auto"                       the model may call them; needs --enable-auto-tool-choice and a
                               --tool-call-parser, as in vLLM (else a 400 that says so)
  "required", {"type": "function", "function": {"name"}}
                               a 400 for now: a call that must happen needs constrained decoding
`parallel_tool_calls: false` keeps the first call only (router.tool_parsers).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from router.chat_output import ChatParsingConfig
from router.errors import OpenAIError

TOOL_CHOICES = ("none", "auto", "required")


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


def resolve_tools(
    tools: list[ChatTool] | None, tool_choice: Any, config: ChatParsingConfig
) -> tuple[list[dict] | None, bool]:
    """(the tools for the chat template, whether the output is parsed for tool calls)."""
    kind = tool_choice_kind(tool_choice, bool(tools))
    if kind in ("required", "named"):
        what = '"required"' if kind == "required" else "a named function"
        raise OpenAIError(
            f"tool_choice {what} is not supported yet: forcing a call needs constrained decoding; "
            'use "auto" (or "none")',
            param="tool_choice",
            code="unsupported_parameter",
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
    if not config.enable_auto_tool_choice:
        raise OpenAIError(
            'tool_choice "auto" (the default with tools) needs the router started with '
            "--enable-auto-tool-choice and --tool-call-parser (e.g. qwen3_coder); "
            'or send tool_choice "none"',
            param="tool_choice",
        )
    return declared, True

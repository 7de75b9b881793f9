"""A chat request rendered through the model's chat template: messages, tools, template kwargs.

What reaches the template (`render_chat`):
  messages               as router.protocol's `template_messages()` gives them; an assistant
                         message's `tool_calls[].function.arguments` JSON string is decoded to
                         an object first, as vLLM does (Qwen3.5/3.6 templates loop over
                         `arguments|items`)
  tools                  the request's tools, when it declares some
  chat_template_kwargs   e.g. {"enable_thinking": false}
Never silent: tools given to a template that never reads `tools`, or a kwarg it never reads
(`jinja2.meta` lists the names a template reads), is a 400 naming the field, not a prompt that
quietly lacks them. Names the router sets itself (messages, add_generation_prompt, tools, the
special tokens) cannot be set through chat_template_kwargs.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
from jinja2 import meta

from pdserve.tokenizer import Tokenizer
from router.errors import OpenAIError

TEMPLATES_CACHED = 8


@functools.lru_cache(maxsize=TEMPLATES_CACHED)
def template_variables(source: str) -> frozenset[str]:
    """The names a chat template reads from its context."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    return frozenset(meta.find_undeclared_variables(env.parse(source)))


def decode_tool_call_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each assistant tool call's `arguments` string decoded (a 400 if not JSON)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            decoded = []
            for j, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    try:
                        arguments = json.loads(function["arguments"] or "{}")
                    except ValueError as e:
                        where = f"messages.{i}.tool_calls.{j}.function.arguments"
                        raise OpenAIError(f"{where} is not valid JSON: {e}", param=where) from e
                    call = {**call, "function": {**function, "arguments": arguments}}
                decoded.append(call)
            message = {**message, "tool_calls": decoded}
        out.append(message)
    return out


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    template_kwargs: dict[str, Any] | None,
) -> str:
    """The prompt text of a chat request (a 400 naming the field for what cannot render)."""
    kwargs = dict(template_kwargs or {})
    taken = {"messages", "add_generation_prompt", "tools", *tokenizer.special_tokens}
    if reserved := sorted(taken & set(kwargs)):
        raise OpenAIError(f"chat_template_kwargs cannot set {reserved}", param="chat_template_kwargs")
    if tokenizer.chat_template is not None:
        try:
            read = template_variables(tokenizer.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise OpenAIError(f"the chat template does not compile: {e}", param="messages") from e
        if unread := sorted(set(kwargs) - read):
            raise OpenAIError(
                f"chat_template_kwargs sets {unread}, which this model's chat template does not read",
                param="chat_template_kwargs",
            )
        if tools and "tools" not in read:
            raise OpenAIError(
                "this model's chat template does not render tools (it never reads `tools`)", param="tools"
            )
    if tools:
        kwargs["tools"] = tools
    try:
        return tokenizer.apply_chat_template(
            decode_tool_call_arguments(messages), add_generation_prompt, **kwargs
        )
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        # bad roles or content, kwargs the template cannot use (a number where it loops), a refusal
        raise OpenAIError(f"{e}", param="messages") from e

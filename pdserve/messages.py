"""The messages between the router, prefill and decode services, in one place.

Each is a dataclass with `to_wire()` (a msgpack-able dict) and `from_wire(dict)`, which checks
every field's type and raises `ValueError` naming the field: a service validates what it is
sent at its boundary, so a malformed call is refused (gRPC INVALID_ARGUMENT) before it reaches
the engine. Nothing here imports torch or the engine: the router uses it too.

    router  --PrefillBurst-->  prefill        (stream of PrefillResult, one per request, as ready)
    router  --DecodeStart--->  decode         (stream of DecodeEvent)
    decode  --LeaseRelease-->  prefill        (after the READ: was the lease intact?)
    router  --Abort--------->  prefill/decode (the client left, or the router gave up)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
MAX_INT64 = 2**63 - 1


def _check(name: str, value: Any, kind: type | tuple[type, ...], optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if isinstance(value, bool) and kind in (int, float):  # bool is an int subclass
        raise ValueError(f"{name} must be {kind.__name__}, got bool")
    if not isinstance(value, kind):
        want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ValueError(f"{name} must be {want}, got {type(value).__name__}")
    if isinstance(value, int) and not -MAX_INT64 - 1 <= value <= MAX_INT64:
        raise ValueError(f"{name} is outside int64")
    return value


def _ints(name: str, value: Any, minimum: int = 0) -> list[int]:
    _check(name, value, list)
    # `type(v) is int` leaves out bool; min and max run in C (a prompt has thousands of ids)
    if not all(type(v) is int for v in value) or (
        value and not minimum <= min(value) <= max(value) <= MAX_INT64
    ):
        raise ValueError(f"{name} must be a list of integers >= {minimum}")
    return value


@functools.cache
def _names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _wire(message: Any) -> dict:
    """A message's fields as a dict, the values shared: `dataclasses.asdict` copies lists item by
    item, and a 4K-token prompt's copies (three a request) took ~3 ms of the router's event loop
    each, which a burst of 32 conversations waited for in turn (issue 9, session 16)."""
    return {name: getattr(message, name) for name in _names(type(message))}


def _fields(cls: type[T], msg: Any) -> dict:
    if not isinstance(msg, dict):
        raise ValueError(f"{cls.__name__} must be a map, got {type(msg).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in msg if k not in names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {unknown}")
    return msg


@dataclass(slots=True)
class Lease:
    """Where a prefilled request's state lies on its prefill instance, and the lease on it.

    The KV of token `t` is in page `kv_pages[t // page_size]`; the GDN states are in slot
    `state_slot`; they hold `num_tokens` tokens (the prompt). `lease_id` is a random token the
    prefill instance made when it began holding that memory: the decode side READs the memory,
    then asks the holder whether this lease was still held (`LeaseRelease`); memory whose lease
    expired or was released may already belong to another request, so the READ is thrown away.
    `agent` is the prefill instance's transfer agent name (instance id + incarnation).
    """

    request_id: str
    lease_id: str
    agent: str
    kv_pages: list[int]
    state_slot: int
    num_tokens: int

    def to_wire(self) -> dict:
        return _wire(self)

    @classmethod
    def from_wire(cls, msg: Any) -> Lease:
        m = _fields(cls, msg)
        lease = cls(
            request_id=_check("lease.request_id", m.get("request_id"), str),
            lease_id=_check("lease.lease_id", m.get("lease_id"), str),
            agent=_check("lease.agent", m.get("agent"), str),
            kv_pages=_ints("lease.kv_pages", m.get("kv_pages")),
            state_slot=_check("lease.state_slot", m.get("state_slot"), int),
            num_tokens=_check("lease.num_tokens", m.get("num_tokens"), int),
        )
        if lease.num_tokens <= 0 or lease.state_slot < 0:
            raise ValueError("lease: num_tokens must be positive and state_slot non-negative")
        return lease

    def check_pages(self, page_size: int) -> None:
        """Raise ValueError unless `kv_pages` is exactly the pages `num_tokens` tokens fill."""
        need = -(-self.num_tokens // page_size)
        if len(self.kv_pages) != need:
            raise ValueError(
                f"request {self.request_id!r}: {self.num_tokens} tokens at page size {page_size} "
                f"fill {need} pages, the lease names {len(self.kv_pages)}"
            )


@dataclass(slots=True)
class GenerateItem:
    """One request of a burst: its tokens and its sampling parameters (SamplingParams fields).
    `prefix_source`: another instance caching a longer prefix of the prompt than the prefill
    instance the router chose, `{"agent", "key", "num_tokens"}` (pdserve.prefix_sharing)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict
    prefix_source: dict | None = None

    @classmethod
    def from_wire(cls, msg: Any) -> GenerateItem:
        m = _fields(cls, msg)
        rid = _check("request_id", m.get("request_id"), str)
        if not rid:
            raise ValueError("request_id must not be empty")
        return cls(
            rid,
            _ints("prompt_token_ids", m.get("prompt_token_ids")),
            _check("params", m.get("params"), dict),
            _prefix_source(m.get("prefix_source")),
        )

    def to_wire(self) -> dict:
        return _wire(self)


def _prefix_source(value: Any) -> dict | None:
    if value is None:
        return None
    _check("prefix_source", value, dict)
    unknown = sorted(str(k) for k in value if k not in ("agent", "key", "num_tokens"))
    if unknown:
        raise ValueError(f"prefix_source: unknown fields {unknown}")
    _check("prefix_source.agent", value.get("agent"), str)
    key = _check("prefix_source.key", value.get("key"), str)
    if not 0 < len(key) <= 128 or key.strip("0123456789abcdef"):
        raise ValueError("prefix_source.key must be a hex digest")
    if _check("prefix_source.num_tokens", value.get("num_tokens"), int) <= 0:
        raise ValueError("prefix_source.num_tokens must be positive")
    return value


@dataclass(slots=True)
class PrefillBurst:
    requests: list[GenerateItem]

    @classmethod
    def from_wire(cls, msg: Any) -> PrefillBurst:
        m = _fields(cls, msg)
        items = _check("requests", m.get("requests"), list)
        if not items:
            raise ValueError("a burst needs at least one request")
        requests = [GenerateItem.from_wire(r) for r in items]
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids must be unique within a burst")
        return cls(requests)

    def to_wire(self) -> dict:
        return {"requests": [r.to_wire() for r in self.requests]}


@dataclass(slots=True)
class PrefillResult:
    """A request's first token (or its error). `lease` is set when decoding goes on elsewhere.
    `token_id` is None when the request asked for no output token (max_tokens 0: its prompt
    logprobs only). `prompt_logprobs` (asked for): one entry per prompt token, None for the first,
    then {"token_id", "logprob", "rank", "top_logprobs": {id: logprob}}.
    `error_code`: "invalid" (the request's own fault: HTTP 400), "queue_full" (503, retry later),
    "aborted", "failed" (the engine failed it). `queue_s`: seconds from the request's arrival on
    the instance (its burst read by the RPC handler: a step under way then counts) to the first
    step that scheduled it; `prefill_s`: from then to its first token."""

    request_id: str
    token_id: int | None = 0
    text_delta: str = ""
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    lease: Lease | None = None
    error: str | None = None
    error_code: str | None = None
    queue_s: float = 0.0
    prefill_s: float = 0.0

    def to_wire(self) -> dict:
        wire = _wire(self)
        wire["lease"] = None if self.lease is None else self.lease.to_wire()
        return wire

    @classmethod
    def from_wire(cls, msg: Any) -> PrefillResult:
        m = dict(_fields(cls, msg))
        m["lease"] = None if m.get("lease") is None else Lease.from_wire(m["lease"])
        _check("request_id", m.get("request_id"), str)
        _check("token_id", m.get("token_id", 0), int, optional=True)
        _check("prompt_logprobs", m.get("prompt_logprobs"), list, optional=True)
        for name in ("queue_s", "prefill_s"):
            _check(name, m.get(name, 0.0), float)
        return cls(**m)


@dataclass(slots=True)
class DecodeStart:
    """Start decoding a prefilled request: pull its state (`lease`), feed `first_token`."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict
    first_token: int
    lease: Lease
    first_logprobs: list | None = None

    def to_wire(self) -> dict:
        wire = _wire(self)
        wire["lease"] = self.lease.to_wire()
        return wire

    @classmethod
    def from_wire(cls, msg: Any) -> DecodeStart:
        m = _fields(cls, msg)
        item = GenerateItem.from_wire({k: m.get(k) for k in ("request_id", "prompt_token_ids", "params")})
        lease = Lease.from_wire(m.get("lease"))
        if lease.request_id != item.request_id:
            raise ValueError("the lease names another request")
        return cls(
            item.request_id,
            item.prompt_token_ids,
            item.params,
            _check("first_token", m.get("first_token"), int),
            lease,
            _check("first_logprobs", m.get("first_logprobs"), list, optional=True),
        )


@dataclass(slots=True)
class DecodeEvent:
    """What a decode stream yields: new tokens, or (once) the transfer's figures."""

    token_ids: list[int] = field(default_factory=list)
    text_delta: str = ""
    logprobs: list | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    transfer: dict | None = None  # {"bytes": n, "seconds": s}

    def to_wire(self) -> dict:
        return _wire(self)

    @classmethod
    def from_wire(cls, msg: Any) -> DecodeEvent:
        return cls(**_fields(cls, msg))


@dataclass(slots=True)
class LeaseRelease:
    """Decode to prefill after its READ (`pulled`), or the router giving up on a hand-over."""

    request_id: str
    lease_id: str
    pulled: bool = False

    def to_wire(self) -> dict:
        return _wire(self)

    @classmethod
    def from_wire(cls, msg: Any) -> LeaseRelease:
        m = _fields(cls, msg)
        return cls(
            _check("request_id", m.get("request_id"), str),
            _check("lease_id", m.get("lease_id"), str),
            _check("pulled", m.get("pulled", False), bool),
        )


@dataclass(slots=True)
class Abort:
    """Stop these requests wherever they are (queued, prefilling, held) and free their memory."""

    request_ids: list[str]

    def to_wire(self) -> dict:
        return _wire(self)

    @classmethod
    def from_wire(cls, msg: Any) -> Abort:
        ids = _check("request_ids", _fields(cls, msg).get("request_ids"), list)
        if not all(isinstance(i, str) for i in ids):
            raise ValueError("request_ids must be strings")
        return cls(ids)

"""The messages between the router, prefill and decode services, in one place.

Each is a dataclass with `to_wire()` (a msgpack-able dict) and `from_wire(dict)`, which checks
every field's type and raises `ValueError` naming the field: a service validates what it is
sent at its boundary, so a malformed call is refused (gRPC INVALID_ARGUMENT) before it reaches
the engine. Nothing here imports torch or the engine: the router uses it too.

    router  --PrefillBurst-->  prefill        (stream of PrefillResult, one per request, as ready)
    router  --DecodeStart--->  decode         (stream of DecodeEvent)
    decode  --LeaseRenewal-->  prefill        (still waiting for memory: hold the state longer)
    decode  --LeaseRelease-->  prefill        (after the READ: was the lease intact?)
    router  --Abort--------->  prefill/decode (the client left, or the router gave up)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.wire_fields import check, fields_of, ints, wire_dict


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
        return wire_dict(self)

    @classmethod
    def from_wire(cls, msg: Any) -> Lease:
        m = fields_of(cls, msg)
        lease = cls(
            request_id=check("lease.request_id", m.get("request_id"), str),
            lease_id=check("lease.lease_id", m.get("lease_id"), str),
            agent=check("lease.agent", m.get("agent"), str),
            kv_pages=ints("lease.kv_pages", m.get("kv_pages")),
            state_slot=check("lease.state_slot", m.get("state_slot"), int),
            num_tokens=check("lease.num_tokens", m.get("num_tokens"), int),
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
        m = fields_of(cls, msg)
        rid = check("request_id", m.get("request_id"), str)
        if not rid:
            raise ValueError("request_id must not be empty")
        return cls(
            rid,
            ints("prompt_token_ids", m.get("prompt_token_ids")),
            check("params", m.get("params"), dict),
            _prefix_source(m.get("prefix_source")),
        )

    def to_wire(self) -> dict:
        return wire_dict(self)


def _prefix_source(value: Any) -> dict | None:
    if value is None:
        return None
    check("prefix_source", value, dict)
    unknown = sorted(str(k) for k in value if k not in ("agent", "key", "num_tokens"))
    if unknown:
        raise ValueError(f"prefix_source: unknown fields {unknown}")
    check("prefix_source.agent", value.get("agent"), str)
    key = check("prefix_source.key", value.get("key"), str)
    if not 0 < len(key) <= 128 or key.strip("0123456789abcdef"):
        raise ValueError("prefix_source.key must be a hex digest")
    if check("prefix_source.num_tokens", value.get("num_tokens"), int) <= 0:
        raise ValueError("prefix_source.num_tokens must be positive")
    return value


@dataclass(slots=True)
class PrefillBurst:
    requests: list[GenerateItem]

    @classmethod
    def from_wire(cls, msg: Any) -> PrefillBurst:
        m = fields_of(cls, msg)
        items = check("requests", m.get("requests"), list)
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
        wire = wire_dict(self)
        wire["lease"] = None if self.lease is None else self.lease.to_wire()
        return wire

    @classmethod
    def from_wire(cls, msg: Any) -> PrefillResult:
        m = dict(fields_of(cls, msg))
        m["lease"] = None if m.get("lease") is None else Lease.from_wire(m["lease"])
        check("request_id", m.get("request_id"), str)
        check("token_id", m.get("token_id", 0), int, optional=True)
        check("prompt_logprobs", m.get("prompt_logprobs"), list, optional=True)
        for name in ("queue_s", "prefill_s"):
            check(name, m.get(name, 0.0), float)
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
        wire = wire_dict(self)
        wire["lease"] = self.lease.to_wire()
        return wire

    @classmethod
    def from_wire(cls, msg: Any) -> DecodeStart:
        m = fields_of(cls, msg)
        item = GenerateItem.from_wire({k: m.get(k) for k in ("request_id", "prompt_token_ids", "params")})
        lease = Lease.from_wire(m.get("lease"))
        if lease.request_id != item.request_id:
            raise ValueError("the lease names another request")
        return cls(
            item.request_id,
            item.prompt_token_ids,
            item.params,
            check("first_token", m.get("first_token"), int),
            lease,
            check("first_logprobs", m.get("first_logprobs"), list, optional=True),
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
        return wire_dict(self)

    @classmethod
    def from_wire(cls, msg: Any) -> DecodeEvent:
        return cls(**fields_of(cls, msg))


@dataclass(slots=True)
class LeaseRelease:
    """Decode to prefill after its READ (`pulled`), or the router giving up on a hand-over."""

    request_id: str
    lease_id: str
    pulled: bool = False

    def to_wire(self) -> dict:
        return wire_dict(self)

    @classmethod
    def from_wire(cls, msg: Any) -> LeaseRelease:
        m = fields_of(cls, msg)
        return cls(
            check("request_id", m.get("request_id"), str),
            check("lease_id", m.get("lease_id"), str),
            check("pulled", m.get("pulled", False), bool),
        )


@dataclass(slots=True)
class LeaseRenewal:
    """Decode to prefill while a request waits for a free sequence slot or pages there: hold its
    state another lease time (the decode side renews while its running sequences free memory)."""

    request_id: str
    lease_id: str

    def to_wire(self) -> dict:
        return wire_dict(self)

    @classmethod
    def from_wire(cls, msg: Any) -> LeaseRenewal:
        m = fields_of(cls, msg)
        return cls(check("request_id", m.get("request_id"), str), check("lease_id", m.get("lease_id"), str))


@dataclass(slots=True)
class Abort:
    """Stop these requests wherever they are (queued, prefilling, held) and free their memory."""

    request_ids: list[str]

    def to_wire(self) -> dict:
        return wire_dict(self)

    @classmethod
    def from_wire(cls, msg: Any) -> Abort:
        ids = check("request_ids", fields_of(cls, msg).get("request_ids"), list)
        if not all(isinstance(i, str) for i in ids):
            raise ValueError("request_ids must be strings")
        return cls(ids)

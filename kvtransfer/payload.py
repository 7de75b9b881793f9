"""`RequestPayload`: what the prefill service hands the router / decode so decode can pull."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import msgpack


@dataclass(frozen=True, slots=True)
class RequestPayload:
    """Where one prefilled request's data lies in the prefill instance's pools.

    The KV cache of token `t` is in page `kv_pages[t // page_size]`; the GDN conv and recurrent
    states of all layers are in state slot `state_slot`. `num_tokens` is how many tokens the
    cache and the states contain (the prompt: the first sampled token is not in them yet).
    """

    request_id: str
    kv_pages: list[int]
    state_slot: int
    num_tokens: int
    prefill_agent: str  # the TransferEndpoint["agent"] of the prefill instance

    def __post_init__(self) -> None:
        if self.num_tokens <= 0:
            raise ValueError(f"request {self.request_id!r}: num_tokens must be positive")
        if self.state_slot < 0 or any(p < 0 for p in self.kv_pages):
            raise ValueError(f"request {self.request_id!r}: negative page or slot id")

    def check_pages(self, page_size: int) -> None:
        """Raise ValueError unless `kv_pages` is exactly the pages `num_tokens` tokens fill."""
        need = -(-self.num_tokens // page_size)
        if len(self.kv_pages) != need:
            raise ValueError(
                f"request {self.request_id!r}: {self.num_tokens} tokens at page size {page_size} "
                f"fill {need} pages, the payload names {len(self.kv_pages)}"
            )

    def remote_units(self) -> dict[str, list[int]]:
        """The `remote_units` argument of `pull`."""
        return pool_units(self.kv_pages, self.state_slot)

    def to_bytes(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> RequestPayload:
        return cls(**msgpack.unpackb(data))


def pool_units(kv_pages: list[int], state_slot: int) -> dict[str, list[int]]:
    """Units of every pdserve pool for one request: its pages in `kv`, its slot in both states."""
    return {"kv": list(kv_pages), "conv": [state_slot], "recurrent": [state_slot]}

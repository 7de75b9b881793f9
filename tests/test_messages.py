"""The typed messages between the processes: they survive msgpack, and a malformed one is a
ValueError naming the field before anything acts on it."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.messages import (
    Abort,
    DecodeStart,
    Lease,
    LeaseRelease,
    LeaseRenewal,
    PrefillBurst,
    PrefillResult,
)


def wire(message: dict) -> dict:
    return msgpack.unpackb(msgpack.packb(message), raw=False)


def lease(**changes) -> dict:
    base = {"request_id": "r1", "lease_id": "ab" * 16, "agent": "prefill-0#1", "kv_pages": [4, 9, 2]}
    return {**base, "state_slot": 3, "num_tokens": 10, **changes}


def test_messages_round_trip_through_msgpack() -> None:
    held = Lease.from_wire(wire(lease()))
    assert held == Lease("r1", "ab" * 16, "prefill-0#1", [4, 9, 2], 3, 10)
    result = PrefillResult("r1", token_id=5, lease=held)
    assert PrefillResult.from_wire(wire(result.to_wire())) == result
    start = DecodeStart("r1", [1, 2, 3], {"max_tokens": 4}, 5, held)
    assert DecodeStart.from_wire(wire(start.to_wire())) == start
    assert LeaseRelease.from_wire(wire(LeaseRelease("r1", "x", True).to_wire())).pulled is True
    assert LeaseRenewal.from_wire(wire(LeaseRenewal("r1", "x").to_wire())) == LeaseRenewal("r1", "x")
    assert Abort.from_wire(wire(Abort(["a", "b"]).to_wire())).request_ids == ["a", "b"]
    held.check_pages(4)
    with pytest.raises(ValueError, match="fill 2 pages, the lease names 3"):
        held.check_pages(8)


@pytest.mark.parametrize(
    ("message", "kind", "match"),
    [
        (lease(state_slot=True), Lease, "state_slot must be int"),
        (lease(state_slot=-1), Lease, "non-negative"),
        (lease(kv_pages=[1, "2"]), Lease, "kv_pages must be a list of integers"),
        (lease(kv_pages=[2**64]), Lease, "kv_pages must be a list of integers"),
        (lease(kv_pages=[1, True]), Lease, "kv_pages must be a list of integers"),
        (lease(kv_pages=[3, -1, 2]), Lease, "kv_pages must be a list of integers"),
        (lease(kv_pages=[1.0]), Lease, "kv_pages must be a list of integers"),
        (lease(extra=1), Lease, "unknown fields"),
        ({"requests": []}, PrefillBurst, "at least one request"),
        (
            {"requests": [{"request_id": "a", "prompt_token_ids": [1], "params": {}}] * 2},
            PrefillBurst,
            "unique",
        ),
        ({"requests": [{"request_id": "", "prompt_token_ids": [1], "params": {}}]}, PrefillBurst, "empty"),
        ({"request_ids": [1]}, Abort, "strings"),
        ("not a map", LeaseRelease, "must be a map"),
    ],
)
def test_malformed_messages_name_the_field(message: object, kind: type, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        kind.from_wire(message)


def test_a_decode_start_whose_lease_names_another_request_is_refused() -> None:
    start = DecodeStart("r2", [1, 2], {}, 5, Lease.from_wire(lease())).to_wire()
    with pytest.raises(ValueError, match="another request"):
        DecodeStart.from_wire(start)

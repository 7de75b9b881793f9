"""`router.request_fields.lone_surrogate_at`: where a lone surrogate hides in a request body,
token-id lists passed over whole (a 262K-token prompt item by item held the event loop ~60-90 ms)
without missing a string mixed into such a list."""

from __future__ import annotations

import pytest

from router.request_fields import lone_surrogate_at


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({"prompt": list(range(5000))}, None),
        ({"prompt": [1, 2.5, True, None]}, None),
        ({"prompt": [*range(5000), "ok", "a\ud800"]}, "prompt.5001"),
        ({"prompt": [list(range(10)), [3, "\udc00"]]}, "prompt.1.1"),
        ({"prompt": [1, 2], "stop": ["\udfff"]}, "stop.0"),
        ({"prompt": [1, {"\ud800": 2}]}, "prompt.1.\\ud800"),
    ],
)
def test_a_lone_surrogate_is_found_past_token_ids(body: dict, where: str | None) -> None:
    assert lone_surrogate_at(body) == where

"""Validation at the router's edge (issue 6, points 6 and 10): every integer of a request is
range-checked before it is encoded, so a request's own bad field is a 400 naming it and never
reaches a backend (`top_k: 2**64` used to overflow msgpack in the router and take a prefill out
of rotation); stop strings are bounded; a prompt too long to fit is refused by its length before
it is tokenized, with a bound whose vocabulary pass is left for the first long prompt, runs off
the event loop, and once for a burst. The backend here packs each request as the disaggregated
backend does (msgpack) and rebuilds its SamplingParams as the services do."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import asdict
from pathlib import Path

import msgpack
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.sampling.params import INT64_MAX, INT64_MIN, SamplingParams
from pdserve.tokenizer import Tokenizer, load_tokenizer
from router.app import create_app
from router.backend import GenerateRequest, TokenEvent
from router.prompt_chars import longest_token, max_chars_per_token, max_chars_per_token_async
from tests.router_requests import CHAT, MODEL

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
BASE = {
    CHAT_PATH: {"model": MODEL, "messages": CHAT, "max_tokens": 2},
    COMPLETIONS_PATH: {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 2},
}


class WireBackend:
    """Packs every request like router.disagg (msgpack of the ids and `asdict(params)`), rebuilds
    the params like the services, then finishes at once; keeps what it was sent."""

    def __init__(self) -> None:
        self.sent: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        self.sent.append(req)
        wire = msgpack.unpackb(msgpack.packb({"ids": req.prompt_token_ids, "params": asdict(req.params)}))
        SamplingParams(**wire["params"])
        yield TokenEvent([7], "x", None, True, "length")

    async def health(self) -> dict:
        return {}

    def max_model_len(self) -> int:
        return 128


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture
def backend() -> WireBackend:
    return WireBackend()


@pytest.fixture
def http(tokenizer: Tokenizer, backend: WireBackend) -> TestClient:
    return TestClient(create_app(backend, tokenizer, MODEL), raise_server_exceptions=False)


def refused(http: TestClient, backend: WireBackend, path: str, fields: dict) -> str | None:
    """Sends BASE[path] with `fields`; asserts a 400 that reached no backend; its error's param."""
    response = http.post(path, json={**BASE[path], **fields})
    assert response.status_code == 400, response.text
    assert backend.sent == []
    return response.json()["error"]["param"]


VOCAB = 248_077  # the tiny model's tokenizer
HUGE = [
    ({"top_k": 2**64}, "top_k"),  # found: msgpack "Integer value out of range" in the router
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": VOCAB + 1}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"n": 2**64}, "n"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"min_tokens": 2**64}, "min_tokens"),
    ({"stop_token_ids": [1, 2**64]}, "stop_token_ids"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
    ({"stop": ["x"] * 65}, "stop"),
    ({"stop": ["x" * 4000, "y" * 97]}, "stop"),
]


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
@pytest.mark.parametrize(("fields", "param"), HUGE)
def test_out_of_range_is_400_naming_the_field(
    http: TestClient, backend: WireBackend, path: str, fields: dict, param: str
) -> None:
    assert refused(http, backend, path, fields) == param
    assert refused(http, backend, path, {**fields, "stream": True}) == param


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT_PATH, {"max_completion_tokens": 2**64}, "max_completion_tokens"),
        (CHAT_PATH, {"logprobs": True, "top_logprobs": 2**64}, "top_logprobs"),
        (COMPLETIONS_PATH, {"logprobs": 2**64}, "logprobs"),
        (COMPLETIONS_PATH, {"prompt": [1, 2**64]}, "prompt"),
        (COMPLETIONS_PATH, {"prompt": [[1], [-(2**64)]]}, "prompt"),
    ],
)
def test_endpoint_fields_out_of_range(
    http: TestClient, backend: WireBackend, path: str, fields: dict, param: str
) -> None:
    assert refused(http, backend, path, fields) == param


def test_the_edges_of_the_ranges_pass(http: TestClient, backend: WireBackend) -> None:
    """top_k up to the vocabulary; a seed at the top of int64 with n=3: the choices' seeds
    (seed + j) wrap within int64 instead of overflowing it, and stay distinct."""
    body = {**BASE[COMPLETIONS_PATH], "top_k": VOCAB, "seed": INT64_MAX, "n": 3}
    assert http.post(COMPLETIONS_PATH, json=body).status_code == 200
    seeds = [r.params.seed for r in backend.sent]
    assert seeds == [INT64_MAX, INT64_MIN, INT64_MIN + 1]
    assert {r.params.top_k for r in backend.sent} == {VOCAB}
    body = {**BASE[CHAT_PATH], "seed": INT64_MIN, "top_k": -1, "stop": ["s"] * 64}
    assert http.post(CHAT_PATH, json=body).status_code == 200


INT_FIELDS = {
    CHAT_PATH: ["n", "top_k", "seed", "max_tokens", "max_completion_tokens", "min_tokens", "top_logprobs"],
    COMPLETIONS_PATH: ["n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs"],
}
BIG_INTS = st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]).flatmap(
    lambda v: st.sampled_from([v, -v, v + 1, v - 1])
)
INTS = st.integers(-3, 200) | st.integers() | BIG_INTS


@settings(
    max_examples=300, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(data=st.data(), path=st.sampled_from([CHAT_PATH, COMPLETIONS_PATH]))
def test_huge_ints_anywhere_are_400_or_fit_the_wire(
    http: TestClient, backend: WireBackend, data: st.DataObject, path: str
) -> None:
    """Any integers in every integer field (and in the id lists): either a 400 naming a field the
    request sent, before any backend saw it, or every generation packs and rebuilds as int64."""
    backend.sent.clear()
    names = data.draw(st.lists(st.sampled_from(INT_FIELDS[path]), min_size=1, max_size=4, unique=True))
    fields = {name: data.draw(INTS, label=name) for name in names}
    if data.draw(st.booleans()):
        fields["stop_token_ids"] = data.draw(st.lists(INTS, max_size=3), label="stop_token_ids")
    if path == COMPLETIONS_PATH and data.draw(st.booleans()):
        fields["prompt"] = data.draw(st.lists(INTS, min_size=1, max_size=3), label="prompt")
    if "top_logprobs" in fields:
        fields["logprobs"] = True
    response = http.post(path, content=json.dumps({**BASE[path], **fields}))
    assert response.status_code in (200, 400), response.text
    if response.status_code == 400:
        assert backend.sent == []
        param = response.json()["error"]["param"]
        assert param is None or param.split(".")[0] in {*fields, "messages", "prompt"}, (param, fields)
    else:
        assert backend.sent and all(-(2**63) <= r.params.seed < 2**63 for r in backend.sent if r.params.seed)


# ---- prompts too long to fit, refused by their length before they are tokenized
@pytest.fixture
def spied(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of the texts the router tokenizes."""
    lengths: list[int] = []
    encode, encode_batch = tokenizer.encode, tokenizer.encode_batch

    def spy_encode(text: str, **kw: bool) -> list[int]:
        lengths.append(len(text))
        return encode(text, **kw)

    def spy_batch(texts: list[str], *args: bool) -> list[list[int]]:
        lengths.extend(map(len, texts))
        return encode_batch(texts, *args)

    monkeypatch.setattr(tokenizer, "encode", spy_encode)
    monkeypatch.setattr(tokenizer, "encode_batch", spy_batch)
    return lengths


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
def test_a_30_mb_prompt_is_refused_by_its_length_at_once(
    http: TestClient, backend: WireBackend, spied: list[int], path: str
) -> None:
    """max_model_len 128 x 512 characters a token at most (128 for the longest token, x4 for NFC):
    a longer text cannot fit. 30 MB used to be tokenized first (~20 s of CPU) to learn that."""
    text = "All work and no play makes Jack a dull boy. " * 700_000
    body = {"prompt": text} if path == COMPLETIONS_PATH else {"messages": [{"role": "user", "content": text}]}
    start = time.monotonic()
    param = refused(http, backend, path, body)
    assert param == ("prompt" if path == COMPLETIONS_PATH else "messages")
    assert time.monotonic() - start < 5 and max(spied, default=0) < 10_000
    assert refused(http, backend, path, {**body, "stream": True}) == param
    over = {"prompt": ["ok", "x" * (128 * 512 + 1)]} if path == COMPLETIONS_PATH else body
    assert refused(http, backend, path, over) == param and max(spied, default=0) < 10_000


TEXTS = st.text(st.sampled_from(" \n\tab-=é\u0301\u1100\u1161\u11a8ᾳ\u0313\u0342\u0345😀<|>imstar_endoftx"))
TEXTS |= st.builds(lambda c, n: c * n, st.sampled_from([" ", "-", "=", "\n", "0", "ab"]), st.integers(1, 600))
TEXTS |= st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "\n"])).map("".join)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(text=TEXTS)
def test_the_bound_never_refuses_a_prompt_that_fits(tokenizer: Tokenizer, text: str) -> None:
    """No text has more characters than its tokens times `max_chars_per_token`: long runs of one
    character, special tokens, and NFC compositions (Hangul jamo, Greek with 3 marks: 4 code
    points to 1)."""
    assert len(text) <= max(1, len(tokenizer.encode(text))) * max_chars_per_token(tokenizer)
    assert max_chars_per_token(tokenizer) == 128 * 4


def test_the_longest_token_is_read_id_by_id_and_through_gaps(tokenizer: Tokenizer) -> None:
    """The id walk finds what the whole dict says, and a vocabulary with a gap in its ids (the
    longest entry past the size) falls back to the dict rather than miss it."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import BPE

    assert longest_token(tokenizer.backend) == max(map(len, tokenizer.backend.get_vocab(True))) == 128
    assert longest_token(Backend(BPE(vocab={"a": 0, "ccc": 5}, merges=[]))) == 3


def test_a_burst_of_long_prompts_runs_the_vocabulary_pass_once(tokenizer: Tokenizer) -> None:
    """Prompts arriving together before the bound is known share one pass, not one each."""
    passes = []

    def counted(t: Tokenizer) -> int | None:
        passes.append(t)
        time.sleep(0.05)  # a pass long enough for the others to arrive during it
        return max_chars_per_token.__wrapped__(t)

    async def burst() -> list[int | None]:
        return await asyncio.gather(*(max_chars_per_token_async(tokenizer) for _ in range(8)))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("router.prompt_chars.max_chars_per_token", functools.lru_cache(counted))
        bounds = asyncio.run(burst())
    assert bounds == [max_chars_per_token(tokenizer)] * 8 and len(passes) == 1


def test_building_the_router_leaves_the_vocabulary_pass_for_later(tiny_model_dir: Path) -> None:
    """The prompt-length bound reads the whole vocabulary (0.15 s): not at start-up."""
    from router.server import RouterConfig, build_router

    before = max_chars_per_token.cache_info().misses
    router = build_router(RouterConfig(model=str(tiny_model_dir), redis_url="redis://127.0.0.1:1"))
    asyncio.run(router.registry.close())
    assert max_chars_per_token.cache_info().misses == before


def test_the_vocabulary_pass_runs_off_the_event_loop(tokenizer: Tokenizer) -> None:
    async def bound_and_loop_thread() -> tuple[int | None, bool]:
        loop_thread = threading.get_ident()
        threads = []
        computed = max_chars_per_token.__wrapped__

        def spy(t: object) -> int | None:
            threads.append(threading.get_ident())
            return computed(t)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr("router.prompt_chars.max_chars_per_token", spy)
            bound = await max_chars_per_token_async(tokenizer)
        return bound, threads != [] and loop_thread not in threads

    assert asyncio.run(bound_and_loop_thread()) == (128 * 4, True)

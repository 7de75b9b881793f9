"""router.batch_encode: prompts tokenized together in batches on a worker thread give the ids of
one `Tokenizer.encode` each; texts arriving while a batch encodes join the next batch; a caller
that leaves, or a tokenizer error, touches no other caller."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pdserve.tokenizer import Tokenizer, load_tokenizer
from router.batch_encode import EncodeBatcher
from router.segment_encode import MIN_CACHED_CHARS, SegmentEncoder


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


def texts(n: int) -> list[str]:
    return [
        f"<|im_start|>user\nconversation {i}: " + "the quick brown fox jumps. " * (50 + 7 * i)
        for i in range(n)
    ]


def test_a_burst_is_encoded_in_few_batches_with_the_ids_of_one_encode_each(tokenizer: Tokenizer) -> None:
    batcher = EncodeBatcher(tokenizer)
    prompts = texts(32)

    async def burst() -> list[list[int]]:
        return await asyncio.gather(
            *(batcher.encode(t, add_special_tokens=i % 5 == 0) for i, t in enumerate(prompts))
        )

    got = asyncio.run(burst())
    assert got == [tokenizer.encode(t, add_special_tokens=i % 5 == 0) for i, t in enumerate(prompts)]
    assert batcher.batches <= 2  # the first text alone (nothing was encoding), the other 31 together


def test_texts_arriving_during_a_batch_form_the_next(tokenizer: Tokenizer) -> None:
    batcher = EncodeBatcher(tokenizer)
    first, later = texts(1)[0], texts(9)[1:]

    async def staggered() -> tuple[list[int], list[list[int]]]:
        head = asyncio.create_task(batcher.encode(first))
        await asyncio.sleep(0)  # the first batch is on the worker thread now
        tail = await asyncio.gather(*(batcher.encode(t) for t in later))
        return await head, tail

    head, tail = asyncio.run(staggered())
    assert head == tokenizer.encode(first) and tail == [tokenizer.encode(t) for t in later]
    assert batcher.batches == 2


def test_a_cancelled_caller_and_an_error_touch_no_one_else(tokenizer: Tokenizer) -> None:
    batcher = EncodeBatcher(tokenizer)
    prompts = texts(4)

    async def run() -> tuple[list[list[int]], BaseException | None]:
        leaving = asyncio.create_task(batcher.encode(prompts[0]))
        staying = [asyncio.create_task(batcher.encode(t)) for t in prompts[1:]]
        await asyncio.sleep(0)
        leaving.cancel()
        got = await asyncio.gather(*staying)
        bad = None
        try:
            await batcher.encode(None)  # type: ignore[arg-type]  # the tokenizer raises TypeError
        except Exception as err:  # noqa: BLE001
            bad = err
        return got, bad

    got, bad = asyncio.run(run())
    assert got == [tokenizer.encode(t) for t in prompts[1:]]
    assert isinstance(bad, TypeError)
    assert asyncio.run(batcher.encode(prompts[0])) == tokenizer.encode(prompts[0])  # still serving


def test_chats_tokenized_by_pieces_equal_one_encode_and_reuse_earlier_turns(tokenizer: Tokenizer) -> None:
    """A rendered chat tokenized a piece between added tokens at a time, pieces seen before from
    the cache, gives `Tokenizer.encode`'s ids: multi-turn chats with tool calls, `<think>`, added
    tokens back to back or at either end, text that only resembles one, non-ASCII and combining
    marks next to the cuts; the next turn tokenizes no long piece it has seen; a full cache drops
    the least recently used."""
    system = "<|im_start|>system\nBe terse. " + "Répondez brièvement, s'il vous plaît. " * 20 + "<|im_end|>\n"
    turns = [
        "<|im_start|>user\nWeather in Oslo? ñ\u0303 한국어<|im_end|>\n<|im_start|>assistant\n",
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "city": "Oslo"}\n',
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n-3 C\n</tool_response><|im_end|>",
        "\u0301 a combining mark first, <|im_start (not a token) and <|im_end|><|im_end|> twice " * 3,
    ]
    segments = SegmentEncoder(tokenizer)
    conversation = system
    for turn in turns:
        conversation += turn
        chats = [conversation, system + turn, turn]
        assert segments.encode_batch(chats) == [tokenizer.encode(c) for c in chats]
    assert segments.cached_chars >= len(system) - len("<|im_start|><|im_end|>\n")  # the system prompt's
    calls: list[list[str]] = []
    encode_batch = tokenizer.encode_batch
    tokenizer.encode_batch = lambda texts, special=False: calls.append(texts) or encode_batch(texts, special)
    try:
        message = "user\nAnd tomorrow, in Bergen, around noon, will it rain or snow there?"
        follow_up = f"{conversation}<|im_start|>{message}<|im_end|>\n"
        assert segments.encode_batch([follow_up]) == [tokenizer.encode(follow_up)]
    finally:
        del tokenizer.encode_batch
    assert [p for p in calls[0] if len(p) >= MIN_CACHED_CHARS] == [message]  # the new message alone
    small = SegmentEncoder(tokenizer, max_chars=len(system) + 10)
    small.encode_batch([system, turns[3]])
    assert small.cached_chars <= len(system) + 10
    assert small.encode_batch([system]) == [tokenizer.encode(system)]


def test_a_tokenizer_whose_pieces_would_not_add_up_is_tokenized_whole() -> None:
    """Metaspace that marks only the text's first word (`prepend_scheme="first"`): a piece after an
    added token would get the mark too, so the whole text is tokenized, as `encode` does."""
    from tokenizers import AddedToken, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    vocab = {"[UNK]": 0, "▁a": 1, "a": 2, "▁b": 3, "b": 4, "▁": 5}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    backend.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    tokenizer = Tokenizer(backend, eos_token_ids=[0])
    segments = SegmentEncoder(tokenizer)
    assert segments.encode_batch(["a<s>b", "a b<s>a"]) == [
        tokenizer.encode("a<s>b"),
        tokenizer.encode("a b<s>a"),
    ]

"""Tokenizing the prompts that arrive together in one batch, off the event loop.

A burst of chat requests (32 conversations of 2-4K tokens each on the H200, issue 9's workload)
reaches the router within a few milliseconds; tokenized one after another on the event loop, the
last of them waited for all the others (~10 ms each: the largest part of the router's share of
TTFT there). `EncodeBatcher.encode` queues the text; while no batch is being encoded the queue is
handed at once to the tokenizer's `encode_batch` on a worker thread, which releases the GIL and
encodes the texts in parallel on the machine's cores; texts that arrive meanwhile form the next
batch, sent when this one is done. The ids are those of one `Tokenizer.encode` per text; a text
without special tokens added (a rendered chat) is tokenized a piece between added tokens at a
time, pieces seen before coming from a cache (`router.segment_encode`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pdserve.tokenizer import Tokenizer
from router.segment_encode import SegmentEncoder


@dataclass(slots=True)
class _Text:
    text: str
    add_special_tokens: bool
    ids: asyncio.Future[list[int]] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class EncodeBatcher:
    """One batch of texts at a time on a worker thread; the next one queues behind it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.segments: SegmentEncoder | None = None  # chats: new pieces only (made at first use)
        self._queued: list[_Text] = []
        self._drainer: asyncio.Task | None = None  # held: the loop keeps only a weak reference
        self.batches = 0  # batches encoded (for tests and logs)

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        item = _Text(text, add_special_tokens)
        self._queued.append(item)
        if self._drainer is None or self._drainer.done():  # no batch encoding now
            self._drainer = asyncio.get_running_loop().create_task(self._drain())
        return await item.ids

    async def _drain(self) -> None:
        while self._queued:
            batch, self._queued = self._queued, []
            self.batches += 1
            try:
                results = await asyncio.to_thread(self._encode_all, batch)
            except Exception as err:  # noqa: BLE001 - each caller gets the tokenizer's error
                results = [err] * len(batch)
            for item, ids in zip(batch, results, strict=True):
                if item.ids.done():  # the caller went away (a cancelled request)
                    continue
                if isinstance(ids, Exception):
                    item.ids.set_exception(ids)
                else:
                    item.ids.set_result(ids)

    def _encode_all(self, batch: list[_Text]) -> list[list[int]]:
        """The ids of each text, in order: one encode_batch for each setting of add_special_tokens."""
        out: list[list[int]] = [[] for _ in batch]
        for special in (False, True):
            where = [i for i, item in enumerate(batch) if item.add_special_tokens is special]
            if where:
                texts = [batch[i].text for i in where]
                if special:
                    encoded = self.tokenizer.encode_batch(texts, True)
                else:
                    self.segments = self.segments or SegmentEncoder(self.tokenizer)
                    encoded = self.segments.encode_batch(texts)
                for i, ids in zip(where, encoded, strict=True):
                    out[i] = ids
        return out

"""Fanning one request out to a backend generation per choice, and racing work against the
client leaving: the pieces of router.app that run per request, apart from the HTTP handlers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from router.backend import Backend, GenerateRequest, TokenEvent
from router.errors import BackendError
from router.metrics import RouterMetrics

log = logging.getLogger("pdserve.router")
T = TypeVar("T")
Item = tuple[int, TokenEvent | BackendError]


_CANCELLING: set[asyncio.Future] = set()  # cancelled tasks, held until their cancellation has run


def cancel(task: asyncio.Future) -> None:
    """Cancel `task` and keep it referenced until it is done: the event loop holds tasks only
    weakly, and a cancelled task nobody holds can be collected before its cancellation runs
    ("Task was destroyed but it is pending!", its finally blocks skipped)."""
    if task.done():
        return
    task.cancel()
    _CANCELLING.add(task)
    task.add_done_callback(_CANCELLING.discard)


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


class Fanout:
    """One backend generation per choice, their events merged into one queue as (choice, event)."""

    def __init__(
        self, backend: Backend, requests: list[GenerateRequest], metrics: RouterMetrics, arrival: float
    ) -> None:
        self.backend = backend
        self.queue: asyncio.Queue[Item] = asyncio.Queue()
        self.closed = False
        self.tasks = [
            asyncio.create_task(self._pump(i, req, metrics, arrival)) for i, req in enumerate(requests)
        ]

    async def _pump(self, index: int, req: GenerateRequest, metrics: RouterMetrics, arrival: float) -> None:
        tracker = metrics.track(len(req.prompt_token_ids), arrival)
        try:
            async with contextlib.aclosing(self.backend.generate(req)) as events:
                async for event in events:
                    tracker.on_tokens(len(event.token_ids), event.finish_reason if event.finished else None)
                    self.queue.put_nowait((index, event))
                    if event.finished:
                        return
            raise BackendError("the backend ended a stream without finishing it", 500)
        except BackendError as e:
            tracker.on_error()
            self.queue.put_nowait((index, e))
        except Exception as e:  # a bug in a backend: the client gets an error, the server lives on
            log.exception("backend generate(%s) failed", req.request_id)
            tracker.on_error()
            self.queue.put_nowait((index, BackendError(f"backend failure: {type(e).__name__}: {e}", 500)))
        finally:
            tracker.close()

    async def next(self) -> Item:
        return await self.queue.get()

    def fail(self, error: BackendError) -> None:
        """End the request with `error` (whoever reads the queue sees it next), its work cancelled."""
        self.queue.put_nowait((0, error))
        for task in self.tasks:
            cancel(task)

    def close(self) -> None:
        self.closed = True
        for task in self.tasks:
            cancel(task)


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """`await awaitable`, or raise ClientGone (cancelling it) if the client leaves first."""
    work = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        cancel(work)
        raise
    finally:
        cancel(gone)
    if not work.done():  # the client left first
        cancel(work)  # takes effect at the task's next step: do not read its state now
        raise ClientGone
    return work.result()

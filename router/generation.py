"""One request's generations, from its GenerateRequests to the answer (steps 3-7 of the request
lifecycle in router.handlers): admit them, fan them out, wait for the first event, answer with
one JSON body or an SSE stream, and release what they hold however it ends."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from router.admission import Admission, QueueTimeout, Ticket
from router.backend import Backend, GenerateRequest
from router.drain import SHUTDOWN_MESSAGE, Drain
from router.errors import BackendError, OpenAIError, error_body
from router.fanout import ClientGone, Fanout, Item, unless_disconnected
from router.metrics import RouterMetrics
from router.responses import Choice, ClosingStreamingResponse, ResponseFormat, sse

log = logging.getLogger("pdserve.router")


class Generations:
    """What answering needs beyond the request: the backend, its queue and the drain."""

    def __init__(self, backend: Backend, metrics: RouterMetrics, admission: Admission, drain: Drain) -> None:
        self.backend = backend
        self.metrics = metrics
        self.admission = admission
        self.drain = drain

    async def answer(
        self,
        request: Request,
        stream: bool,
        fmt: ResponseFormat,
        requests: list[GenerateRequest],
        choices: list[Choice],
        arrival: float | None = None,
    ) -> Response:
        """Steps 3 (admit) to 7 (cleanup): `requests[i]` fills `choices[i]`."""
        arrival = time.monotonic() if arrival is None else arrival
        if self.drain.draining:  # a 503 carries Retry-After
            raise OpenAIError(SHUTDOWN_MESSAGE, 503, code="shutting_down")
        ticket = self.admission.admit(len(requests), arrival)
        fanout = Fanout(self.backend, requests, self.metrics, arrival)
        self.drain.track(fanout)
        try:
            first = await unless_disconnected(request, ticket.next(fanout))
            if isinstance(first[1], BackendError):
                raise first[1]
            if stream:
                events = stream_choices(fmt, fanout, ticket, choices, first)
                closing = (fanout.close, ticket.close)
                fanout = None  # the stream owns it (and the ticket) now
                return ClosingStreamingResponse(events, closing)
            return JSONResponse(
                await unless_disconnected(request, collect_choices(fmt, fanout, ticket, choices, first))
            )
        except ClientGone:
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        finally:
            if fanout is not None:
                fanout.close()
                ticket.close()


async def collect_choices(
    fmt: ResponseFormat, fanout: Fanout, ticket: Ticket, choices: list[Choice], item: Item
) -> dict:
    """Step 6, stream=false: every choice to its end -> the one JSON body."""
    remaining = len(choices)
    while True:
        index, event = item
        if isinstance(event, BackendError):
            raise event
        choices[index].add(event)
        remaining -= event.finished
        if not remaining:
            return fmt.response(choices)
        item = await ticket.next(fanout)


async def stream_choices(
    fmt: ResponseFormat, fanout: Fanout, ticket: Ticket, choices: list[Choice], item: Item
) -> AsyncIterator[str]:
    """Step 6, stream=true: the SSE events, an error event when a choice fails, then [DONE]."""
    try:
        for chunk in fmt.head_chunks(choices):
            yield sse(fmt.with_running_usage(chunk, choices))
        remaining = len(choices)
        while True:
            index, event = item
            if isinstance(event, BackendError):
                log.warning("backend error mid-stream of %s: %s", fmt.id, event.message)
                yield sse(error_body(event.message, event.status))
                break
            choices[index].add(event)
            if (chunk := fmt.event_chunk(choices[index], event)) is not None:
                yield sse(fmt.with_running_usage(chunk, choices))
            remaining -= event.finished
            if not remaining:
                if fmt.include_usage:
                    yield sse(fmt.usage_chunk(choices))
                break
            try:
                item = await ticket.next(fanout)
            except QueueTimeout as e:
                log.warning("queue timeout mid-stream of %s", fmt.id)
                yield sse(error_body(e.message, e.status, code=e.code))
                break
        yield sse("[DONE]")
    finally:
        fanout.close()
        ticket.close()

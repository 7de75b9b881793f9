"""The router's HTTP protocol (router.http_guard) under a connection flood, over real sockets to a
real uvicorn server: requests that do not arrive whole (half the headers, or headers without the
body they announce) are closed after the request timeout, connections past the cap are closed as
they are accepted, a well-formed request is served meanwhile, and an answer that streams past
the timeout (a pipelined request's too) is never cut."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import resource
import socket
import time
from collections.abc import AsyncIterator

import httpx
import uvicorn

from router.http_guard import connection_cap, guarded_protocol


async def app(scope: dict, receive, send) -> None:
    """ "ok"; on /slow 12 chunks over 1.2 s (past the tests' request timeouts)."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    if scope["path"] == "/slow":
        for i in range(12):
            await send({"type": "http.response.body", "body": b"tick%d;" % i, "more_body": True})
            await asyncio.sleep(0.1)
    await send({"type": "http.response.body", "body": b"ok"})


def all_closed_within(socks: list[socket.socket], seconds: float) -> list[bool]:
    """`closed_within` of each socket, all in the same `seconds` (in parallel)."""
    with concurrent.futures.ThreadPoolExecutor(len(socks)) as pool:
        return list(pool.map(lambda s: closed_within(s, seconds), socks))


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Does the server close `sock` within `seconds` (EOF or a reset; what it still sends before
    that is read and dropped)?"""
    return receive(sock, seconds)[1]


def receive(sock: socket.socket, seconds: float, until: bytes | None = None) -> tuple[bytes, bool]:
    """What `sock` receives within `seconds` (or until it ends with `until`), and whether the
    server closed it (EOF or a reset)."""
    deadline, got = time.monotonic() + seconds, b""
    while (until is None or not got.endswith(until)) and (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return got, True
        except TimeoutError:
            break
        if not chunk:
            return got, True
        got += chunk
    return got, False


@contextlib.asynccontextmanager
async def serve_guarded(request_timeout_s: float, max_connections: int) -> AsyncIterator[int]:
    """A uvicorn server of `app` with the guarded protocol, on a free port (yielded)."""
    protocol = guarded_protocol(request_timeout_s=request_timeout_s, max_connections=max_connections)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, http=protocol, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    asyncio.get_running_loop().create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.sleep(0.2)


def test_half_sent_requests_time_out_and_a_flood_is_capped() -> None:
    async def main() -> None:
        async with serve_guarded(request_timeout_s=1.0, max_connections=8) as port:
            half = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
            for sock in half[:3]:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            for sock in half[3:]:  # whole headers, and not the body they announce
                sock.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            await asyncio.sleep(0.1)
            flood = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
            await asyncio.sleep(0.1)
            # 6 half-sent + 2 of the flood fit under the cap of 8; the other 4 are closed at once
            closed = await asyncio.to_thread(all_closed_within, flood, 0.3)
            assert closed.count(True) == 4, closed
            for sock, was_closed in zip(flood, closed, strict=True):
                if not was_closed:
                    sock.close()  # frees 2 places under the cap
            await asyncio.sleep(0.1)
            async with httpx.AsyncClient() as client:  # served while the half-sent ones wait
                answer = await client.get(f"http://127.0.0.1:{port}/health")
                assert answer.text == "ok"
            # the half-sent ones are closed after the request timeout, not before
            late = await asyncio.to_thread(all_closed_within, half, 2.0)
            assert all(late), late
            for sock in half + flood:
                sock.close()

    asyncio.run(main())


def test_a_kept_alive_connection_is_timed_again_for_its_next_headers() -> None:
    async def main() -> None:
        async with serve_guarded(request_timeout_s=0.5, max_connections=8) as port:
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(2)
            assert b"200 OK" in await asyncio.to_thread(sock.recv, 1024)
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the next request, half sent
            assert await asyncio.to_thread(closed_within, sock, 1.5)
            sock.close()

    asyncio.run(main())


SLOW = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
FAST = b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n"
SLOW_END = b"tick11;\r\n2\r\nok\r\n0\r\n\r\n"  # its last chunks, chunked


def test_an_answer_streaming_past_the_timeout_is_not_cut_pipelined_or_not() -> None:
    """/slow streams 1.2 s against a 0.5 s request timeout: alone, and pipelined behind /fast in
    one packet (uvicorn reads it in as /fast's answer ends: it is whole, so it is not timed)."""

    async def main() -> list[bytes]:
        async with serve_guarded(request_timeout_s=0.5, max_connections=8) as port:
            answers = []
            for requests in (SLOW, FAST + SLOW):
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(requests)
                answers.append((await asyncio.to_thread(receive, sock, 3.0, SLOW_END))[0])
                sock.close()
        return answers

    alone, pipelined = asyncio.run(main())
    assert all(answer.endswith(SLOW_END) for answer in (alone, pipelined)), (alone, pipelined)


def test_the_cap_leaves_descriptors_for_the_rest() -> None:
    cap = connection_cap()  # raises the soft limit to the hard one first
    assert cap == max(64, resource.getrlimit(resource.RLIMIT_NOFILE)[0] - 1024)

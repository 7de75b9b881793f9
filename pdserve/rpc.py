"""gRPC with msgpack messages: `RpcServer` and `RpcClient`, no code generation.

A method is `/{service}/{name}`; requests and responses are dicts packed with msgpack (bytes
stay bytes, int map keys are allowed). Two kinds of methods:

    server = RpcServer("pdserve.Prefill")
    server.unary("Prefill", handler)     # async def handler(request: dict) -> dict
    server.stream("Tokens", handler)     # async def handler(request: dict) -> AsyncIterator[dict]
    port = await server.start("0.0.0.0", 0)

    client = RpcClient(f"host:{port}", "pdserve.Prefill")
    reply = await client.unary("Prefill", {...}, timeout=5.0)
    async for item in client.stream("Tokens", {...}): ...

Errors cross the wire as a gRPC status and come out of the client as one exception type,
`RpcError(code, message)`, `code` being the status name. In a handler, `ValueError` ->
INVALID_ARGUMENT, `LookupError` (KeyError included) -> NOT_FOUND, `RpcError` -> its own code
(a handler that calls another service passes its error on), anything else -> INTERNAL (logged).
A failing handler never takes the server down. A client that cancels a stream (or closes its
generator early) cancels the call; the server handler then sees `CancelledError` or
`GeneratorExit` at the point where it waits.

Every server also answers `pdserve.Rpc/Ping` (`RpcClient.ping`; the container healthchecks'
`python -m pdserve.rpc HOST:PORT` exits 0 when the server answers). The internal secret
(`pdserve.internal_auth`; `secret=` of server and client, by default `load_internal_secret()`,
None: no auth): a client sends it with every call; a server that has one refuses any call
without it with UNAUTHENTICATED before its body is decoded. Ping stays open for healthchecks and
tells only the service and method names (public in the source). A client hands its secret to
every server it calls: dial only addresses from the signed registry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import msgpack

from pdserve.internal_auth import FROM_ENV, CallGate, SecretArg, auth_metadata, resolve_secret
from pdserve.internal_auth import load_internal_secret as load_internal_secret  # re-exported

log = logging.getLogger("pdserve.rpc")

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
PING_SERVICE = "pdserve.Rpc"
# keepalive: ping an idle connection every 2 s and give up on one whose ping goes unanswered
# for 2 s: a dead peer (a crashed or frozen process, a pulled cable) fails its calls within ~4 s
_COMMON_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
SERVER_OPTIONS = _COMMON_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),  # accept the clients' 2 s pings
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.so_reuseport", 0),  # a port that is taken is an error, not a second listener
]
CLIENT_OPTIONS = _COMMON_OPTIONS + [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),  # a restarted peer is found again within ~2 s
]

UnaryHandler = Callable[[dict], Awaitable[dict]]
StreamHandler = Callable[[dict], AsyncIterator[dict]]


def pack(message: dict) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(data: bytes) -> dict:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class RpcError(Exception):
    """A failed call: `code` is the gRPC status name ("UNAVAILABLE", "INVALID_ARGUMENT", ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_grpc(cls, error: grpc.aio.AioRpcError) -> RpcError:
        return cls(error.code().name, error.details() or "")


def _status_of(error: Exception) -> grpc.StatusCode:
    if isinstance(error, RpcError):
        return getattr(grpc.StatusCode, error.code, grpc.StatusCode.UNKNOWN)
    if isinstance(error, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, LookupError):
        return grpc.StatusCode.NOT_FOUND
    return grpc.StatusCode.INTERNAL


async def _abort(context: grpc.aio.ServicerContext, method: str, error: Exception) -> None:
    status = _status_of(error)
    message = error.message if isinstance(error, RpcError) else str(error) or type(error).__name__
    if status == grpc.StatusCode.INTERNAL:
        log.exception("rpc %s failed", method)
        message = f"{type(error).__name__}: {message}"
    await context.abort(status, message)


def _unary_method(method: str, handler: UnaryHandler, gate: CallGate) -> grpc.RpcMethodHandler:
    async def call(body: bytes, context: grpc.aio.ServicerContext) -> dict:
        await gate.check(context, method)
        try:
            return await handler(unpack(body))
        except Exception as e:
            await _abort(context, method, e)
            raise  # not reached: abort raises

    # the request arrives as bytes and is decoded after the gate: a caller without the secret
    # must not make the server build its message (a 200 MB msgpack array of nils had held the
    # event loop 3.5-7.6 s and left GBs allocated, before the call was refused)
    return grpc.unary_unary_rpc_method_handler(call, response_serializer=pack)


async def _call_unary(
    channel: grpc.aio.Channel,
    method: str,
    request: dict,
    timeout: float | None,
    metadata: tuple[tuple[str, str], ...] | None = None,
) -> dict:
    call = channel.unary_unary(method, request_serializer=pack, response_deserializer=unpack)
    try:
        return await call(request, timeout=timeout, metadata=metadata)
    except grpc.aio.AioRpcError as e:
        raise RpcError.from_grpc(e) from None


def join_host_port(host: str, port: int) -> str:
    """`host:port`, with an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now (the OS picks it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RpcServer:
    """One gRPC service (`service` is its full name, e.g. "pdserve.Decode") on an asyncio server.
    `secret`: the internal secret every call must carry (FROM_ENV: `load_internal_secret()`;
    None: calls need none)."""

    def __init__(self, service: str, secret: SecretArg = FROM_ENV) -> None:
        self.service = service
        self._gate = CallGate(resolve_secret(secret))
        self._methods: dict[str, grpc.RpcMethodHandler] = {}
        self._server: grpc.aio.Server | None = None

    def unary(self, name: str, handler: UnaryHandler) -> None:
        """Serve `name`: one request dict in, one response dict out."""
        self._methods[name] = _unary_method(f"/{self.service}/{name}", handler, self._gate)

    @property
    def requires_secret(self) -> bool:
        return self._gate.secret is not None

    def stream(self, name: str, handler: StreamHandler) -> None:
        """Serve `name`: one request dict in, a stream of response dicts out (an async generator)."""
        method = f"/{self.service}/{name}"

        async def call(body: bytes, context: grpc.aio.ServicerContext) -> None:
            await self._gate.check(context, method)  # before the body is decoded (_unary_method)
            try:
                # aclosing: a cancelled call closes the handler's generator right away
                async with contextlib.aclosing(handler(unpack(body))) as items:
                    async for item in items:
                        try:
                            await context.write(item)
                        except Exception as e:  # the client left as we wrote: the call is gone,
                            # and aborting it would fail too (grpc logs that as an ERROR)
                            log.debug("rpc %s: write failed, the call is over: %s", method, e)
                            return
            except Exception as e:
                await _abort(context, method, e)

        self._methods[name] = grpc.unary_stream_rpc_method_handler(call, response_serializer=pack)

    async def start(self, host: str, port: int) -> int:
        """Listen on `host:port` (port 0: a free port) and serve; returns the bound port."""
        if self._server is not None:
            raise RuntimeError(f"{self.service} server already started")

        async def ping(_body: bytes, _context: grpc.aio.ServicerContext) -> dict:  # open: not decoded
            return {"service": self.service, "methods": sorted(self._methods)}

        server = grpc.aio.server(options=SERVER_OPTIONS)
        pinged = grpc.unary_unary_rpc_method_handler(ping, response_serializer=pack)
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(self.service, dict(self._methods)),
                grpc.method_handlers_generic_handler(PING_SERVICE, {"Ping": pinged}),
            )
        )
        address = join_host_port(host, port)
        try:
            bound = server.add_insecure_port(address)
        except RuntimeError as e:  # grpc raises when it cannot bind
            raise OSError(f"cannot listen on {address}: {e}") from e
        if bound == 0:
            raise OSError(f"cannot listen on {address}")
        await server.start()
        self._server = server
        return bound

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting calls; running calls get `grace` seconds, then they are cancelled."""
        if self._server is not None:
            await self._server.stop(grace)
            self._server = None

    async def wait_for_termination(self) -> None:
        """Block until the server stops."""
        if self._server is not None:
            await self._server.wait_for_termination()


class RpcClient:
    """Calls the methods of one service at `address` ("host:port") over one channel, sending
    `secret` with every call (FROM_ENV: `load_internal_secret()`; None: no secret)."""

    def __init__(self, address: str, service: str, secret: SecretArg = FROM_ENV) -> None:
        self.address = address
        self.service = service
        self._metadata = auth_metadata(resolve_secret(secret))
        self._channel: grpc.aio.Channel | None = None

    def _channel_now(self) -> grpc.aio.Channel:
        if self._channel is None:  # made on first use, inside the event loop that uses it
            self._channel = grpc.aio.insecure_channel(self.address, options=CLIENT_OPTIONS)
        return self._channel

    async def unary(self, name: str, request: dict, timeout: float | None = None) -> dict:
        """Call `name` and return its response; raises `RpcError`."""
        method = f"/{self.service}/{name}"
        return await _call_unary(self._channel_now(), method, request, timeout, self._metadata)

    async def stream(self, name: str, request: dict, timeout: float | None = None) -> AsyncIterator[dict]:
        """Call `name` and yield its responses; raises `RpcError`. Closing the generator cancels the call."""
        method = self._channel_now().unary_stream(
            f"/{self.service}/{name}", request_serializer=pack, response_deserializer=unpack
        )
        call = method(request, timeout=timeout, metadata=self._metadata)
        try:
            async for item in call:
                yield item
        except grpc.aio.AioRpcError as e:
            raise RpcError.from_grpc(e) from None
        finally:
            call.cancel()  # a no-op once the call has finished

    async def ping(self, timeout: float = 2.0) -> dict:
        """Ask the server which service it runs: {"service": ..., "methods": [...]}."""
        return await _call_unary(self._channel_now(), f"/{PING_SERVICE}/Ping", {}, timeout, self._metadata)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


async def _ping_main(address: str, timeout: float) -> int:
    client = RpcClient(address, PING_SERVICE, secret=None)  # Ping is open
    try:
        print(await client.ping(timeout))
    except RpcError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        await client.close()
    return 0


if __name__ == "__main__":  # python -m pdserve.rpc HOST:PORT  (a healthcheck)
    if len(sys.argv) != 2:
        sys.exit("usage: python -m pdserve.rpc HOST:PORT")
    sys.exit(asyncio.run(_ping_main(sys.argv[1], timeout=3.0)))

"""`--grpc-server grpcio`: Tulip's services on grpc.aio's server instead of `tulip.h2server`.

Why both: ours (`tulip.h2server`) does its HTTP/2 framing on the event loop and costs ~0.1-0.3 ms
less a request (docs/performance-log.md); grpc.aio's is the gRPC project's own, maintained and
interop-tested implementation, with what ours leaves out: TLS (`--tls-cert` / `--tls-key`),
compressed requests (gzip / deflate from any client), and grpc-core's HTTP/2 limits. An operator
chooses; the service is the same code either way.

Nothing of the service is written twice: Tulip's servicer registers as it does on ours
(`tulip.server.add_tulip`, grpc_health's `add_HealthServicer_to_server`). grpcio's method handlers
(Info, health) go to grpc.aio unchanged; a `tulip.h2server.Direct` method (Embed, EmbedStream) is
served through a thin adapter: a coroutine per call that opens the same session (`UnaryEmbed`,
`EmbedStream`), hands it each request as grpc.aio delivers it, and writes the replies the session
gives its call (`_Call`: `reply` / `finish`, what a session uses of `tulip.h2server.Call`). grpc.aio
cancels the coroutine when the client cancels or the deadline passes: the session is told `gone()`,
as ours tells it. One difference: a streaming client's cancel ends grpc.aio's request iterator just
before it cancels the call, so the session may hear `end()` first, then `gone()` (EmbedStream ends
its call only once every request is answered, so it still drops the work it holds).
"""

from __future__ import annotations

import asyncio
import collections
import logging

import grpc

from tulip.h2server import Direct

log = logging.getLogger("tulip.aioserver")

__all__ = ["AioServer"]

# grpc-core's ping policy, loosened to ours: a client may ping every second while it waits for a reply,
# whether or not data flows (Ivy's stream and channel ping after 4 s without hearing from Tulip, see
# trellis.client; under grpc's default of one ping in 5 minutes without data, the third such ping draws
# GOAWAY too_many_pings and breaks every call on that connection).
PING_OPTIONS = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
]


class _Call:
    """The call a Direct session answers on (the `reply` / `finish` of `tulip.h2server.Call`), over a
    grpc.aio context: replies queue here in order and the call's coroutine writes them."""

    __slots__ = ("context", "replies", "over", "code", "details", "_wake")

    def __init__(self, context):
        self.context = context
        self.replies: collections.deque = collections.deque()
        self.over = False
        self.code, self.details = grpc.StatusCode.OK, ""
        self._wake: asyncio.Future | None = None

    def invocation_metadata(self):  # tulip.tracing reads a unary call's `traceparent` here
        return self.context.invocation_metadata()

    def reply(self, message) -> None:
        if not self.over:
            self.replies.append(message)
            self._poke()

    def finish(self, code: grpc.StatusCode, details: str = "") -> None:
        if not self.over:
            self.over, self.code, self.details = True, code, details
            self._poke()

    def _poke(self) -> None:
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        """Until the session replies or finishes (called only while it has done neither since)."""
        self._wake = asyncio.get_running_loop().create_future()
        try:
            await self._wake
        finally:
            self._wake = None

    async def end(self) -> None:
        """The call's status, as the session gave it (OK: return normally)."""
        if self.code is not grpc.StatusCode.OK:
            await self.context.abort(self.code, self.details)


def _failed(call: _Call, session, path: str, e: Exception) -> None:
    """A session's method raised: as on ours, the call ends UNKNOWN and the session hears it is gone."""
    log.error("gRPC handler %s failed", path, exc_info=e)
    call.finish(grpc.StatusCode.UNKNOWN, f"Unexpected error in RPC handler: {type(e).__name__}: {e}")
    if session is not None:
        session.gone()


def _unary(direct: Direct, path: str):
    async def handler(request, context):
        call, session = _Call(context), None
        try:
            session = direct.open(call)
            session.message(request)
            if not call.over:
                session.end()
        except Exception as e:
            _failed(call, session, path, e)
        try:
            while not call.over:
                await call.wait()
        except BaseException:  # cancelled: the client went away or the deadline passed
            if not call.over:
                call.over = True
                session.gone()
            raise
        await call.end()
        if not call.replies:
            await context.abort(grpc.StatusCode.INTERNAL, "the handler ended the call without a reply")
        return call.replies[0]

    return grpc.unary_unary_rpc_method_handler(handler, direct.request_deserializer, direct.response_serializer)


async def _read(requests, call: _Call, session, path: str) -> None:
    """A streaming call's requests to its session as grpc.aio delivers them, then `end()`."""
    try:
        async for request in requests:
            if call.over:
                return
            session.message(request)
        if not call.over:
            session.end()
    except asyncio.CancelledError:
        raise
    except Exception as e:
        if not call.over:
            _failed(call, session, path, e)


def _stream(direct: Direct, path: str):
    async def handler(requests, context):
        call = _Call(context)
        try:
            session = direct.open(call)
        except Exception as e:
            _failed(call, None, path, e)
            return await call.end()
        # reading and writing at once: one task reads, this coroutine writes (grpc.aio takes one write at a time)
        reader = asyncio.ensure_future(_read(requests, call, session, path))
        try:
            while True:
                while call.replies:
                    await context.write(call.replies.popleft())
                if call.over:
                    break
                await call.wait()
        except BaseException:
            if not call.over:
                call.over = True
                session.gone()
            raise
        finally:
            reader.cancel()
        await call.end()

    return grpc.stream_stream_rpc_method_handler(handler, direct.request_deserializer, direct.response_serializer)


def adapt(handler, path: str):
    """grpc.aio's method handler for `handler`: a Direct method adapted, anything else as it is."""
    if type(handler) is not Direct:
        return handler
    if handler.request_streaming and handler.response_streaming:
        return _stream(handler, path)
    if not (handler.request_streaming or handler.response_streaming):
        return _unary(handler, path)
    raise TypeError(f"{path}: only unary-unary and stream-stream Direct methods are adapted to grpc.aio")


class _Adapted(grpc.GenericRpcHandler):
    """A generic handler whose Direct methods come out adapted (once per method)."""

    def __init__(self, inner):
        self.inner = inner
        self.cache: dict = {}

    def service(self, details):
        h = self.inner.service(details)
        if type(h) is not Direct:
            return h
        a = self.cache.get(h)
        if a is None:
            a = self.cache[h] = adapt(h, details.method)
        return a


class AioServer:
    """grpc.aio's server behind `tulip.h2server.Server`'s interface (registration, `listen`,
    `listen_unix`, `stop`), and `start()` once every port is added. `tls`: (certificate chain, private
    key) PEM bytes: every port then takes TLS only."""

    def __init__(self, max_message: int = 4 << 20, tls: tuple[bytes, bytes] | None = None):
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
            ("grpc.so_reuseport", 0),  # a port in use is an error, as on ours, not a second server sharing it
            *PING_OPTIONS,
        ])
        self.credentials = grpc.ssl_server_credentials([(tls[1], tls[0])]) if tls else None

    def add_generic_rpc_handlers(self, handlers) -> None:
        self.server.add_generic_rpc_handlers(tuple(_Adapted(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.server.add_registered_method_handlers(
            service, {name: adapt(h, f"/{service}/{name}") for name, h in handlers.items()})

    def _add(self, address: str) -> int:
        if self.credentials is not None:
            return self.server.add_secure_port(address, self.credentials)
        return self.server.add_insecure_port(address)

    async def listen(self, host: str, port: int) -> int:
        """Add TCP HOST:PORT (0: a free port); returns the port (serving from `start()`)."""
        where = f"[{host}]" if ":" in host and not host.startswith("[") else host
        try:
            return self._add(f"{where}:{port}")
        except RuntimeError as e:  # grpcio's "Failed to bind": the same error as ours gives
            raise OSError(f"cannot listen on {host}:{port}: {e}") from None

    async def listen_unix(self, path: str) -> None:
        try:
            self._add(f"unix:{path}")
        except RuntimeError as e:
            raise OSError(f"cannot listen on unix:{path}: {e}") from None

    async def start(self) -> None:
        await self.server.start()

    async def stop(self, grace: float | None) -> None:
        await self.server.stop(grace)

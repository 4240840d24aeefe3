"""Tulip's gRPC server: gRPC over HTTP/2 written here on an asyncio Protocol (the framing of
tulip.h2stream, the server's side of it), in place of grpc.aio's server.

Why: every request pays the server's transport twice (the request in, the reply out). On the
CPU machine a 512-token EmbedStream round trip to a server that answers at once costs ~0.12 ms
less through this than through grpc.aio's server, and a unary call ~0.3 ms less (see
docs/performance-log.md); grpc.aio's server runs its C core's transport on a thread of its own
and hands each message to the event loop, this one does the framing on the loop itself.

It serves grpcio's method handlers as they are (`add_generic_rpc_handlers`,
`add_registered_method_handlers`: what grpc_health's `add_HealthServicer_to_server` calls), with a
context that has what handlers use of grpc.aio's (`abort`, `write`, `add_done_callback`,
`invocation_metadata`, `time_remaining`, `cancelled`, `set_code`, `set_details`, `peer`). Unary and
server-streaming handlers are coroutines (or async generators) run as a task per call; streaming
requests come through an async iterator. A `Direct` method (Tulip's Embed and EmbedStream) is served
by callbacks instead: each request reaches its session as it is decoded, in `data_received`, and the
session answers whenever it likes (from the engine loop's completion callback), with no task,
iterator, generator or future between the socket and the handler either way.

What it does of the protocol: prior knowledge HTTP/2 (no TLS, as Tulip's only port), any number
of concurrent streams per connection, flow control both ways (our windows large and topped up
at half; sends wait in order for the peer's windows), SETTINGS, PING answered (no strikes:
clients' keepalive pings are welcome), `grpc-timeout` (the call ends DEADLINE_EXCEEDED and its
handler is cancelled), a client's RST_STREAM or a lost connection cancels the handler, message
size limits both ways (RESOURCE_EXHAUSTED), identity encoding only (a compressed message is
UNIMPLEMENTED), unknown methods UNIMPLEMENTED, a request that is not gRPC answered with HTTP 415
(HTTP/1.1 on the port: a 400 that says so). `stop(grace)`: GOAWAY on every connection, calls in
flight finish within the grace, then they are cancelled.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import struct
import time
import urllib.parse
from typing import Any, NamedTuple

import grpc
import hpack

from tulip.h2stream import (_HEAD, _PREFACE, _PREFIX, _U32, ACK, CONTINUATION, DATA, DEFAULT_FRAME, DEFAULT_WINDOW,
                            END_HEADERS, END_STREAM, GOAWAY, HEADERS, MAX_FRAME, PADDED, PING, PRIORITY_FLAG,
                            PUSH_PROMISE, RST_STREAM, SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE,
                            WINDOW, WINDOW_UPDATE, _literal, frame, frames)

log = logging.getLogger("tulip.h2server")

__all__ = ["Direct", "Server"]

NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, CANCEL = 0, 1, 3, 6, 8
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
MAX_STREAMS = 1000  # concurrent calls per connection
WRITE_HIGH = 4 << 20  # a streaming handler's write() waits while this much of its call is not yet sent
_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}
_HEADERS_OK = b"".join(_literal(k, v) for k, v in (
    (b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-accept-encoding", b"identity")))
_SETTINGS = frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", k, v) for k, v in (
    (SETTINGS_MAX_CONCURRENT_STREAMS, MAX_STREAMS), (SETTINGS_INITIAL_WINDOW_SIZE, WINDOW),
    (SETTINGS_MAX_FRAME_SIZE, MAX_FRAME)))) + frame(WINDOW_UPDATE, 0, 0, _U32.pack(WINDOW - DEFAULT_WINDOW))
_HTTP1 = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s")
_HTTP1_BODY = b"this port speaks gRPC (HTTP/2 with prior knowledge); Ivy's HTTP API is on its own port\n"


class _Details(NamedTuple):  # grpc.HandlerCallDetails, what a generic handler's service() reads
    method: str
    invocation_metadata: tuple


class _Abort(Exception):
    """context.abort(): the call ends with the status already set."""


def _grpc_message(text: str) -> bytes:
    """gRPC's percent-encoding of grpc-message: bytes outside printable ASCII, and '%'."""
    return urllib.parse.quote(text, safe=" !\"#$&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`"
                                         "abcdefghijklmnopqrstuvwxyz{|}~").encode()


def _timeout(value: bytes) -> float | None:
    unit = _TIMEOUT_UNITS.get(value[-1:])
    if unit is None or not value[:-1].isdigit() or len(value) > 9:
        return None
    return int(value[:-1]) * unit


def _settle(fut: asyncio.Future | None) -> None:
    """Wake whoever awaits `fut` (if anyone still does)."""
    if fut is not None and not fut.done():
        fut.set_result(None)


class _Requests:
    """A streaming call's requests as an async iterator (each message decoded when it came)."""

    def __init__(self):
        self.items: collections.deque = collections.deque()
        self.ended = False
        self.waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        self.items.append(item)
        _settle(self.waiter)

    def end(self) -> None:
        self.ended = True
        _settle(self.waiter)

    def __aiter__(self):
        return self

    async def __anext__(self):
        while not self.items:
            if self.ended:
                raise StopAsyncIteration
            self.waiter = asyncio.get_running_loop().create_future()
            await self.waiter
        return self.items.popleft()


class Direct(NamedTuple):
    """A method served by callbacks (registered where grpcio's method handlers go).

    `open(call)` is called once a call has its first request to give (a unary call: when the
    client's END_STREAM came; a streaming one: at its headers) and returns the call's session:
    `session.message(request)` for each decoded request, `session.end()` after the client's last,
    `session.gone()` once the call ended without the session ending it (the client reset it or went
    away, its deadline passed, a bad message, the server stopped). The session answers with
    `call.reply(message)` and ends the call with `call.finish(code, details)`; an exception out of
    its methods ends the call UNKNOWN (and tells it `gone()`)."""
    open: Any
    request_deserializer: Any
    response_serializer: Any
    request_streaming: bool
    response_streaming: bool


class Call:
    """One call (one HTTP/2 stream) and the context its handler is given."""

    def __init__(self, conn: "Connection", sid: int, path: str, headers: list, handler):
        self.conn, self.sid, self.path, self.handler = conn, sid, path, handler
        self._headers = headers
        self.window = conn.peer_initial  # what we may still send on this stream
        self.queued: collections.deque = collections.deque()  # DATA not yet sent (views), in order
        self.queued_bytes = 0
        self.trailers: bytes | None = None  # the trailers frame, once the call is over (sent after `queued`)
        self.headers_sent = False
        self.remote_closed = False  # the client's END_STREAM came
        self.over = False  # the status is decided (trailers queued or the stream reset)
        self.code, self.details = grpc.StatusCode.OK, ""
        self.task: asyncio.Task | None = None
        self.requests: _Requests | None = None
        self.session = None  # a Direct method's session, once opened (None again once told it is gone)
        self.unary_request: bytes | None = None  # a unary request's message, until the client's END_STREAM
        self.callbacks: list = []
        self.recv = 0  # received on this stream since its window was last topped up
        self._in = bytearray()
        self.deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future | None = None  # write() waits on it while too much is queued

    # --- grpc.aio's ServicerContext, the parts handlers use -------------------------------------

    def invocation_metadata(self) -> tuple:
        return tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in self._headers if not k.startswith(b":"))

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def cancelled(self) -> bool:
        return self.over and self.code is grpc.StatusCode.CANCELLED

    def done(self) -> bool:
        return self.over

    def peer(self) -> str:
        return self.conn.peer

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def add_done_callback(self, cb) -> None:
        if self.over and self.trailers is None:
            cb(self)
        else:
            self.callbacks.append(cb)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        if code is grpc.StatusCode.OK:
            raise ValueError("abort() needs a status other than OK")
        self.code, self.details = code, details
        raise _Abort()

    async def write(self, message) -> None:
        """Send one reply of a streaming call; waits while much of the call's output is not yet sent."""
        if self.over:
            raise asyncio.CancelledError()
        self.send(self.handler.response_serializer(message) if self.handler.response_serializer else message)
        while self.queued_bytes > WRITE_HIGH and not self.over:
            self._drained = asyncio.get_running_loop().create_future()
            await self._drained

    def reply(self, message) -> None:
        """A Direct session's reply: serialized and sent now (no waiting for the client to read)."""
        self.send(self.handler.response_serializer(message))

    # --- the stream ------------------------------------------------------------------------------

    def send(self, msg: bytes) -> None:
        """One message out, as far as the windows let it now (the rest in order as they open)."""
        conn = self.conn
        if self.over or conn.closed:
            return
        out = conn.out
        if not self.headers_sent:
            self.headers_sent = True
            out.append(frame(HEADERS, END_HEADERS, self.sid, _HEADERS_OK))
        size = len(msg) + _PREFIX
        if not self.queued and size <= conn.window and size <= self.window and size <= conn.peer_frame:
            out.append(_HEAD.pack(size >> 16, size & 0xFFFF, DATA, 0, self.sid) + b"\x00"
                       + len(msg).to_bytes(4, "big") + msg)
            conn.window -= size
            self.window -= size
        else:
            self.queued.append(memoryview(b"\x00" + len(msg).to_bytes(4, "big") + msg))
            self.queued_bytes += size
            conn.flush(self)
        conn.write_soon()

    def finish(self, code: grpc.StatusCode, details: str = "") -> None:
        """End the call with this status: trailers after whatever is still queued."""
        if self.over:
            return
        self.over, self.code, self.details = True, code, details
        block = (b"" if self.headers_sent else _HEADERS_OK) + _literal(b"grpc-status", str(code.value[0]).encode())
        if details:
            block += _literal(b"grpc-message", _grpc_message(details))
        self.trailers = frame(HEADERS, END_HEADERS | END_STREAM, self.sid, block)
        self.conn.flush(self)
        self.conn.write_soon()
        self._stop_timer()
        if self.requests is not None:
            self.requests.end()
        self._wake_writer()

    def reset(self, code: grpc.StatusCode, details: str, rst: int | None) -> None:
        """End the call without trailers (the client reset it, the connection is gone, or we reset it)."""
        if rst is not None and not self.over and not self.conn.closed:
            self.conn.out.append(frame(RST_STREAM, 0, self.sid, _U32.pack(rst)))
            self.conn.write_soon()
        if not self.over:
            self.over, self.code, self.details = True, code, details
        self.trailers = None
        self.queued.clear()
        self.queued_bytes = 0
        self._stop_timer()
        if self.requests is not None:
            self.requests.end()
        self._wake_writer()
        self._halt()
        self.conn.forget(self)

    def closed_out(self) -> None:
        """The trailers went out: the call is over on our side (its session, which holds the call,
        is let go: no cycle is left for the collector)."""
        self.trailers = None
        self.session = None
        if not self.remote_closed and not self.conn.closed:  # the client may stop sending (gRPC's servers do this)
            self.conn.out.append(frame(RST_STREAM, 0, self.sid, _U32.pack(NO_ERROR)))
        self.conn.forget(self)

    def run_callbacks(self) -> None:
        callbacks, self.callbacks = self.callbacks, []
        for cb in callbacks:
            try:
                cb(self)
            except Exception:
                log.exception("a call's done callback failed")

    def _wake_writer(self) -> None:
        _settle(self._drained)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if not self.over:
            self._halt()  # first: the session hears it before the trailers let it go (`closed_out`)
            self.finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _halt(self) -> None:
        """Stop the handler: cancel its task, or tell a Direct session that its call is gone (once)."""
        if self.task is not None and not self.task.done():
            self.task.cancel()
        session, self.session = self.session, None
        if session is not None:
            session.gone()

    # --- the handler -----------------------------------------------------------------------------

    def start(self, message: bytes | None) -> None:
        h = self.handler
        if type(h) is Direct:
            return self._open(message)
        if h.request_streaming:
            coro = self._stream_in(h)
        else:
            try:
                request = h.request_deserializer(message) if h.request_deserializer else message
            except Exception as e:
                return self.finish(grpc.StatusCode.INTERNAL, f"Exception deserializing request: {e!r}")
            coro = self._unary_in(h, request)
        self.task = self.conn.loop.create_task(coro)

    async def _unary_in(self, h, request) -> None:
        await self._serve(h.unary_stream if h.response_streaming else h.unary_unary, request)

    async def _stream_in(self, h) -> None:
        await self._serve(h.stream_stream if h.response_streaming else h.stream_unary, self.requests)

    async def _serve(self, fn, arg) -> None:
        h = self.handler
        try:
            result = fn(arg, self)
            if h.response_streaming:
                if inspect.isasyncgen(result):
                    async for reply in result:
                        await self.write(reply)
                else:
                    await result  # a coroutine that writes through context.write()
            else:
                reply = await result
                if not self.over and self.code is grpc.StatusCode.OK:
                    self.send(h.response_serializer(reply) if h.response_serializer else reply)
            self.finish(self.code, self.details)
        except _Abort:
            self.finish(self.code, self.details)
        except asyncio.CancelledError:
            self.finish(grpc.StatusCode.CANCELLED, "Cancelled")
        except Exception as e:
            log.exception("gRPC handler %s failed", self.path)
            self.finish(grpc.StatusCode.UNKNOWN, f"Unexpected error in RPC handler: {type(e).__name__}: {e}")

    def _open(self, message: bytes | None) -> None:
        """A Direct method: its session now, and a unary call's one request."""
        h = self.handler
        if not h.request_streaming:
            try:
                request = h.request_deserializer(message)
            except Exception as e:
                return self.finish(grpc.StatusCode.INTERNAL, f"Exception deserializing request: {e!r}")
        try:
            self.session = h.open(self)
        except Exception as e:
            return self._failed(e)
        if not h.request_streaming:
            self._to_session(request)
            if self.session is not None:
                self._to_session(None)

    def _to_session(self, request) -> None:
        """One request to the session (None: the client's last came)."""
        session = self.session
        if session is None or self.over:
            return
        try:
            session.message(request) if request is not None else session.end()
        except Exception as e:
            self._failed(e)

    def _failed(self, e: Exception) -> None:
        log.exception("gRPC handler %s failed", self.path, exc_info=e)
        self._halt()
        self.finish(grpc.StatusCode.UNKNOWN, f"Unexpected error in RPC handler: {type(e).__name__}: {e}")

    def message(self, data: bytes) -> None:
        """DATA for this call: whole messages to the handler (a unary request waits for END_STREAM)."""
        buf = self._in
        buf += data
        limit = self.conn.server.max_message
        while len(buf) >= _PREFIX:
            if buf[0] != 0:
                return self.reset_with(grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported "
                                       "(this server takes identity encoding only)")
            n = int.from_bytes(buf[1:5], "big")
            if n > limit:
                return self.reset_with(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                       f"Received message larger than max ({n} vs. {limit})")
            if len(buf) < _PREFIX + n:
                return
            msg = bytes(buf[_PREFIX:_PREFIX + n])
            del buf[:_PREFIX + n]
            if self.requests is not None or self.session is not None:
                h = self.handler
                try:
                    request = h.request_deserializer(msg) if h.request_deserializer else msg
                except Exception as e:
                    return self.reset_with(grpc.StatusCode.INTERNAL, f"Exception deserializing request: {e!r}")
                if self.session is not None:
                    self._to_session(request)
                    if self.over:
                        return
                else:
                    self.requests.put(request)
            elif self.unary_request is None:
                self.unary_request = msg
            else:
                return self.reset_with(grpc.StatusCode.UNIMPLEMENTED, "a unary method got more than one request")

    def reset_with(self, code: grpc.StatusCode, details: str) -> None:
        """Answer with a status now and stop the handler (a bad message)."""
        self._halt()
        self.finish(code, details)

    def end_of_requests(self) -> None:
        self.remote_closed = True
        if self.over:
            return
        if self._in:
            return self.reset_with(grpc.StatusCode.INTERNAL, "the request stream ended inside a message")
        if self.requests is not None:
            self.requests.end()
        elif self.session is not None:
            self._to_session(None)
        elif self.unary_request is None:
            self.finish(grpc.StatusCode.INTERNAL, "a unary method got no request")
        else:
            msg, self.unary_request = self.unary_request, None
            self.start(msg)


class Connection(asyncio.Protocol):
    """One client connection: its HTTP/2 framing and its calls."""

    def __init__(self, server: "Server"):
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.closed = False
        self.calls: dict[int, Call] = {}
        self.out: list[bytes] = []
        self._write_pending = False
        self._buf = b""
        self._preface = True  # the client's preface not yet checked
        self._decoder = hpack.Decoder()
        self._block = b""  # a header block waiting for its CONTINUATION frames
        self._block_sid = 0
        self._block_end = False
        self.window = DEFAULT_WINDOW  # what we may still send on the connection
        self.peer_initial, self.peer_frame = DEFAULT_WINDOW, DEFAULT_FRAME
        self._recv = 0  # received on the connection since its window was last topped up
        self.last_sid = 0  # the highest stream the client opened
        self.blocked: dict[int, Call] = {}  # calls with output waiting for a window, in order
        self.going_away = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = ((f"ipv6:[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"ipv4:{peer[0]}:{peer[1]}")
                     if isinstance(peer, tuple) else f"unix:{peer or ''}")
        self.server.connections.add(self)
        if self.server.stopping:
            self.go_away()

    def connection_lost(self, exc) -> None:
        self.transport = None
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.out.clear()
        for call in list(self.calls.values()):
            call.reset(grpc.StatusCode.CANCELLED, "the client's connection was lost", None)
        self.server.connections.discard(self)
        if self.transport is not None:
            self.transport.abort()
            self.transport = None
        self.server.call_over()

    def fail(self, code: int, detail: str) -> None:
        """A connection error: GOAWAY with its code, then the connection closed."""
        log.info("tulip: closing a connection from %s: %s", self.peer, detail)
        if self.transport is not None and not self.closed:
            self.transport.write(b"".join(self.out) + frame(GOAWAY, 0, 0, struct.pack(">LL", self.last_sid, code)
                                                           + detail.encode()[:256]))
            self.out.clear()
            t, self.transport = self.transport, None
            t.close()
        self._close()

    def go_away(self) -> None:
        """A graceful GOAWAY: calls opened so far finish, no new ones."""
        if not self.going_away and not self.closed:
            self.going_away = True
            self.out.append(frame(GOAWAY, 0, 0, struct.pack(">LL", self.last_sid, NO_ERROR)))
            self.write_soon()
            if not self.calls:
                self.loop.call_soon(self._close_when_sent)

    def _close_when_sent(self) -> None:
        if self.transport is not None and not self.closed:
            self._write()
            t, self.transport = self.transport, None
            t.close()
            self._close()

    # --- reading ---------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._buf:
            data, self._buf = self._buf + data, b""
        pos, n = 0, len(data)
        if self._preface:
            if n < len(_PREFACE):
                if not _PREFACE.startswith(data):
                    return self._not_http2(data)
                self._buf = data
                return
            if not data.startswith(_PREFACE):
                return self._not_http2(data)
            self._preface = False
            pos = len(_PREFACE)
            # our SETTINGS once the client's preface came (HTTP/1.1 on the port gets a plain answer instead)
            self.out.append(_SETTINGS)
        for ftype, flags, sid, payload, pos in frames(data, pos):
            if ftype < 0:
                return self.fail(FRAME_SIZE_ERROR, f"a frame of {flags} bytes, over the {MAX_FRAME} allowed")
            self._frame(ftype, flags, sid, payload)
            if self.closed:
                return
        if pos < n:
            self._buf = data[pos:]
        self._write()

    def _not_http2(self, data: bytes) -> None:
        if data[:4] in (b"GET ", b"POST", b"PUT ", b"HEAD", b"OPTI", b"DELE", b"PATC"):
            self.transport.write(_HTTP1 % (len(_HTTP1_BODY), _HTTP1_BODY))
        t, self.transport = self.transport, None
        t.close()
        self._close()

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self._block and ftype != CONTINUATION:
            return self.fail(PROTOCOL_ERROR, "a header block without its CONTINUATION")
        if ftype == DATA:
            self._recv += len(payload)
            if self._recv >= WINDOW // 2:
                self.out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self._recv)))
                self._recv = 0
            call = self.calls.get(sid)
            if call is None:
                if sid > self.last_sid or sid == 0:
                    return self.fail(PROTOCOL_ERROR, f"DATA on stream {sid}, which is not open")
                return  # a call that is already over (its stream reset or answered): dropped
            if call.remote_closed:
                return self.fail(PROTOCOL_ERROR, f"DATA on stream {sid} after its END_STREAM")
            call.recv += len(payload)
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]] if payload and payload[0] < len(payload) else b""
            if not call.over:
                call.message(payload)
                if call.recv >= WINDOW // 2 and not call.over:
                    self.out.append(frame(WINDOW_UPDATE, 0, sid, _U32.pack(call.recv)))
                    call.recv = 0
            if flags & END_STREAM:
                call.end_of_requests()
        elif ftype == HEADERS or ftype == CONTINUATION:
            if ftype == HEADERS:
                if flags & PADDED:
                    payload = payload[1:len(payload) - payload[0]] if payload and payload[0] < len(payload) else b""
                if flags & PRIORITY_FLAG:
                    payload = payload[5:]
                self._block_sid, self._block_end = sid, bool(flags & END_STREAM)
            elif sid != self._block_sid or not self._block:
                return self.fail(PROTOCOL_ERROR, "a CONTINUATION that continues nothing")
            self._block += payload
            if flags & END_HEADERS:
                block, self._block = self._block, b""
                self._headers(self._block_sid, block, self._block_end)
        elif ftype == WINDOW_UPDATE:
            if len(payload) != 4:
                return self.fail(FRAME_SIZE_ERROR, "a WINDOW_UPDATE that is not 4 bytes")
            inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
            if sid == 0:
                self.window += inc
                for call in list(self.blocked.values()):
                    self.flush(call)
            elif (call := self.calls.get(sid)) is not None:
                call.window += inc
                self.flush(call)
        elif ftype == SETTINGS:
            if sid != 0 or (not flags & ACK and len(payload) % 6):
                return self.fail(PROTOCOL_ERROR, "a malformed SETTINGS frame")
            if flags & ACK:
                return
            for i in range(0, len(payload), 6):
                key, value = struct.unpack_from(">HL", payload, i)
                if key == SETTINGS_INITIAL_WINDOW_SIZE:
                    if value > 0x7FFFFFFF:
                        return self.fail(FLOW_CONTROL_ERROR, "an initial window over 2^31 - 1")
                    for call in self.calls.values():
                        call.window += value - self.peer_initial
                    self.peer_initial = value
                elif key == SETTINGS_MAX_FRAME_SIZE:
                    if not DEFAULT_FRAME <= value <= 0xFFFFFF:
                        return self.fail(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
                    self.peer_frame = value
            self.out.append(frame(SETTINGS, ACK, 0))
            for call in list(self.calls.values()):
                self.flush(call)
        elif ftype == PING:
            if len(payload) != 8:
                return self.fail(FRAME_SIZE_ERROR, "a PING that is not 8 bytes")
            if not flags & ACK:
                self.out.append(frame(PING, ACK, 0, payload))
        elif ftype == RST_STREAM:
            call = self.calls.get(sid)
            if call is not None:
                call.reset(grpc.StatusCode.CANCELLED, "the client cancelled the call", None)
        elif ftype == GOAWAY:
            pass  # the client will open no more streams; those open carry on
        elif ftype == PUSH_PROMISE:
            return self.fail(PROTOCOL_ERROR, "a PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types: ignored, as HTTP/2 says

    def _headers(self, sid: int, block: bytes, ends_stream: bool) -> None:
        try:
            headers = self._decoder.decode(block, raw=True)
        except Exception as e:  # hpack's errors: the connection's header state is lost
            return self.fail(PROTOCOL_ERROR, f"a header block that does not decode ({e!r})")
        call = self.calls.get(sid)
        if call is not None:  # trailers from the client: only END_STREAM means anything
            if ends_stream:
                call.end_of_requests()
            return
        if sid % 2 == 0:
            return self.fail(PROTOCOL_ERROR, f"a client opened the even stream {sid}")
        if sid <= self.last_sid:
            return  # trailers of a call already over: nothing to do
        self.last_sid = sid
        if self.going_away:
            self.out.append(frame(RST_STREAM, 0, sid, _U32.pack(7)))  # REFUSED_STREAM: safe to retry elsewhere
            return
        h = dict(headers)
        path = h.get(b":path", b"").decode("latin-1")
        ctype = h.get(b"content-type", b"")
        if h.get(b":method") != b"POST" or not (ctype == b"application/grpc" or ctype.startswith(b"application/grpc+")
                                                or ctype.startswith(b"application/grpc;")):
            status = b"405" if h.get(b":method") != b"POST" else b"415"
            self.out.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, _literal(b":status", status)
                                  + _literal(b"content-type", b"text/plain")))
            return
        if len(self.calls) >= MAX_STREAMS:
            self.out.append(frame(RST_STREAM, 0, sid, _U32.pack(7)))
            return
        handler = self.server.handler(path)
        call = Call(self, sid, path, headers, handler)
        self.calls[sid] = call
        if handler is None:
            call.finish(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
        elif h.get(b"grpc-encoding", b"identity") != b"identity":
            call.finish(grpc.StatusCode.UNIMPLEMENTED, f"grpc-encoding {h[b'grpc-encoding'].decode('latin-1')} is "
                        "not supported (this server takes identity only)")
        else:
            if (t := h.get(b"grpc-timeout")) is not None:
                seconds = _timeout(t)
                if seconds is None:
                    call.finish(grpc.StatusCode.INTERNAL, f"malformed grpc-timeout {t.decode('latin-1')!r}")
                else:
                    call.deadline = time.monotonic() + seconds
                    call._timer = self.loop.call_later(seconds, call._expire)
            if not call.over and handler.request_streaming:
                if type(handler) is not Direct:
                    call.requests = _Requests()
                call.start(None)
        if ends_stream:
            call.end_of_requests()

    # --- writing ---------------------------------------------------------------------------------

    def flush(self, call: Call) -> None:
        """Send what `call` has queued as far as the windows let it; its trailers once all is out."""
        queued, out = call.queued, self.out
        while queued:
            room = min(self.window, call.window, self.peer_frame)
            if room <= 0:
                self.blocked[call.sid] = call
                return
            view = queued[0]
            part = view[:room]
            out.append(frame(DATA, 0, call.sid, bytes(part)))
            self.window -= len(part)
            call.window -= len(part)
            call.queued_bytes -= len(part)
            if len(view) <= room:
                queued.popleft()
            else:
                queued[0] = view[room:]
        self.blocked.pop(call.sid, None)
        if call.queued_bytes <= WRITE_HIGH:
            call._wake_writer()
        if call.trailers is not None:
            out.append(call.trailers)
            call.closed_out()

    def forget(self, call: Call) -> None:
        if self.calls.get(call.sid) is call:
            del self.calls[call.sid]
            self.blocked.pop(call.sid, None)
            call.run_callbacks()
            if self.going_away and not self.calls:
                self.loop.call_soon(self._close_when_sent)
            self.server.call_over()

    def write_soon(self) -> None:
        """Write what is queued: now when called outside data_received, else at its end."""
        if not self._write_pending:
            self._write_pending = True
            self.loop.call_soon(self._write)

    def _write(self) -> None:
        self._write_pending = False
        out = self.out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(data)


class Server:
    """The gRPC server: grpcio's method handlers on asyncio listeners (`listen`)."""

    def __init__(self, max_message: int = 4 << 20):
        self.max_message = max_message
        self._generic: list = []
        self._paths: dict[str, Any] = {}
        self._cache: dict[str, Any] = {}
        self._listeners: list[asyncio.AbstractServer] = []
        self.connections: set[Connection] = set()
        self.stopping = False
        self._idle: asyncio.Event | None = None

    # grpcio's registration calls (generated add_*_to_server functions make them)
    def add_generic_rpc_handlers(self, handlers) -> None:
        self._generic.extend(handlers)
        self._cache.clear()

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        for name, h in handlers.items():
            self._paths[f"/{service}/{name}"] = h
        self._cache.clear()

    def handler(self, path: str):
        h = self._cache.get(path, False)
        if h is False:
            h = self._paths.get(path)
            if h is None:
                details = _Details(path, ())
                for g in self._generic:
                    h = g.service(details)
                    if h is not None:
                        break
            if len(self._cache) < 64:  # a bound: unknown paths come from clients
                self._cache[path] = h
        return h

    async def listen(self, host: str, port: int) -> int:
        """Listen on TCP HOST:PORT (0: a free port); returns the port."""
        srv = await asyncio.get_running_loop().create_server(lambda: Connection(self), host, port,
                                                             reuse_address=True)
        self._listeners.append(srv)
        return srv.sockets[0].getsockname()[1]

    async def listen_unix(self, path: str) -> None:
        srv = await asyncio.get_running_loop().create_unix_server(lambda: Connection(self), path)
        self._listeners.append(srv)

    def _calls(self) -> int:
        return sum(len(c.calls) for c in self.connections)

    def call_over(self) -> None:
        if self._idle is not None and not self._calls():
            self._idle.set()

    async def stop(self, grace: float | None) -> None:
        """Stop listening, GOAWAY every connection; calls in flight get `grace` seconds to finish,
        then they are cancelled and the connections closed."""
        self.stopping = True
        for srv in self._listeners:
            srv.close()
        for conn in list(self.connections):
            conn.go_away()
        self._idle = asyncio.Event()
        if self._calls():
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                pass
        for conn in list(self.connections):
            for call in list(conn.calls.values()):
                call.reset(grpc.StatusCode.UNAVAILABLE, "the server stopped", CANCEL)
            conn._close_when_sent()
        for srv in self._listeners:
            await srv.wait_closed()

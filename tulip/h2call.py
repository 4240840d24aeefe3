"""One call of tulip.h2server (one HTTP/2 stream): the context its handler is given (what handlers
use of grpc.aio's), the handler run as a task or a `Direct` session by callbacks, its messages in
(gRPC's 5-byte framing, counted against the connection's flow-control bounds) and out (queued while
the peer's windows or a paused transport hold them, within the output bounds)."""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import time
import urllib.parse
from typing import Any, NamedTuple

import grpc

from tulip.h2body import BIG, Pieces, whole
from tulip.h2limits import ENHANCE_YOUR_CALM, NO_ERROR
from trellis.h2frames import DATA, END_HEADERS, END_STREAM, HEADERS, RST_STREAM, frame
from trellis.h2frames import HEAD, PREFIX, U32, literal

log = logging.getLogger("tulip.h2server")

WRITE_HIGH = 4 << 20  # a streaming handler's write() waits while this much of its call is not yet sent
HEADERS_OK = b"".join(literal(k, v) for k, v in (
    (b":status", b"200"), (b"content-type", b"application/grpc"), (b"grpc-accept-encoding", b"identity")))
_BAD = grpc.StatusCode.INVALID_ARGUMENT  # a request that is not one: the docs' promise (never INTERNAL)


class Abort(Exception):
    """context.abort(): the call ends with the status already set."""


def grpc_message(text: str) -> bytes:
    """gRPC's percent-encoding of grpc-message: bytes outside printable ASCII, and '%'."""
    return urllib.parse.quote(text, safe=" !\"#$&'()*+,-./0123456789:;<=>?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[\\]^_`"
                                         "abcdefghijklmnopqrstuvwxyz{|}~").encode()


def _settle(fut: asyncio.Future | None) -> None:
    """Wake whoever awaits `fut` (if anyone still does)."""
    if fut is not None and not fut.done():
        fut.set_result(None)


class Requests:
    """A streaming call's requests as an async iterator (each message decoded when it came); a
    message's bytes stay counted against the connection's windows until the handler takes it."""

    def __init__(self, call: "Call"):
        self.call = call
        self.items: collections.deque = collections.deque()  # (request, wire bytes)
        self.ended = False
        self.waiter: asyncio.Future | None = None

    def put(self, item, size: int) -> None:
        self.items.append((item, size))
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
        item, size = self.items.popleft()
        self.call.conn.release(self.call, size)
        return item


class Direct(NamedTuple):
    """A method served by callbacks (registered where grpcio's method handlers go).

    `open(call)` is called once a call has its first request to give (a unary call: when the
    client's END_STREAM came; a streaming one: at its headers) and returns the call's session:
    `session.message(request)` for each decoded request, `session.end()` after the client's last,
    `session.gone()` once the call ended without the session ending it (the client reset it or went
    away, its deadline passed, a bad message, the server stopped, its replies overflowed what the peer
    let us send). The session answers with `call.reply(message)` and ends the call with
    `call.finish(code, details)`; an exception out of its methods ends the call UNKNOWN (and tells it
    `gone()`). `arrays`: a message of tulip.h2body.BIG bytes or more reaches `request_deserializer` as a
    writable uint8 numpy array (copied once from the socket's reads) instead of bytes."""
    open: Any
    request_deserializer: Any
    response_serializer: Any
    request_streaming: bool
    response_streaming: bool
    arrays: bool = False


class Call:
    """One call (one HTTP/2 stream) and the context its handler is given."""

    def __init__(self, conn, sid: int, path: str, headers: list, handler):
        self.conn, self.sid, self.path, self.handler = conn, sid, path, handler
        self._headers = headers
        self.window_off = 0  # what we may still send on this stream, less the peer's initial window (lazy)
        self.recv_window = conn.stream_window  # what the peer may still send on this stream
        self.held = 0  # bytes received and not yet handed over (a partial message, requests not yet read)
        self.partial_at = 0.0  # when the partial message last grew
        self.queued: collections.deque = collections.deque()  # DATA not yet sent (views), in order
        self.queued_bytes = 0
        self.trailers: bytes | None = None  # the trailers frame, once the call is over (sent after `queued`)
        self.headers_sent = False
        self.remote_closed = False  # the client's END_STREAM came
        self.over = False  # the status is decided (trailers queued or the stream reset)
        self.code, self.details = grpc.StatusCode.OK, ""
        self.task: asyncio.Task | None = None
        self.requests: Requests | None = None
        self.session = None  # a Direct method's session, once opened (None again once told it is gone)
        self.unary_request: bytes | None = None  # a unary request's message, until the client's END_STREAM
        self.callbacks: list = []
        self._prefix = bytearray()  # the start of a message's 5-byte prefix, until it is whole
        self._body: Pieces | None = None  # the message whose prefix came, until it is whole
        self._arrays = type(handler) is Direct and handler.arrays  # big messages as arrays (Direct.arrays)
        self.deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future | None = None  # write() waits on it while too much is queued
        self.writing = False  # a streaming handler waits in write() (it is doing work: stop() lets it finish)

    # --- grpc.aio's ServicerContext, the parts handlers use -------------------------------------

    def invocation_metadata(self) -> tuple:
        return tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in self._headers if not k.startswith(b":"))

    def time_remaining(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    @property
    def stalled(self) -> bool:
        """The connection's replies are not being taken (Limits.hold_s): new work should wait, held."""
        return self.conn.stalled

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
        raise Abort()

    async def write(self, message) -> None:
        """Send one reply of a streaming call; waits while much of the call's output is not yet sent."""
        if self.over:
            raise asyncio.CancelledError()
        self.send(self.handler.response_serializer(message) if self.handler.response_serializer else message)
        self.writing = True
        try:
            while self.queued_bytes > WRITE_HIGH and not self.over:
                self._drained = asyncio.get_running_loop().create_future()
                await self._drained
        finally:
            self.writing = False

    def reply(self, message) -> None:
        """A Direct session's reply: serialized and sent now (no waiting for the client to read);
        past the output bounds the call is reset (the session hears `gone()`)."""
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
            out.append(frame(HEADERS, END_HEADERS, self.sid, HEADERS_OK))
        size = len(msg) + PREFIX
        if (not self.queued and not conn.paused and size <= conn.window and size <= conn.peer_initial + self.window_off
                and size <= conn.peer_frame):
            out.append(HEAD.pack(size >> 16, size & 0xFFFF, DATA, 0, self.sid) + b"\x00"
                       + len(msg).to_bytes(4, "big") + msg)
            conn.window -= size
            self.window_off -= size
            if conn.stalled:
                conn.moved()
        else:
            if self.queued_bytes + size > conn.call_output or conn.queued_out + size > conn.conn_output:
                return self.overflow(size)
            self.queued.append(memoryview(b"\x00" + len(msg).to_bytes(4, "big") + msg))
            self.queued_bytes += size
            conn.queued_out += size
            conn.flush(self)
        conn.write_soon()

    def overflow(self, size: int) -> None:
        """A reply the peer is not taking (its windows, or a socket it does not read) would pass the
        output bounds: the call is reset ENHANCE_YOUR_CALM (grpc clients: RESOURCE_EXHAUSTED)."""
        conn = self.conn
        log.warning("tulip: resetting call %s from %s: %d reply bytes wait for the peer (%d on the connection), "
                    "another %d would pass the bounds", self.path, conn.peer, self.queued_bytes, conn.queued_out, size)
        self.reset(grpc.StatusCode.RESOURCE_EXHAUSTED, "the client is not reading its replies", ENHANCE_YOUR_CALM)

    def finish(self, code: grpc.StatusCode, details: str = "") -> None:
        """End the call with this status: trailers after whatever is still queued."""
        if self.over:
            return
        self.over, self.code, self.details = True, code, details
        block = (b"" if self.headers_sent else HEADERS_OK) + literal(b"grpc-status", str(code.value[0]).encode())
        if details:
            block += literal(b"grpc-message", grpc_message(details))
        self.trailers = frame(HEADERS, END_HEADERS | END_STREAM, self.sid, block)
        self.conn.flush(self)
        self.conn.write_soon()
        self._stop_timer()
        if self.requests is not None:
            self.requests.end()
        self._wake_writer()

    def reset(self, code: grpc.StatusCode, details: str, rst: int | None) -> None:
        """End the call without trailers (the client reset it, the connection is gone, or we reset it)."""
        conn = self.conn
        if rst is not None and not conn.closed and conn.calls.get(self.sid) is self:
            conn.out.append(frame(RST_STREAM, 0, self.sid, U32.pack(rst)))
            conn.write_soon()
        if not self.over:
            self.over, self.code, self.details = True, code, details
        self.trailers = None
        conn.queued_out -= self.queued_bytes
        self.queued.clear()
        self.queued_bytes = 0
        self._stop_timer()
        if self.requests is not None:
            self.requests.end()
        self._wake_writer()
        self._halt()
        conn.forget(self)

    def closed_out(self) -> None:
        """The trailers went out: the call is over on our side (its session, which holds the call,
        is let go: no cycle is left for the collector)."""
        self.trailers = None
        self.session = None
        if not self.remote_closed and not self.conn.closed:  # the client may stop sending (gRPC's servers do this)
            self.conn.out.append(frame(RST_STREAM, 0, self.sid, U32.pack(NO_ERROR)))
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
                return self.finish(_BAD, f"Exception deserializing request: {e!r}")
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
        except Abort:
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
                return self.finish(_BAD, f"Exception deserializing request: {e!r}")
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

    def message(self, data) -> None:
        """DATA for this call (bytes, or a memoryview of a socket read): whole messages to the handler (a
        unary request waits for END_STREAM). What is handed over is consumed (the connection opens the
        windows again for it); a partial message and requests a streaming handler has not read yet stay
        `held`. A message's bytes are kept as views until it is whole, then copied once (tulip.h2body)."""
        body = self._body
        if body is None and not self._prefix and len(data) > PREFIX and data[0] == 0 \
                and len(data) == PREFIX + int.from_bytes(data[1:5], "big"):
            if len(data) - PREFIX <= self.conn.server.max_message:  # one whole message in one frame: the usual
                msg = data[PREFIX:]  # (bytes: a copy, as small messages come; a view of a big one's read: not yet)
                return self._deliver(msg if type(msg) is bytes and (len(msg) < BIG or not self._arrays)
                                     else whole(msg, self._arrays))
        before = len(self._prefix) + (body.size if body is not None else 0)
        limit = self.conn.server.max_message
        error = None
        pos, end = 0, len(data)
        while pos < end and not self.over:
            if body is None:  # the 5-byte prefix (it may span frames too)
                prefix = self._prefix
                take = min(PREFIX - len(prefix), end - pos)
                prefix += data[pos:pos + take]
                pos += take
                if len(prefix) < PREFIX:
                    break
                if prefix[0] != 0:
                    error = (grpc.StatusCode.UNIMPLEMENTED, "compressed messages are not supported "
                             "(this server takes identity encoding only)")
                    break
                n = int.from_bytes(prefix[1:5], "big")
                if n > limit:
                    error = (grpc.StatusCode.RESOURCE_EXHAUSTED, f"Received message larger than max ({n} vs. {limit})")
                    break
                body = self._body = Pieces(n, self._arrays)
            take = min(body.need - body.size, end - pos)
            if take:
                body.add(data[pos:pos + take])
                pos += take
            if body.size == body.need:
                self._body = None
                self._prefix.clear()
                self._deliver(body.take(self._arrays))
                body = self._body
        if error is not None:
            return self.reset_with(*error)
        if self.over:  # a request the handler refused: what is left goes
            return self.drop_input()
        conn = self.conn
        pending = self.pending_bytes()
        grown = pending - before
        self.held += grown
        conn.held += grown
        if pending:
            self.partial_at = time.monotonic()
            conn.partial[self.sid] = self
            if body is not None:
                conn.progress(self, body.need - body.size)
        elif before:
            conn.partial.pop(self.sid, None)

    def pending_bytes(self) -> int:
        """Bytes of a message not yet whole (its prefix included)."""
        return len(self._prefix) + (self._body.size if self._body is not None else 0)

    def _deliver(self, msg) -> None:
        """One whole request message to the handler (bytes; for a Direct handler a big one is a writable
        uint8 array, tulip.h2body)."""
        if self.requests is not None or self.session is not None:
            h = self.handler
            try:
                request = h.request_deserializer(msg) if h.request_deserializer else msg
            except Exception as e:
                return self.reset_with(_BAD, f"Exception deserializing request: {e!r}")
            if self.session is not None:
                self._to_session(request)
            else:
                self.held += len(msg) + PREFIX  # held until the handler reads it
                self.conn.held += len(msg) + PREFIX
                self.requests.put(request, len(msg) + PREFIX)
        elif self.unary_request is None:
            self.unary_request = msg
        else:
            self.reset_with(grpc.StatusCode.UNIMPLEMENTED, "a unary method got more than one request")

    def drop_input(self) -> None:
        """Let go of what this call holds of its client's bytes (the call is over)."""
        if self.held:
            conn = self.conn
            conn.held -= self.held
            self.held = 0
            if not conn.closed:  # the connection's window opens again for what was dropped
                conn.topup(None)
                if conn.out:
                    conn.write_soon()
        self._prefix.clear()
        self._body = None
        if self.requests is not None:
            self.requests.items.clear()
        self.conn.partial.pop(self.sid, None)

    def reset_with(self, code: grpc.StatusCode, details: str) -> None:
        """Answer with a status now and stop the handler (a bad message)."""
        self._halt()
        self.finish(code, details)
        self.drop_input()

    def end_of_requests(self) -> None:
        self.remote_closed = True
        if self.over:
            return
        if pending := self.pending_bytes():
            return self.reset_with(_BAD, f"the request stream ended inside a message ({pending} bytes of it came)")
        if self.requests is not None:
            self.requests.end()
        elif self.session is not None:
            self._to_session(None)
        elif self.unary_request is None:
            self.finish(_BAD, "a unary method got no request message")
        else:
            msg, self.unary_request = self.unary_request, None
            self.start(msg)

"""Tulip's gRPC server: gRPC over HTTP/2 written here on an asyncio Protocol (the framing of
tulip.h2stream, the server's side of it), in place of grpc.aio's server. Its calls are
tulip.h2call's, its limits tulip.h2limits'.

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

What it does of the protocol: prior knowledge HTTP/2 (no TLS, as Tulip's only port), concurrent
streams per connection, flow control both ways (sends wait in order for the peer's windows; our
windows are opened again only for what was consumed), SETTINGS, PING answered (keepalive pings are
welcome, floods are not), `grpc-timeout` (the call ends DEADLINE_EXCEEDED and its handler is
cancelled), a client's RST_STREAM or a lost connection cancels the handler, message size limits
both ways (RESOURCE_EXHAUSTED), identity encoding only (a compressed message is UNIMPLEMENTED),
unknown methods UNIMPLEMENTED, a request that is not gRPC answered with HTTP 415 (HTTP/1.1 on the
port: a 400 that says so), RFC 9113's connection and stream errors. Against a hostile peer
(`tulip.h2limits.Limits`, docs/reliability.md): bounded header blocks, buffered input and queued
output, control-frame and reset rates (GOAWAY ENHANCE_YOUR_CALM), preface, idle and stall
deadlines, a connection cap; no frame costs work in proportion to the calls open. `stop(grace)`:
GOAWAY on every connection, server-streaming handlers that are only waiting (health Watch) end at
once, other calls in flight finish within the grace, then they are cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from typing import Any, NamedTuple

import grpc
import hpack

from tulip.h2call import WRITE_HIGH, Call, Direct, Requests, parse_timeout
from tulip.h2limits import (COMPRESSION_ERROR, ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, MAX_WINDOW,
                            NO_ERROR, PROTOCOL_ERROR, REFUSED_STREAM, STREAM_CLOSED, Bucket, Limits, raise_nofile_limit,
                            request_error)
from trellis.h2frames import (ACK, CONTINUATION, DATA, DEFAULT_FRAME, DEFAULT_WINDOW, END_HEADERS, END_STREAM, GOAWAY,
                              HEADERS, MAX_FRAME, PADDED, PING, PRIORITY, PRIORITY_FLAG, PUSH_PROMISE, RST_STREAM,
                              SETTINGS, SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE,
                              WINDOW, WINDOW_UPDATE, frame, frames)
from trellis.h2frames import PREFACE as _PREFACE, PREFIX as _PREFIX, U32 as _U32, literal as _literal

log = logging.getLogger("tulip.h2server")

__all__ = ["Call", "Direct", "Limits", "Server"]

SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_MAX_HEADER_LIST_SIZE = 0x3, 0x6
MAX_SETTINGS = 64  # entries in one SETTINGS frame (nghttp2: 32); more is ENHANCE_YOUR_CALM
TICK_S = 1.0  # how often the server looks at its connections' deadlines
OPEN_PER_TURN = 32  # calls one connection may open per event-loop turn: the rest of what it sent waits for the
# next turn, so other connections (and the engine loop's callbacks) are served between (grpc-core's
# max_requests_per_read, its rapid-reset mitigation, is the same idea)
_HTTP1 = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s")
_HTTP1_BODY = b"this port speaks gRPC (HTTP/2 with prior knowledge); Ivy's HTTP API is on its own port\n"
_nofile_raised = False


class _Details(NamedTuple):  # grpc.HandlerCallDetails, what a generic handler's service() reads
    method: str
    invocation_metadata: tuple


class Connection(asyncio.Protocol):
    """One client connection: its HTTP/2 framing and its calls."""

    def __init__(self, server: "Server"):
        self.server = server
        limits = self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.closed = False
        self.calls: dict[int, Call] = {}
        self.out: list[bytes] = []
        self._write_pending = False
        self._buf = b""
        self._preface = True  # the client's preface not yet checked
        self._decoder = hpack.Decoder(max_header_list_size=limits.max_header_list)
        self._block = b""  # a header block waiting for its CONTINUATION frames
        self._block_open = False
        self._block_sid = 0
        self._block_end = False
        self._conts = 0
        # sending: what the peer lets us send (the connection's window; a stream's is its initial window
        # plus the call's window_off, so a new initial window costs no walk over the calls)
        self.window = DEFAULT_WINDOW
        self.peer_initial, self.peer_frame = DEFAULT_WINDOW, DEFAULT_FRAME
        self.blocked: dict[int, Call] = {}  # calls with output waiting for the connection's window (or writes)
        self.starved: dict[int, Call] = {}  # calls with output waiting for their own stream's window
        self.queued_out = 0  # reply bytes queued in calls
        self.paused = False  # the transport is above its write high-water mark
        self._reading = True
        self.progress_at = 0.0  # when output last moved (or began to wait), while some waits
        self._buffered = 0  # the transport's write buffer at the last tick (paused: it shrinks if the peer reads)
        self.call_output = max(limits.call_output, server.max_message + _PREFIX)
        self.conn_output = max(limits.conn_output, server.max_message + _PREFIX)
        # receiving: our windows are opened again only for bytes handed over (`held`: not yet)
        self.stream_window = limits.stream_buffered
        self.recv_window = WINDOW  # what the peer may still send on the connection
        self.held = 0
        self.conn_buffered = max(limits.conn_buffered, server.max_message + _PREFIX + MAX_FRAME)
        self.partial: dict[int, Call] = {}  # calls holding a partial message
        self.last_sid = 0  # the highest stream the client opened
        self.going_away = False
        self.control = Bucket(limits.control_burst, limits.control_rate)
        self.resets = Bucket(limits.reset_burst, limits.reset_rate)
        self.made_at = self.idle_since = time.monotonic()
        self._opened = 0  # calls opened in this turn
        self._later = False  # stop reading frames now: the rest next turn (OPEN_PER_TURN)

    def connection_made(self, transport) -> None:
        self.transport = transport
        server = self.server
        if len(server.connections) >= self.limits.max_connections:
            server.refused += 1  # over the cap: closed at once (told in the next tick's log line)
            self.closed = True
            self.transport = None
            transport.abort()
            return
        peer = transport.get_extra_info("peername")
        self.peer = ((f"ipv6:[{peer[0]}]:{peer[1]}" if ":" in peer[0] else f"ipv4:{peer[0]}:{peer[1]}")
                     if isinstance(peer, tuple) else f"unix:{peer or ''}")
        transport.set_write_buffer_limits(high=self.limits.write_high)
        server.connections.add(self)
        server.watch()
        if server.stopping:
            self.go_away()

    def connection_lost(self, exc) -> None:
        self.transport = None
        self._close()

    def pause_writing(self) -> None:
        """The peer is not reading what we write: no more DATA goes to the transport, and nothing more
        is read from the peer (so it cannot make us queue more answers) until it drains."""
        if not self.blocked and not self.starved:
            self.progress_at = time.monotonic()
        self.paused = True
        self._buffered = self.transport.get_write_buffer_size() if self.transport is not None else 0
        self.reading()

    def resume_writing(self) -> None:
        self.paused = False
        self.progress_at = time.monotonic()
        if self.transport is not None and not self.closed:
            self.reading()
            self._unblock()
            self._write()

    def reading(self) -> None:
        """Read from the peer unless writes are paused (it does not read what we write: it gets to ask
        for nothing more) or what it sent waits for the next turn. (Not while replies wait for its
        flow-control windows: its WINDOW_UPDATEs must still be read.)"""
        want = not (self.paused or self._later)
        if want != self._reading and self.transport is not None and not self.closed:
            self._reading = want
            self.transport.resume_reading() if want else self.transport.pause_reading()

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

    def fail(self, code: int, detail: str, abort: bool = False) -> None:
        """A connection error: GOAWAY with its code, then the connection closed (`abort`: at once, what is
        not yet written dropped, as when writes are paused)."""
        log.info("tulip: closing a connection from %s: %s", self.peer, detail)
        if self.transport is not None and not self.closed:
            self.transport.write(b"".join(self.out) + frame(GOAWAY, 0, 0, struct.pack(">LL", self.last_sid, code)
                                                           + detail.encode()[:256]))
            self.out.clear()
            t, self.transport = self.transport, None
            if self.paused or abort:
                t.abort()  # a peer that does not read would hold a closing transport open
            else:
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

    def tick(self, now: float) -> None:
        """The deadlines (the server calls this every TICK_S): preface, idle, a peer that does not
        read, partial messages that stopped growing."""
        limits = self.limits
        if self._preface:
            if now - self.made_at > limits.preface_timeout_s:
                log.info("tulip: closing a connection from %s: no HTTP/2 preface within %g s", self.peer,
                         limits.preface_timeout_s)
                self._close()
            return
        if not self.calls and limits.idle_timeout_s and now - self.idle_since > limits.idle_timeout_s:
            self.go_away()
        if self.paused or self.blocked or self.starved:
            if self.paused and self.transport is not None:  # paused: bytes still drain if the peer reads slowly
                buffered = self.transport.get_write_buffer_size()
                if buffered < self._buffered:
                    self.progress_at = now
                self._buffered = buffered
            if now - self.progress_at > limits.reply_stall_s:
                # the peer takes none of its replies: its calls are cancelled, so the work it queued is
                # dropped rather than computed (Tulip's sessions hear gone() and cancel their requests)
                return self.fail(ENHANCE_YOUR_CALM, f"no byte of its replies could be sent for "
                                 f"{limits.reply_stall_s:g} s ({self.queued_out} bytes wait; its {len(self.calls)} "
                                 "calls are cancelled)", abort=True)
        for call in [c for c in self.partial.values() if now - c.partial_at > limits.stall_s]:
            call.reset_with(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a request message got no bytes for "
                            f"{limits.stall_s:g} s ({len(call._in)} of it came)")
        if self.partial:
            self._write()

    # --- reading ---------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
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
            self.out.append(self.server.settings_frame)
        for ftype, flags, sid, payload, pos in frames(data, pos):
            if ftype < 0:
                return self.fail(FRAME_SIZE_ERROR, f"a frame of {flags} bytes, over the {MAX_FRAME} allowed")
            self._frame(ftype, flags, sid, payload)
            if self.closed:
                return
            if self._later:
                self.reading()
                self.loop.call_soon(self._next_turn)
                break
        if pos < n:
            self._buf = data[pos:]
        self._write()

    def _next_turn(self) -> None:
        self._later, self._opened = False, 0
        if self.closed:
            return
        self.reading()
        self.data_received(b"")

    def _not_http2(self, data: bytes) -> None:
        if data[:4] in (b"GET ", b"POST", b"PUT ", b"HEAD", b"OPTI", b"DELE", b"PATC"):
            self.transport.write(_HTTP1 % (len(_HTTP1_BODY), _HTTP1_BODY))
        t, self.transport = self.transport, None
        t.close()
        self._close()

    def _frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
        if self._block_open and ftype != CONTINUATION:
            return self.fail(PROTOCOL_ERROR, "a header block without its CONTINUATION")
        if ftype == DATA:
            return self._data(flags, sid, payload)
        if ftype == HEADERS:
            if sid == 0:
                return self.fail(PROTOCOL_ERROR, "HEADERS on stream 0")
            if flags & PADDED:
                if not payload or payload[0] >= len(payload):
                    return self.fail(PROTOCOL_ERROR, "HEADERS padded past its end")
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY_FLAG:
                if len(payload) < 5:
                    return self.fail(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
                payload = payload[5:]
            if len(payload) > self.limits.max_header_block:
                return self.fail(ENHANCE_YOUR_CALM, f"a header block over {self.limits.max_header_block} bytes")
            self._block_sid, self._block_end, self._conts = sid, bool(flags & END_STREAM), 0
            if flags & END_HEADERS:
                return self._headers(sid, payload, self._block_end)
            self._block, self._block_open = payload, True
        elif ftype == CONTINUATION:
            if not self._block_open or sid != self._block_sid:
                return self.fail(PROTOCOL_ERROR, "a CONTINUATION that continues nothing")
            self._conts += 1
            if self._conts > self.limits.max_continuations or len(self._block) + len(payload) > self.limits.max_header_block:
                return self.fail(ENHANCE_YOUR_CALM, f"a header block over {self.limits.max_header_block} bytes or "
                                 f"{self.limits.max_continuations} CONTINUATION frames")
            self._block += payload
            if flags & END_HEADERS:
                block, self._block, self._block_open = self._block, b"", False
                self._headers(self._block_sid, block, self._block_end)
        elif ftype == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif ftype == SETTINGS:
            self._settings(flags, sid, payload)
        elif ftype == PING:
            if sid != 0:
                return self.fail(PROTOCOL_ERROR, "PING on a stream")
            if len(payload) != 8:
                return self.fail(FRAME_SIZE_ERROR, "a PING that is not 8 bytes")
            if not flags & ACK:
                if not self.control.take():
                    return self._calm("PING")
                self.out.append(frame(PING, ACK, 0, payload))
        elif ftype == RST_STREAM:
            if sid == 0:
                return self.fail(PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:
                return self.fail(FRAME_SIZE_ERROR, "a RST_STREAM that is not 4 bytes")
            call = self.calls.get(sid)
            if call is None:
                if sid > self.last_sid:
                    return self.fail(PROTOCOL_ERROR, f"RST_STREAM on stream {sid}, which was never opened")
                return
            if not call.over and not (self.resets.take() and self.server.resets.take()):
                return self._calm("RST_STREAM (calls reset as they start)")  # rapid reset: work started, thrown away
            call.reset(grpc.StatusCode.CANCELLED, "the client cancelled the call", None)
        elif ftype == GOAWAY:
            if sid != 0:
                return self.fail(PROTOCOL_ERROR, "GOAWAY on a stream")
            # the client will open no more streams; those open carry on
        elif ftype == PUSH_PROMISE:
            return self.fail(PROTOCOL_ERROR, "a PUSH_PROMISE from a client")
        elif ftype == PRIORITY:
            if sid == 0:
                return self.fail(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if not self.control.take():
                return self._calm("PRIORITY")
            if len(payload) != 5:
                self._stream_error(sid, FRAME_SIZE_ERROR)
        elif not self.control.take():  # frame types we do not know: ignored, as HTTP/2 says (within the bucket)
            return self._calm(f"frames of type {ftype}")

    def _calm(self, what: str) -> None:
        self.fail(ENHANCE_YOUR_CALM, f"{what} faster than {self.limits.control_rate:g} a second after a burst "
                  f"of {self.limits.control_burst}" if what != "RST_STREAM (calls reset as they start)" else
                  f"{what} faster than {self.limits.reset_rate:g} a second after a burst of {self.limits.reset_burst}")

    def _stream_error(self, sid: int, code: int) -> None:
        """RFC 9113's stream error: RST_STREAM with `code` (the call, if any, ends)."""
        call = self.calls.get(sid)
        if call is not None:
            call.reset(grpc.StatusCode.INTERNAL, f"HTTP/2 stream error {code}", code)
        else:
            self.out.append(frame(RST_STREAM, 0, sid, _U32.pack(code)))

    def _data(self, flags: int, sid: int, payload: bytes) -> None:
        n = len(payload)
        self.recv_window -= n
        if self.recv_window < 0:
            return self.fail(FLOW_CONTROL_ERROR, f"DATA past the connection's window ({-self.recv_window} bytes over)")
        if flags & PADDED:
            if not payload or payload[0] >= n:
                return self.fail(PROTOCOL_ERROR, "DATA padded past its end")
            payload = payload[1:n - payload[0]]
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_sid or sid == 0:
                return self.fail(PROTOCOL_ERROR, f"DATA on stream {sid}, which is not open")
            return self._topup(None)  # a call that is already over (its stream reset or answered): dropped
        if call.remote_closed:
            return self._stream_error(sid, STREAM_CLOSED)
        call.recv_window -= n
        if call.recv_window < 0:
            return self._stream_error(sid, FLOW_CONTROL_ERROR)
        if not payload and not flags & END_STREAM and not self.control.take():
            return self._calm("empty DATA frames")
        if not call.over:
            call.message(payload)
        self._topup(call)
        if flags & END_STREAM:
            call.end_of_requests()

    def _topup(self, call: Call | None) -> None:
        """Open the windows again for what was handed over: each back to its size less what is held."""
        inc = WINDOW - self.held - self.recv_window
        if inc >= WINDOW // 2:
            self.out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(inc)))
            self.recv_window += inc
        if call is not None and not call.over:
            inc = self.stream_window - call.held - call.recv_window
            if inc >= self.stream_window // 2:
                self.out.append(frame(WINDOW_UPDATE, 0, call.sid, _U32.pack(inc)))
                call.recv_window += inc

    def progress(self, call: Call, need: int) -> None:
        """A partial message needs `need` more bytes: let them come, past the stream's usual window (the
        message limit bounds it), past the connection's only within `conn_buffered`."""
        if call.recv_window < need:
            inc = need - call.recv_window
            self.out.append(frame(WINDOW_UPDATE, 0, call.sid, _U32.pack(inc)))
            call.recv_window += inc
        if self.recv_window < need and self.held + need <= self.conn_buffered:
            inc = need - self.recv_window
            self.out.append(frame(WINDOW_UPDATE, 0, 0, _U32.pack(inc)))
            self.recv_window += inc

    def release(self, call: Call, n: int) -> None:
        """A streaming handler took a request: its bytes are consumed."""
        call.held -= n
        self.held -= n
        if not self.closed:
            self._topup(call)
            if self.out:
                self.write_soon()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            return self.fail(FRAME_SIZE_ERROR, "a WINDOW_UPDATE that is not 4 bytes")
        inc = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                return self.fail(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            if self.window + inc > MAX_WINDOW:
                return self.fail(FLOW_CONTROL_ERROR, "the connection's window over 2^31 - 1")
            self.window += inc
            if self.blocked:
                self.progress_at = time.monotonic()
                self._unblock()
            return
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_sid:
                return self.fail(PROTOCOL_ERROR, f"WINDOW_UPDATE on stream {sid}, which was never opened")
            return
        if inc == 0:
            return self._stream_error(sid, PROTOCOL_ERROR)
        if self.peer_initial + call.window_off + inc > MAX_WINDOW:
            return self._stream_error(sid, FLOW_CONTROL_ERROR)
        call.window_off += inc
        if call.queued:
            self.progress_at = time.monotonic()
            self.flush(call)

    def _unblock(self) -> None:
        """Send what waited for the connection's window, in order, as far as it goes now: each call
        visited sends something or moves to `starved`, so the walk costs what it sends."""
        for call in list(self.blocked.values()):
            if self.window <= 0 or self.paused:
                break
            self.flush(call)

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid != 0:
            return self.fail(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                return self.fail(FRAME_SIZE_ERROR, "a SETTINGS acknowledgement with a payload")
            return
        if len(payload) % 6:
            return self.fail(FRAME_SIZE_ERROR, "a SETTINGS frame that is not 6-byte entries")
        if len(payload) > 6 * MAX_SETTINGS:
            return self.fail(ENHANCE_YOUR_CALM, f"over {MAX_SETTINGS} entries in one SETTINGS frame")
        if not self.control.take():
            return self._calm("SETTINGS")
        initial = None
        for i in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HL", payload, i)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    return self.fail(FLOW_CONTROL_ERROR, "an initial window over 2^31 - 1")
                initial = value  # only the last one counts
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not DEFAULT_FRAME <= value <= 0xFFFFFF:
                    return self.fail(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
                self.peer_frame = value
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                return self.fail(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
        self.out.append(frame(SETTINGS, ACK, 0))
        if initial is not None and initial != self.peer_initial:
            grew = initial > self.peer_initial
            self.peer_initial = initial  # every stream's window moves with it (window_off is relative)
            if grew and self.starved:
                self.progress_at = time.monotonic()
                for call in list(self.starved.values()):  # bounded by the calls waiting, and by the rate limit
                    if self.window <= 0 or self.paused:
                        break
                    self.flush(call)

    def _headers(self, sid: int, block: bytes, ends_stream: bool) -> None:
        try:
            headers = self._decoder.decode(block, raw=True)
        except hpack.OversizedHeaderListError:
            return self.fail(ENHANCE_YOUR_CALM, f"a header list over {self.limits.max_header_list} bytes decoded")
        except Exception as e:  # hpack's errors: the connection's header state is lost
            return self.fail(COMPRESSION_ERROR, f"a header block that does not decode ({e!r})")
        call = self.calls.get(sid)
        if call is not None:  # trailers from the client: only END_STREAM means anything
            if ends_stream:
                call.end_of_requests()
            return
        if sid % 2 == 0:
            return self.fail(PROTOCOL_ERROR, f"a client opened the even stream {sid}")
        if sid <= self.last_sid:
            if any(k[:1] == b":" for k, _ in headers):
                return self.fail(PROTOCOL_ERROR, f"a request on stream {sid}, not above the last opened {self.last_sid}")
            return  # trailers of a call already over: nothing to do
        self.last_sid = sid
        if self.going_away:
            self.out.append(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))  # safe to retry elsewhere
            return
        if problem := request_error(headers):
            log.info("tulip: a malformed request from %s: %s", self.peer, problem)
            if not self.control.take():
                return self._calm("malformed requests")
            self.out.append(frame(RST_STREAM, 0, sid, _U32.pack(PROTOCOL_ERROR)))
            return
        h = dict(headers)
        path = h[b":path"].decode("latin-1")
        ctype = h.get(b"content-type", b"")
        if h[b":method"] != b"POST" or not (ctype == b"application/grpc" or ctype.startswith(b"application/grpc+")
                                           or ctype.startswith(b"application/grpc;")):
            if not self.control.take():
                return self._calm("requests that are not gRPC")
            status = b"405" if h[b":method"] != b"POST" else b"415"
            self.out.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, _literal(b":status", status)
                                  + _literal(b"content-type", b"text/plain")))
            return
        if len(self.calls) >= self.limits.max_streams or self.queued_out > self.conn_output // 4:
            # (past a quarter of conn_output waiting for this peer: a client that does not take its
            # answers gets no new work done; REFUSED_STREAM is safe to retry)
            if not self.control.take():
                return self._calm("streams over SETTINGS_MAX_CONCURRENT_STREAMS")
            self.out.append(frame(RST_STREAM, 0, sid, _U32.pack(REFUSED_STREAM)))
            return
        self._opened += 1
        if self._opened >= OPEN_PER_TURN:
            self._later = True
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
                seconds = parse_timeout(t)
                if seconds is None:
                    call.finish(grpc.StatusCode.INVALID_ARGUMENT, f"malformed grpc-timeout {t.decode('latin-1')!r} "
                                "(1 to 8 digits and one of H M S m u n)")
                else:
                    call.deadline = time.monotonic() + seconds
                    call._timer = self.loop.call_later(seconds, call._expire)
            if not call.over and handler.request_streaming:
                if type(handler) is not Direct:
                    call.requests = Requests(call)
                call.start(None)
        if ends_stream:
            call.end_of_requests()

    # --- writing ---------------------------------------------------------------------------------

    def flush(self, call: Call) -> None:
        """Send what `call` has queued as far as the windows (and the transport) let it; its trailers
        once all is out."""
        queued, out = call.queued, self.out
        while queued:
            stream = self.peer_initial + call.window_off
            room = min(self.window, stream, self.peer_frame)
            if room <= 0 or self.paused:
                if not self.blocked and not self.starved and not self.paused:
                    self.progress_at = time.monotonic()
                if stream <= 0 and not self.paused:
                    self.blocked.pop(call.sid, None)
                    self.starved[call.sid] = call
                else:
                    self.starved.pop(call.sid, None)
                    self.blocked[call.sid] = call
                return
            view = queued[0]
            part = view[:room]
            out.append(frame(DATA, 0, call.sid, bytes(part)))
            sent = len(part)
            self.window -= sent
            call.window_off -= sent
            call.queued_bytes -= sent
            self.queued_out -= sent
            if len(view) <= room:
                queued.popleft()
            else:
                queued[0] = view[room:]
        self.blocked.pop(call.sid, None)
        self.starved.pop(call.sid, None)
        if call.queued_bytes <= WRITE_HIGH:
            call._wake_writer()
        if call.trailers is not None:
            out.append(call.trailers)
            call.closed_out()

    def forget(self, call: Call) -> None:
        if self.calls.get(call.sid) is call:
            del self.calls[call.sid]
            self.blocked.pop(call.sid, None)
            self.starved.pop(call.sid, None)
            call.drop_input()
            call.run_callbacks()
            if not self.calls:
                self.idle_since = time.monotonic()
                if self.going_away:
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
    """The gRPC server: grpcio's method handlers on asyncio listeners (`listen`), each peer held to
    `limits`."""

    def __init__(self, max_message: int = 4 << 20, limits: Limits = Limits()):
        self.max_message = max_message
        self.limits = limits
        self.settings_frame = frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", k, v) for k, v in (
            (SETTINGS_MAX_CONCURRENT_STREAMS, limits.max_streams), (SETTINGS_INITIAL_WINDOW_SIZE, limits.stream_buffered),
            (SETTINGS_MAX_FRAME_SIZE, MAX_FRAME), (SETTINGS_MAX_HEADER_LIST_SIZE, limits.max_header_list)))
        ) + frame(WINDOW_UPDATE, 0, 0, _U32.pack(WINDOW - DEFAULT_WINDOW))
        self._generic: list = []
        self._paths: dict[str, Any] = {}
        self._cache: dict[str, Any] = {}
        self._listeners: list[asyncio.AbstractServer] = []
        self.connections: set[Connection] = set()
        self.stopping = False
        self.refused = 0  # connections closed at once for the cap
        self.resets = Bucket(limits.reset_burst, limits.reset_rate)  # client resets over all connections
        self._refused_told = 0
        self._idle: asyncio.Event | None = None
        self._ticker: asyncio.TimerHandle | None = None

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
        """Listen on TCP HOST:PORT (0: a free port); returns the port. The first listener raises the
        process's open-file limit to its hard limit (room for `limits.max_connections`)."""
        global _nofile_raised
        if not _nofile_raised:
            _nofile_raised = True
            raise_nofile_limit()
        srv = await asyncio.get_running_loop().create_server(lambda: Connection(self), host, port,
                                                             reuse_address=True)
        self._listeners.append(srv)
        return srv.sockets[0].getsockname()[1]

    async def listen_unix(self, path: str) -> None:
        srv = await asyncio.get_running_loop().create_unix_server(lambda: Connection(self), path)
        self._listeners.append(srv)

    def watch(self) -> None:
        """Keep the deadline tick running while there are connections."""
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().call_later(TICK_S, self._tick)

    def _tick(self) -> None:
        self._ticker = None
        now = time.monotonic()
        for conn in list(self.connections):
            conn.tick(now)
        if self.refused != self._refused_told:
            log.warning("tulip: %d connections closed at once: over the cap of %d open",
                        self.refused - self._refused_told, self.limits.max_connections)
            self._refused_told = self.refused
        if self.connections:
            self.watch()

    def _calls(self) -> int:
        return sum(len(c.calls) for c in self.connections)

    def call_over(self) -> None:
        if self._idle is not None and not self._calls():
            self._idle.set()

    async def stop(self, grace: float | None) -> None:
        """Stop listening, GOAWAY every connection; server-streaming grpcio handlers (one request, replies
        until the client leaves) that are only waiting (not in a write: health Watch) end at once UNAVAILABLE; the other calls in flight get `grace`
        seconds to finish, then they are cancelled and the connections closed."""
        self.stopping = True
        for srv in self._listeners:
            srv.close()
        for conn in list(self.connections):
            conn.go_away()
        self._idle = asyncio.Event()
        if self._calls():
            await asyncio.sleep(0.05)  # a Watch told NOT_SERVING just before writes it first
            for conn in list(self.connections):
                for call in list(conn.calls.values()):
                    h = call.handler
                    if (h is not None and type(h) is not Direct and h.response_streaming and not h.request_streaming
                            and not call.writing and not call.over):
                        call.finish(grpc.StatusCode.UNAVAILABLE, "the server is stopping")
                        call._halt()
        if self._calls():
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:
                pass
        for conn in list(self.connections):
            for call in list(conn.calls.values()):
                call.reset(grpc.StatusCode.UNAVAILABLE, "the server stopped", 8)
            conn._close_when_sent()
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for srv in self._listeners:
            await srv.wait_closed()

"""The frames of one Tulip HTTP/2 connection (`tulip.h2conn.Connection`, the server's side of
`trellis.h2frames`' framing): each frame the client sends dispatched (HEADERS and CONTINUATION into
header blocks and new calls, DATA into calls, SETTINGS, PING, RST_STREAM, WINDOW_UPDATE, PRIORITY),
RFC 9113's connection and stream errors, the control-frame and reset buckets, calls opened per loop
turn, and flow control both ways: our windows opened again only for what was consumed (`topup`,
`progress`, `release`), replies sent as the peer's windows allow (`flush`, `unblock`).

`Framing` is a base class of `Connection`, not an object of its own: the hot path (a frame in, a reply
out) stays one method call on the connection, as it was when both were one class. It owns the state
`__init__` sets here; the connection's lifecycle (`tulip.h2conn`) owns the rest."""

from __future__ import annotations

import logging
import struct
import time

import grpc
import hpack

from tulip.h2call import WRITE_HIGH, Call, Direct, Requests
from tulip.h2limits import (COMPRESSION_ERROR, ENHANCE_YOUR_CALM, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, MAX_WINDOW,
                            PROTOCOL_ERROR, REFUSED_STREAM, STREAM_CLOSED, Bucket, parse_timeout, request_error)
from trellis.h2frames import (ACK, CONTINUATION, DATA, DEFAULT_FRAME, DEFAULT_WINDOW, END_HEADERS, END_STREAM, GOAWAY,
                              HEADERS, MAX_FRAME, PADDED, PING, PRIORITY, PRIORITY_FLAG, PUSH_PROMISE, RST_STREAM,
                              SETTINGS, SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE,
                              WINDOW, WINDOW_UPDATE, frame)
from trellis.h2frames import PREFIX, U32, literal

log = logging.getLogger("tulip.h2server")

MAX_SETTINGS = 64  # entries in one SETTINGS frame (nghttp2: 32); more is ENHANCE_YOUR_CALM
OPEN_PER_TURN = 32  # calls one connection may open per event-loop turn: the rest of what it sent waits for the
# next turn, so other connections (and the engine loop's callbacks) are served between (grpc-core's
# max_requests_per_read, its rapid-reset mitigation, is the same idea)


class Framing:
    """A connection's frames and flow control (a base class of `tulip.h2conn.Connection`, whose
    `__init__` sets `server`, `limits`, `loop`, `calls`, `out` and the lifecycle's state first)."""

    def __init__(self, server):
        limits = server.limits
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
        self.call_output = max(limits.call_output, server.max_message + PREFIX)
        self.conn_output = max(limits.conn_output, server.max_message + PREFIX)
        # receiving: our windows are opened again only for bytes handed over (`held`: not yet)
        self.stream_window = limits.stream_buffered
        self.recv_window = WINDOW  # what the peer may still send on the connection
        self.held = 0
        self.conn_buffered = max(limits.conn_buffered, server.max_message + PREFIX + MAX_FRAME)
        self.partial: dict[int, Call] = {}  # calls holding a partial message
        self._data_left = 0  # bytes of the DATA frame being read still to come (`data_begin`)
        self._data_call: Call | None = None  # ... the call they go to (None: dropped)
        self._data_end = 0  # ... whether it ends the stream
        self.control = Bucket(limits.control_burst, limits.control_rate)
        self.resets = Bucket(limits.reset_burst, limits.reset_rate)

    def on_frame(self, ftype: int, flags: int, sid: int, payload: bytes) -> None:
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
            self.out.append(frame(RST_STREAM, 0, sid, U32.pack(code)))

    def _data(self, flags: int, sid: int, payload) -> None:
        """A whole DATA frame (its payload bytes, or a view of the socket's read when big). (The checks of
        `data_begin` and the steps of `data_bytes` inline: this is every request's path.)"""
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
            return self.topup(None)  # a call that is already over (its stream reset or answered): dropped
        if call.remote_closed:
            return self._stream_error(sid, STREAM_CLOSED)
        call.recv_window -= n
        if call.recv_window < 0:
            return self._stream_error(sid, FLOW_CONTROL_ERROR)
        if not payload and not flags & END_STREAM and not self.control.take():
            return self._calm("empty DATA frames")
        if not call.over:
            call.message(payload)
        self.topup(call)
        if flags & END_STREAM:
            call.end_of_requests()

    def data_begin(self, flags: int, sid: int, n: int) -> None:
        """A DATA frame of `n` bytes (padding included) begins: what its header tells (the windows, the
        stream); its payload follows through `data_bytes`, whole or as the socket's reads bring it."""
        if self._block_open:  # (on_frame says so for whole frames; a frame read in parts comes here first)
            return self.fail(PROTOCOL_ERROR, "a header block without its CONTINUATION")
        if n > self.recv_window:
            return self.fail(FLOW_CONTROL_ERROR, f"DATA past the connection's window ({n - self.recv_window} bytes over)")
        call = self.calls.get(sid)
        if call is None:
            if sid > self.last_sid or sid == 0:
                return self.fail(PROTOCOL_ERROR, f"DATA on stream {sid}, which is not open")
            # a call that is already over (its stream reset or answered): its bytes are dropped
        elif call.remote_closed:
            self._stream_error(sid, STREAM_CLOSED)
            call = None
        elif call.recv_window < n:
            self._stream_error(sid, FLOW_CONTROL_ERROR)
            call = None
        self._data_left, self._data_call, self._data_end = n, call, flags & END_STREAM

    def data_bytes(self, payload, n: int = 0) -> None:
        """Bytes of the DATA frame `data_begin` began (`n`: what they count against the windows, padding
        included; 0: their length), to its call; the call's END_STREAM once the frame is all here."""
        n = n or len(payload)
        self.recv_window -= n
        self._data_left -= n
        call = self._data_call
        if call is not None:
            call.recv_window -= n
            if not call.over:
                call.message(payload)
        self.topup(call)
        if not self._data_left:
            self._data_call = None
            if call is not None and self._data_end:
                call.end_of_requests()

    def topup(self, call: Call | None) -> None:
        """Open the windows again for what was handed over: each back to its size less what is held."""
        inc = WINDOW - self.held - self.recv_window
        if inc >= WINDOW // 2:
            self.out.append(frame(WINDOW_UPDATE, 0, 0, U32.pack(inc)))
            self.recv_window += inc
        if call is not None and not call.over:
            inc = self.stream_window - call.held - call.recv_window
            if inc >= self.stream_window // 2:
                self.out.append(frame(WINDOW_UPDATE, 0, call.sid, U32.pack(inc)))
                call.recv_window += inc

    def progress(self, call: Call, need: int) -> None:
        """A partial message needs `need` more bytes: let them come, past the stream's usual window (the
        message limit bounds it), past the connection's only within `conn_buffered`."""
        if call.recv_window < need:
            inc = need - call.recv_window
            self.out.append(frame(WINDOW_UPDATE, 0, call.sid, U32.pack(inc)))
            call.recv_window += inc
        if self.recv_window < need and self.held + need <= self.conn_buffered:
            inc = need - self.recv_window
            self.out.append(frame(WINDOW_UPDATE, 0, 0, U32.pack(inc)))
            self.recv_window += inc

    def release(self, call: Call, n: int) -> None:
        """A streaming handler took a request: its bytes are consumed."""
        call.held -= n
        self.held -= n
        if not self.closed:
            self.topup(call)
            if self.out:
                self.write_soon()

    def _window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            return self.fail(FRAME_SIZE_ERROR, "a WINDOW_UPDATE that is not 4 bytes")
        inc = U32.unpack(payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if inc == 0:
                return self.fail(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            if self.window + inc > MAX_WINDOW:
                return self.fail(FLOW_CONTROL_ERROR, "the connection's window over 2^31 - 1")
            self.window += inc
            if self.blocked:
                self.progress_at = time.monotonic()
                self.unblock()
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

    def unblock(self) -> None:
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
            self.out.append(frame(RST_STREAM, 0, sid, U32.pack(REFUSED_STREAM)))  # safe to retry elsewhere
            return
        if problem := request_error(headers):
            log.info("tulip: a malformed request from %s: %s", self.peer, problem)
            if not self.control.take():
                return self._calm("malformed requests")
            self.out.append(frame(RST_STREAM, 0, sid, U32.pack(PROTOCOL_ERROR)))
            return
        h = dict(headers)
        path = h[b":path"].decode("latin-1")
        ctype = h.get(b"content-type", b"")
        if h[b":method"] != b"POST" or not (ctype == b"application/grpc" or ctype.startswith(b"application/grpc+")
                                           or ctype.startswith(b"application/grpc;")):
            if not self.control.take():
                return self._calm("requests that are not gRPC")
            status = b"405" if h[b":method"] != b"POST" else b"415"
            self.out.append(frame(HEADERS, END_HEADERS | END_STREAM, sid, literal(b":status", status)
                                  + literal(b"content-type", b"text/plain")))
            return
        if len(self.calls) >= self.limits.max_streams or self.queued_out > self.conn_output // 4:
            # (past a quarter of conn_output waiting for this peer: a client that does not take its
            # answers gets no new work done; REFUSED_STREAM is safe to retry)
            if not self.control.take():
                return self._calm("streams over SETTINGS_MAX_CONCURRENT_STREAMS")
            self.out.append(frame(RST_STREAM, 0, sid, U32.pack(REFUSED_STREAM)))
            return
        self.opened += 1
        if self.opened >= OPEN_PER_TURN:
            self.later = True
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
        if self.stalled and queued and not self.paused and min(self.window, self.peer_initial + call.window_off) > 0:
            self.moved()  # bytes go now: the peer reads again
        while queued:
            stream = self.peer_initial + call.window_off
            room = min(self.window, stream, self.peer_frame)
            if room <= 0 or self.paused:
                began = not self.blocked and not self.starved and not self.paused
                if began:
                    self.progress_at = time.monotonic()
                if stream <= 0 and not self.paused:
                    self.blocked.pop(call.sid, None)
                    self.starved[call.sid] = call
                else:
                    self.starved.pop(call.sid, None)
                    self.blocked[call.sid] = call
                if began:
                    self.waiting()
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

"""One client connection of Tulip's HTTP/2 server (`tulip.h2server.Server` makes one per socket), its
lifecycle: made (the connection cap), the client's preface (HTTP/1.1 on the port answered in plain
text), reading paused while writes are and resumed a turn later when a turn opened its quota of
calls, the deadlines (preface, idle, a peer that takes no replies, stale partial messages), GOAWAY
(a connection error's, a graceful one's), close, and what a turn queued written as one write. Its
frames and flow control are `tulip.h2flow.Framing`'s, a base class: the same object."""

from __future__ import annotations

import asyncio
import logging
import struct
import time

import grpc

from tulip.h2body import BIG
from tulip.h2call import Call
from tulip.h2flow import Framing
from tulip.h2limits import ENHANCE_YOUR_CALM, FRAME_SIZE_ERROR, NO_ERROR
from trellis.h2frames import DATA, GOAWAY, HEAD, MAX_FRAME, PADDED, frame
from trellis.h2frames import PREFACE

log = logging.getLogger("tulip.h2server")

_HTTP1 = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s")
_HTTP1_BODY = b"this port speaks gRPC (HTTP/2 with prior knowledge); Ivy's HTTP API is on its own port\n"


class Connection(Framing, asyncio.Protocol):
    """One client connection: its HTTP/2 framing and its calls."""

    def __init__(self, server):  # a tulip.h2server.Server
        self.server = server
        self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.closed = False
        self.calls: dict[int, Call] = {}
        self.out: list[bytes] = []
        self._write_pending = False
        self._buf = b""
        self._preface = True  # the client's preface not yet checked
        self.paused = False  # the transport is above its write high-water mark
        self._reading = True
        self.progress_at = 0.0  # when output last moved (or began to wait), while some waits
        self._buffered = 0  # the transport's write buffer at the last tick (paused: it shrinks if the peer reads)
        self.stalled = False  # replies waited `hold_s` with no byte sent: its sessions' work is held
        self._hold_timer: asyncio.TimerHandle | None = None
        self.last_sid = 0  # the highest stream the client opened
        self.going_away = False
        self.made_at = self.idle_since = time.monotonic()
        self.opened = 0  # calls opened in this turn
        self.later = False  # stop reading frames now: the rest next turn (OPEN_PER_TURN)
        super().__init__(server)  # Framing's state: header blocks, windows, buckets

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
        began = not self.blocked and not self.starved
        if began:
            self.progress_at = time.monotonic()
        self.paused = True
        self._buffered = self.transport.get_write_buffer_size() if self.transport is not None else 0
        self.reading()
        if began:
            self.waiting()

    def resume_writing(self) -> None:
        self.paused = False
        self.progress_at = time.monotonic()
        if self.stalled:
            self.moved()
        if self.transport is not None and not self.closed:
            self.reading()
            self.unblock()
            self._write()

    # --- holding the work of a peer that takes no replies (Limits.hold_s) ---------------------------

    def waiting(self) -> None:
        """Replies began to wait for the peer (`progress_at` is now): its work is held now (`hold_s` 0),
        or looked at again in `hold_s`."""
        if self._hold_timer is None and not self.stalled and not self.closed:
            if not self.limits.hold_s:
                return self._hold_check()
            self._hold_timer = self.loop.call_later(self.limits.hold_s, self._hold_check)

    def _hold_check(self) -> None:
        self._hold_timer = None
        if self.closed or self.stalled or not (self.paused or self.blocked or self.starved):
            return
        left = self.progress_at + self.limits.hold_s - time.monotonic()
        if left > 0:  # something moved meanwhile: a new wait began then
            self._hold_timer = self.loop.call_later(left, self._hold_check)
            return
        # Why here: the engine computes a call's work long before its reply is due, so a peer that
        # asks for many replies and reads none had all it queued computed until `reply_stall_s`;
        # now its queued work waits (in place) until it reads, and is dropped if it never does.
        self.stalled = True
        log.debug("tulip: holding the work of %s: its replies wait (%d bytes)", self.peer, self.queued_out)
        for call in list(self.calls.values()):
            hold = getattr(call.session, "hold", None)
            if hold is not None:
                hold()

    def moved(self) -> None:
        """Bytes of this stalled connection's replies went out (or none wait any more): its held work
        resumes (the latest call's first, so that each session's requests that reached the front of the
        engine's queue go back there in arrival order)."""
        self.stalled = False
        for call in list(reversed(self.calls.values())):
            resume = getattr(call.session, "resume", None)
            if resume is not None:
                resume()
        if (self.paused or self.blocked or self.starved) and self._hold_timer is None and not self.closed:
            self.progress_at = time.monotonic()  # a new wait, looked at on a later turn (not at once)
            self._hold_timer = self.loop.call_later(self.limits.hold_s, self._hold_check)

    def reading(self) -> None:
        """Read from the peer unless writes are paused (it does not read what we write: it gets to ask
        for nothing more) or what it sent waits for the next turn. (Not while replies wait for its
        flow-control windows: its WINDOW_UPDATEs must still be read.)"""
        want = not (self.paused or self.later)
        if want != self._reading and self.transport is not None and not self.closed:
            self._reading = want
            self.transport.resume_reading() if want else self.transport.pause_reading()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.out.clear()
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
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
                self.loop.call_soon(self.close_when_sent)

    def close_when_sent(self) -> None:
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
                    if self.stalled:
                        self.moved()
                self._buffered = buffered
            if now - self.progress_at > limits.reply_stall_s:
                # the peer takes none of its replies: its calls are cancelled, so the work it queued is
                # dropped rather than computed (Tulip's sessions hear gone() and cancel their requests)
                return self.fail(ENHANCE_YOUR_CALM, f"no byte of its replies could be sent for "
                                 f"{limits.reply_stall_s:g} s ({self.queued_out} bytes wait; its {len(self.calls)} "
                                 "calls are cancelled)", abort=True)
        for call in [c for c in self.partial.values() if now - c.partial_at > limits.stall_s]:
            call.reset_with(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a request message got no bytes for "
                            f"{limits.stall_s:g} s ({call.pending_bytes()} of it came)")
        if self.partial:
            self._write()

    # --- reading ---------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        pos, n, view = 0, len(data), None
        if self._data_left:  # the rest of a DATA frame, to its call as it comes (tulip.h2flow.data_begin)
            view = memoryview(data)
            pos = min(self._data_left, n)
            self.data_bytes(view[:pos])
            if self.closed:
                return
        elif self._buf:
            data, self._buf = self._buf + data, b""
            n = len(data)
        if self._preface:
            if n < len(PREFACE):
                if not PREFACE.startswith(data):
                    return self._not_http2(data)
                self._buf = data
                return
            if not data.startswith(PREFACE):
                return self._not_http2(data)
            self._preface = False
            pos = len(PREFACE)
            # our SETTINGS once the client's preface came (HTTP/1.1 on the port gets a plain answer instead)
            self.out.append(self.server.settings_frame)
        while n - pos >= 9:
            hi, lo, ftype, flags, sid = HEAD.unpack_from(data, pos)
            length = hi << 16 | lo
            if length > MAX_FRAME:
                return self.fail(FRAME_SIZE_ERROR, f"a frame of {length} bytes, over the {MAX_FRAME} allowed")
            end = pos + 9 + length
            if end > n:
                if ftype == DATA and not flags & PADDED:
                    # Why not wait for the whole frame: a big message's frames (up to MAX_FRAME) span many
                    # socket reads; its payload goes to the call read by read, as views, never joined
                    if view is None:
                        view = memoryview(data)
                    self.data_begin(flags, sid & 0x7FFFFFFF, length)
                    if not self.closed and n > pos + 9:
                        self.data_bytes(view[pos + 9:])
                    if self.closed:
                        return
                    pos = n
                break
            if ftype == DATA and length >= BIG:  # a big payload as a view of the read (the call copies what it keeps)
                if view is None:
                    view = memoryview(data)
                self.on_frame(DATA, flags, sid & 0x7FFFFFFF, view[pos + 9:end])
            else:
                self.on_frame(ftype, flags, sid & 0x7FFFFFFF, data[pos + 9:end])
            pos = end
            if self.closed:
                return
            if self.later:
                self.reading()
                self.loop.call_soon(self._next_turn)
                break
        if pos < n:
            self._buf = data[pos:]
        self._write()

    def _next_turn(self) -> None:
        self.later, self.opened = False, 0
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

    def forget(self, call: Call) -> None:
        if self.calls.get(call.sid) is call:
            del self.calls[call.sid]
            self.blocked.pop(call.sid, None)
            self.starved.pop(call.sid, None)
            call.drop_input()
            call.run_callbacks()
            if self.stalled and not (self.paused or self.blocked or self.starved):
                self.moved()  # nothing waits for the peer any more
            if not self.calls:
                self.idle_since = time.monotonic()
                if self.going_away:
                    self.loop.call_soon(self.close_when_sent)
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

"""What tulip.h2server holds a hostile HTTP/2 peer to (issue 47, faults 1-8): the limits as one
frozen dataclass with their defaults, the token bucket that rate-limits control frames and client
resets, and the request-header checks RFC 9113 requires (8.2, 8.3).

Why hand-written: the server's framing is our own (tulip.h2server says why), so the limits that a
library such as nghttp2 or grpc-core applies inside its framing have to be applied here; the
figures follow theirs where they have one (docs/reliability.md, "Tulip's HTTP/2 server")."""

from __future__ import annotations

import re
import resource
import time
from dataclasses import dataclass

# HTTP/2 error codes (RFC 9113, 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = 0x5, 0x6, 0x7, 0x8
COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x9, 0xB
MAX_WINDOW = 0x7FFFFFFF  # 2^31 - 1: no flow-control window may exceed it (RFC 9113, 6.9.1)


@dataclass(frozen=True)
class Limits:
    """The bounds a `tulip.h2server.Server` keeps each peer within (defaults in docs/reliability.md)."""

    max_header_block: int = 64 << 10
    """Bytes of one header block as sent (HEADERS plus its CONTINUATIONs, compressed); over it the
    connection is closed (GOAWAY ENHANCE_YOUR_CALM): the CONTINUATION flood."""
    max_header_list: int = 64 << 10
    """Decoded size of one header list (RFC 7541's measure: name + value + 32 a field), advertised as
    SETTINGS_MAX_HEADER_LIST_SIZE and enforced while decoding (an HPACK bomb: GOAWAY ENHANCE_YOUR_CALM)."""
    max_continuations: int = 32
    """CONTINUATION frames after one HEADERS frame (nghttp2: 8, h2: 64)."""
    max_streams: int = 1000
    """Concurrent calls per connection (SETTINGS_MAX_CONCURRENT_STREAMS; more are REFUSED_STREAM)."""
    conn_buffered: int = 32 << 20
    """Request bytes one connection may have received and not yet handed over (partial messages,
    messages a streaming handler has not read), at least the message limit plus a frame: flow-control
    windows are opened for bytes consumed, and beyond this for nothing else."""
    stream_buffered: int = 16 << 20
    """The same for one call (our stream window), stretched to let one announced message complete
    (at most the message limit)."""
    call_output: int = 16 << 20
    """Reply bytes one call may have waiting for the peer (its window, or a transport that is not
    draining), at least one message of the limit; over it the call is reset ENHANCE_YOUR_CALM
    (grpc clients: RESOURCE_EXHAUSTED)."""
    conn_output: int = 64 << 20
    """The same summed over one connection's calls (at least one message of the limit); past a quarter
    of it the peer's new calls are refused (REFUSED_STREAM: no new work for a client that does not
    take its answers)."""
    write_high: int = 1 << 20
    """The transport's write high-water mark: above it writes pause (no more DATA is written, and no
    more is read from the peer) until it drains under a quarter of it."""
    stall_s: float = 20.0
    """A partial request message that got no byte for this long is dropped (RESOURCE_EXHAUSTED)."""
    hold_s: float = 0.0
    """A connection whose replies have waited this long with not one byte of them sent (the measure of
    `reply_stall_s`; 0: as soon as one cannot go) stops getting work done: its Direct sessions are told
    `hold()` (Tulip's take their queued requests out of the engine's batching, in place, and queue new
    ones held) and `resume()` once a byte moves; closed at `reply_stall_s`, the held work is dropped,
    never computed. A peer that reads takes its replies within a round trip (grpcio's windows and
    Ivy's 16 MiB ones are not even reached: its work is never held); one that does not gets the steps
    already formed when its first reply could not go (before: everything it queued, until
    `reply_stall_s`)."""
    reply_stall_s: float = 5.0
    """A connection whose replies have waited this long with not one byte of them sent (writes paused:
    the peer does not read its socket; or calls waiting for a flow-control window with no WINDOW_UPDATE
    that let anything go) gets GOAWAY ENHANCE_YOUR_CALM and is closed, every call on it cancelled, so
    the work it queued is dropped, not computed for a peer that will not take it. A peer that reads
    (Ivy: 16 MiB windows, topped up at half) moves bytes every round trip. (Go's http2 Server
    WriteByteTimeout is the same measure, off by default; nghttpx --frontend-write-timeout: 30 s;
    grpc-core has none short of keepalive, 2 h on servers: ours is short because each call here is
    engine work done for the peer.)"""
    control_burst: int = 1000
    """Control frames a connection may send at once that make us write or work (PING, SETTINGS,
    PRIORITY, empty DATA, unknown types, requests refused at once); beyond the bucket GOAWAY
    ENHANCE_YOUR_CALM (nghttp2: 1000 queued acknowledgements)."""
    control_rate: float = 200.0
    """... refilled at this many a second."""
    reset_burst: int = 1000
    """Calls a client may reset (RST_STREAM on a call not yet over) at once: rapid reset
    (CVE-2023-44487); beyond the bucket GOAWAY ENHANCE_YOUR_CALM (nghttp2: 1000, then 33 a second).
    One bucket per connection and one over all the server's connections (a client that reconnects
    after each GOAWAY gets no new budget)."""
    reset_rate: float = 100.0
    """... refilled at this many a second."""
    preface_timeout_s: float = 10.0
    """A connection that has not sent HTTP/2's preface within this is closed."""
    idle_timeout_s: float = 300.0
    """A connection with no call for this long gets a graceful GOAWAY and is closed (0: never)."""
    max_connections: int = 1000
    """Open connections per server; one more is closed as soon as it is accepted."""

    def __post_init__(self):
        for name in ("max_header_block", "max_header_list", "max_streams", "conn_buffered", "stream_buffered",
                     "call_output", "conn_output", "write_high", "control_burst", "reset_burst", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"Limits.{name} {getattr(self, name)} must be >= 1")
        for name in ("stall_s", "reply_stall_s", "control_rate", "reset_rate", "preface_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Limits.{name} {getattr(self, name)} must be > 0")
        if self.hold_s < 0:
            raise ValueError(f"Limits.hold_s {self.hold_s} must be >= 0")
        if self.max_continuations < 0 or self.idle_timeout_s < 0:
            raise ValueError(f"Limits: max_continuations {self.max_continuations} and idle_timeout_s "
                             f"{self.idle_timeout_s} must be >= 0")


class Bucket:
    """A token bucket, refilled lazily: `take()` costs one float decrement until it runs dry."""

    __slots__ = ("tokens", "burst", "rate", "at")

    def __init__(self, burst: int, rate: float):
        self.tokens, self.burst, self.rate, self.at = float(burst), burst, rate, time.monotonic()

    def take(self) -> bool:
        self.tokens -= 1
        if self.tokens >= 0:
            return True
        now = time.monotonic()  # dry: add what accrued since the last refill (at most the burst)
        self.tokens = min(self.burst - 1.0, self.tokens + (now - self.at) * self.rate)
        self.at = now
        return self.tokens >= 0


_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))
# connection-specific fields are malformed in HTTP/2 (RFC 9113, 8.2.2); te only as "trailers"
_CONNECTION = frozenset((b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"))
_UPPER = re.compile(rb"[A-Z]")


def request_error(headers: list) -> str:
    """Why a request's header list is malformed (RFC 9113, 8.2 / 8.3.1), or "" when it is not."""
    seen, regular = set(), False
    for k, v in headers:
        if k[:1] == b":":
            if regular or k not in _PSEUDO or k in seen:
                return f"pseudo-header {k.decode('latin-1')!r} out of place, unknown or repeated"
            seen.add(k)
        else:
            regular = True
            if k in _CONNECTION or (k == b"te" and v != b"trailers"):
                return f"connection-specific header {k.decode('latin-1')!r}"
    if not {b":method", b":scheme", b":path"} <= seen:
        return "a request without :method, :scheme and :path"
    if _UPPER.search(b"\0".join(k for k, _ in headers)):
        return "an upper-case header name"
    return ""


def raise_nofile_limit() -> int:
    """Raise this process's open-file soft limit to its hard limit (each connection is a descriptor:
    the connection cap is what bounds them, this makes room for it); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(value: bytes) -> float | None:
    """grpc-timeout (1 to 8 digits and a unit) in seconds; None when malformed."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    if unit is None or not value[:-1].isdigit() or len(value) > 9:
        return None
    return int(value[:-1]) * unit

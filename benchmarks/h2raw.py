"""A raw HTTP/2 client for attacking and conformance-testing a gRPC server: frames as bytes over a
plain socket (no HTTP/2 library in the way, so it can send what a library would refuse to), with
readers for what the server answers (GOAWAY and its code, RST_STREAM, a call's grpc-status).

Used by tests/test_h2attacks.py and benchmarks/h2attacks.py."""

from __future__ import annotations

import socket
import struct
import time
import urllib.parse

import hpack

from trellis.h2frames import (ACK, CONTINUATION, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, PING, PREFACE,
                              RST_STREAM, SETTINGS, WINDOW_UPDATE, frame, frames, literal)

__all__ = ["RawH2", "frame", "request_block", "grpc_message"]


def grpc_message(msg: bytes, declared: int | None = None) -> bytes:
    """gRPC's 5-byte prefix (uncompressed) and `msg`; `declared` lies about the length."""
    return b"\x00" + struct.pack(">L", len(msg) if declared is None else declared) + msg


def request_block(path: str, extra: tuple = (), pseudo: tuple | None = None) -> bytes:
    """A request's header block as never-indexed literals (no HPACK state is involved, so a
    block can be sent on any connection in any order)."""
    fields = pseudo if pseudo is not None else (
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", path.encode()), (b":authority", b"localhost"))
    fields = (*fields, (b"content-type", b"application/grpc"), (b"te", b"trailers"), *extra)
    return b"".join(literal(k, v) for k, v in fields)


class RawH2:
    """One client connection; `frames_until` collects what the server sends."""

    def __init__(self, host: str, port: int, preface: bool = True, settings: bytes = b"", timeout: float = 5.0):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.got: list = []  # (type, flags, stream id, payload) in the order they came
        self.closed = False
        self.decoder = hpack.Decoder()
        if preface:
            self.send(PREFACE + frame(SETTINGS, 0, 0, settings))

    def send(self, data: bytes) -> bool:
        try:
            self.sock.sendall(data)
            return True
        except OSError:
            self.closed = True
            return False

    def headers(self, sid: int, path: str, end_stream: bool = False, extra: tuple = ()) -> bytes:
        return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, request_block(path, extra))

    def call(self, sid: int, path: str, msg: bytes, extra: tuple = ()) -> None:
        """A unary call: HEADERS, one message with END_STREAM."""
        self.send(self.headers(sid, path, extra=extra) + frame(DATA, END_STREAM, sid, grpc_message(msg)))

    def read(self, timeout: float) -> bool:
        """Read what comes within `timeout`; False once the server closed the connection."""
        if self.closed:
            return False
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(1 << 20)
        except (socket.timeout, BlockingIOError):
            return True
        except OSError:
            chunk = b""
        if not chunk:
            self.closed = True
            return False
        data, pos = self.buf + chunk, 0
        for ftype, flags, sid, payload, pos in frames(data):
            self.got.append((ftype, flags, sid, payload))
        self.buf = data[pos:]
        return True

    def frames_until(self, done, timeout: float = 5.0) -> list:
        """Read until `done(frames so far)` or the connection closes or `timeout` passes."""
        end = time.monotonic() + timeout
        while not done(self.got) and time.monotonic() < end:
            if not self.read(min(0.2, max(0.01, end - time.monotonic()))):
                break
        return self.got

    def goaway(self, timeout: float = 5.0) -> int | None:
        """The error code of the server's GOAWAY (None: none came)."""
        got = self.frames_until(lambda fs: any(f[0] == GOAWAY for f in fs), timeout)
        for ftype, _, _, payload in got:
            if ftype == GOAWAY:
                return struct.unpack(">LL", payload[:8])[1]
        return None

    def rst(self, sid: int, timeout: float = 5.0) -> int | None:
        got = self.frames_until(lambda fs: any(f[0] == RST_STREAM and f[2] == sid for f in fs), timeout)
        for ftype, _, s, payload in got:
            if ftype == RST_STREAM and s == sid:
                return struct.unpack(">L", payload)[0]
        return None

    def status(self, sid: int, timeout: float = 5.0) -> tuple[int | None, str]:
        """The call's grpc-status and grpc-message from its trailers (None: no trailers came)."""
        def trailers(fs):
            return [f for f in fs if f[0] in (HEADERS, CONTINUATION) and f[2] == sid and f[1] & END_STREAM]
        self.frames_until(trailers, timeout)
        self.decoder = hpack.Decoder()
        for ftype, flags, s, payload in self.got:
            if ftype == HEADERS and s == sid and flags & END_STREAM:
                h = dict(self.decoder.decode(payload, raw=True))
                if b"grpc-status" in h:
                    return int(h[b"grpc-status"]), urllib.parse.unquote(h.get(b"grpc-message", b"").decode())
        return None, ""

    def outcome(self, sid: int, timeout: float = 3.0) -> tuple:
        """What became of the connection or stream `sid`: ("goaway", code), ("rst", code),
        ("status", grpc code) or ("none", None)."""
        def decided(fs):
            return any(f[0] == GOAWAY or (f[2] == sid and (f[0] == RST_STREAM or (f[0] == HEADERS and f[1] & END_STREAM)))
                       for f in fs)
        self.frames_until(decided, timeout)
        for ftype, flags, s, payload in self.got:
            if ftype == GOAWAY:
                return "goaway", struct.unpack(">LL", payload[:8])[1]
            if s == sid and ftype == RST_STREAM:
                return "rst", struct.unpack(">L", payload)[0]
            if s == sid and ftype == HEADERS and flags & END_STREAM:
                return "status", self.status(sid, 0)[0]
        return "none", None

    def ping(self, data: bytes = b"12345678") -> None:
        self.send(frame(PING, 0, 0, data))

    def ack_settings(self) -> None:
        self.send(frame(SETTINGS, ACK, 0))

    def window_update(self, sid: int, inc: int) -> bytes:
        return frame(WINDOW_UPDATE, 0, sid, struct.pack(">L", inc))

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

"""HTTP/2's frame codec (RFC 9113) as both ends of Tulip's gRPC use it: the client's EmbedStream
(`trellis.h2stream`) and Tulip's server (`tulip.h2server`, `tulip.h2call`).

Why hand-written: the `h2` state machine costs ~85 us of per-frame Python per request (measured
when `trellis.h2stream` was written), most of what our own framing saves over grpc.aio. What is
here is the part both ends share and that holds no connection state: frame types, flags and
settings ids, the frame header's layout, one frame out (`frame`), the whole frames of a buffer in
(`frames`), an HPACK literal header field (`literal`) and error codes' names (`error_name`). Header
blocks in are decoded with `hpack`, by each end.
"""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # the client's connection preface
PREFIX = 5  # gRPC's message prefix: compressed flag, big-endian length
WINDOW = 1 << 24  # the receive window both ends of ours open, per stream and for the connection
MAX_FRAME = 1 << 20  # the largest frame both ends of ours take (fewer frames per big message)
DEFAULT_WINDOW, DEFAULT_FRAME = 65535, 16384  # HTTP/2's initial values until the peer's SETTINGS say otherwise
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x2, 0x4, 0x5
ERRORS = ("NO_ERROR", "PROTOCOL_ERROR", "INTERNAL_ERROR", "FLOW_CONTROL_ERROR", "SETTINGS_TIMEOUT", "STREAM_CLOSED",
          "FRAME_SIZE_ERROR", "REFUSED_STREAM", "CANCEL", "COMPRESSION_ERROR", "CONNECT_ERROR", "ENHANCE_YOUR_CALM",
          "INADEQUATE_SECURITY", "HTTP_1_1_REQUIRED")
HEAD = struct.Struct(">BHBBL")  # a frame header: length (24 bits as 8 + 16), type, flags, stream id
U32 = struct.Struct(">L")


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return HEAD.pack(n >> 16, n & 0xFFFF, ftype, flags, sid) + payload


def frames(data: bytes, pos: int = 0):
    """The whole frames of `data` from `pos`: (type, flags, stream id, payload, where it ends); a
    frame over MAX_FRAME comes as type -1 with its length in place of the flags, and ends it."""
    n = len(data)
    while n - pos >= 9:
        hi, lo, ftype, flags, sid = HEAD.unpack_from(data, pos)
        length = hi << 16 | lo
        end = pos + 9 + length
        if length > MAX_FRAME:
            yield -1, length, 0, b"", end
            return
        if end > n:
            return
        yield ftype, flags, sid & 0x7FFFFFFF, data[pos + 9:end], end
        pos = end


def error_name(code: int) -> str:
    """An HTTP/2 error code's name (RFC 9113, 7), or "error N" for one it does not define."""
    return ERRORS[code] if 0 <= code < len(ERRORS) else f"error {code}"


def literal(name: bytes, value: bytes) -> bytes:
    """An HPACK literal header field, never indexed, no Huffman coding (RFC 7541, 6.2.2)."""
    return b"\x00" + _int7(len(name)) + name + _int7(len(value)) + value


def _int7(n: int) -> bytes:
    if n < 127:
        return bytes([n])
    out, n = [127], n - 127
    while n >= 128:
        out.append((n & 127) | 128)
        n >>= 7
    return bytes([*out, n])

"""Protobuf's varint (its wire format's integer encoding) by hand, for the two places that write or cut
messages around protobuf instead of through it: Tulip's usual reply serialised straight from its rows and its
big image requests' `pixels` cut out as a view (`tulip.messages`), and the client's image request sent with the
caller's pixels after the other fields (`trellis.client`). Why hand-written: protobuf's runtime has no public
varint codec, and going through a message would copy the 38.5 MB of pixels these paths exist to leave in place."""

from __future__ import annotations


def varint(v: int) -> bytes:
    """`v` (>= 0) as a protobuf varint: 7 bits a byte, low first, the high bit set on all but the last."""
    out = bytearray()
    while v > 0x7F:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def read_varint(buf, pos: int, end: int) -> tuple[int, int]:
    """The varint at `buf[pos:end]` (bytes, memoryview: items are ints) and the position after it; (-1, end + 1)
    where it is truncated or over 64 bits."""
    value = shift = 0
    while pos < end:
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            break
    return -1, end + 1

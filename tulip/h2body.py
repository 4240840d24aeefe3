"""One request message's bytes as tulip.h2server receives them (issue 51): the pieces of a message that
spans DATA frames and socket reads, held as views of the bytes the socket gave (no copy on the way in),
put together once when the message is whole (`Pieces.take`); `whole` for a message that came in one frame.

Why: a 38.5 MB image request (256 pictures of 224 x 224) reached the servicer after ~7 copies of
its bytes (partial frames joined read by read, the frame's payload sliced, the message grown in a
bytearray and sliced out of it, twice); each copy of that size is ~33 ms on the 2-core CPU machine
(the page faults of fresh memory), so the copies, not the framing, were the server's share of the
request path. A message is now copied once, into a numpy buffer (numpy asks for huge pages for
large arrays: the same copy costs ~11 ms there), which stays writable, so its pixels reach the
engine as a view of it (tulip.messages.decode_request cuts them out of the message).

Bounds: a piece that is less than half of the socket read it came in is copied (small), so the
bytes held alive are at most about twice the message's bytes received (no view pins a large read
for a few bytes of it); nothing is allocated for the bytes a message announces until they came."""

from __future__ import annotations

import numpy as np

BIG = 64 << 10  # a message of this many bytes or more is handed to Direct handlers as a writable uint8 array
FILL = 1 << 20  # ... and once this much of it came, its buffer is made and what comes is copied in as it comes


def whole(view, direct: bool):
    """A message that came whole (`view`: bytes or a memoryview of a socket read): bytes, or for a Direct
    handler and a big one, a writable uint8 array (one copy either way)."""
    if direct and len(view) >= BIG:
        out = np.empty(len(view), np.uint8)
        memoryview(out)[:] = view
        return out
    return bytes(view)


class Pieces:
    """A message's bytes received so far (`size` of `need`), in order: views and small copies; for a Direct
    handler that takes arrays, once FILL bytes came, the message's own buffer, each piece copied into it as it
    comes (so the socket's reads are let go at once and the next ones reuse their memory: holding 38.5 MB of
    reads made every request fault that much fresh memory in, ~20 ms of the server's ~55 a request on the
    2-core CPU machine)."""

    __slots__ = ("parts", "size", "need", "arrays", "into")

    def __init__(self, need: int, arrays: bool = False):
        self.parts: list = []
        self.size = 0
        self.need = need
        self.arrays = arrays and need >= BIG
        self.into: memoryview | None = None  # the message's buffer, once made

    def add(self, view) -> None:
        """Keep `view` (a memoryview of a socket read, or bytes) as the next piece of the message."""
        into, n = self.into, len(view)
        if into is not None:
            into[self.size:self.size + n] = view
            self.size += n
            return
        if type(view) is memoryview and 2 * n < len(view.obj):
            view = bytes(view)  # a small part of a larger read: copied, so the read can go
        self.parts.append(view)
        self.size += n
        if self.arrays and self.size >= FILL:
            self._fill()

    def _fill(self) -> None:
        """The message's buffer, what came so far copied in. (Made only once FILL bytes of the message came:
        a peer that announces big messages and sends a few bytes of each gets nothing reserved; numpy asks
        for huge pages past 4 MiB, so what is resident is what came, plus at most one such page.)"""
        try:
            out = np.empty(self.need, np.uint8)
        except MemoryError:  # (a strict overcommit policy): the pieces stay views, put together at the end
            self.arrays = False
            return
        dst, at = memoryview(out), 0
        for p in self.parts:
            dst[at:at + len(p)] = p
            at += len(p)
        self.parts, self.into = [out], dst

    def take(self, direct: bool):
        """The whole message: bytes, or for a Direct handler and a big message a writable uint8 array
        (the pieces copied once into it)."""
        parts, self.parts = self.parts, []
        if self.into is not None:
            self.into = None
            return parts[0]
        if len(parts) == 1:
            return whole(parts[0], direct)
        if not direct or self.size < BIG:
            return b"".join(parts)
        out = np.empty(self.size, np.uint8)
        dst, at = memoryview(out), 0
        for p in parts:
            n = len(p)
            dst[at:at + n] = p
            at += n
        return out

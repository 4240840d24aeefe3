"""Ivy's HTTP/1.1 protocol under uvicorn: httptools' (uvicorn's own) with the read limits uvicorn
lacks. uvicorn bounds only an idle keep-alive connection (`timeout_keep_alive`); a peer that opens a
connection and sends nothing, sends its headers a byte at a time, or never finishes its body held
the connection (and its buffers) for ever, and httptools takes headers of any size.

Here a request must be read whole (headers and body) within `read_timeout` seconds of its first
byte (a new connection: of its opening), else the connection is closed (a 408 first while still in
the headers); headers over MAX_HEAD_BYTES are a 431. Once read, a request's handling is bounded by
Ivy's own deadlines (`--request-timeout-s`), not by this.

A worker holds at most `max_connections` connections (--max-connections): uvicorn takes every
connection the kernel hands it (its `limit_concurrency` answers 503 only once a request's head is
complete, so peers that send a byte and wait each keep a descriptor until the read timeout: 20,000
of them filled the descriptor table). Past the cap, the connection that has waited longest for a
request head (a silent or slow peer, or an idle keep-alive connection) is closed to make room; a
connection whose request is being read or answered is never closed for it; when every one is
busy, the new one is answered 503 and closed at once.

A connection costs next to nothing until its first bytes arrive: uvicorn's own protocol state (an
httptools parser, its loggers looked up, the peer's addresses read, ~5 KiB and ~50 us) is built
then, not when it is accepted. A flood of connections that send nothing is mostly accepted, made to
wait and closed to make room before any of them speaks (19,970 of them cost the worker 2.0 s of
CPU and +92 MiB with the state built at once; see docs/reliability.md for the figures now); a
connection closed before it spoke gets no 408 (it sent no request to answer).

The bytes a connection writes in one turn of the event loop go out in one write (`OneWrite`):
uvicorn writes a response's head and its body apart, which cost two send calls and two TCP
segments for the peer to read."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 << 10  # request line and headers; nginx takes 4 x 8 KiB, Node.js 16 KiB


def _reply(status: bytes) -> bytes:
    return b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class OneWrite:
    """A transport whose writes are held until the end of the event loop's current turn and then
    sent as one (`b"".join`); everything else is the wrapped transport's. `close()` sends what is
    held first; `abort()`, or the connection closing meanwhile, drops it."""

    __slots__ = ("transport", "loop", "held")

    def __init__(self, transport, loop):
        self.transport, self.loop, self.held = transport, loop, None

    def write(self, data: bytes) -> None:
        if self.held is None:
            self.held = [data]
            self.loop.call_soon(self.flush)
        else:
            self.held.append(data)

    def writelines(self, lines) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        held, self.held = self.held, None
        if held and not self.transport.is_closing():  # the peer gone meanwhile: nothing to send it
            self.transport.write(held[0] if len(held) == 1 else b"".join(held))

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def abort(self) -> None:
        self.held = None
        self.transport.abort()

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size() + sum(map(len, self.held or ()))

    def __getattr__(self, name):
        return getattr(self.transport, name)


# This worker's connections waiting for a request head, oldest first (a dict: ordered, O(1) removal).
_WAITING: dict["ReadLimitedProtocol", None] = {}
_OPEN = [0]  # this worker's open connections, spoken or not (uvicorn's `connections` counts the spoken ones)


class ReadLimitedProtocol(HttpToolsProtocol):
    """See the module docstring. uvicorn builds it with its own keywords; `read_timeout` and
    `max_connections` come in through functools.partial (ivy.__main__), which survives the spawn of
    its worker processes."""

    def __init__(self, *args, read_timeout: float = 30.0, max_connections: int = 4096, **kwargs):
        self._uvicorn = (args, kwargs)  # uvicorn's __init__, at the first bytes (`_speak`); None once run
        self.loop = kwargs.get("_loop") or asyncio.get_event_loop()
        self.transport = None
        self.read_timeout = read_timeout
        self.max_connections = max_connections
        self._read_timer = None
        self._in_head = True  # the bytes arriving belong to a request's line and headers
        self._head_bytes = 0
        self._completed = 0  # requests read whole on this connection
        self._head_size = 0  # this request's line and headers, as parsed

    def connection_made(self, transport) -> None:
        self.transport = transport  # uvicorn's connection_made runs at the first bytes (`_speak`)
        _OPEN[0] += 1
        self._arm()
        if _OPEN[0] > self.max_connections:
            oldest = next(iter(_WAITING), None)
            if oldest is None:  # every connection has a request under way
                transport.write(_reply(b"503 Service Unavailable"))
                transport.close()
                return
            oldest._stalled()  # closes it (a 408 first); its descriptor is freed when the loop sees it closed
        _WAITING[self] = None

    def _speak(self) -> None:
        """The connection's first bytes: uvicorn's protocol state, built now (see the module docstring)."""
        args, kwargs = self._uvicorn
        self._uvicorn = None
        transport = self.transport
        super().__init__(*args, **kwargs)
        super().connection_made(OneWrite(transport, self.loop))

    def connection_lost(self, exc) -> None:
        _OPEN[0] -= 1
        self._disarm()
        _WAITING.pop(self, None)
        if self._uvicorn is None:
            super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # kept alive: waiting for the next request's head
            _WAITING[self] = None

    def _arm(self) -> None:
        if self._read_timer is None:
            self._read_timer = self.loop.call_later(self.read_timeout, self._stalled)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _stalled(self) -> None:
        self._read_timer = None
        _WAITING.pop(self, None)
        if not self.transport.is_closing():
            if self._in_head and self._uvicorn is None:  # a peer that has sent nothing gets no reply
                self.transport.write(_reply(b"408 Request Timeout"))
            self.transport.close()

    def _too_large(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(_reply(b"431 Request Header Fields Too Large"))
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._uvicorn is not None:
            self._speak()
        head, done = self._in_head, self._completed
        super().data_received(data)
        if head and self._in_head and done == self._completed:  # all of `data` was head, still incomplete
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._too_large()

    def on_url(self, url: bytes) -> None:
        self._head_size += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_size += len(name) + len(value) + 4
        super().on_header(name, value)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_size = 0
        self._arm()  # a keep-alive connection's next request: read within the timeout too

    def on_headers_complete(self) -> None:
        self._in_head = False
        _WAITING.pop(self, None)  # a request under way: never closed to make room
        if self._head_size > MAX_HEAD_BYTES:  # headers that came whole in one read
            self._too_large()  # closing: uvicorn starts no request for them
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._completed += 1
        self._in_head, self._head_bytes = True, 0  # bytes from here on are the next request's

"""Tulip's gRPC server: gRPC over HTTP/2 written here on an asyncio Protocol (the framing of
trellis.h2frames, the server's side of it), in place of grpc.aio's server. This module owns `Server`
(the handler registry, `listen`, the deadline tick, the connection cap's log, graceful `stop`); a
connection's lifecycle is tulip.h2conn's, its frames and flow control tulip.h2flow's, its calls
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

from tulip.h2call import Call, Direct
from tulip.h2conn import Connection
from tulip.h2limits import Bucket, Limits, raise_nofile_limit
from trellis.h2frames import (DEFAULT_WINDOW, MAX_FRAME, SETTINGS, SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE,
                              WINDOW, WINDOW_UPDATE, frame)
from trellis.h2frames import U32

log = logging.getLogger("tulip.h2server")

__all__ = ["Call", "Connection", "Direct", "Limits", "Server"]

SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_MAX_HEADER_LIST_SIZE = 0x3, 0x6
TICK_S = 1.0  # how often the server looks at its connections' deadlines
_nofile_raised = False


class _Details(NamedTuple):  # grpc.HandlerCallDetails, what a generic handler's service() reads
    method: str
    invocation_metadata: tuple


class Server:
    """The gRPC server: grpcio's method handlers on asyncio listeners (`listen`), each peer held to
    `limits`."""

    def __init__(self, max_message: int = 4 << 20, limits: Limits = Limits()):
        self.max_message = max_message
        self.limits = limits
        self.settings_frame = frame(SETTINGS, 0, 0, b"".join(struct.pack(">HL", k, v) for k, v in (
            (SETTINGS_MAX_CONCURRENT_STREAMS, limits.max_streams), (SETTINGS_INITIAL_WINDOW_SIZE, limits.stream_buffered),
            (SETTINGS_MAX_FRAME_SIZE, MAX_FRAME), (SETTINGS_MAX_HEADER_LIST_SIZE, limits.max_header_list)))
        ) + frame(WINDOW_UPDATE, 0, 0, U32.pack(WINDOW - DEFAULT_WINDOW))
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
            conn.close_when_sent()
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        for srv in self._listeners:
            await srv.wait_closed()

"""A small asyncio client for Tulip, for Ivy and for internal scorers.

    async with TulipClient("127.0.0.1:50051") as c:
        info = await c.info()
        vecs = await c.embed([[101, 7592, 102], [101, 2088, 102]])   # float32 [2, dim]

Sequences are pre-tokenized (token ids); the client packs them as int32 bytes. With
transport="stream" (the default) every call of one client shares one open EmbedStream, on an
HTTP/2 connection of its own (`trellis.h2stream`), which costs less per request than a unary call;
"unary" uses Embed on the client's grpc.aio channel (as Info and health always do). With `spin_ms` > 0 the
client keeps its event loop polling while a reply is due (for up to that long per request,
`trellis.spin.Spinner`): lower latency for one busy core; for callers on hosts with cores to spare.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trellis.options import PER_SEQUENCE, Options
from trellis.protowire import varint
from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from trellis import h2stream
from trellis.spin import Spinner

KEEPALIVE_S = 4.0  # a ping after this long without hearing from the peer
KEEPALIVE_TIMEOUT_S = 4.0  # unanswered this long: the connection is closed
CONNECT_TIMEOUT_S = KEEPALIVE_TIMEOUT_S  # a stream's connection not made by then: UNAVAILABLE (retried elsewhere)


_I4 = np.dtype("<i4")
_F4 = np.dtype("<f4")


def pack(seqs: Sequence[Sequence[int] | np.ndarray]) -> tuple[bytes, list[int]]:
    """Token-id sequences -> (int32 little-endian bytes, lengths)."""
    if len(seqs) == 1:  # one sequence (an online request): its bytes, no concatenation
        a = seqs[0]
        if type(a) is not np.ndarray or a.dtype is not _I4:
            a = np.asarray(a, dtype=_I4)
        return a.tobytes(), [len(a)]
    lengths = [len(s) for s in seqs]
    if not seqs:
        return b"", lengths
    return np.concatenate([np.asarray(s, dtype=_I4) for s in seqs]).tobytes(), lengths


def unpack(reply: tulip_pb2.EmbedReply) -> np.ndarray:
    """EmbedReply -> float32 [n, dim], int8 [n, dim], or packed sign bits uint8 [n, ceil(dim / 8)]."""
    n, dim = reply.shape
    encoding = reply.encoding
    if encoding == tulip_pb2.ENCODING_INT8:
        return np.frombuffer(reply.embeddings, dtype=np.int8).reshape(n, dim)
    if encoding == tulip_pb2.ENCODING_BINARY:
        return np.frombuffer(reply.embeddings, dtype=np.uint8).reshape(n, (dim + 7) // 8)
    return np.ndarray((n, dim), _F4, reply.embeddings)  # one numpy call: each costs on a reply that wakes a cold core


@dataclass(frozen=True)
class EmbedOptions(Options):
    """What an embed request asks of Tulip beside its token ids, one object from Ivy's route
    through the balancer to the client: the request options (`trellis.options.Options`, their
    fields first, declared there once) and how the request travels. The per-sequence options are
    empty or one per sequence (`part` splits them).

    request_id:     the caller's id (a chunk's: "-k" added by `part`; the stream adds "#n").
    deadline:       time.monotonic() by which the whole request (every chunk, retries included) must
                    be answered; 0: none. Each call is given what is left of it as its timeout.
    traceparent:    W3C trace context of the caller's span (ivy.tracing sets it per chunk): sent in the
                    stream message's `traceparent` field, as gRPC metadata on a unary call; "": none.
    priority:       the request's scheduling class, tulip_pb2.PRIORITY_ONLINE (the default) or
                    tulip_pb2.PRIORITY_BATCH (bulk jobs: Tulip serves queued online work first and gives
                    batch work the token budget online work leaves). A transport field, not an option.
    """

    request_id: str = ""
    deadline: float = 0.0
    traceparent: str = ""
    priority: int = tulip_pb2.PRIORITY_ONLINE

    def part(self, a: int, b: int, k: int) -> "EmbedOptions":
        """The options of sequences [a, b), chunk k of a request split over replicas."""
        return replace(self, **{name: getattr(self, name)[a:b] for name in PER_SEQUENCE},
                       request_id=f"{self.request_id}-{k}" if self.request_id else "")

    def timeout(self) -> float | None:
        """Seconds left until the deadline (at least 1 ms), or None without one."""
        return max(self.deadline - time.monotonic(), 0.001) if self.deadline else None

    def request(self, seqs) -> tulip_pb2.EmbedRequest:
        ids, lengths = pack(seqs)
        return self._fill(tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths))

    def message(self, seqs) -> tuple[tulip_pb2.EmbedRequest, np.ndarray | None]:
        """What `TulipClient.call` sends for `seqs`: the message and, for an image request, its pixels apart
        (`image_head`: the stream sends them from the array, not copied into the message). Token ids: `request`'s
        message and None; an options type that carries pixels (Ivy's ImageOptions) returns its `image_head`."""
        return self.request(seqs), None

    def image_request(self, pixels: np.ndarray) -> tulip_pb2.EmbedRequest:
        """An image request: `pixels` uint8 [n, S, S, 3] (RGB, resized and cropped as the model's image
        processor does; S the model's Info.image_size), sent as they are (Tulip rescales and normalises)."""
        req, pixels = self.image_head(pixels)
        req.pixels = pixels.tobytes()
        return req

    def image_head(self, pixels: np.ndarray) -> tuple[tulip_pb2.EmbedRequest, np.ndarray]:
        """`image_request` without its pixels (`images` set) and the pixels, C-contiguous uint8 (the
        caller's array itself where it is one): the stream sends them after the message's bytes as
        they are (`TulipStream.request`), not copied into a message (~33 ms a copy of 256 pictures of
        224 x 224 on the 2-core CPU machine)."""
        pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
        if pixels.ndim != 4 or pixels.shape[3] != 3 or pixels.shape[1] != pixels.shape[2]:
            raise ValueError(f"pixels must be uint8 [n, S, S, 3], not {list(pixels.shape)}")
        return self._fill(tulip_pb2.EmbedRequest(images=pixels.shape[0])), pixels

    def _fill(self, req: tulip_pb2.EmbedRequest) -> tulip_pb2.EmbedRequest:
        if self is _DEFAULT:
            return req
        req.request_id = self.request_id
        if self.priority:
            req.priority = self.priority
        return self.to_proto(req)


_DEFAULT = EmbedOptions()


@dataclass
class EmbedResult:
    """Everything one Embed call returned, per sequence in request order.

    vectors: dense rows (see `unpack`); sparse: (token ids, weights) when OUTPUT_SPARSE was asked;
    colbert: float32 [tokens after the first, colbert_dim] when OUTPUT_COLBERT was asked;
    scores: a cross-encoder's float32 [n, num_labels] (then `vectors` is empty, [n, 0]).
    """

    vectors: np.ndarray
    sparse: list = field(default_factory=list)
    colbert: list = field(default_factory=list)
    scores: np.ndarray | None = None


def unpack_result(reply: tulip_pb2.EmbedReply) -> EmbedResult:
    if reply.scores:
        n, labels = reply.shape
        return EmbedResult(np.empty((n, 0), np.float32), scores=np.frombuffer(reply.scores, dtype="<f4").reshape(n, labels))
    vectors = unpack(reply)
    if not reply.sparse and not reply.colbert_lengths:  # dense vectors only
        return EmbedResult(vectors)
    sparse = [(np.asarray(s.token_ids, dtype=np.int64), np.asarray(s.weights, dtype=np.float32)) for s in reply.sparse]
    colbert = []
    if reply.colbert_lengths:
        flat = np.frombuffer(reply.colbert, dtype="<f4").reshape(-1, reply.colbert_dim)
        colbert = np.split(flat, np.cumsum(list(reply.colbert_lengths))[:-1])
    return EmbedResult(vectors, sparse, colbert)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The exception a unary call would raise, for failures seen on the stream."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class _Expired(Exception):
    """A stream request's deadline passed (set on its future by the timer)."""


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


_STATUS = {c.value[0]: c for c in grpc.StatusCode}
_PIXELS_KEY = b"\x72"  # EmbedRequest.pixels' key: field 14, length-delimited


class TulipStream:
    """One long-lived EmbedStream call multiplexing concurrent requests by request_id, on an HTTP/2
    connection of its own (`trellis.h2stream`: cheaper per message than grpc.aio's call).

    Tulip matches replies (and cancels) by request_id, so every message on the stream carries one
    of its own: the caller's request_id with "#n" added (n counts this stream's requests), or n.

    Opened on first use (within CONNECT_TIMEOUT_S, or what is left of the first caller's timeout);
    if it breaks, the requests waiting on it fail with UNAVAILABLE (so a balancer retries them
    elsewhere) and the next request opens a new one.

    The reply path is one hop: the connection's data_received sets the caller's future, which is all
    the caller awaits (a deadline is a timer on the loop that fails that future). Messages go out in
    order, as far as the peer's flow-control window lets them; a caller that leaves takes its message
    back if none of it is out yet, and otherwise queues a cancel behind it."""

    def __init__(self, target: str, max_message: int):
        self.target, self.max_message = target, max_message
        self._where = h2stream.address(target)  # ValueError for a target it cannot reach
        self._conn: h2stream.StreamConnection | None = None
        self._opening: asyncio.Future | None = None
        self._ids = itertools.count()

    @property
    def _pending(self) -> dict[str, asyncio.Future]:
        return self._conn.pending if self._conn is not None else {}

    def _reply(self, conn: h2stream.StreamConnection, data: bytes) -> None:
        try:
            reply = tulip_pb2.EmbedReply.FromString(data)
        except Exception as e:  # not an EmbedReply: the stream cannot be trusted
            conn._end(f"Tulip sent a message that is not an EmbedReply ({e})")
            return
        fut = conn.pending.pop(reply.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(reply)

    def _closed(self, conn: h2stream.StreamConnection, details: str) -> None:
        if self._conn is conn:
            self._conn = None
        err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"stream to Tulip broke: {details}")
        pending, conn.pending = conn.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)

    async def _connect(self) -> h2stream.StreamConnection:
        loop = asyncio.get_running_loop()
        kind, where, port_or_authority = self._where
        conn = None

        def protocol():
            nonlocal conn
            authority = port_or_authority if kind == "unix" else f"{where}:{port_or_authority}"
            conn = h2stream.StreamConnection(authority, lambda data: self._reply(conn, data), self._closed,
                                             self.max_message, KEEPALIVE_S, KEEPALIVE_TIMEOUT_S)
            return conn

        try:
            if kind == "unix":
                await asyncio.wait_for(loop.create_unix_connection(protocol, where), CONNECT_TIMEOUT_S)
            else:
                await asyncio.wait_for(loop.create_connection(protocol, where, port_or_authority), CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                            f"cannot reach Tulip at {self.target}: {e or 'no answer'}") from None
        if conn.closed:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, f"the connection to Tulip at {self.target} closed at once")
        self._conn = conn
        return conn

    async def _open(self, timeout: float | None) -> h2stream.StreamConnection:
        """The open stream, or a new one (one connection attempt shared by every caller meanwhile)."""
        if self._opening is None or self._opening.done():
            self._opening = asyncio.ensure_future(self._connect())
        try:
            return await asyncio.wait_for(asyncio.shield(self._opening), timeout)
        except asyncio.TimeoutError:
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    async def request(self, req: tulip_pb2.EmbedRequest, timeout: float | None,
                      pixels: np.ndarray | None = None) -> tulip_pb2.EmbedReply:
        """`pixels` (C-contiguous uint8, `EmbedOptions.image_head`): the message's `pixels` field, sent from
        the array as it is after the rest of the message (protobuf takes a message's fields in any order)."""
        conn = self._conn
        if conn is None or not conn.usable:
            conn = await self._open(timeout)
        n = next(self._ids)
        rid = req.request_id = f"{req.request_id}#{n}" if req.request_id else str(n)  # unique on the stream
        loop = conn.loop
        fut = loop.create_future()
        conn.pending[rid] = fut
        timer = None
        if timeout is not None:
            req.timeout_ms = min(max(1, int(timeout * 1e3)), 2**32 - 1)  # Tulip drops it if still queued by then
            timer = loop.call_later(timeout, _expire, fut)
        try:
            if pixels is None:
                token = conn.send(req.SerializeToString())
            else:
                tail = pixels.reshape(-1).data
                token = conn.send(req.SerializeToString() + _PIXELS_KEY + varint(len(tail)), tail)
        except Exception:
            conn.pending.pop(rid, None)
            if timer is not None:
                timer.cancel()
            raise
        try:
            reply = await fut
        except _Expired:
            self._leave(conn, rid, token)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:  # our caller is gone: so is Tulip's queued work for it
            self._leave(conn, rid, token)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if reply.error_code:
            raise rpc_error(_STATUS.get(reply.error_code, grpc.StatusCode.UNKNOWN), reply.error_message)
        return reply

    def _leave(self, conn: h2stream.StreamConnection, rid: str, token) -> None:
        """The caller of request `rid` is gone: its message is taken back if none of it is out, else
        Tulip is told (behind it on the stream, so after it)."""
        conn.pending.pop(rid, None)
        if conn.closed or conn.take_back(token):
            return  # never sent, or that stream is gone and its queued work with it
        conn.send(tulip_pb2.EmbedRequest(request_id=rid, cancel=True).SerializeToString())

    async def close(self) -> None:
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class TulipClient:
    """One channel to one Tulip replica."""

    def __init__(self, target: str, max_message_mb: int = 64, transport: str = "stream", spin_ms: float = 0.0):
        if transport not in ("stream", "unary"):
            raise ValueError(f"transport {transport!r} is not stream or unary")
        self.transport = transport
        self.outstanding = 0  # calls waiting for their reply
        self._spinner = Spinner(spin_ms / 1e3, lambda: self.outstanding > 0)
        self._spin, self._stream = spin_ms > 0, transport == "stream"
        mb = max_message_mb << 20
        self.target = target
        self.channel = grpc.aio.insecure_channel(target, options=[
            ("grpc.max_receive_message_length", mb),
            ("grpc.max_send_message_length", mb),
            # a peer that stops answering (a dead node, a cut link: no reset, no error) is found by a ping
            # unanswered for KEEPALIVE_TIMEOUT_S; the transport is then closed, so what waits on it fails
            # UNAVAILABLE (a balancer retries it elsewhere) instead of hanging until its deadline. grpc's
            # default of at most 2 pings between data frames sent is kept: on an idle channel more would
            # draw GOAWAY "too_many_pings" from a server with grpc's default ping policy (Tulip allows them)
            ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1e3)),
            ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1e3)),
            # a replica that starts (or comes back) is reached within a second: the default backoff
            # grows to two minutes, which left Ivy workers unready long after Tulip was serving
            ("grpc.initial_reconnect_backoff_ms", 200),
            ("grpc.min_reconnect_backoff_ms", 200),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ])
        self.stub = tulip_pb2_grpc.TulipStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.stream = TulipStream(target, mb) if self._stream else None

    async def __aenter__(self) -> "TulipClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.close()
        await self.channel.close()

    async def info(self, timeout: float | None = 5.0) -> tulip_pb2.InfoReply:
        return await self.stub.Info(tulip_pb2.InfoRequest(), timeout=timeout)

    async def score(self, seqs, segment_starts: Sequence[int] = (), timeout: float | None = None,
                    raw_scores: bool = False, priority: int = tulip_pb2.PRIORITY_ONLINE) -> np.ndarray:
        """A cross-encoder's float32 [n, num_labels] scores of token-id sequences (query-document pairs
        as its tokenizer's pair template builds them; `segment_starts`: where each second segment starts).
        `priority`: tulip_pb2.PRIORITY_BATCH for bulk work (see `EmbedOptions.priority`)."""
        return (await self.embed_result(seqs, timeout=timeout, segment_starts=segment_starts,
                                        raw_scores=raw_scores, priority=priority)).scores

    async def embed(self, seqs, dimensions: int = 0, timeout: float | None = None,
                    encoding: int = tulip_pb2.ENCODING_FLOAT32, priority: int = tulip_pb2.PRIORITY_ONLINE) -> np.ndarray:
        """Embed token-id sequences; the array's type follows `encoding` (see `unpack`). `priority`:
        tulip_pb2.PRIORITY_BATCH for bulk work, served after queued online work (`EmbedOptions.priority`)."""
        if timeout is None and not dimensions and encoding == tulip_pb2.ENCODING_FLOAT32 and not priority:
            return (await self.call(seqs, _DEFAULT)).vectors
        deadline = time.monotonic() + timeout if timeout is not None else 0.0
        return (await self.call(seqs, EmbedOptions(dimensions, encoding, deadline=deadline, priority=priority))).vectors

    async def embed_result(self, seqs, dimensions: int = 0, timeout: float | None = None,
                           encoding: int = tulip_pb2.ENCODING_FLOAT32, outputs: Sequence[int] = (),
                           pool_from: Sequence[int] = (), segment_starts: Sequence[int] = (),
                           raw_scores: bool = False, request_id: str = "",
                           priority: int = tulip_pb2.PRIORITY_ONLINE) -> EmbedResult:
        """Embed with extra `outputs` (tulip_pb2.OUTPUT_SPARSE / OUTPUT_COLBERT) where the model has them;
        `pool_from`: per sequence, leading (prompt) tokens mean pooling leaves out. A cross-encoder's
        result has `scores`; `segment_starts`: per sequence where its second segment starts (0: none),
        `raw_scores`: the head's logits, not activated. `request_id`: the caller's id for the request
        (the stream adds "#n" to keep its messages apart, see TulipStream). `priority`: the scheduling
        class, tulip_pb2.PRIORITY_BATCH for bulk work (see `EmbedOptions.priority`)."""
        deadline = time.monotonic() + timeout if timeout is not None else 0.0
        return await self.call(seqs, EmbedOptions(dimensions, encoding, tuple(outputs), pool_from, segment_starts,
                                                  raw_scores, request_id, deadline, priority=priority))

    async def embed_images(self, pixels: np.ndarray, dimensions: int = 0, timeout: float | None = None,
                           encoding: int = tulip_pb2.ENCODING_FLOAT32, request_id: str = "",
                           priority: int = tulip_pb2.PRIORITY_ONLINE) -> np.ndarray:
        """Embed pictures with a model that has an image tower (CLIP, SigLIP: Info.image_size S > 0): `pixels`
        uint8 [n, S, S, 3], RGB, resized and cropped as its image processor does (ivy.images makes them);
        the vectors share the text embeddings' space."""
        deadline = time.monotonic() + timeout if timeout is not None else 0.0
        opts = EmbedOptions(dimensions, encoding, request_id=request_id, deadline=deadline, priority=priority)
        if self._stream:  # the pixels go from the array itself (the array must not change until this returns)
            req, pixels = opts.image_head(pixels)
            return (await self.call((), opts, req, pixels)).vectors
        return (await self.call((), opts, opts.image_request(pixels))).vectors

    async def call(self, seqs, opts: EmbedOptions, req: tulip_pb2.EmbedRequest | None = None,
                   pixels: np.ndarray | None = None) -> EmbedResult:
        """Embed token-id sequences as `opts` asks (`embed_result`'s arguments in one object), within
        what is left of its deadline; `req`: the message already built from `opts` (an image request's,
        `EmbedOptions.image_request`), sent instead; on the stream, `pixels` (`EmbedOptions.image_head`)
        are its pixels, sent from the array. Without `req`, `opts.message(seqs)` builds both (an image
        request's pixels apart: a balancer's chunk sends them uncopied too). (One coroutine for both: no second await on the request
        path.)"""
        if req is None:
            req, pixels = opts.message(seqs)
        timeout = opts.timeout()
        self.outstanding += 1
        try:
            if self._spin:
                self._spinner.kick()
            if self._stream:
                if opts.traceparent:  # one stream carries many requests: the context rides in each message
                    req.traceparent = opts.traceparent
                return unpack_result(await self.stream.request(req, timeout, pixels))
            if pixels is not None:
                req.pixels = pixels.tobytes()
            metadata = (("traceparent", opts.traceparent),) if opts.traceparent else None
            return unpack_result(await self.stub.Embed(req, timeout=timeout, metadata=metadata))
        finally:
            self.outstanding -= 1

    async def healthy(self, timeout: float = 1.0) -> bool:
        try:
            r = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.aio.AioRpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

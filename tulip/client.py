"""A small asyncio client for Tulip, for Ivy and for internal scorers.

    async with TulipClient("127.0.0.1:50051") as c:
        info = await c.info()
        vecs = await c.embed([[101, 7592, 102], [101, 2088, 102]])   # float32 [2, dim]

Sequences are pre-tokenized (token ids); the client packs them as int32 bytes. With
transport="stream" (the default) every call of one client shares one open EmbedStream,
which costs less per request than a unary call; "unary" uses Embed. With `spin_ms` > 0 the
client keeps its event loop polling while a reply is due (for up to that long per request,
`tulip.spin.Spinner`): lower latency for one busy core; for callers on hosts with cores to spare.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from tulip.spin import Spinner

KEEPALIVE_S = 4.0  # a ping after this long without hearing from the peer
KEEPALIVE_TIMEOUT_S = 4.0  # unanswered this long: the connection is closed


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
class EmbedOptions:
    """What an embed request asks of Tulip beside its token ids, one object from Ivy's route
    through the balancer to the client (a new EmbedRequest field: the proto, the route that sets it,
    this class and the servicer). The per-sequence fields are empty or one per sequence.

    dimensions:     Matryoshka truncation (0: the model's full width).
    encoding:       tulip_pb2.ENCODING_* of the reply's vectors.
    outputs:        extra tulip_pb2.OUTPUT_* (sparse, ColBERT) where the model has them.
    pool_from:      per sequence, leading (prompt) tokens mean pooling leaves out.
    segment_starts: a cross-encoder's pairs: per sequence where its second segment starts (0: none).
    raw_scores:     a cross-encoder's logits, not activated.
    request_id:     the caller's id (a chunk's: "-k" added by `part`; the stream adds "#n").
    deadline:       time.monotonic() by which the whole request (every chunk, retries included) must
                    be answered; 0: none. Each call is given what is left of it as its timeout.
    traceparent:    W3C trace context of the caller's span (ivy.tracing sets it per chunk): sent in the
                    stream message's `traceparent` field, as gRPC metadata on a unary call; "": none.
    """

    dimensions: int = 0
    encoding: int = tulip_pb2.ENCODING_FLOAT32
    outputs: tuple[int, ...] = ()
    pool_from: Sequence[int] = ()
    segment_starts: Sequence[int] = ()
    raw_scores: bool = False
    request_id: str = ""
    deadline: float = 0.0
    traceparent: str = ""

    def part(self, a: int, b: int, k: int) -> "EmbedOptions":
        """The options of sequences [a, b), chunk k of a request split over replicas."""
        return EmbedOptions(self.dimensions, self.encoding, self.outputs, self.pool_from[a:b],
                            self.segment_starts[a:b], self.raw_scores,
                            f"{self.request_id}-{k}" if self.request_id else "", self.deadline, self.traceparent)

    def timeout(self) -> float | None:
        """Seconds left until the deadline (at least 1 ms), or None without one."""
        return max(self.deadline - time.monotonic(), 0.001) if self.deadline else None

    def request(self, seqs) -> tulip_pb2.EmbedRequest:
        ids, lengths = pack(seqs)
        req = tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths)
        if self is _DEFAULT:
            return req
        req.dimensions, req.encoding, req.raw_scores, req.request_id = (
            self.dimensions, self.encoding, self.raw_scores, self.request_id)
        if self.outputs:  # the repeated fields only where set
            req.outputs.extend(self.outputs)
        if len(self.pool_from):
            req.pool_from.extend(self.pool_from)
        if len(self.segment_starts):
            req.segment_starts.extend(self.segment_starts)
        return req


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


def _started(coro) -> asyncio.Task:
    """`coro` as a task that has already run up to its first wait (Python >= 3.12: eager start, so a
    write is handed to gRPC before this returns); before 3.12 an ordinary task (it starts on the next
    loop iteration)."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, eager_start=True)
    return loop.create_task(coro)


class _Expired(Exception):
    """A stream request's deadline passed (set on its future by the timer)."""


def _expire(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


_STATUS = {c.value[0]: c for c in grpc.StatusCode}


class TulipStream:
    """One long-lived EmbedStream call multiplexing concurrent requests by request_id.

    Tulip matches replies (and cancels) by request_id, so every message on the stream carries one
    of its own: the caller's request_id with "#n" added (n counts this stream's requests), or n.

    Opened on first use; if it breaks, the requests waiting on it fail with UNAVAILABLE (so a
    balancer retries them elsewhere) and the next request opens a new one.

    The reply path is one hop: the reader task sets the caller's future, which is all the caller
    awaits (a deadline is a timer on the loop that fails that future, not `asyncio.wait_for`). Writes
    go through an outbox that one writer task empties in order (started eagerly where Python has it,
    so an idle stream's message is handed to gRPC before `request` first waits): grpc.aio cancels the
    whole call when a write on it is cancelled, so no caller ever awaits a write; a caller that leaves
    takes its message out of the outbox if it is not sent yet, and otherwise queues a cancel behind it."""

    def __init__(self, stub: tulip_pb2_grpc.TulipStub):
        self._stub = stub
        self._call = None
        self._pending: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._outbox: collections.deque = collections.deque()  # (call, request, its future or None)
        self._writing = False  # a writer task is emptying the outbox
        self._writer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()  # a reference to each reader until it is done

    async def _read(self, call) -> None:
        err = rpc_error(grpc.StatusCode.UNAVAILABLE, "Tulip closed the stream")
        try:
            async for reply in call:
                fut = self._pending.pop(reply.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(reply)
                    if not self._pending:  # its caller was the only one: let it run before the next read is armed
                        await asyncio.sleep(0)
        except grpc.aio.AioRpcError as e:
            err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"stream to Tulip broke: {e.details()}")
        except asyncio.CancelledError:
            pass
        finally:
            if self._call is call:
                self._call = None
            pending, self._pending = self._pending, {}
            for fut in pending.values():
                if not fut.done():
                    fut.set_exception(err)

    def _background(self, task: asyncio.Task) -> None:
        self._tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self._tasks.discard)

    def _send(self, call, req: tulip_pb2.EmbedRequest, fut: asyncio.Future | None) -> tuple:
        entry = (call, req, fut)
        self._outbox.append(entry)
        if not self._writing:
            self._writing = True
            self._writer = _started(self._write())  # referenced until the next (the loop keeps a weak one)
        return entry

    async def _write(self) -> None:
        outbox = self._outbox
        try:
            while outbox:
                call, req, fut = outbox.popleft()
                try:
                    await call.write(req)
                except asyncio.CancelledError:
                    if not call.cancelled():
                        raise  # this task is cancelled, not the call (close() cancels the call)
                    err = rpc_error(grpc.StatusCode.UNAVAILABLE, "stream to Tulip is closed: cancelled")
                except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
                    err = rpc_error(grpc.StatusCode.UNAVAILABLE, f"stream to Tulip is closed: {e}")
                except Exception as e:  # the message itself (its caller sees what went wrong)
                    err = e
                else:
                    continue
                if fut is not None and not fut.done():  # the reader may have failed it first
                    fut.set_exception(err)
        finally:
            self._writing = False

    async def request(self, req: tulip_pb2.EmbedRequest, timeout: float | None) -> tulip_pb2.EmbedReply:
        call = self._call
        if call is None:
            call = self._call = self._stub.EmbedStream()
            self._background(asyncio.get_running_loop().create_task(self._read(call)))
        n = next(self._ids)
        rid = req.request_id = f"{req.request_id}#{n}" if req.request_id else str(n)  # unique on the stream
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending[rid] = fut
        timer = None
        if timeout is not None:
            req.timeout_ms = min(max(1, int(timeout * 1e3)), 2**32 - 1)  # Tulip drops it if still queued by then
            timer = loop.call_later(timeout, _expire, fut)
        entry = self._send(call, req, fut)
        try:
            reply = await fut
        except _Expired:
            self._leave(call, rid, entry)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except asyncio.CancelledError:  # our caller is gone: so is Tulip's queued work for it
            self._leave(call, rid, entry)
            raise
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(rid, None)
        if reply.error_code:
            raise rpc_error(_STATUS.get(reply.error_code, grpc.StatusCode.UNKNOWN), reply.error_message)
        return reply

    def _leave(self, call, rid: str, entry) -> None:
        """The caller of request `rid` is gone: its message is taken back if still unsent, else Tulip
        is told (behind it on the stream, so after it)."""
        self._pending.pop(rid, None)
        for i, e in enumerate(self._outbox):
            if e is entry:
                del self._outbox[i]
                return  # never sent
        if self._call is call:  # otherwise that stream is gone, and its queued work with it
            self._send(call, tulip_pb2.EmbedRequest(request_id=rid, cancel=True), None)

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None


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
        self.stream = TulipStream(self.stub)

    async def __aenter__(self) -> "TulipClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self.stream.close()
        await self.channel.close()

    async def info(self, timeout: float | None = 5.0) -> tulip_pb2.InfoReply:
        return await self.stub.Info(tulip_pb2.InfoRequest(), timeout=timeout)

    async def score(self, seqs, segment_starts: Sequence[int] = (), timeout: float | None = None,
                    raw_scores: bool = False) -> np.ndarray:
        """A cross-encoder's float32 [n, num_labels] scores of token-id sequences (query-document pairs
        as its tokenizer's pair template builds them; `segment_starts`: where each second segment starts)."""
        return (await self.embed_result(seqs, timeout=timeout, segment_starts=segment_starts,
                                        raw_scores=raw_scores)).scores

    async def embed(self, seqs, dimensions: int = 0, timeout: float | None = None,
                    encoding: int = tulip_pb2.ENCODING_FLOAT32) -> np.ndarray:
        """Embed token-id sequences; the array's type follows `encoding` (see `unpack`)."""
        if timeout is None and not dimensions and encoding == tulip_pb2.ENCODING_FLOAT32:
            return (await self.call(seqs, _DEFAULT)).vectors
        deadline = time.monotonic() + timeout if timeout is not None else 0.0
        return (await self.call(seqs, EmbedOptions(dimensions, encoding, deadline=deadline))).vectors

    async def embed_result(self, seqs, dimensions: int = 0, timeout: float | None = None,
                           encoding: int = tulip_pb2.ENCODING_FLOAT32, outputs: Sequence[int] = (),
                           pool_from: Sequence[int] = (), segment_starts: Sequence[int] = (),
                           raw_scores: bool = False, request_id: str = "") -> EmbedResult:
        """Embed with extra `outputs` (tulip_pb2.OUTPUT_SPARSE / OUTPUT_COLBERT) where the model has them;
        `pool_from`: per sequence, leading (prompt) tokens mean pooling leaves out. A cross-encoder's
        result has `scores`; `segment_starts`: per sequence where its second segment starts (0: none),
        `raw_scores`: the head's logits, not activated. `request_id`: the caller's id for the request
        (the stream adds "#n" to keep its messages apart, see TulipStream)."""
        deadline = time.monotonic() + timeout if timeout is not None else 0.0
        return await self.call(seqs, EmbedOptions(dimensions, encoding, tuple(outputs), pool_from, segment_starts,
                                                  raw_scores, request_id, deadline))

    async def call(self, seqs, opts: EmbedOptions) -> EmbedResult:
        """Embed token-id sequences as `opts` asks (`embed_result`'s arguments in one object), within
        what is left of its deadline."""
        req = opts.request(seqs)
        timeout = opts.timeout()
        self.outstanding += 1
        try:
            if self._spin:
                self._spinner.kick()
            if self._stream:
                if opts.traceparent:  # one stream carries many requests: the context rides in each message
                    req.traceparent = opts.traceparent
                return unpack_result(await self.stream.request(req, timeout))
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

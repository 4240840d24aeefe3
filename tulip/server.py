"""Tulip's gRPC server: validate requests, queue them on the engine loop, reply.

One asyncio event loop runs the gRPC server (tulip.h2server, or grpc.aio's with `--grpc-server
grpcio`, tulip.aioserver: unary `Embed`, streaming `EmbedStream`, `Info`, health) and the engine
loop (`tulip.loop.EngineLoop`: FCFS batches, overlapped steps, results scattered to the waiting
requests). Embed and EmbedStream are served by callbacks (`UnaryEmbed`, `EmbedStream`): a request
is validated and queued as its message is decoded, and its reply written by the engine loop's
completion callback, with no task, iterator or generator in between. A bad request is answered INVALID_ARGUMENT before
it is queued; an engine failure fails only the requests in that batch.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import time
from dataclasses import replace
from pathlib import Path
from time import perf_counter_ns

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rose.engine import Engine, EngineConfig
from rose.extras import Extra
from trellis import postprocess
from trellis.modelref import ModelRef, resolve
from trellis.options import Options, no_options, no_reply_options, verify
from trellis.tulip.v1 import tulip_pb2
from tulip.config import TulipConfig
from tulip.h2server import Direct, Server
from tulip.loop import EngineLoop, Request, warm_up
from tulip.metrics import TulipMetrics

log = logging.getLogger("tulip")
SERVICE_NAME = "trellis.tulip.v1.Tulip"
DEFAULT_BATCH_TOKENS = 16384  # --max-batch-tokens 0: this, or the model's max sequence length where longer


def parse_request(req: tulip_pb2.EmbedRequest, info: tulip_pb2.InfoReply
                  ) -> tuple[np.ndarray, tuple[int, ...], tuple[int, ...] | None, tuple[int, ...] | None]:
    """Check an EmbedRequest against the served model (its options: `trellis.options.verify`) and unpack it
    into (int32 ids, lengths, pool_from or None, segment_starts or None; plain ints); raise ValueError (an
    option's: trellis.options.OptionError) with a caller-facing message."""
    lens = tuple(req.lengths)  # plain ints: cheaper than numpy for the usual handful of sequences
    raw = req.token_ids  # (each read of a bytes field makes a new bytes object)
    ids = np.frombuffer(raw, dtype="<i4") if not len(raw) % 4 else None
    vocab_size, max_seq_len = info.vocab_size, info.max_seq_len
    if not lens:
        raise ValueError("request has no sequences (lengths is empty)")
    if ids is None:
        raise ValueError(f"token_ids has {len(raw)} bytes, not a multiple of 4 (int32 little-endian)")
    if sum(lens) != ids.shape[0]:
        raise ValueError(f"lengths add up to {sum(lens)} tokens but token_ids holds {ids.shape[0]}")
    if min(lens) == 0:
        raise ValueError(f"sequence {lens.index(0)} is empty")
    longest = max(lens)
    if longest > max_seq_len:
        raise ValueError(f"sequence {lens.index(longest)} has {longest} tokens; "
                         f"this model accepts at most {max_seq_len}")
    if ids.view("<u4").max() >= vocab_size:
        lo, hi = int(ids.min()), int(ids.max())
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    verify(Options.from_proto(req), info, lens)
    pool_from = tuple(req.pool_from) if req.pool_from else None
    segments = tuple(req.segment_starts) if req.segment_starts else None
    return ids, lens, pool_from, segments


EXTRAS = {tulip_pb2.OUTPUT_SPARSE: Extra.SPARSE, tulip_pb2.OUTPUT_COLBERT: Extra.COLBERT}
NO_EXTRAS = frozenset()
F32 = np.dtype("<f4")  # the reply's float encoding
_MAX = np.maximum.reduce  # an array's max without ndarray.max's Python wrapper


def _varint(v: int) -> bytes:
    out = bytearray()
    while v > 0x7F:
        out.append(v & 0x7F | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


_PLAIN: dict[tuple[int, int, int], tuple[bytes, bytes]] = {}  # (rows, dim, tokens) -> the bytes around the rows


def plain_reply(vectors: np.ndarray, tokens: int, request_id: str = "") -> bytes:
    """The usual reply, float32 rows and nothing else, serialized straight from the rows (C-contiguous
    little-endian float32 [n, dim]): byte for byte `EmbedReply(embeddings=vectors.tobytes(), shape=vectors.shape,
    prompt_tokens=tokens, request_id=request_id).SerializeToString()`, with one copy of the rows and no message."""
    n, dim = vectors.shape
    around = _PLAIN.get((n, dim, tokens))
    if around is None:
        if len(_PLAIN) > 4096:
            _PLAIN.clear()
        shape = _varint(n) + _varint(dim)  # fields 1 (bytes), 2 (packed uint32), 3 (uint32; 0: left out)
        around = _PLAIN[n, dim, tokens] = (
            b"\x0a" + _varint(4 * n * dim) if n * dim else b"",
            b"\x12" + _varint(len(shape)) + shape + (b"\x18" + _varint(tokens) if tokens else b""))
    if not request_id:
        return b"".join((around[0], vectors, around[1]))
    rid = request_id.encode()  # field 9 (string)
    return b"".join((around[0], vectors, around[1], b"J", _varint(len(rid)), rid))


def serialize_reply(reply: tulip_pb2.EmbedReply | bytes) -> bytes:
    """The servicer's replies on the wire: an EmbedReply, or one already serialized (`plain_reply`)."""
    return reply if type(reply) is bytes else reply.SerializeToString()


class RpcFailure(Exception):
    """A request's failure, as the gRPC status it is answered with."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message

    @classmethod
    def of(cls, error: Exception) -> "RpcFailure":
        """The engine loop's failures: a full queue, a passed deadline, a failed step."""
        code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, OverflowError)
                else grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(error, TimeoutError)
                else grpc.StatusCode.INTERNAL)
        return cls(code, str(error))


class TulipServicer:
    def __init__(self, loop: EngineLoop, served_name: str, ref: ModelRef | None = None):
        self.loop = loop
        self.tracing = loop.tracing  # tulip.tracing.Tracing with --otlp-endpoint, else None
        e = loop.engine
        self.scores = e.num_labels > 0  # a cross-encoder: replies carry scores
        self.info = tulip_pb2.InfoReply(
            model=served_name,
            embedding_dim=e.embedding_dim,
            num_labels=e.num_labels,
            activation=e.activation,
            revision=ref.revision if ref is not None else "",  # which files: Ivy and `trellis serve` show it
            random_weights=ref is not None and ref.random_weights,
            max_seq_len=e.spec.max_seq_len,
            vocab_size=e.spec.vocab_size,
            pooling=e.spec.pooling,
            normalized=e.spec.normalize,
            outputs=[tulip_pb2.OUTPUT_SCORES] if self.scores else
            [tulip_pb2.OUTPUT_DENSE] + [o for o, n in EXTRAS.items() if n in e.extra_outputs],
            dtype=str(e.dtype).removeprefix("torch."),
            device=str(e.device),
            max_batch_tokens=loop.cfg.max_batch_tokens,
            attention=e.attention.name,
            encodings=[tulip_pb2.ENCODING_FLOAT32] + (
                [tulip_pb2.ENCODING_INT8, tulip_pb2.ENCODING_BINARY] if e.spec.quantized_outputs else []),
        )

        # The online case (one sequence of plain ids, nothing else asked) is checked in one test
        # against these plain ints: up to `_plain_max` tokens it passes every check of `_request`
        # (0 where even its one row's reply is over the message limit: the general path says so).
        cfg = loop.cfg
        row = 4 * (e.num_labels if self.scores else e.embedding_dim) + 64  # `_reply_bytes` of one row
        fits = row <= (cfg.max_message_mb << 20) - 4096
        self._plain_max = min(e.spec.max_seq_len, cfg.max_queued_tokens) if fits else 0
        self._vocab = e.spec.vocab_size
        self._ok = loop.metrics.requests.labels("OK")
        self.draining = False  # set at SIGTERM (drain()): new requests are UNAVAILABLE (a balancer retries them elsewhere)
        self._streams: set = set()  # each open EmbedStream, to end it once answered when draining starts

    def drain(self) -> None:
        """SIGTERM: refuse new work, and end each open stream once its requests are answered (an open
        stream otherwise held the server for its whole grace period; its client reopens elsewhere)."""
        self.draining = True
        for stream in list(self._streams):
            stream.settle()

    async def Info(self, request, context):
        return self.info

    def submit(self, request, call, on_done, stream: bool) -> Request:
        """Validate `request`, stamp and trace it, queue it on the engine loop (its message rides
        along as the Request's `tag`); RpcFailure / OverflowError as `_request` / the queue raise."""
        stages = self.loop.stages
        stamps = stages.received(request) if stages is not None else None
        req = self._request(request, on_done)
        req.tag = request
        if stamps is not None:
            stamps[3] = perf_counter_ns()
            req.stamps = stamps
        if self.tracing is not None:
            self.tracing.start(req, request, None if stream else call)
        if stream and request.timeout_ms:
            req.deadline = time.monotonic() + request.timeout_ms / 1e3
        self.loop.submit_nowait(req)
        return req

    def answer(self, call, req: Request, rows, request_id: str = "") -> RpcFailure | None:
        """Build the reply to a completed request and send it on `call`, its stages stamped (built,
        encoded, handed on); the failure to report instead where building it failed."""
        stamps = req.stamps
        if stamps is not None:
            stamps[10] = perf_counter_ns()
        try:
            reply = self._reply(req.tag, req, rows, request_id)
        except Exception as e:  # never leave a request unanswered
            log.exception("building a reply failed (request %r)", request_id)
            return RpcFailure(grpc.StatusCode.INTERNAL, f"could not build the reply: {e}")
        self._ok.inc()
        if stamps is not None:
            self.loop.stages.replying(reply, stamps)
        call.reply(reply)
        if stamps is not None:
            self.loop.stages.written(reply)
        return None

    def _request(self, request: tulip_pb2.EmbedRequest, on_done=None) -> Request:
        """Validate one request; raise RpcFailure with the reason: INVALID_ARGUMENT for a malformed
        one, OUT_OF_RANGE for one this server can never take (more tokens than its whole queue, or a
        reply over its message limit), so a retry is not worth it."""
        if self.draining:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "this server is draining (shutting down); send the "
                             "request to another replica")
        if type(request) is Undecodable:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"malformed EmbedRequest ({request.error})")
        lens = request.lengths
        if len(lens) == 1:  # the online case: one plain sequence (no option set) passes every check below in one test
            n, raw = lens[0], request.token_ids
            if 0 < n <= self._plain_max and len(raw) == n << 2 and no_options(request):
                ids = np.frombuffer(raw, dtype="<u4")  # unsigned: a negative id is huge
                if _MAX(ids) < self._vocab:
                    return Request(ids.view("<i4"), (n,), NO_EXTRAS, on_done)
        try:
            ids, lengths, pool_from, segments = parse_request(request, self.info)
        except ValueError as e:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        cfg = self.loop.cfg
        if len(ids) > cfg.max_queued_tokens:
            raise RpcFailure(grpc.StatusCode.OUT_OF_RANGE, f"request of {len(ids)} tokens exceeds this server's whole "
                             f"queue of {cfg.max_queued_tokens} tokens (--max-queued-tokens); split it")
        if (size := self._reply_bytes(request, len(lengths), len(ids))) > (cfg.max_message_mb << 20) - 4096:
            raise RpcFailure(grpc.StatusCode.OUT_OF_RANGE, f"the reply would be {size / 2**20:.1f} MiB, over this "
                             f"server's message limit of {cfg.max_message_mb} MiB (--max-message-mb); split the request")
        if pool_from is not None and any(pool_from) and self.loop.engine.spec.include_prompt:
            # this model's pooling takes the prompt with the text (the engine pools every token)
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "pool_from: this model pools its prompt with the "
                             "text (sentence-transformers include_prompt: true); send no pool_from")
        extras = frozenset(EXTRAS[o] for o in request.outputs if o in EXTRAS) if request.outputs else NO_EXTRAS
        return Request(ids, lengths, extras, on_done, pool_from, segments)

    def _reply_bytes(self, request, seqs: int, tokens: int) -> int:
        """An upper bound of the reply's size, known before any work."""
        if self.scores:
            return seqs * 4 * self.info.num_labels + 64
        dims = request.dimensions or self.info.embedding_dim
        enc = request.encoding
        row = 4 * dims if not enc else dims if enc == tulip_pb2.ENCODING_INT8 else -(-dims // 8)
        size = seqs * row + 64
        if not request.outputs:
            return size
        if tulip_pb2.OUTPUT_COLBERT in request.outputs:
            size += (tokens - seqs) * self.loop.engine.heads.colbert_dim * 4 + 8 * seqs
        if tulip_pb2.OUTPUT_SPARSE in request.outputs:
            # a varint id and a float per kept token (SPLADE: per vocabulary id), framing per sequence
            size += (seqs * self.info.vocab_size if self.loop.engine.sparse_rows else tokens) * 10 + 8 * seqs
        return size

    def _reply(self, request: tulip_pb2.EmbedRequest, req: Request, vectors: np.ndarray,
               request_id: str = "") -> tulip_pb2.EmbedReply | bytes:
        """The reply for a completed request (the usual one already serialized, see `serialize_reply`)."""
        if self.scores:  # a cross-encoder's rows are its logits
            scores = vectors if request.raw_scores else self.loop.engine.activate(vectors)
            return postprocess.scores_reply(scores, req.num_tokens, request_id)
        if no_reply_options(request) and vectors.dtype == F32:  # the usual case
            return plain_reply(np.ascontiguousarray(vectors), req.num_tokens, request_id)
        extras = req.extras
        return postprocess.embed_reply(
            vectors, Options.from_proto(request), req.num_tokens, request_id,
            sparse=req.sparse if Extra.SPARSE in extras else None,
            colbert=req.colbert if Extra.COLBERT in extras else None,
            colbert_dim=self.loop.engine.heads.colbert_dim if Extra.COLBERT in extras else 0)


class UnaryEmbed:
    """One unary Embed call (a `tulip.h2server.Direct` session): the request is validated and queued
    as its message is decoded; the engine loop's completion callback writes the reply and ends the
    call. No task: a call whose client goes away (or whose deadline passes) drops its queued work."""

    __slots__ = ("servicer", "call", "req")

    def __init__(self, servicer: TulipServicer, call):
        self.servicer, self.call, self.req = servicer, call, None

    def message(self, request) -> None:
        try:
            self.req = self.servicer.submit(request, self.call, self.done, stream=False)
        except (RpcFailure, OverflowError) as e:
            self.fail(e if type(e) is RpcFailure else RpcFailure.of(e))

    def end(self) -> None:
        pass

    def fail(self, e: RpcFailure) -> None:
        self.servicer.loop.metrics.requests.labels(e.code.name).inc()
        self.call.finish(e.code, e.message)

    def done(self, req: Request, rows, error) -> None:
        failure = RpcFailure.of(error) if error is not None else self.servicer.answer(self.call, req, rows)
        if failure is not None:
            return self.fail(failure)
        self.call.finish(grpc.StatusCode.OK)

    def gone(self) -> None:
        req = self.req
        if req is not None and req.pending > 0 and not req.cancelled:
            self.servicer.loop.cancel(req)
            self.servicer.loop.metrics.requests.labels("CANCELLED").inc()


class EmbedStream:
    """One EmbedStream call (a `tulip.h2server.Direct` session): requests tagged with request_id,
    replies in completion order, each written by the engine loop's completion callback. A failed
    request gets a reply with error_code / error_message; the stream and everyone else carry on. The
    call ends once the client has closed its side (or the server is draining) and every request it
    sent is answered; a message with `cancel` drops that request's queued work."""

    __slots__ = ("servicer", "call", "outstanding", "by_id", "closed")

    def __init__(self, servicer: TulipServicer, call):
        self.servicer, self.call = servicer, call
        self.outstanding: set[Request] = set()
        self.by_id: dict[str, Request] = {}  # outstanding requests that carry an id (a cancel names one)
        self.closed = False
        servicer._streams.add(self)

    def message(self, request) -> None:
        s = self.servicer
        if type(request) is not Undecodable and request.cancel:
            req = self.by_id.pop(request.request_id, None)
            if req is not None and req in self.outstanding:  # its caller is gone: drop what is queued
                self.outstanding.discard(req)
                s.loop.cancel(req)
                s.loop.metrics.requests.labels("CANCELLED").inc()
                self.settle()
            return
        try:
            req = s.submit(request, self.call, self.done, stream=True)
        except (RpcFailure, OverflowError) as e:
            return self.fail(request, e if type(e) is RpcFailure else RpcFailure.of(e))
        self.outstanding.add(req)
        if request.request_id:
            self.by_id[request.request_id] = req

    def end(self) -> None:
        self.closed = True
        self.settle()

    def settle(self) -> None:
        """End the call once nothing is left to answer and no more will come (closed, or draining)."""
        if not self.outstanding and (self.closed or self.servicer.draining):
            self.servicer._streams.discard(self)
            self.call.finish(grpc.StatusCode.OK)

    def fail(self, request, error: RpcFailure) -> None:
        self.servicer.loop.metrics.requests.labels(error.code.name).inc()
        self.call.reply(tulip_pb2.EmbedReply(request_id=request.request_id, error_code=error.code.value[0],
                                             error_message=error.message))

    def done(self, req: Request, rows, error) -> None:
        self.outstanding.discard(req)
        request = req.tag
        if request.request_id:
            self.by_id.pop(request.request_id, None)
        failure = RpcFailure.of(error) if error is not None else \
            self.servicer.answer(self.call, req, rows, request.request_id)
        if failure is not None:
            self.fail(request, failure)
        self.settle()

    def gone(self) -> None:
        self.servicer._streams.discard(self)
        for req in self.outstanding:
            self.servicer.loop.cancel(req)
        self.outstanding.clear()


class Undecodable:
    """An Embed message that is not an EmbedRequest: answered INVALID_ARGUMENT on its own (on a
    stream, the stream and its other requests carry on), never UNKNOWN or a dropped stream."""

    request_id = ""  # no id could be read: the reply says so with an empty one
    timeout_ms = 0

    def __init__(self, error: str):
        self.error = error


def decode_request(data: bytes):
    try:
        return tulip_pb2.EmbedRequest.FromString(data)
    except Exception as e:  # protobuf's DecodeError, or whatever a hostile message provokes
        return Undecodable(f"{type(e).__name__}: {e}")


def add_tulip(server, servicer: TulipServicer) -> None:
    """Register the Tulip service on `server`, a `tulip.h2server.Server`: Embed and EmbedStream as
    `Direct` methods (sessions `UnaryEmbed`, `EmbedStream`), Info as a grpcio method handler. The
    (de)serializers are wrapped to stamp the decode / encode points when stage recording is on; a
    message that does not decode reaches the session as `Undecodable`; a reply may come already
    serialized, `serialize_reply`."""
    stages = servicer.loop.stages
    req_in, rep_out = decode_request, serialize_reply
    if stages is not None:
        req_in, rep_out = stages.deserializer(req_in), stages.serializer(rep_out)
    handlers = {
        "Embed": Direct(lambda call: UnaryEmbed(servicer, call), req_in, rep_out, False, False),
        "EmbedStream": Direct(lambda call: EmbedStream(servicer, call), req_in, rep_out, True, True),
        "Info": grpc.unary_unary_rpc_method_handler(servicer.Info, tulip_pb2.InfoRequest.FromString,
                                                    tulip_pb2.InfoReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


def log_stages(stages) -> None:
    if stages is not None and stages.ring:
        log.info("tulip: stage p50 over the last %d requests (ms): %s", len(stages.ring),
                 ", ".join(f"{k} {v['p50_ms']:.4f}" for k, v in stages.summary().items()))


def make_server(cfg: TulipConfig):
    """The gRPC server `--grpc-server` names: ours (`tulip.h2server.Server`) or grpc.aio's
    (`tulip.aioserver.AioServer`, TLS where asked); the same registration calls serve either."""
    if cfg.grpc_server == "ours":
        return Server(max_message=cfg.max_message_mb << 20)
    from tulip.aioserver import AioServer

    tls = None
    if cfg.tls_cert:
        try:
            tls = (Path(cfg.tls_cert).read_bytes(), Path(cfg.tls_key).read_bytes())
        except OSError as e:
            raise ValueError(f"cannot read a TLS file: {e}") from None
    return AioServer(cfg.max_message_mb << 20, tls)


async def serve(cfg: TulipConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain, return the exit code."""
    server = make_server(cfg)  # first: a bad server setting fails before the model loads
    ref = resolve(cfg.model, cfg.revision)  # a Hub id: downloaded here if the cache lacks it (trellis.modelref)
    log.log(logging.WARNING if ref.random_weights else logging.INFO, "model %s", ref.describe())
    engine = Engine(EngineConfig(str(ref.path), cfg.device, cfg.dtype, cfg.attention, cfg.graphs, compile=cfg.compile,
                                 attention_table=cfg.attention_table, kernel_tokens=cfg.kernel_tokens))
    if not cfg.max_batch_tokens:
        budget = max(DEFAULT_BATCH_TOKENS, engine.spec.max_seq_len)
        if cfg.max_queued_tokens < budget:
            raise ValueError(f"max_queued_tokens {cfg.max_queued_tokens} is below this model's step budget {budget} "
                             f"({DEFAULT_BATCH_TOKENS}, or its maximum length where longer); raise it")
        cfg = replace(cfg, max_batch_tokens=budget)
    if cfg.max_batch_tokens < engine.spec.max_seq_len:
        raise ValueError(
            f"max_batch_tokens {cfg.max_batch_tokens} is smaller than the model's max sequence length "
            f"{engine.spec.max_seq_len}"
        )
    if engine.runner is not None and cfg.max_inflight > engine.runner.cfg.ring:
        raise ValueError(f"max_inflight {cfg.max_inflight} exceeds the engine's ring of {engine.runner.cfg.ring} "
                         "result buffers")
    warm_up(engine, cfg.warmup)
    # Everything loaded so far lives as long as the process: keep it out of the collector's
    # scans, so a full collection while serving is short.
    gc.collect()
    gc.freeze()
    metrics = TulipMetrics(engine)
    if cfg.metrics_port:
        metrics.serve(cfg.metrics_port, cfg.host)
    loop = EngineLoop(engine, cfg, metrics)
    served_name = cfg.served_model_name or ref.name
    if cfg.otlp_endpoint:  # imported only then: without it no OpenTelemetry SDK module is loaded
        from tulip.tracing import Tracing

        loop.tracing = Tracing(cfg.otlp_endpoint, served_name, f"{cfg.host}:{cfg.port}")
    loop.start()
    servicer = TulipServicer(loop, served_name, ref)
    add_tulip(server, servicer)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = await server.listen(cfg.host, cfg.port)
    if cfg.uds:
        await server.listen_unix(cfg.uds)
    if cfg.grpc_server == "grpcio":
        await server.start()  # grpc.aio serves once every port is added
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("tulip serving %s on %s:%d (%s gRPC server%s)", servicer.info.model, cfg.host, port, cfg.grpc_server,
             ", TLS" if cfg.tls_cert else "")
    print(f"TULIP_READY {cfg.host}:{port}" + (f" unix:{cfg.uds}" if cfg.uds else ""), flush=True)

    stop = asyncio.Event()
    aloop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        aloop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("tulip: draining (up to %.1f s)", cfg.drain_seconds)
    # NOT_SERVING first: a balancer watching health (Ivy) stops sending here at once; then new work that
    # still arrives, on open streams too, is UNAVAILABLE (sent elsewhere); what is in flight finishes,
    # and each open stream ends once its requests are answered (drain()).
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    servicer.drain()
    await server.stop(grace=cfg.drain_seconds)
    await loop.stop(cfg.drain_seconds)
    if loop.tracing is not None:
        loop.tracing.shutdown()
    log_stages(loop.stages)
    log.info("tulip: stopped")
    return 0

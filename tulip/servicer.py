"""Tulip's gRPC servicer: Embed and EmbedStream as callback sessions (`UnaryEmbed`, `EmbedStream`: a
request validated and queued on the engine loop as its message is decoded, its reply written by the
engine loop's completion callback, with no task, iterator or generator in between), Info, drain's
refusal of new work, and their registration on a server (`add_tulip`). What a request and a reply
are on the wire is tulip.messages'; start-up and the process's life are tulip.server's."""

from __future__ import annotations

import logging
import time
from time import perf_counter_ns

import grpc
import numpy as np

from rose.extras import Extra
from trellis import postprocess
from trellis.modelref import ModelRef
from trellis.options import Options, no_options, no_reply_options
from trellis.tulip.v1 import tulip_pb2
from tulip.h2server import Direct
from tulip.loop import EngineLoop, Request
from tulip.messages import (EXTRAS, F32, NO_EXTRAS, PRIORITIES, Images, Undecodable, bad_priority, decode_request,
                            parse_images, parse_request, plain_reply, serialize_reply)
from tulip.stages import RESUME, VALIDATE

log = logging.getLogger("tulip")
SERVICE_NAME = "trellis.tulip.v1.Tulip"
_MAX = np.maximum.reduce  # an array's max without ndarray.max's Python wrapper


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
            image_size=e.image_size,
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
        if type(request) is Images:  # a big image request, its pixels cut from the message's bytes
            request, pixels = request.request, request.pixels
            req = self._request(request, on_done, pixels)
        else:
            req = self._request(request, on_done)
        req.tag = request
        if stamps is not None:
            stamps[VALIDATE] = perf_counter_ns()
            req.stamps = stamps
        if self.tracing is not None:
            self.tracing.start(req, request, None if stream else call)
        if stream and request.timeout_ms:
            req.deadline = time.monotonic() + request.timeout_ms / 1e3
        self.loop.submit_nowait(req, getattr(call, "stalled", False))  # (held: its client takes no replies)
        return req

    def answer(self, call, req: Request, rows, request_id: str = "") -> RpcFailure | None:
        """Build the reply to a completed request and send it on `call`, its stages stamped (built,
        encoded, handed on); the failure to report instead where building it failed."""
        stamps = req.stamps
        if stamps is not None:
            stamps[RESUME] = perf_counter_ns()
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

    def _request(self, request: tulip_pb2.EmbedRequest, on_done=None, pixels: np.ndarray | None = None) -> Request:
        """Validate one request; raise RpcFailure with the reason: INVALID_ARGUMENT for a malformed
        one, OUT_OF_RANGE for one this server can never take (more tokens than its whole queue, or a
        reply over its message limit), so a retry is not worth it. `pixels`: an image request's, cut
        from its message (tulip.messages.Images)."""
        if self.draining:
            raise RpcFailure(grpc.StatusCode.UNAVAILABLE, "this server is draining (shutting down); send the "
                             "request to another replica")
        if type(request) is Undecodable:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, f"malformed EmbedRequest ({request.error})")
        priority = request.priority  # the scheduling class (a transport field: no option, no fast-path test)
        if priority and priority not in PRIORITIES:  # proto3 enums are open: an unknown number arrives as is
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, bad_priority(priority))
        if pixels is not None:
            return self._images(request, on_done, priority, pixels)
        lens = request.lengths
        if len(lens) == 1:  # the online case: one plain sequence (no option set) passes every check below in one test
            n, raw = lens[0], request.token_ids
            if 0 < n <= self._plain_max and len(raw) == n << 2 and no_options(request) and not (
                    request.images or request.pixels):  # (~0.09 us: an image field beside ids is refused below)
                ids = np.frombuffer(raw, dtype="<u4")  # unsigned: a negative id is huge
                if _MAX(ids) < self._vocab:
                    return Request(ids.view("<i4"), (n,), NO_EXTRAS, on_done, None, None, priority)
        if request.images or request.pixels:
            return self._images(request, on_done, priority)
        try:
            ids, lengths, pool_from, segments = parse_request(request, self.info)
        except ValueError as e:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        self._check_size(request, len(lengths), len(ids), f"request of {len(ids)} tokens")
        if pool_from is not None and any(pool_from) and self.loop.engine.spec.include_prompt:
            # this model's pooling takes the prompt with the text (the engine pools every token)
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, "pool_from: this model pools its prompt with the "
                             "text (sentence-transformers include_prompt: true); send no pool_from")
        extras = frozenset(EXTRAS[o] for o in request.outputs if o in EXTRAS) if request.outputs else NO_EXTRAS
        return Request(ids, lengths, extras, on_done, pool_from, segments, priority)

    def _images(self, request: tulip_pb2.EmbedRequest, on_done, priority: int,
                pixels: np.ndarray | None = None) -> Request:
        """An image request (`pixels`, `images`) checked against the model's image tower; its images are
        budgeted at the tower's tokens each (patches and class token: `Engine.image_tokens`). `pixels`: the
        uint8 bytes cut from a big message (tulip.messages.Images), else `request.pixels` is read once (each
        read of a bytes field is a copy)."""
        if pixels is None:
            pixels = np.frombuffer(request.pixels, dtype=np.uint8)
        try:
            n, lens = parse_images(request, self.info, self.loop.engine.image_tokens, pixels.size)
        except ValueError as e:
            raise RpcFailure(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        self._check_size(request, n, sum(lens), f"request of {n} images ({sum(lens)} tokens)")
        side = self.info.image_size
        return Request(None, lens, NO_EXTRAS, on_done, None, None, priority, pixels=pixels.reshape(n, side, side, 3))

    def _check_size(self, request, seqs: int, tokens: int, what: str) -> None:
        """OUT_OF_RANGE for a request this server can never take: more tokens than its whole queue, or a reply
        over its message limit (so a retry is not worth it)."""
        cfg = self.loop.cfg
        if tokens > cfg.max_queued_tokens:
            raise RpcFailure(grpc.StatusCode.OUT_OF_RANGE, f"{what} exceeds this server's whole queue of "
                             f"{cfg.max_queued_tokens} tokens (--max-queued-tokens); split it")
        if (size := self._reply_bytes(request, seqs, tokens)) > (cfg.max_message_mb << 20) - 4096:
            raise RpcFailure(grpc.StatusCode.OUT_OF_RANGE, f"the reply would be {size / 2**20:.1f} MiB, over this "
                             f"server's message limit of {cfg.max_message_mb} MiB (--max-message-mb); split the request")

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

    def hold(self) -> None:
        """The connection takes no replies (tulip.h2conn, Limits.hold_s): its queued work waits."""
        if self.req is not None:
            self.servicer.loop.hold((self.req,))

    def resume(self) -> None:
        if self.req is not None:
            self.servicer.loop.resume((self.req,))

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

    def hold(self) -> None:
        """The connection takes no replies (tulip.h2conn, Limits.hold_s): the queued work waits."""
        self.servicer.loop.hold(self.outstanding)

    def resume(self) -> None:
        self.servicer.loop.resume(sorted(self.outstanding, key=lambda r: r.queued_at))

    def gone(self) -> None:
        self.servicer._streams.discard(self)
        for req in self.outstanding:
            self.servicer.loop.cancel(req)
        self.outstanding.clear()


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
        # (arrays: a big request comes as a writable array, its pixels cut from it, tulip.messages.decode_request)
        "Embed": Direct(lambda call: UnaryEmbed(servicer, call), req_in, rep_out, False, False, True),
        "EmbedStream": Direct(lambda call: EmbedStream(servicer, call), req_in, rep_out, True, True, True),
        "Info": grpc.unary_unary_rpc_method_handler(servicer.Info, tulip_pb2.InfoRequest.FromString,
                                                    tulip_pb2.InfoReply.SerializeToString),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


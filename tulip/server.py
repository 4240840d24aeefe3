"""Tulip's process: the gRPC server `--grpc-server` names (`make_server`), start-up (the model loaded,
the batch budget checked, warm-up, metrics, the engine loop, the services registered, health), serving
until SIGTERM / SIGINT, then the drain (NOT_SERVING first, then new work refused) and the stage log.

One asyncio event loop runs the gRPC server (tulip.h2server, or grpc.aio's with `--grpc-server
grpcio`, tulip.aioserver: unary `Embed`, streaming `EmbedStream`, `Info`, health) and the engine
loop (`tulip.loop.EngineLoop`: FCFS batches, overlapped steps, results scattered to the waiting
requests). Embed and EmbedStream are served by callbacks (tulip.servicer's `UnaryEmbed`, `EmbedStream`):
a request is validated and queued as its message is decoded (tulip.messages), and its reply written by
the engine loop's completion callback, with no task, iterator or generator in between. A bad request is
answered INVALID_ARGUMENT before it is queued; an engine failure fails only the requests in that batch.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from dataclasses import replace
from pathlib import Path

from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rose.engine import Engine, EngineConfig
from trellis.modelref import resolve
from tulip.config import TulipConfig
from tulip.h2server import Server
from tulip.loop import EngineLoop
from tulip.warmup import warm_up
from tulip.messages import parse_request, plain_reply, serialize_reply
from tulip.metrics import TulipMetrics
from tulip.servicer import SERVICE_NAME, RpcFailure, TulipServicer, add_tulip

# parse_request ... add_tulip live in tulip.messages and tulip.servicer; named here too, where tests and
# benchmarks (hop, servers, step_host, also run against older source trees) import them from
__all__ = ["RpcFailure", "TulipServicer", "add_tulip", "log_stages", "make_server", "parse_request", "plain_reply",
           "serialize_reply", "serve"]

log = logging.getLogger("tulip")
DEFAULT_BATCH_TOKENS = 16384  # --max-batch-tokens 0: this, or the model's max sequence length where longer


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
                                 attention_table=cfg.attention_table, kernel_tokens=cfg.kernel_tokens,
                                 quantization=cfg.quantization, fp8_min_tokens=cfg.fp8_min_tokens,
                                 online_lane_tokens=cfg.online_lane_tokens))
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
    warm_up(engine, cfg.warmup, cfg.max_batch_tokens)  # (the shape classes up to a step's budget)
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

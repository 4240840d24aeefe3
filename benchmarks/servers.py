"""Tulip's two gRPC servers side by side: ours (`tulip.h2server`) and grpc.aio's (`--grpc-server grpcio`,
`tulip.aioserver`), the same servicer and engine loop behind each.

    python -m benchmarks.servers                                   # both, null engine: the transport alone
    python -m benchmarks.servers --grpc-server grpcio              # one of them
    python -m benchmarks.servers --model preset:bge-m3 --out benchmarks/results/DATE_MACHINE_servers-REV   # a GPU

Each server runs in a process of its own, built as `python -m tulip` builds it (`tulip.server.make_server`
from a TulipConfig with that `grpc_server`, `add_tulip`, grpc_health), over `benchmarks.hop`'s null engine
(`--device-ms`: a step that completes that much later; 0: at once) or, with `--model`, the real engine.
Both are up at once and measured in alternating rounds (`--rounds`), so a noisy host's drift falls on
both alike. Clients, one pre-tokenized 1 x `--length` request at a time: `trellis.client` (Ivy's: the
EmbedStream on our own framing, unary on grpc.aio) in this process, and `benchmarks.protoclient` (grpcio's
sync and asyncio stubs, from the proto alone) in a process of its own. One JSON object per (server,
client, transport) on stdout (`bench: "servers"`; protoclient's rows: the median over rounds of each
round's p50 / p99), then a table of p50 / p99 per server and ours minus grpcio's on stderr.
`--server-io inline` runs grpc.aio's server on gRPC's iomgr (`benchmarks.hop.INLINE_IO`, sockets polled
on the completion-queue thread) instead of grpc's default, as `GRPC_EXPERIMENTS` would for a Tulip.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import Recorder, free_port, model_tag, percentiles, run_client
from benchmarks.hop import INLINE_IO, _environ, _proto_client, _wait_ready

SERVERS = ("ours", "grpcio")


def _serve(kind: str, port: int, args: dict, ready) -> None:
    import uvloop
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from benchmarks.hop import NullEngine
    from tulip.config import TulipConfig
    from tulip.loop import EngineLoop
    from tulip.server import TulipServicer, add_tulip, make_server

    async def main():
        if args["model"]:
            from rose.engine import Engine, EngineConfig

            engine = Engine(EngineConfig(model=args["model"], attention=args["attention"], compile=args["compile"]))
        else:
            engine = NullEngine(args["device_ms"])
        cfg = TulipConfig(grpc_server=kind, spin_ms=args["spin_ms"],
                          max_batch_tokens=max(16384, engine.spec.max_seq_len), max_queued_tokens=1 << 22)
        loop = EngineLoop(engine, cfg)
        loop.start()
        server = make_server(cfg)
        add_tulip(server, TulipServicer(loop, "bench"))
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        await server.listen("127.0.0.1", port)
        if kind == "grpcio":
            await server.start()
        await hs.set("", health_pb2.HealthCheckResponse.SERVING)
        gc.collect()  # as tulip.server.serve does: what is loaded stays out of the collector's scans
        gc.freeze()
        ready.put({})
        await asyncio.Event().wait()  # until the parent terminates this process

    uvloop.install()
    asyncio.run(main())


async def _client_rounds(targets: dict, transport: str, n: int, rounds: int, length: int) -> dict:
    """trellis.client: 200 warm-up requests per server, then `rounds` alternating rounds of n / rounds each;
    every request's round trip in ms, by server."""
    from trellis.client import TulipClient

    seq = [np.arange(5, 5 + length, dtype=np.int32)]
    clients = {k: TulipClient(t, transport=transport) for k, t in targets.items()}
    times: dict[str, list[float]] = {k: [] for k in targets}
    try:
        for c in clients.values():
            for _ in range(200):
                await c.embed(seq)
        for _ in range(rounds):
            for k, c in clients.items():
                for _ in range(max(1, n // rounds)):
                    t0 = time.perf_counter_ns()
                    await c.embed(seq)
                    times[k].append((time.perf_counter_ns() - t0) / 1e6)
    finally:
        for c in clients.values():
            await c.close()
    return times


def table(rows: list[dict], kinds: tuple[str, ...]) -> str:
    """p50 / p99 per (client, transport) and server, and ours minus grpcio's where both ran."""
    keys = list(dict.fromkeys((r["client"], r["transport"]) for r in rows))
    by = {(r["client"], r["transport"], r["grpc_server"]): r for r in rows}
    head = "client          transport " + "".join(f"{k + ' p50 / p99 ms':>24}" for k in kinds)
    both = set(kinds) == set(SERVERS)
    lines = [head + ("   ours - grpcio (p50)" if both else "")]
    for client, transport in keys:
        cells = [by.get((client, transport, k)) for k in kinds]
        line = f"{client:<15} {transport:<9} " + "".join(
            f"{c['p50_ms']:>14.3f} / {c['p99_ms']:<7.3f}" if c else f"{'-':>24}" for c in cells)
        if both and all(cells):
            line += f"   {by[client, transport, 'ours']['p50_ms'] - by[client, transport, 'grpcio']['p50_ms']:+.3f}"
        lines.append(line)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--grpc-server", default="ours,grpcio",
                    help="the servers to measure, comma-separated: ours, grpcio (default both)")
    ap.add_argument("--n", type=int, default=3000, help="timed requests per server and client row")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds the requests are split into")
    ap.add_argument("--length", type=int, default=128, help="tokens of the one sequence per request")
    ap.add_argument("--device-ms", type=float, default=0.0, help="the null engine's step time")
    ap.add_argument("--spin-ms", type=float, default=10.0, help="Tulip's --spin-ms")
    ap.add_argument("--model", default="", help="serve this model (e.g. preset:bge-m3) with the real engine instead "
                    "of the null one")
    ap.add_argument("--attention", default="auto", help="with --model")
    ap.add_argument("--compile", action="store_true", help="with --model")
    ap.add_argument("--proto", action=argparse.BooleanOptionalAction, default=True,
                    help="also time benchmarks.protoclient's grpcio sync / aio clients")
    ap.add_argument("--server-io", choices=("default", "inline"), default="default",
                    help="grpc.aio's server on grpc's default I/O or on gRPC's iomgr (INLINE_IO)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    kinds = tuple(k for k in args.grpc_server.split(",") if k)
    if not kinds or set(kinds) - set(SERVERS):
        ap.error(f"--grpc-server {args.grpc_server!r}: a comma-separated list of {', '.join(SERVERS)}")

    rec = Recorder(args.out, f"servers_{model_tag(args.model) if args.model else f'null-{args.device_ms:g}ms'}")
    ctx = mp.get_context("spawn")
    procs, targets = [], {}
    try:
        for kind in kinds:
            port, ready = free_port(), ctx.Queue()
            p = ctx.Process(target=_serve, args=(kind, port, vars(args), ready), daemon=True)
            with _environ({"GRPC_EXPERIMENTS": INLINE_IO} if args.server_io == "inline" and kind == "grpcio" else {}):
                p.start()
            procs.append(p)
            _wait_ready(p, ready, 900)
            targets[kind] = f"127.0.0.1:{port}"
        common = dict(bench="servers", server=f"tulip + {args.model or 'null engine'}", shape=f"1x{args.length}",
                      device_ms=None if args.model else args.device_ms, spin_ms=args.spin_ms, cpus=os.cpu_count(),
                      server_io=args.server_io)
        for transport in ("stream", "unary"):
            times = run_client(_client_rounds(targets, transport, args.n, args.rounds, args.length))
            for kind in kinds:
                rec.emit(**common, grpc_server=kind, client="trellis.client", transport=transport, **percentiles(times[kind]))
        if args.proto:
            runs: dict = {}
            for _ in range(args.rounds):
                for kind in kinds:
                    for r in _proto_client(targets[kind], max(1, args.n // args.rounds)):
                        runs.setdefault((kind, r["client"], r["transport"]), []).append(r)
            for (kind, client, transport), rs in runs.items():
                rec.emit(**common, grpc_server=kind, client=f"grpcio {client}", transport=transport,
                         n=sum(r["n"] for r in rs), rounds=len(rs),
                         p50_ms=round(statistics.median(r["p50_ms"] for r in rs), 4),
                         p99_ms=round(statistics.median(r["p99_ms"] for r in rs), 4))
    finally:
        for p in procs:
            p.terminate()
            p.join(10)
    print(table(rec.rows, kinds), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

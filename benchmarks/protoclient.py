"""A minimal Tulip client written from the proto alone: grpcio and the generated stubs, nothing else.

    python -m benchmarks.protoclient 127.0.0.1:50051 [--n 3000] [--warmup 200] [--length 128]
        [--clients sync,aio] [--transports unary,stream]

An independent check on `benchmarks.hop` (whose client is `trellis.client`): one pre-tokenized
1 x `--length` request at a time, p50 / p99 of the round trip, one JSON object per (client,
transport) on stdout: `bench: "hop-proto"`, `client` (`sync`: grpc's blocking stubs, what an
internal scorer would write; `aio`: grpc.aio on the default asyncio loop), `transport`, `n`,
`p50_ms`, `p99_ms`, `mean_ms`. It imports nothing from tulip, ivy, rose or benchmarks (run it
with only grpcio, protobuf and the repository's `trellis/` on the path); `benchmarks.hop` runs it
in a process of its own and adds the environment fields.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import statistics
import struct
import sys
import time

import grpc

from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc


def make_request(length: int) -> tulip_pb2.EmbedRequest:
    ids = struct.pack(f"<{length}i", *range(5, 5 + length))
    return tulip_pb2.EmbedRequest(token_ids=ids, lengths=[length])


def check(reply: tulip_pb2.EmbedReply, length: int) -> None:
    if reply.error_code:
        raise RuntimeError(f"Tulip answered error {reply.error_code}: {reply.error_message}")
    if reply.shape[0] != 1 or len(reply.embeddings) != 4 * reply.shape[1] or reply.prompt_tokens != length:
        raise RuntimeError(f"unexpected reply: shape {list(reply.shape)}, {len(reply.embeddings)} bytes, "
                           f"{reply.prompt_tokens} prompt tokens")


def stats(ms: list[float]) -> dict:
    s = sorted(ms)
    return {"n": len(s), "p50_ms": round(statistics.median(s), 4),
            "p99_ms": round(s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))], 4),
            "mean_ms": round(sum(s) / len(s), 4)}


def sync_unary(target: str, req, n: int, warmup: int, length: int) -> list[float]:
    with grpc.insecure_channel(target) as ch:
        embed = tulip_pb2_grpc.TulipStub(ch).Embed
        ts = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            reply = embed(req)
            ts.append((time.perf_counter() - t0) * 1e3)
            check(reply, length)
    return ts[warmup:]


def sync_stream(target: str, req, n: int, warmup: int, length: int) -> list[float]:
    """One open EmbedStream; the request iterator is fed from this thread through a queue (how a
    blocking caller multiplexes a bidi stream with grpc's sync API)."""
    q: queue.SimpleQueue = queue.SimpleQueue()
    with grpc.insecure_channel(target) as ch:
        replies = tulip_pb2_grpc.TulipStub(ch).EmbedStream(iter(q.get, None))
        ts = []
        try:
            for i in range(warmup + n):
                req.request_id = str(i)
                t0 = time.perf_counter()
                q.put(req)
                reply = next(replies)
                ts.append((time.perf_counter() - t0) * 1e3)
                check(reply, length)
                if reply.request_id != str(i):
                    raise RuntimeError(f"reply for {reply.request_id!r}, expected {i}")
        finally:
            q.put(None)
            replies.cancel()
    return ts[warmup:]


async def aio_unary(target: str, req, n: int, warmup: int, length: int) -> list[float]:
    async with grpc.aio.insecure_channel(target) as ch:
        embed = tulip_pb2_grpc.TulipStub(ch).Embed
        ts = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            reply = await embed(req)
            ts.append((time.perf_counter() - t0) * 1e3)
            check(reply, length)
    return ts[warmup:]


async def aio_stream(target: str, req, n: int, warmup: int, length: int) -> list[float]:
    async with grpc.aio.insecure_channel(target) as ch:
        call = tulip_pb2_grpc.TulipStub(ch).EmbedStream()
        ts = []
        for i in range(warmup + n):
            req.request_id = str(i)
            t0 = time.perf_counter()
            await call.write(req)
            reply = await call.read()
            ts.append((time.perf_counter() - t0) * 1e3)
            check(reply, length)
        await call.done_writing()
    return ts[warmup:]


RUNS = {("sync", "unary"): sync_unary, ("sync", "stream"): sync_stream,
        ("aio", "unary"): aio_unary, ("aio", "stream"): aio_stream}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="HOST:PORT or unix:PATH of a Tulip (or of benchmarks.hop's echo)")
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--clients", default="sync,aio")
    ap.add_argument("--transports", default="unary,stream")
    args = ap.parse_args(argv)
    for client in args.clients.split(","):
        for transport in args.transports.split(","):
            run = RUNS.get((client, transport))
            if run is None:
                raise SystemExit(f"no {client!r} client for transport {transport!r} (clients: sync, aio; "
                                 "transports: unary, stream)")
            req = make_request(args.length)
            call = run(args.target, req, args.n, args.warmup, args.length)
            ts = asyncio.run(call) if asyncio.iscoroutine(call) else call
            print(json.dumps({"bench": "hop-proto", "client": client, "transport": transport,
                              "shape": f"1x{args.length}", **stats(ts)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

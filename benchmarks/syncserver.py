"""The other gRPC server arrangement, as echo floors: grpc's sync server (a thread pool) beside grpc.aio.

    python -m benchmarks.syncserver sync|bridge|bridge-spin PORT [--workers 8]

`sync`: an echo servicer on `grpc.server(ThreadPoolExecutor)`, the sync server's own floor.
`bridge`: the same, but each unary reply is made on an asyncio (uvloop) loop in another thread
and handed back through a future, the least a sync front to Tulip's asyncio engine loop costs;
`bridge-spin`: that loop kept polling as Tulip's --spin-ms keeps its own (the handler threads then
wait for the GIL the spinning loop holds: the interpreter's switch interval shows in the p99).
Streams are echoed on the handler thread in all three. `benchmarks.hop` serves these beside its
grpc.aio echo and times them with `benchmarks.protoclient`; prints READY once listening.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures as cf
import threading

import grpc

from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc

REPLY = tulip_pb2.EmbedReply(embeddings=bytes(4096), shape=[1, 1024], prompt_tokens=128)


class SyncEcho(tulip_pb2_grpc.TulipServicer):
    def Embed(self, request, context):
        return REPLY

    def EmbedStream(self, request_iterator, context):
        for r in request_iterator:
            rep = tulip_pb2.EmbedReply()
            rep.CopyFrom(REPLY)
            rep.request_id = r.request_id
            yield rep


class BridgedEcho(SyncEcho):
    """Unary replies made on an asyncio loop in another thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def Embed(self, request, context):
        fut: cf.Future = cf.Future()
        self.loop.call_soon_threadsafe(fut.set_result, REPLY)
        return fut.result()


def _run_loop(loop: asyncio.AbstractEventLoop, spin: bool) -> None:
    asyncio.set_event_loop(loop)
    if spin:
        def tick():
            loop.call_soon(tick)

        loop.call_soon(tick)
    loop.run_forever()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("sync", "bridge", "bridge-spin"))
    ap.add_argument("port", type=int)
    ap.add_argument("--workers", type=int, default=8)
    args = ap.parse_args(argv)
    server = grpc.server(cf.ThreadPoolExecutor(args.workers))
    if args.kind == "sync":
        servicer = SyncEcho()
    else:
        try:
            import uvloop

            loop = uvloop.new_event_loop()
        except ImportError:
            loop = asyncio.new_event_loop()
        threading.Thread(target=_run_loop, args=(loop, args.kind == "bridge-spin"), daemon=True).start()
        servicer = BridgedEcho(loop)
    tulip_pb2_grpc.add_TulipServicer_to_server(servicer, server)
    if not server.add_insecure_port(f"127.0.0.1:{args.port}"):
        raise OSError(f"could not bind 127.0.0.1:{args.port}")
    server.start()
    print("READY", flush=True)
    server.wait_for_termination()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

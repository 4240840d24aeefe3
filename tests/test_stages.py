"""Stage timestamps (tulip.stages): a request served through the servicer, with the stamping
(de)serializers gRPC would call, stamps every point in order; off, nothing is recorded."""

import asyncio

import numpy as np

from benchmarks.hop import NullEngine
from trellis.tulip.v1 import tulip_pb2
from tulip.config import TulipConfig
from tulip.loop import EngineLoop
from tulip.server import TulipServicer, serialize_reply
from tulip.stages import POINTS


class Context:
    def __init__(self):
        self.callbacks = []

    async def abort(self, code, message):
        raise AssertionError(f"{code.name}: {message}")

    def add_done_callback(self, cb):
        self.callbacks.append(cb)


def serve(engine, stages: int, n: int = 5):
    async def main():
        loop = EngineLoop(engine, TulipConfig(max_batch_tokens=512, stage_samples=stages))
        loop.start()
        servicer = TulipServicer(loop, "t")
        rec = loop.stages
        decode = rec.deserializer(tulip_pb2.EmbedRequest.FromString) if rec else tulip_pb2.EmbedRequest.FromString
        encode = rec.serializer(serialize_reply) if rec else serialize_reply
        wire = [tulip_pb2.EmbedRequest(token_ids=np.full(k + 1, 7 + k, dtype="<i4").tobytes(), lengths=[k + 1],
                                       request_id=str(k)).SerializeToString() for k in range(n)]
        for data in wire:  # unary, as grpc.aio calls it: decode, handler, encode, done callbacks
            ctx = Context()
            encode(await servicer.Embed(decode(data), ctx))
            for cb in ctx.callbacks:
                cb(ctx)

        async def incoming():
            for data in wire:
                yield decode(data)

        async for reply in servicer.EmbedStream(incoming(), Context()):
            encode(reply)
        await loop.stop()
        return rec

    return asyncio.run(main())


def test_every_point_is_stamped_in_order():
    rec = serve(NullEngine(20), stages=100)
    assert len(rec.ring) == 10  # five unary, five streamed
    for stamps in rec.ring:
        assert all(stamps), stamps
        assert stamps == sorted(stamps)
    summary = rec.summary()
    assert set(summary) == set(POINTS[1:]) | {"total"}
    assert all(s["n"] == 10 for s in summary.values())
    assert summary["wait"]["p50_ms"] > 10  # the null engine's steps take 20 ms
    assert not rec._decoded and not rec._replies  # every stamped message was claimed


def test_off_by_default():
    assert serve(NullEngine(0), stages=0) is None

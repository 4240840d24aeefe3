"""The online request's fast paths in Tulip and ROSE give what the general paths give: the one
plain sequence's validation (same Request, same errors), its one-sequence Batch, and the usual
reply serialized straight from the rows (byte for byte the EmbedReply message's serialization).
A served request, answered or refused, leaves no reference cycle behind (the collector's pauses
land on the loop: they were most of unary Embed's p99)."""

import asyncio
import gc

import grpc
import numpy as np
import pytest

from benchmarks.hop import NullEngine
from rose.batch import Batch
from trellis.tulip.v1 import tulip_pb2
from tulip.config import TulipConfig
from tulip.loop import EngineLoop
from tulip.server import RpcFailure, TulipServicer, parse_request, plain_reply, serialize_reply

VOCAB = 250002  # NullEngine's


@pytest.fixture(scope="module")
def servicer():
    return TulipServicer(EngineLoop(NullEngine(0), TulipConfig(max_batch_tokens=16384)), "t")


def one(ids, n=None, **kw):
    ids = np.asarray(ids, dtype="<i4")
    return tulip_pb2.EmbedRequest(token_ids=ids.tobytes(), lengths=[len(ids) if n is None else n], **kw)


@pytest.mark.parametrize("ids", [[5], [0, VOCAB - 1], list(range(5, 133)), [7] * 8192])
def test_one_plain_sequence_is_the_general_paths_request(servicer, ids):
    request = one(ids)
    req = servicer._request(request)
    want, lengths, pool_from, segments = parse_request(request, servicer.info)
    assert req.ids.dtype == want.dtype and np.array_equal(req.ids, want)
    assert req.lengths == lengths and req.num_tokens == len(ids)
    assert req.pool_from is pool_from is None and req.segments is segments is None and not req.extras
    assert req.rows is None and req.sparse is None and req.colbert is None


@pytest.mark.parametrize("request_", [
    one([5, -1]), one([5, VOCAB]), one([5, 6, 7], n=2), one([5, 6], n=3), one([7] * 8193), one([], n=0),
    one([5, 6], dimensions=2048), one([5, 6], encoding=tulip_pb2.ENCODING_INT8),
    one([5, 6], outputs=[tulip_pb2.OUTPUT_SPARSE]), one([5, 6], pool_from=[2]), one([5, 6], segment_starts=[1]),
    one([5, 6], raw_scores=True),
    tulip_pb2.EmbedRequest(token_ids=b"\x05\x00\x00", lengths=[1]),
], ids=lambda r: str(r).replace("\n", " ")[:60])
def test_one_bad_sequence_fails_as_the_general_path_says(servicer, request_):
    """Everything the one-test gate lets by to the general path is refused with its message."""
    with pytest.raises(ValueError) as general:
        parse_request(request_, servicer.info)
    with pytest.raises(RpcFailure) as served:
        servicer._request(request_)
    assert served.value.message == str(general.value)


def test_one_sequence_batch_is_the_general_batch():
    """The one-sequence batch (shared positions / seq_ids, cached cu_seqlens) against the general
    path's: the same sequence packed after another, cut back out."""
    for n in (1, 3, 128, 5000):
        ids = np.arange(7, 7 + n, dtype=np.int32)
        fast = Batch.from_sequences([ids])
        both = Batch.from_sequences([np.array([1, 2], dtype=np.int32), ids])
        assert fast.input_ids.dtype == both.input_ids.dtype and fast.input_ids.tolist() == both.input_ids[2:].tolist()
        assert fast.positions.dtype == both.positions.dtype and fast.positions.tolist() == both.positions[2:].tolist()
        assert fast.seq_ids.dtype == both.seq_ids.dtype and fast.seq_ids.tolist() == (both.seq_ids[2:] - 1).tolist()
        assert fast.cu_seqlens.dtype == both.cu_seqlens.dtype and fast.cu_seqlens.tolist() == [0, n]
        assert (fast.max_seqlen, fast.seq_lens, fast.segment_starts) == (n, (n,), None)
        assert Batch.from_sequences([ids]).cu_seqlens is fast.cu_seqlens  # kept per length


@pytest.mark.parametrize("rows, dim", [(1, 1024), (1, 3), (3, 64), (200, 8)])
@pytest.mark.parametrize("tokens", [0, 1, 127, 128, 300000])
@pytest.mark.parametrize("request_id", ["", "17", "é" * 70, "x" * 300])
def test_plain_reply_is_the_messages_bytes(rows, dim, tokens, request_id):
    vectors = np.random.default_rng(0).standard_normal((rows, dim), dtype=np.float32)
    want = tulip_pb2.EmbedReply(embeddings=vectors.tobytes(), shape=vectors.shape, prompt_tokens=tokens,
                                request_id=request_id).SerializeToString()
    assert plain_reply(vectors, tokens, request_id) == want
    row = vectors[-1:]  # one row of a step's copied rows, as the engine loop delivers it
    assert plain_reply(row, tokens, request_id) == tulip_pb2.EmbedReply(
        embeddings=row.tobytes(), shape=(1, dim), prompt_tokens=tokens, request_id=request_id).SerializeToString()
    assert serialize_reply(want) is want
    assert serialize_reply(tulip_pb2.EmbedReply.FromString(want)) == want


def test_served_replies_are_the_general_paths(servicer):
    """The usual reply (bytes) and one built as a message (dimensions) carry the same rows."""
    from trellis.client import unpack

    rows = np.random.default_rng(0).standard_normal((1, 1024), dtype=np.float32)
    req = servicer._request(one(range(5, 69)))
    plain = servicer._reply(one(range(5, 69)), req, rows)
    sliced = servicer._reply(one(range(5, 69), dimensions=1024), req, rows)
    assert type(plain) is bytes and type(sliced) is tulip_pb2.EmbedReply
    got = tulip_pb2.EmbedReply.FromString(plain)
    assert got.prompt_tokens == sliced.prompt_tokens == 64 and list(got.shape) == list(sliced.shape) == [1, 1024]
    assert np.array_equal(unpack(got), unpack(sliced)) and np.array_equal(unpack(got), rows)


@pytest.mark.parametrize("transport", ["unary", "stream"])
def test_a_served_request_leaves_no_cyclic_garbage(transport):
    """Requests through Tulip's server on loopback (its own client), good and refused ones: after
    they are answered, a collection finds nothing that only a cycle kept alive."""
    from trellis.client import TulipClient
    from tulip.h2server import Server
    from tulip.server import add_tulip

    async def main():
        loop = EngineLoop(NullEngine(0.2), TulipConfig(max_batch_tokens=16384))
        loop.start()
        server = Server()
        add_tulip(server, TulipServicer(loop, "t"))
        port = await server.listen("127.0.0.1", 0)
        client = TulipClient(f"127.0.0.1:{port}", transport=transport)
        try:
            for _ in range(5):  # warm: connections, caches, lazily built objects
                await client.embed([list(range(5, 133))])
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for k in range(40):
                    await client.embed([list(range(5, 133 + k))])
                    if k % 10 == 0:
                        with pytest.raises(grpc.aio.AioRpcError):
                            await client.embed([[5, VOCAB]])  # a bad token id: refused
                gc.collect()
                garbage = [type(o).__name__ for o in gc.garbage]
            finally:
                gc.set_debug(0)
                gc.garbage.clear()
        finally:
            await client.close()
            await server.stop(1)
            await loop.stop()
        return garbage

    garbage = asyncio.run(main())
    assert not garbage, f"{len(garbage)} objects in cycles after 44 {transport} requests: {sorted(set(garbage))}"

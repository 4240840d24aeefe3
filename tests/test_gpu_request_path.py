"""CUDA only: a served request's whole path in Tulip (decode, validate, schedule, batch, launch,
poll, copy out, reply, encode) makes no synchronizing CUDA call except the one in
`LazyTensor.synchronize()`. Skipped (with the reason) without CUDA.

The engine loop runs in-process over a real CUDA engine (the default model where its package is
installed, else a random checkpoint of its shapes); requests go over loopback through Tulip's own
server (unary Embed and one EmbedStream, grpcio's client in the same process), with
`torch.cuda.set_sync_debug_mode("error")` on: any synchronizing call elsewhere raises, and the
request fails. Every shape is served three
times first (eager, capture, replay), so the checked pass is the steady state: graph replays."""

import asyncio

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU on this machine"),
]

MINILM = dict(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=6,
              intermediate_size=1536, max_position_embeddings=512)


@pytest.fixture(scope="module")
def cuda_engine(tmp_path_factory):
    from rose.engine import Engine, EngineConfig

    try:
        return Engine(EngineConfig(model="default", device="cuda"))
    except (ImportError, FileNotFoundError, ValueError):  # the default model's package is not installed
        from tests.checkpoints import save_checkpoint

        path, _ = save_checkpoint("bert", tmp_path_factory.mktemp("minilm"), **MINILM)
        return Engine(EngineConfig(model=str(path), device="cuda"))


def requests():
    from trellis.client import pack
    from trellis.tulip.v1 import tulip_pb2

    g = np.random.default_rng(0)

    def req(lens, i, **kw):
        ids, lengths = pack([g.integers(1000, 20000, n).astype(np.int32) for n in lens])
        return tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths, request_id=str(i), **kw)

    return [req([128], 0), req([3, 40, 7], 1), req([64], 2, dimensions=32), req([17, 17], 3, timeout_ms=60_000)]


def serve(engine, rounds_unchecked: int, stages: int = 0, check: bool = True):
    """Serve requests() `rounds_unchecked` times, then once more under sync debug mode "error"
    (LazyTensor.synchronize allowed); return the checked round's replies."""
    from rose.lazy import LazyTensor
    from tulip.config import TulipConfig
    from tulip.loop import EngineLoop
    from tulip.server import TulipServicer

    original = LazyTensor.synchronize

    def synchronize(self):  # the one blocking call the design allows
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return original(self)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    async def one_round(stub):
        import grpc

        msgs = requests()
        unary = []
        for m in msgs:
            try:
                unary.append(await stub.Embed(m))
            except grpc.aio.AioRpcError as e:
                raise RuntimeError(f"request failed: {e.code().name}: {e.details()}") from None
        call = stub.EmbedStream()
        streamed = []
        for m in msgs:  # lock-step, so every round forms the same batches (no new graph key)
            await call.write(m)
            streamed.append(await call.read())
        await call.done_writing()
        assert await call.read() is grpc.aio.EOF
        return unary, streamed

    async def main():
        import grpc

        from trellis.tulip.v1 import tulip_pb2_grpc
        from tulip.h2server import Server
        from tulip.server import add_tulip

        # spin long: completion is polled on the event loop (the waiter thread would call
        # synchronize() on another thread, where the debug mode is process-wide too)
        loop = EngineLoop(engine, TulipConfig(max_batch_tokens=4096, spin_ms=10_000, stage_samples=stages))
        loop.start()
        server = Server()
        add_tulip(server, TulipServicer(loop, "test"))
        port = await server.listen("127.0.0.1", 0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = tulip_pb2_grpc.TulipStub(ch)
            for _ in range(rounds_unchecked):
                await one_round(stub)
            if check:
                torch.cuda.set_sync_debug_mode("error")
            try:
                out = await one_round(stub)
            finally:
                if check:
                    torch.cuda.set_sync_debug_mode("default")
        await server.stop(1)
        await loop.stop()
        return out

    LazyTensor.synchronize = synchronize if check else original
    try:
        return asyncio.run(main())
    finally:
        LazyTensor.synchronize = original


@pytest.mark.parametrize("stages", [0, 100], ids=["plain", "stage-stamps"])
def test_a_served_request_makes_no_sync_but_the_lazy_tensors(cuda_engine, stages):
    check_replies(cuda_engine, *serve(cuda_engine, rounds_unchecked=3, stages=stages))


def check_replies(engine, unary, streamed):
    """Each reply (unary and streamed) against the engine's own step on the same sequences."""
    from rose.batch import Batch
    from trellis.client import unpack

    assert [r.error_code for r in streamed] == [0] * 4, [r.error_message for r in streamed]
    assert sorted(r.request_id for r in streamed) == ["0", "1", "2", "3"]
    msgs = requests()
    by_id = {r.request_id: r for r in streamed}
    for m, u in zip(msgs, unary):
        seqs = np.split(np.frombuffer(m.token_ids, dtype="<i4"), np.cumsum(list(m.lengths))[:-1])
        want = engine.step(Batch.from_sequences(seqs)).synchronize().float().numpy()
        if m.dimensions:
            want = want[:, :m.dimensions]
        want = want / np.linalg.norm(want, axis=1, keepdims=True)
        for got in (unpack(u), unpack(by_id[m.request_id])):
            assert got.shape == want.shape
            cos = (got * want).sum(axis=1) / np.linalg.norm(got, axis=1)
            assert cos.min() >= 0.999, cos  # bf16: the served steps ran as graph replays


def test_the_check_catches_a_sync_on_the_request_path(cuda_engine, monkeypatch):
    """The harness itself: a `.item()` slipped into request validation makes the checked round fail."""
    from tulip.server import TulipServicer

    probe = torch.ones(1, device="cuda")
    validate = TulipServicer._request

    def synced(self, request, on_done=None):
        probe.item()  # a synchronizing call: fine in the unchecked rounds, an error in the checked one
        return validate(self, request, on_done)

    monkeypatch.setattr(TulipServicer, "_request", synced)
    with pytest.raises(RuntimeError, match="synchroniz"):
        serve(cuda_engine, rounds_unchecked=1)

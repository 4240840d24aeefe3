"""Tulip as a real process on loopback: Info, Embed, validation, backpressure, drain, health."""

import asyncio
import signal
import time

import grpc
import numpy as np
import pytest
import torch

from ivy.balancer import Balancer, chunk
from rose.batch import Batch
from tests.conftest import Proc, free_port
from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from trellis.client import EmbedOptions, TulipClient, pack

rng = np.random.default_rng(0)


def rand_seqs(*lens):
    return [rng.integers(1000, 30000, n).astype(np.int32) for n in lens]


def run(coro):
    return asyncio.run(coro)


def test_info_and_health(tulip_server):
    target, _ = tulip_server

    async def main():
        async with TulipClient(target) as c:
            return await c.info(), await c.healthy()

    info, healthy = run(main())
    assert healthy
    assert (info.model, info.embedding_dim, info.max_seq_len, info.vocab_size) == ("all-MiniLM-L6-v2", 384, 256, 30522)
    assert (info.pooling, info.normalized, list(info.outputs)) == ("mean", True, [tulip_pb2.OUTPUT_DENSE])
    assert list(info.encodings) == [tulip_pb2.ENCODING_FLOAT32]
    assert info.attention == "sdpa"  # the backend serving (on a GPU, e.g. "table(fa4+varlen)")
    assert info.max_batch_tokens == 16384  # the default budget, the model's 256 being shorter


def test_default_batch_budget_fits_a_long_model(tmp_path):
    """Without --max-batch-tokens, a model longer than 16384 tokens (Qwen3's 32768) still starts:
    the step budget is its max sequence length."""
    from tests.checkpoints import save_checkpoint

    path, _ = save_checkpoint("bert", tmp_path / "long", max_position_embeddings=20000)
    port = free_port()
    proc = Proc(["-m", "tulip", "--model", str(path), "--port", str(port), "--device", "cpu"], tmp_path)
    try:
        proc.wait_for(lambda: "TULIP_READY" in proc.output())

        async def main():
            async with TulipClient(f"127.0.0.1:{port}") as c:
                return await c.info()

        info = run(main())
    finally:
        proc.stop()
    assert (info.max_seq_len, info.max_batch_tokens) == (20000, 20000)


def test_embed_matches_engine_and_dimensions(tulip_server, engine):
    target, _ = tulip_server
    seqs = rand_seqs(3, 256, 1, 40)

    async def main():
        async with TulipClient(target) as c:
            return await c.embed(seqs), await c.embed(seqs, dimensions=32)

    full, short = run(main())
    ref = engine.step(Batch.from_sequences(seqs)).synchronize().numpy()
    assert full.shape == (4, 384) and full.dtype == np.float32
    np.testing.assert_allclose(full, ref, atol=1e-5)
    assert short.shape == (4, 32)
    np.testing.assert_allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
    cut = ref[:, :32] / np.linalg.norm(ref[:, :32], axis=1, keepdims=True)
    np.testing.assert_allclose(short, cut, atol=1e-5)


BAD = [
    (dict(token_ids=b"", lengths=[]), "no sequences"),
    (dict(token_ids=b"\x01\x00\x00", lengths=[1]), "not a multiple of 4"),
    (dict(token_ids=pack([[5, 6]])[0], lengths=[3]), "add up to 3"),
    (dict(token_ids=pack([[5, 6]])[0], lengths=[2, 0]), "sequence 1 is empty"),
    (dict(token_ids=pack([[5, 99999]])[0], lengths=[2]), "token id 99999 is outside"),
    (dict(token_ids=pack([[5, -3]])[0], lengths=[2]), "token id -3 is outside"),
    (dict(token_ids=pack([[5] * 257])[0], lengths=[257]), "257 tokens; this model accepts at most 256"),
    (dict(token_ids=pack([[5]])[0], lengths=[1], dimensions=385), "dimensions 385 exceeds"),
    (dict(token_ids=pack([[5]])[0], lengths=[1], outputs=[7]), "not supported"),
    (dict(token_ids=pack([[5]])[0], lengths=[1], encoding=1), "ENCODING_INT8 is not supported"),
    (dict(token_ids=pack([[5, 6], [7]])[0], lengths=[2, 1], pool_from=[1]), "pool_from has 1 entries for 2"),
    (dict(token_ids=pack([[5, 6], [7]])[0], lengths=[2, 1], pool_from=[1, 1]), "leaves no token of sequence 1"),
    (dict(token_ids=pack([[5, 6], [7]])[0], lengths=[2, 1], pool_from=[1, 0]), "pools its prompt with the text"),
]


def test_bad_requests_rejected_while_others_are_served(tulip_server, engine):
    target, _ = tulip_server
    good = rand_seqs(100, 7, 256)
    ref = engine.step(Batch.from_sequences(good)).synchronize().numpy()

    async def main():
        async with TulipClient(target) as c:
            async def bad(kw):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.stub.Embed(tulip_pb2.EmbedRequest(**kw))
                return e.value

            goods = [c.embed(good) for _ in range(4)]
            bads = [bad(kw) for kw, _ in BAD]
            return await asyncio.gather(*goods, *bads)

    out = run(main())
    for got in out[:4]:
        np.testing.assert_allclose(got, ref, atol=1e-5)
    for err, (_, message) in zip(out[4:], BAD):
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in err.details()


def test_every_option_on_one_sequence_is_applied_or_refused(tulip_server):
    """Every request option (the fields of trellis.options.Options: a new one is covered without an edit
    here), its example value on one sequence (the request Tulip's one-sequence fast path sees) is refused
    INVALID_ARGUMENT or changes the reply, and gives what the general path gives that sequence inside a
    two-sequence request (the same refusal, or the same row). An option the fast path or the plain-reply
    check did not know would come back as the default's reply."""
    from dataclasses import fields

    from trellis.client import unpack
    from trellis.options import Options

    target, _ = tulip_server
    seq, other = rand_seqs(9, 5)

    def request(seqs, f=None):
        ids, lengths = pack(seqs)
        req = tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths)
        if f is not None:
            value = f.metadata["example"]
            if f.metadata["per_sequence"]:  # the example for the first sequence, the default (0) for the others
                value = (*value, *[0] * (len(seqs) - 1))
            Options(**{f.name: value}).to_proto(req)
        return req

    async def main():
        async with TulipClient(target, transport="unary") as c:
            async def outcome(req):
                try:
                    return await c.stub.Embed(req)
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (req, e.details())
                    return e.details()

            default = await outcome(request([seq]))
            return default, [(f, await outcome(request([seq], f)), await outcome(request([seq, other], f)))
                             for f in fields(Options)]

    default, outcomes = run(main())
    assert not isinstance(default, str)
    for f, one, both in outcomes:
        if isinstance(one, str):  # refused: by the same check, with the same message, on either path
            assert both == one, (f.name, one, both)
            continue
        assert one.SerializeToString() != default.SerializeToString(), f"{f.name} was ignored on one sequence"
        assert not isinstance(both, str), (f.name, both)
        assert (one.encoding, list(one.shape)[1:]) == (both.encoding, list(both.shape)[1:]), f.name
        a, b = unpack(one), unpack(both)[:1]
        assert np.allclose(a, b, atol=1e-5) if a.dtype == np.float32 else np.abs(a.astype(int) - b).max() <= 1


@pytest.mark.parametrize("spin_ms", [0.0, 5.0])
def test_stream_multiplexes_and_isolates_bad_requests(tulip_server, engine, spin_ms):
    """One open EmbedStream: concurrent good requests get their own results, bad ones get their
    own INVALID_ARGUMENT, and the stream keeps serving; the same with a client that spins."""
    target, _ = tulip_server
    goods = [rand_seqs(int(n)) for n in rng.integers(1, 200, 12)]
    refs = [engine.step(Batch.from_sequences(g)).synchronize().numpy() for g in goods]

    async def main():
        async with TulipClient(target, transport="stream", spin_ms=spin_ms) as c:
            async def bad():
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.embed([[5, 99999]])
                return e.value

            out = await asyncio.gather(*(c.embed(g) for g in goods), bad(), bad())
            after = await c.embed(goods[0])
            assert c.outstanding == 0
            return out, after

    out, after = run(main())
    for got, ref in zip(out[:12], refs):
        np.testing.assert_allclose(got, ref, atol=1e-5)
    for err in out[12:]:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "99999" in err.details()
    np.testing.assert_allclose(after, refs[0], atol=1e-5)


def test_stream_deadline_drops_a_queued_request(tulip_server):
    """A stream message with timeout_ms that is still queued when it passes is answered
    DEADLINE_EXCEEDED without running; the request ahead of it and a later one are served."""
    target, _ = tulip_server

    def msg(seqs, rid, timeout_ms=0):
        ids, lengths = pack(seqs)
        return tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths, request_id=rid, timeout_ms=timeout_ms)

    async def main():
        async with grpc.aio.insecure_channel(target) as ch:
            call = tulip_pb2_grpc.TulipStub(ch).EmbedStream()
            # Two bulk jobs fill both step slots; the short query behind them expires in the queue.
            for m in (msg(rand_seqs(*[256] * 60), "bulk1"), msg(rand_seqs(*[256] * 60), "bulk2"),
                      msg(rand_seqs(9), "late", timeout_ms=1), msg(rand_seqs(9), "fine", timeout_ms=60_000)):
                await call.write(m)
            await call.done_writing()
            return {r.request_id: r async for r in call}

    replies = run(main())
    assert replies["late"].error_code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "deadline" in replies["late"].error_message
    for rid in ("bulk1", "bulk2", "fine"):
        assert replies[rid].error_code == 0 and len(replies[rid].embeddings) > 0


class _HoldingServicer(tulip_pb2_grpc.TulipServicer):
    """A real gRPC EmbedStream peer: answers every message at once except those whose ids it is told
    to hold, and records what arrived (request ids, cancels)."""

    def __init__(self, hold: set):
        self.hold, self.seen, self.cancels = hold, [], []

    async def EmbedStream(self, request_iterator, context):
        async for r in request_iterator:
            if r.cancel:
                self.cancels.append(r.request_id)
                continue
            self.seen.append(r.request_id)
            if r.request_id not in self.hold:
                yield tulip_pb2.EmbedReply(request_id=r.request_id, shape=[len(r.lengths), 2],
                                           embeddings=bytes(8 * len(r.lengths)), prompt_tokens=sum(r.lengths))


def test_stream_callers_that_leave_are_taken_back_or_cancelled_behind_their_message():
    """TulipStream's messages go out in order, as far as the peer's flow-control window lets them
    (a 16 MB message waits for it). A caller cancelled while its message still waits behind another
    takes it back (the peer never sees it); one whose message went out is cancelled on the stream
    (behind it), also when its deadline passes (a timer, DEADLINE_EXCEEDED); the stream stays open."""
    port = free_port()

    async def main():
        servicer = _HoldingServicer({"2", "3", "4"})
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 << 20)])
        tulip_pb2_grpc.add_TulipServicer_to_server(servicer, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        try:
            async with TulipClient(f"127.0.0.1:{port}") as c:
                assert (await c.embed([[5, 6, 7]])).shape == (1, 2)  # "0": the stream is open
                stream = c.stream._conn
                big = asyncio.create_task(c.embed([np.zeros(4_000_000, np.int32)], timeout=30))  # "1": 16 MB
                small = asyncio.create_task(c.embed([[8, 9]], timeout=30))  # "2": queued behind it
                for _ in range(100):
                    await asyncio.sleep(0)
                    if len(c.stream._conn.queued) == 2:
                        break
                assert len(c.stream._conn.queued) == 2, "the small message was not waiting behind the big one"
                small.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await small
                assert (await big).shape == (1, 2)
                held = asyncio.create_task(c.embed([[1, 2]], timeout=30))  # "3": sent, never answered
                await asyncio.sleep(0)  # it takes its id first
                with pytest.raises(grpc.aio.AioRpcError) as late:
                    await c.embed([[3, 4]], timeout=0.2)  # "4": sent, expires
                held.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await held
                after = await c.embed([[5]], timeout=5)  # "5"
                for _ in range(100):  # the cancels reach the peer
                    if len(servicer.cancels) == 2:
                        break
                    await asyncio.sleep(0.01)
                return late.value, after, c.stream._conn is stream, c.stream._pending, servicer
        finally:
            await server.stop(None)

    late, after, same_stream, pending, servicer = run(main())
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED and after.shape == (1, 2) and same_stream
    assert servicer.seen == ["0", "1", "3", "4", "5"]  # "2" was taken back before it was sent
    assert servicer.cancels == ["4", "3"]  # each behind its own message; none for "2"
    assert pending == {}


def test_stream_to_a_dead_replica_is_unavailable():
    async def main():
        async with TulipClient(f"127.0.0.1:{free_port()}", transport="stream") as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.embed([[5, 6]], timeout=10)
            return e.value

    assert run(main()).code() == grpc.StatusCode.UNAVAILABLE


def test_backpressure_resource_exhausted(tulip_server):
    target, _ = tulip_server  # started with --max-queued-tokens 20000

    async def main():  # three requests that each fit the queue, sent at once: the last finds it full
        async with TulipClient(target) as c:
            results = await asyncio.gather(*(c.embed(rand_seqs(*[256] * 74, 56)) for _ in range(3)),
                                           return_exceptions=True)
            return results, await c.embed(rand_seqs(5))

    results, ok = run(main())
    errors = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert errors and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors)
    assert "queue full" in errors[0].details() and "limit 20000" in errors[0].details()
    assert any(not isinstance(r, BaseException) and r.shape == (75, 384) for r in results)
    assert ok.shape == (1, 384)


def test_deadline_cancels_and_server_keeps_serving(tulip_server):
    target, _ = tulip_server

    async def main():
        async with TulipClient(target) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.embed(rand_seqs(*[256] * 60), timeout=0.01)
            return e.value, await c.embed(rand_seqs(9))

    err, ok = run(main())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert ok.shape == (1, 384)


def test_balancer_retries_on_another_replica_and_keeps_order(tulip_server, engine):
    target, _ = tulip_server
    seqs = rand_seqs(*(int(n) for n in rng.integers(1, 120, 30)))
    ref = engine.step(Batch.from_sequences(seqs)).synchronize().numpy()
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there

    async def main():
        b = Balancer((dead, target), max_chunk_tokens=200)
        try:
            return (await b.embed(seqs, EmbedOptions(deadline=time.monotonic() + 30))).vectors, b.replicas[0].down_until > 0
        finally:
            await b.close()

    out, marked_down = run(main())
    np.testing.assert_allclose(out, ref, atol=1e-5)
    assert marked_down


def test_balancer_fetches_info_once_a_replica_answers(tmp_path):
    """Ivy asks for Info at start-up until a replica answers, whether or not it is up yet."""
    port = free_port()

    async def main(proc_box):
        b = Balancer((f"127.0.0.1:{port}",), max_chunk_tokens=200)
        try:
            task = asyncio.ensure_future(b.fetch_info(every=0.1))
            await asyncio.sleep(0.5)
            assert not task.done()  # nothing listens yet
            proc_box.append(Proc(["-m", "tulip", "--port", str(port), "--device", "cpu"], tmp_path))
            return await asyncio.wait_for(task, 120)
        finally:
            await b.close()

    procs = []
    try:
        info = run(main(procs))
    finally:
        for p in procs:
            p.stop()
    assert info.embedding_dim == 384


def test_chunking_on_token_budget():
    seqs = [np.zeros(n) for n in (50, 50, 10, 200, 1, 1)]
    assert chunk(seqs, 100) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert chunk(seqs, 10_000) == [(0, 6)]


def test_sigterm_drains_in_flight_requests(tmp_path):
    port = free_port()
    # 32 CPU steps to drain: a grace far over what they take on a loaded 2-core machine, so the test asks only
    # "is what it holds answered?" (that it exits as soon as it is done: tests/test_faults.py)
    proc = Proc(["-m", "tulip", "--port", str(port), "--device", "cpu", "--max-batch-tokens", "512",
                 "--drain-seconds", "120"], tmp_path)
    proc.wait_for(lambda: "TULIP_READY" in proc.output())
    seqs = rand_seqs(*[256] * 64)

    async def main():
        async with TulipClient(f"127.0.0.1:{port}") as c:
            task = asyncio.create_task(c.embed(seqs))
            await asyncio.sleep(0.2)  # the request is queued and stepping
            assert not task.done()
            proc.p.send_signal(signal.SIGTERM)
            return await task

    out = run(main())
    assert out.shape == (64, 384)
    assert proc.p.wait(30) == 0
    assert "draining" in proc.output()


def test_unary_stub_directly(tulip_server):
    """Internal scorers can use the generated stub without the helper."""
    target, _ = tulip_server

    async def main():
        async with grpc.aio.insecure_channel(target) as ch:
            ids, lengths = pack([[101, 7592, 102]])
            return await tulip_pb2_grpc.TulipStub(ch).Embed(tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths))

    r = run(main())
    assert list(r.shape) == [1, 384] and r.prompt_tokens == 3
    assert torch.frombuffer(bytearray(r.embeddings), dtype=torch.float32).norm().item() == pytest.approx(1, abs=1e-5)


def test_prometheus_metrics(tulip_server):
    import re
    import urllib.request

    target, proc = tulip_server

    async def main():
        async with TulipClient(target) as c:
            await c.embed(rand_seqs(7, 30))
            with pytest.raises(grpc.aio.AioRpcError):
                await c.embed([[5, 99999]])

    run(main())
    text = urllib.request.urlopen(proc.metrics_url, timeout=5).read().decode()
    for name in ("tulip_queue_tokens", "tulip_batch_tokens_bucket", "tulip_batch_sequences_bucket",
                 "tulip_step_seconds_bucket", "tulip_queue_seconds_bucket"):
        assert name in text, name
    assert re.search(r'tulip_requests_total\{status="OK"\} [1-9]', text)
    assert re.search(r'tulip_requests_total\{status="INVALID_ARGUMENT"\} [1-9]', text)
    assert float(re.search(r"tulip_batch_tokens_count ([0-9.]+)", text).group(1)) >= 1


def test_unix_domain_socket(tmp_path):
    """A co-located Ivy can reach Tulip over a Unix socket (--uds) as well as TCP."""
    sock = tmp_path / "tulip.sock"
    proc = Proc(["-m", "tulip", "--port", str(free_port()), "--device", "cpu", "--uds", str(sock)], tmp_path)
    try:
        proc.wait_for(lambda: "TULIP_READY" in proc.output())
        assert f"unix:{sock}" in proc.output()

        async def main():
            async with TulipClient(f"unix:{sock}") as c:
                return await c.embed([[101, 7592, 102]]), await c.healthy()

        out, healthy = run(main())
        assert out.shape == (1, 384) and healthy
    finally:
        proc.stop()


def test_probe_exit_status(tulip_server):
    """`python -m tulip.probe` (the compose health check) is 0 for a serving Tulip, 1 where none answers."""
    from tulip import probe

    target, _ = tulip_server
    assert probe.main([target]) == 0
    assert probe.main([f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 1

"""Interop: Tulip served by either gRPC server (`--grpc-server ours|grpcio`) and called by clients that
are not ours, and our client (Ivy's, trellis.client) against a server that is not ours.

One module: two real Tulips (the default model), one per server, started at once and shared by every
test; each test runs once per server (`tulip`: ours, then grpcio) with the same assertions, and the
replies each client got are recorded by case (`agree`): the second server's must equal the first's.
- grpcio's sync and asyncio clients: every RPC of the proto (Embed, EmbedStream, Info) and health
  (Check, Watch), a reply near the message limit (and one over it: OUT_OF_RANGE), a stream of several
  requests (one bad: answered on its own), a message that is not an EmbedRequest and a bad one
  (INVALID_ARGUMENT), a deadline that expires, a client that cancels mid-call (the server drops its
  queued work: the tokens its engine ran), gzip (grpcio's server takes it; ours answers UNIMPLEMENTED, as documented).
- Node's `@grpc/grpc-js` with `@grpc/proto-loader` (tests/node: `npm ci` there when node_modules is
  missing; skipped only where node / npm are absent): the same cases.
- h2load (Debian's nghttp2-client; skipped where absent): 2,000 unary Embed calls on 4 connections, every
  one answered OK (Tulip's own count).
- trellis.client (the EmbedStream over trellis.h2stream, unary over grpc.aio): streaming and unary, cancel,
  deadline, errors, the large reply.
(tests/test_aioserver.py: grpcio's server with TLS, and the adapters on their own.)
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import ROOT, Proc, free_port, metric
from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from trellis.client import TulipClient, pack

pytestmark = pytest.mark.timeout(120)

SERVERS = ("ours", "grpcio")
MAX_MB = 1  # the servers' message limit: a reply of LARGE rows is just under it, of OVER rows over it
LARGE, OVER = 670, 700  # rows of 384 float32: 1,029,120 bytes; 1,075,200 (over 1 MiB - 4 KiB)
NODE = ROOT / "tests" / "node"
LIMITS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
EMBED = "/trellis.tulip.v1.Tulip/Embed"


def request(seqs, **kw) -> tulip_pb2.EmbedRequest:
    ids, lengths = pack(seqs)
    return tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths, **kw)


SMALL = request([[101, 7592, 2088, 102], [101, 2000, 2001, 2002, 2003, 102], [101, 102]])
SMALL_TOKENS = 12
BIG_TOKENS = 16 * 256
BIG = request([np.arange(1000, 1256, dtype=np.int32)] * 16)  # 16 steps of 256 tokens: long enough to cancel
BAD = request([[101, 99999, 102]])  # a token id outside the vocabulary
GARBAGE = b"\xff\xff\xff\xff"  # not an EmbedRequest
STREAM = [request([[101, 2000 + i, 102]] * (i + 1), request_id=f"r{i}") for i in range(4)] + [
    request([[101, 99999]], request_id="bad")]


def large(rows: int) -> tulip_pb2.EmbedRequest:
    return request([[101 + i % 5000, 102] for i in range(rows)])


class Tulip:
    def __init__(self, kind: str, proc: Proc, port: int, metrics_port: int):
        self.kind, self.proc = kind, proc
        self.target, self.metrics_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(self.metrics_url, timeout=5) as r:
            return metric(r.read().decode(), name, **labels)

    def tokens(self) -> float:
        """Tokens the engine has run so far (every step's)."""
        return self.metric("tulip_batch_tokens_sum")

    def wait_ok(self, at_least: float, timeout: float = 5.0) -> float:
        """Requests answered OK, once at least `at_least` (or `timeout` passed)."""
        deadline = time.monotonic() + timeout
        while (n := self.metric("tulip_requests_total", status="OK")) < at_least and time.monotonic() < deadline:
            time.sleep(0.05)
        return n

    def after_small(self) -> float:
        """Tokens run once a SMALL request sent now is answered: queued work (FCFS) has run or was dropped."""
        with grpc.insecure_channel(self.target) as ch:
            tulip_pb2_grpc.TulipStub(ch).Embed(SMALL, timeout=30)
        return self.tokens()


def start(kind: str, tmp: Path, *args: str) -> Tulip:
    port, metrics_port = free_port(), free_port()
    proc = Proc(["-m", "tulip", "--model", "default", "--device", "cpu", "--port", str(port), "--grpc-server", kind,
                 "--max-batch-tokens", "256", "--max-message-mb", str(MAX_MB), "--metrics-port", str(metrics_port),
                 "--drain-seconds", "2", *args], tmp)
    return Tulip(kind, proc, port, metrics_port)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers, started at once (each loads the model: ~8 s on the CPU machine)."""
    tmp = tmp_path_factory.mktemp("interop")
    tulips = {kind: start(kind, tmp) for kind in SERVERS}
    try:
        for t in tulips.values():
            t.proc.wait_for(lambda: "TULIP_READY" in t.proc.output())
        yield tulips
    finally:
        codes = {k: t.proc.stop(check=False) for k, t in tulips.items()}
    assert codes == {k: 0 for k in tulips}, codes  # each drained and stopped cleanly on SIGTERM


@pytest.fixture(params=SERVERS)
def tulip(request, servers) -> Tulip:
    return servers[request.param]


SEEN: dict[str, dict[str, object]] = {}  # case -> server -> the reply grpcio's sync client got


def agree(kind: str, case: str, reply) -> None:
    """Record what a case got from server `kind`; where the other server's is recorded, they must be equal."""
    SEEN.setdefault(case, {})[kind] = reply
    for other, theirs in SEEN[case].items():
        if other != kind:
            same(reply, theirs, f"{case}: {kind} vs {other}")


def ref(t: Tulip, case: str):
    """The reply grpcio's sync client got for `case` from this server (asked now if no test has yet)."""
    if t.kind not in SEEN.get(case, {}):
        with grpc.insecure_channel(t.target, options=LIMITS) as ch:
            stub = tulip_pb2_grpc.TulipStub(ch)
            if case == "info":
                agree(t.kind, case, stub.Info(tulip_pb2.InfoRequest(), timeout=10))
            elif case in ("small", "large"):
                agree(t.kind, case, stub.Embed(SMALL if case == "small" else large(LARGE), timeout=60))
            else:
                for rid, r in check_stream(list(stub.EmbedStream(iter(STREAM), timeout=30))).items():
                    agree(t.kind, f"stream {rid}", r)
    return SEEN[case][t.kind]


def same(a, b, what: str) -> None:
    """Two replies alike: EmbedReplies by their fields (vectors to float rounding: batches may differ),
    anything else exactly."""
    if isinstance(a, tulip_pb2.EmbedReply) and isinstance(b, tulip_pb2.EmbedReply):
        va, vb = np.frombuffer(a.embeddings, "<f4"), np.frombuffer(b.embeddings, "<f4")
        assert va.shape == vb.shape, what
        np.testing.assert_allclose(va, vb, atol=1e-5, err_msg=what)
        a, b = [type(a).FromString(x.SerializeToString()) for x in (a, b)]
        a.ClearField("embeddings"), b.ClearField("embeddings")
    assert a == b, what


def check_embed(reply: tulip_pb2.EmbedReply, rows: int, tokens: int) -> None:
    assert list(reply.shape) == [rows, 384] and reply.prompt_tokens == tokens and not reply.error_code
    v = np.frombuffer(reply.embeddings, "<f4").reshape(rows, 384)
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)


def check_stream(replies: list[tulip_pb2.EmbedReply]) -> dict[str, tulip_pb2.EmbedReply]:
    """Every request of STREAM answered once (in completion order), the bad one with its error."""
    by_id = {r.request_id: r for r in replies}
    assert sorted(by_id) == ["bad", "r0", "r1", "r2", "r3"] and len(replies) == 5
    for i in range(4):
        check_embed(by_id[f"r{i}"], i + 1, 3 * (i + 1))
    assert by_id["bad"].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "99999 is outside the vocabulary" in by_id["bad"].error_message
    return by_id


def rpc_code(fn, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn(*args, **kw)
    return e.value.code(), e.value.details()


def cut_short(t: Tulip, before: float, calls: int, other: int = 0) -> None:
    """`calls` calls of BIG were cancelled or expired since `before` (tokens run), besides `other` tokens
    of answered work: their queued steps were dropped, so together they ran less than one whole BIG."""
    ran = t.after_small() - before - SMALL_TOKENS - other
    assert 0 <= ran < BIG_TOKENS, f"{calls} abandoned calls of {BIG_TOKENS} tokens each ran {ran} tokens"


# --- grpcio's clients -------------------------------------------------------------------------------


def test_grpcio_sync_client_every_rpc(tulip):
    with grpc.insecure_channel(tulip.target, options=LIMITS) as ch:
        stub, hs = tulip_pb2_grpc.TulipStub(ch), health_pb2_grpc.HealthStub(ch)
        info = stub.Info(tulip_pb2.InfoRequest(), timeout=10)
        assert (info.model, info.embedding_dim, info.max_batch_tokens) == ("all-MiniLM-L6-v2", 384, 256)
        agree(tulip.kind, "info", info)
        reply = stub.Embed(SMALL, timeout=30)
        check_embed(reply, 3, SMALL_TOKENS)
        agree(tulip.kind, "small", reply)
        reply = stub.Embed(large(LARGE), timeout=60)
        check_embed(reply, LARGE, 2 * LARGE)
        assert reply.ByteSize() > 1_000_000
        agree(tulip.kind, "large", reply)
        code, details = rpc_code(stub.Embed, large(OVER), timeout=30)
        assert code is grpc.StatusCode.OUT_OF_RANGE and f"message limit of {MAX_MB} MiB" in details
        for rid, r in check_stream(list(stub.EmbedStream(iter(STREAM), timeout=30))).items():
            agree(tulip.kind, f"stream {rid}", r)
        code, details = rpc_code(stub.Embed, BAD, timeout=10)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "99999 is outside the vocabulary" in details
        raw = ch.unary_unary(EMBED, request_serializer=None, response_deserializer=None)
        code, details = rpc_code(raw, GARBAGE, timeout=10)
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "malformed EmbedRequest" in details
        before = tulip.tokens()
        code, _ = rpc_code(stub.Embed, BIG, timeout=0.05)
        assert code is grpc.StatusCode.DEADLINE_EXCEEDED
        future = stub.Embed.future(BIG, timeout=30)
        time.sleep(0.1)
        assert future.cancel() and future.cancelled()
        cut_short(tulip, before, 2)
        assert hs.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        watch = hs.Watch(health_pb2.HealthCheckRequest(), timeout=10)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
    with grpc.insecure_channel(tulip.target, compression=grpc.Compression.Gzip) as ch:
        stub = tulip_pb2_grpc.TulipStub(ch)
        if tulip.kind == "grpcio":  # grpc.aio's server takes compressed requests
            same(stub.Embed(SMALL, timeout=30), ref(tulip, "small"), "gzip")
        else:  # ours takes identity only, and says so (docs/deploy.md)
            code, details = rpc_code(stub.Embed, SMALL, timeout=30)
            assert code is grpc.StatusCode.UNIMPLEMENTED and "identity" in details


def test_grpcio_aio_client_every_rpc(tulip):
    refs = {case: ref(tulip, case) for case in ("info", "small", "large")}
    streamed = {rid: ref(tulip, f"stream {rid}") for rid in ("r0", "r1", "r2", "r3", "bad")}

    async def main():
        async with grpc.aio.insecure_channel(tulip.target, options=LIMITS) as ch:
            stub, hs = tulip_pb2_grpc.TulipStub(ch), health_pb2_grpc.HealthStub(ch)
            same(await stub.Info(tulip_pb2.InfoRequest(), timeout=10), refs["info"], "aio info")
            same(await stub.Embed(SMALL, timeout=30), refs["small"], "aio small")
            same(await stub.Embed(large(LARGE), timeout=60), refs["large"], "aio large")
            call = stub.EmbedStream(timeout=30)
            for r in STREAM:  # written one by one while replies may already come
                await call.write(r)
            await call.done_writing()
            for rid, r in check_stream([r async for r in call]).items():
                same(r, streamed[rid], f"aio stream {rid}")
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Embed(BAD, timeout=10)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await ch.unary_unary(EMBED)(GARBAGE, timeout=10)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            before = tulip.tokens()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Embed(BIG, timeout=0.05)
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            call = stub.Embed(BIG, timeout=30)
            await asyncio.sleep(0.1)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            stream = stub.EmbedStream(timeout=30)  # a stream cancelled with a request in flight
            await stream.write(BIG)
            await asyncio.sleep(0.1)
            stream.cancel()
            assert (await hs.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == 1
            return before

    cut_short(tulip, asyncio.run(main()), 3)


# --- Node's grpc-js ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def node():
    """`node` with tests/node's packages (`npm ci` there when missing; `make test` runs it first)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node / npm are not installed: the @grpc/grpc-js cases need them (apt-get install nodejs npm)")
    if not (NODE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        r = subprocess.run(["npm", "ci", "--no-audit", "--no-fund", "--prefix", str(NODE)], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, f"npm ci in tests/node failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}"
    return shutil.which("node")


def b64(msg) -> str:
    return base64.b64encode(msg if isinstance(msg, bytes) else msg.SerializeToString()).decode()


def test_grpc_js_client_every_rpc(tulip, node, tmp_path):
    refs = {case: ref(tulip, case) for case in ("info", "small", "large")}
    streamed = {rid: ref(tulip, f"stream {rid}") for rid in ("r0", "r1", "r2", "r3", "bad")}
    cases = [
        dict(name="info", rpc="Info", requests=[b64(tulip_pb2.InfoRequest())]),
        dict(name="small", rpc="Embed", requests=[b64(SMALL)]),
        dict(name="large", rpc="Embed", requests=[b64(large(LARGE))]),
        dict(name="over", rpc="Embed", requests=[b64(large(OVER))]),
        dict(name="stream", rpc="EmbedStream", requests=[b64(r) for r in STREAM]),
        dict(name="bad", rpc="Embed", requests=[b64(BAD)]),
        dict(name="garbage", rpc="RawEmbed", requests=[b64(GARBAGE)]),
        dict(name="deadline", rpc="Embed", requests=[b64(BIG)], timeout_ms=50),
        dict(name="cancel", rpc="Embed", requests=[b64(BIG)], cancel_after_ms=100),
        dict(name="cancel stream", rpc="EmbedStream", requests=[b64(BIG)], cancel_after_ms=100),
        dict(name="check", rpc="Check", requests=[b64(health_pb2.HealthCheckRequest())]),
        dict(name="watch", rpc="Watch", requests=[], timeout_ms=10000),
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    before = tulip.tokens()
    r = subprocess.run([node, str(NODE / "interop.js"), tulip.target, str(tmp_path / "cases.json")],
                       capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stderr[-3000:]
    # the answered cases' tokens, then the three abandoned BIGs together less than one whole
    cut_short(tulip, before, 3, other=SMALL_TOKENS + 2 * LARGE + sum(3 * (i + 1) for i in range(4)))
    got = {o["name"]: o for o in map(json.loads, r.stdout.splitlines())}
    assert sorted(got) == sorted(c["name"] for c in cases), r.stdout

    def reply(name, cls=tulip_pb2.EmbedReply):
        assert "reply" in got[name], got[name]
        return cls.FromString(base64.b64decode(got[name]["reply"]))

    same(reply("info", tulip_pb2.InfoReply), refs["info"], "grpc-js info")
    same(reply("small"), refs["small"], "grpc-js small")
    same(reply("large"), refs["large"], "grpc-js large")
    code = {name: o.get("code") for name, o in got.items()}
    assert code["over"] == grpc.StatusCode.OUT_OF_RANGE.value[0], got["over"]
    assert code["stream"] == 0, got["stream"]
    stream = [tulip_pb2.EmbedReply.FromString(base64.b64decode(x)) for x in got["stream"]["replies"]]
    for rid, r in check_stream(stream).items():
        same(r, streamed[rid], f"grpc-js stream {rid}")
    assert code["bad"] == code["garbage"] == grpc.StatusCode.INVALID_ARGUMENT.value[0], (got["bad"], got["garbage"])
    assert "99999 is outside the vocabulary" in got["bad"]["details"]
    assert code["deadline"] == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], got["deadline"]
    assert code["cancel"] == code["cancel stream"] == grpc.StatusCode.CANCELLED.value[0], got
    assert reply("check", health_pb2.HealthCheckResponse).status == health_pb2.HealthCheckResponse.SERVING
    assert reply("watch", health_pb2.HealthCheckResponse).status == health_pb2.HealthCheckResponse.SERVING
    assert code["watch"] == grpc.StatusCode.CANCELLED.value[0]  # the client ended it


# --- h2load -----------------------------------------------------------------------------------------


def test_h2load_thousands_of_unary_calls(tulip, tmp_path):
    """nghttp2's load generator: 2,000 unary Embed calls, 4 connections x 8 streams at once; every one
    answered 200 and, by Tulip's own count, OK (h2load cannot read gRPC trailers)."""
    h2load = shutil.which("h2load")
    if h2load is None:
        pytest.skip("h2load is not installed (apt-get install nghttp2-client)")
    msg = request([[101, 7592, 2088, 102]]).SerializeToString()
    body = tmp_path / "embed.grpc"
    body.write_bytes(b"\x00" + len(msg).to_bytes(4, "big") + msg)  # one gRPC message: uncompressed, length, bytes
    ok = tulip.metric("tulip_requests_total", status="OK")
    n = 2000
    r = subprocess.run([h2load, "-n", str(n), "-c", "4", "-m", "8", "-d", str(body), "-H", "content-type: application/grpc",
                        "-H", "te: trailers", f"http://{tulip.target}{EMBED}"], capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"requests: {n} total, {n} started, {n} done, {n} succeeded, 0 failed, 0 errored, 0 timeout" in r.stdout, r.stdout
    assert f"status codes: {n} 2xx" in r.stdout, r.stdout
    assert tulip.wait_ok(ok + n) == ok + n


# --- Ivy's client (trellis.client) --------------------------------------------------------------------


def test_ivy_client_stream_and_unary(tulip):
    """trellis.client as Ivy uses it: the EmbedStream on our own HTTP/2 framing (trellis.h2stream) and unary on
    grpc.aio; with `--grpc-server grpcio` the server end is not ours."""
    small = [np.frombuffer(SMALL.token_ids, "<i4")[a:b] for a, b in ((0, 4), (4, 10), (10, 12))]
    many = [[101 + i % 5000, 102] for i in range(LARGE)]
    big = [np.arange(1000, 1256, dtype=np.int32)] * 16
    want_small = np.frombuffer(ref(tulip, "small").embeddings, "<f4").reshape(3, 384)
    want_large = np.frombuffer(ref(tulip, "large").embeddings, "<f4").reshape(LARGE, 384)

    async def main(transport: str):
        async with TulipClient(tulip.target, max_message_mb=MAX_MB, transport=transport) as c:
            assert (await c.info()).model == "all-MiniLM-L6-v2"
            calls = [c.embed(small) for _ in range(6)]  # several requests at once on the one stream
            if transport == "stream":  # the large reply on our framing (unary's client is grpc.aio's, above)
                calls.append(c.embed(many))
            outs = await asyncio.gather(*calls)
            for v in outs[:6]:
                np.testing.assert_allclose(v, want_small, atol=1e-5)
            if transport == "stream":
                np.testing.assert_allclose(outs[6], want_large, atol=1e-5)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.embed([[101, 99999]])
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "outside the vocabulary" in e.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.embed([[101, 102]] * OVER)
            assert e.value.code() is grpc.StatusCode.OUT_OF_RANGE
            before = tulip.tokens()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.embed(big, timeout=0.05)
            assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            task = asyncio.ensure_future(c.embed(big))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            np.testing.assert_allclose(await c.embed(small), want_small, atol=1e-5)  # the stream carries on
            return before

    for transport in ("stream", "unary"):
        cut_short(tulip, asyncio.run(main(transport)), 2, other=SMALL_TOKENS)


def test_grpcio_server_welcomes_keepalive_pings(servers):
    """grpc.aio's server is told to take a client's ping every second with no data flowing (grpc-core's
    default, one in 5 minutes, answered a third such ping with GOAWAY "too_many_pings", ending every call
    on the connection; ours takes them too: tests/test_faults.py). A stream idle while its client pings
    every second is still answered."""
    opts = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0)]

    async def main():
        async with grpc.aio.insecure_channel(servers["grpcio"].target, options=opts) as ch:
            call = tulip_pb2_grpc.TulipStub(ch).EmbedStream(timeout=30)
            await call.write(STREAM[0])
            first = await call.read()
            await asyncio.sleep(3.5)  # idle: three pings or more
            await call.write(STREAM[1])
            after = await call.read()
            await call.done_writing()
            return first, after

    first, after = asyncio.run(main())
    assert (first.request_id, after.request_id) == ("r0", "r1") and not after.error_code

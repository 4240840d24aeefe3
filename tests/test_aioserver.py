"""tulip.aioserver in this process (no model): `--grpc-server grpcio` with TLS (`--tls-cert` / `--tls-key`,
a certificate made here by openssl) over benchmarks.hop's null engine, the TLS settings' checks, and the
Direct adapters on their own (replies, statuses, a session that raises, a client that cancels).
tests/test_interop.py serves the real model on both servers to every client."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from trellis.client import pack

pytestmark = pytest.mark.timeout(60)


def request(seqs, **kw) -> tulip_pb2.EmbedRequest:
    ids, lengths = pack(seqs)
    return tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths, **kw)


SMALL = request([[101, 7592, 2088, 102], [101, 2000, 2001, 2002, 2003, 102], [101, 102]])
STREAM = [request([[101, 2000 + i, 102]] * (i + 1), request_id=f"r{i}") for i in range(2)]


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost (openssl)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (apt-get install openssl)")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "2", "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(d / "key.pem"),
                    "-out", str(d / "cert.pem")], check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def test_grpcio_server_with_tls(certificate):
    """`--grpc-server grpcio --tls-cert --tls-key` (the server `tulip.server.make_server` makes of that config,
    Tulip's servicer over benchmarks.hop's null engine, in this process): a TLS client is served, a plaintext
    one is not."""
    from benchmarks.hop import NullEngine
    from grpc_health.v1 import health
    from tulip.config import TulipConfig
    from tulip.loop import EngineLoop
    from tulip.server import TulipServicer, add_tulip, make_server

    cert, key = certificate
    cfg = TulipConfig(grpc_server="grpcio", tls_cert=str(cert), tls_key=str(key), max_batch_tokens=256)

    async def main():
        server = make_server(cfg)
        loop = EngineLoop(NullEngine(0.0, 384), cfg)
        loop.start()
        add_tulip(server, TulipServicer(loop, "null"))
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        port = await server.listen("127.0.0.1", 0)
        await server.start()
        try:
            creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
                reply = await tulip_pb2_grpc.TulipStub(ch).Embed(SMALL, timeout=10)
                assert list(reply.shape) == [3, 384] and reply.prompt_tokens == 12
                stream = tulip_pb2_grpc.TulipStub(ch).EmbedStream(iter(STREAM), timeout=10)
                assert sorted([r.request_id async for r in stream]) == ["r0", "r1"]
                check = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert check.status == health_pb2.HealthCheckResponse.SERVING
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await tulip_pb2_grpc.TulipStub(ch).Info(tulip_pb2.InfoRequest(), timeout=2)
                assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        finally:
            await server.stop(0)
            await loop.stop(1)

    asyncio.run(main())


def test_tls_needs_the_grpcio_server_and_both_files():
    from tulip.config import TulipConfig

    with pytest.raises(ValueError, match="add --grpc-server grpcio"):
        TulipConfig(tls_cert="c.pem", tls_key="k.pem")
    with pytest.raises(ValueError, match="TLS needs both files"):
        TulipConfig(grpc_server="grpcio", tls_cert="c.pem")
    with pytest.raises(ValueError, match="not ours or grpcio"):
        TulipConfig(grpc_server="h2")


def test_direct_adapter_statuses_and_gone():
    """tulip.aioserver's adapters on their own (grpc.aio's server in this process): a session's replies then
    its status reach the client, a session that raises ends its call UNKNOWN and hears `gone()`, and one
    whose client cancels hears `gone()` too, as on ours."""
    from tulip.aioserver import AioServer
    from tulip.h2server import Direct

    events = []

    class Session:
        def __init__(self, call):
            self.call = call

        def message(self, m):
            events.append(("message", m))
            if m == b"raise":
                raise RuntimeError("boom")
            if m == b"hold":
                return
            self.call.reply(m + b"!")
            if m == b"fail":
                self.call.finish(grpc.StatusCode.FAILED_PRECONDITION, "as asked")

        def end(self):  # as EmbedStream: the call ends once nothing is held
            events.append(("end",))
            if ("message", b"hold") not in events:
                self.call.finish(grpc.StatusCode.OK)

        def gone(self):
            events.append(("gone",))

    ident = (lambda b: b, lambda b: b)
    handlers = {"U": Direct(Session, *ident, False, False), "S": Direct(Session, *ident, True, True)}

    async def main():
        server = AioServer()
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
        port = await server.listen("127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                unary, stream = ch.unary_unary("/t.T/U"), ch.stream_stream("/t.T/S")
                assert await unary(b"a", timeout=5) == b"a!"
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await unary(b"raise", timeout=5)
                assert e.value.code() is grpc.StatusCode.UNKNOWN and "boom" in e.value.details()
                assert events[-1] == ("gone",)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await unary(b"fail", timeout=5)
                assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                call = stream(iter([b"x", b"y"]), timeout=5)
                assert [m async for m in call] == [b"x!", b"y!"] and await call.code() is grpc.StatusCode.OK
                call = stream(iter([b"x", b"fail", b"z"]), timeout=5)
                got = []
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for m in call:
                        got.append(m)
                assert got == [b"x!", b"fail!"] and e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
                events.clear()
                call = stream(timeout=5)
                await call.write(b"hold")
                while not events:
                    await asyncio.sleep(0.01)
                call.cancel()
                for _ in range(100):
                    if ("gone",) in events:
                        break
                    await asyncio.sleep(0.01)
                # (grpc.aio ends the request iterator before it cancels the call: end() may come first)
                assert events in ([("message", b"hold"), ("gone",)], [("message", b"hold"), ("end",), ("gone",)])
        finally:
            await server.stop(0)

    asyncio.run(main())

"""Discovery (issue #16): --tulip names resolved into replicas, health-watched, balanced over.

In-process, against real gRPC servers (`StandIn`: the Tulip and health services from the stubs, each
working through the tokens it is sent at a fixed rate, one request at a time, like a device): the
mixed-workload balance target, NOT_SERVING taking a replica out of routing at once, ejection after
failures and a probe bringing it back, the real system resolver. Against real processes: an Ivy in a
private mount namespace whose /etc/hosts (bind-mounted, rewritten in place during the test) gives one
name several loopback addresses, each a real Tulip: a replica added to the name takes load within two
re-resolution periods, one removed or draining gets no new request once Ivy has seen it, and no client
request fails meanwhile.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import Child, HostsFile, free_port, http_status, tulip_requests
from grpc_health.v1 import health, health_pb2_grpc

from ivy.balancer import Balancer
from ivy.config import IvyConfig
from ivy.discovery import NOT_SERVING, SERVING, ReplicaSet, parse_target
from trellis.tulip.v1 import tulip_pb2, tulip_pb2_grpc
from trellis.client import EmbedOptions

# --- targets and settings -------------------------------------------------------------------------

def test_targets_literal_or_name():
    assert parse_target("127.0.0.2:50051").address == "127.0.0.2:50051"
    assert parse_target("[::1]:50051").address == "[::1]:50051"
    assert parse_target("unix:/run/t.sock").address == "unix:/run/t.sock"
    t = parse_target("tulip-headless.default.svc.cluster.local:50051")
    assert (t.address, t.name, t.port) == ("", "tulip-headless.default.svc.cluster.local", 50051)
    t = parse_target("dns:///tulip:7000")
    assert (t.address, t.name, t.port) == ("", "tulip", 7000)
    assert parse_target("dns:///10.0.0.7:7000").address == "10.0.0.7:7000"
    assert parse_target("ipv4:10.0.0.7:7000").address == "ipv4:10.0.0.7:7000"  # gRPC's own schemes: as given
    for bad, says in (("dns://8.8.8.8/tulip:1", "no DNS authority"), ("tulip", "is not HOST:PORT"),
                      ("tulip:0", "is not HOST:PORT"), ("tu lip:5", "neither an IP address nor a DNS name"),
                      ("unix:", "needs an address")):
        with pytest.raises(ValueError, match=says):
            parse_target(bad)


def test_resolve_interval_setting(monkeypatch):
    assert IvyConfig(tulip=("t:1",)).resolve_interval == 5.0
    assert IvyConfig.from_args(["--tulip", "tulip:50051", "--resolve-interval", "0.5"]).resolve_interval == 0.5
    monkeypatch.setenv("IVY_RESOLVE_INTERVAL", "2.5")
    cfg = IvyConfig.from_args(["--tulip", "dns:///tulip:50051"])
    assert cfg.resolve_interval == 2.5 and IvyConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="resolve_interval 0"):
        IvyConfig(tulip=("t:1",), resolve_interval=0)


def test_the_system_resolver_turns_a_name_into_replicas():
    """The real path: socket.getaddrinfo (here through /etc/hosts' localhost), off the loop."""
    async def main():
        s = ReplicaSet(("localhost:50123", "127.0.0.9:1"), resolve_interval=60)
        assert [r.target for r in s.replicas] == ["127.0.0.9:1"]  # names wait for start()
        s.start()
        try:
            for _ in range(100):
                if len(s.replicas) > 1:
                    break
                await asyncio.sleep(0.05)
            return [(r.target, r.source) for r in s.replicas]
        finally:
            await s.close()

    got = asyncio.run(main())
    assert ("127.0.0.9:1", "127.0.0.9:1") in got and ("127.0.0.1:50123", "localhost:50123") in got


# --- a paced stand-in Tulip (real gRPC server, no engine) -----------------------------------------

class StandIn(tulip_pb2_grpc.TulipServicer):
    """Tulip's services from the stubs: each request waits for the 'device' (one at a time) for
    tokens / rate seconds, then gets zero vectors. Counts requests and tokens it was sent."""

    def __init__(self, rate: float = 2e6, dim: int = 8):
        self.rate, self.dim = rate, dim
        self.device = asyncio.Lock()
        self.tokens = self.requests = 0

    async def _do(self, req):
        self.requests += 1
        self.tokens += sum(req.lengths)
        async with self.device:
            await asyncio.sleep(sum(req.lengths) / self.rate)
        n = len(req.lengths)
        return tulip_pb2.EmbedReply(request_id=req.request_id, embeddings=bytes(4 * n * self.dim),
                                    shape=[n, self.dim], prompt_tokens=sum(req.lengths))

    async def Info(self, request, context):
        return tulip_pb2.InfoReply(model="stand-in", embedding_dim=self.dim, max_seq_len=8192)

    async def Embed(self, request, context):
        return await self._do(request)

    async def EmbedStream(self, request_iterator, context):
        out: asyncio.Queue = asyncio.Queue()

        async def read():
            tasks = set()
            async for req in request_iterator:
                if not req.cancel:
                    t = asyncio.ensure_future(self._do(req))
                    t.add_done_callback(lambda t: out.put_nowait(t.result()))
                    tasks.add(t)
            await asyncio.gather(*tasks)
            out.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (reply := await out.get()) is not None:
                yield reply
        finally:
            reader.cancel()


async def serve(port: int = 0, host: str = "127.0.0.1", **kw):
    server = grpc.aio.server()
    s = StandIn(**kw)
    tulip_pb2_grpc.add_TulipServicer_to_server(s, server)
    s.health = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(s.health, server)
    port = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    await s.health.set("", SERVING)
    s.server, s.target = server, f"{host}:{port}"
    return s


async def until(cond, timeout: float = 10.0, every: float = 0.02):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(every)


def seqs(n: int, length: int) -> list[np.ndarray]:
    return [np.ones(length, np.int32)] * n


def test_mixed_workload_balances_tokens_over_four_replicas():
    """Issue #16's target: 100x512, 4x128, 100x512, 2x96, 8x4096, 3x64 tokens, repeated, from 4
    concurrent clients over 4 replicas: the busiest replica's tokens within 10 % of an even split."""
    workload = [(100, 512), (4, 128), (100, 512), (2, 96), (8, 4096), (3, 64)]

    async def main():
        servers = [await serve(host=f"127.0.0.{2 + i}") for i in range(4)]
        b = Balancer(tuple(s.target for s in servers), max_chunk_tokens=8192)
        b.start()
        try:
            await until(lambda: all(r.health == SERVING for r in b.replicas))

            async def client(k: int):
                for j in range(3 * len(workload)):
                    n, length = workload[(j + k) % len(workload)]
                    out = await b.embed(seqs(n, length), EmbedOptions(deadline=time.monotonic() + 30))
                    assert out.vectors.shape == (n, 8)

            await asyncio.gather(*(client(k) for k in range(4)))
            return [s.tokens for s in servers]
        finally:
            await b.close()
            for s in servers:
                await s.server.stop(0)

    tokens = asyncio.run(main())
    ideal = sum(tokens) / 4
    assert sum(tokens) == 4 * 3 * sum(n * length for n, length in workload)
    print(f"tokens per replica {tokens}, busiest / ideal {max(tokens) / ideal:.3f}")
    assert max(tokens) <= 1.10 * ideal, tokens


def test_not_serving_stops_new_requests_at_once_and_serving_brings_it_back():
    async def main():
        a, b = await serve(), await serve()
        bal = Balancer((a.target, b.target), max_chunk_tokens=8192)
        bal.start()
        try:
            await until(lambda: all(r.health == SERVING for r in bal.replicas))
            await asyncio.gather(*(bal.embed(seqs(2, 16), EmbedOptions(deadline=time.monotonic() + 10)) for _ in range(20)))
            assert a.requests > 0 and b.requests > 0
            await b.health.set("", NOT_SERVING)  # a draining Tulip says this first
            await until(lambda: bal.replicas[1].health == NOT_SERVING)
            seen = b.requests
            await asyncio.gather(*(bal.embed(seqs(2, 16), EmbedOptions(deadline=time.monotonic() + 10)) for _ in range(40)))
            assert b.requests == seen  # nothing new once the watch said NOT_SERVING
            stream_closed = bal.replicas[1].client.stream._conn is None  # idle: let it drain and go
            await b.health.set("", SERVING)  # found by the Check probe
            await until(lambda: bal.replicas[1].health == SERVING, timeout=5)
            await asyncio.gather(*(bal.embed(seqs(2, 16), EmbedOptions(deadline=time.monotonic() + 10)) for _ in range(20)))
            return seen, b.requests, stream_closed
        finally:
            await bal.close()
            for s in (a, b):
                await s.server.stop(0)

    seen, after, stream_closed = asyncio.run(main())
    assert after > seen and stream_closed


def test_failures_eject_a_replica_and_a_probe_brings_it_back():
    async def main():
        a, b = await serve(), await serve()
        port = int(b.target.rsplit(":", 1)[1])
        bal = Balancer((a.target, b.target), max_chunk_tokens=8192)
        bal.start()
        try:
            await until(lambda: all(r.health == SERVING for r in bal.replicas))
            await b.server.stop(0)  # gone: its watch and requests fail
            for _ in range(30):  # every request still answered (retried on a)
                await bal.embed(seqs(1, 8), EmbedOptions(deadline=time.monotonic() + 10))
            await until(lambda: bal.replicas[1].ejected, timeout=10)
            served_by_a = a.requests
            b2 = await serve(port)  # back on the same address
            try:
                await until(lambda: not bal.replicas[1].ejected and bal.replicas[1].health == SERVING, timeout=10)
                await asyncio.gather(*(bal.embed(seqs(1, 8), EmbedOptions(deadline=time.monotonic() + 10)) for _ in range(20)))
                return served_by_a, b2.requests
            finally:
                await b2.server.stop(0)
        finally:
            await bal.close()
            await a.server.stop(0)

    served_by_a, back = asyncio.run(main())
    assert served_by_a >= 30 and back > 0


def test_no_replica_yet_is_503_material():
    """A name that resolves to nothing yet leaves no replica: the request is UNAVAILABLE (503), not a crash."""
    async def main():
        bal = Balancer(("no-such-host.invalid:50051",), max_chunk_tokens=8192, resolve_interval=60)
        bal.start()
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await bal.embed(seqs(1, 8), EmbedOptions(deadline=time.monotonic() + 5))
            return e.value
        finally:
            await bal.close()

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "no-such-host.invalid:50051" in err.details()


def test_a_connection_failure_looks_the_name_up_again_soon():
    async def main():
        tulip = await serve()
        s = ReplicaSet((f"localhost:{tulip.target.rsplit(':', 1)[1]}",), resolve_interval=60)
        s.start()
        try:
            await until(lambda: s.lookups == 1 and s.replicas and s.replicas[0].health == SERVING)
            await asyncio.sleep(0.6)
            assert s.lookups == 1  # the next one is a minute away
            t0 = time.monotonic()
            s.failed(s.replicas[0], "connection refused")
            await until(lambda: s.lookups == 2, timeout=5)
            return time.monotonic() - t0
        finally:
            await s.close()
            await tulip.server.stop(0)

    assert asyncio.run(main()) < 1.0


# --- real processes: one name, several loopback addresses -----------------------------------------

INTERVAL = 1.0  # Ivy's --resolve-interval in the test


def _unshare_works(tmp: Path) -> str:
    hosts = tmp / "probe-hosts"
    hosts.write_text("127.0.0.7 probe.trellis.test\n")
    try:
        r = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind {hosts} /etc/hosts && getent hosts probe.trellis.test"],
                           capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare not usable: {e}"
    return "" if "127.0.0.7" in r.stdout else f"unshare -m with a bind mount not permitted: {r.stderr.strip()}"


def test_a_name_with_several_addresses_grows_shrinks_and_drains(tmp_path):
    why = _unshare_works(tmp_path)
    if why:
        pytest.skip(why)
    import openai

    port, metrics_port, http_port = free_port(), free_port(), free_port()
    ips = ["127.0.0.2", "127.0.0.3"]
    hosts = HostsFile(tmp_path / "hosts")

    def name_is(*addrs: str) -> float:
        return hosts.name("tulips.trellis.test", *addrs)

    name_is(ips[0])
    tulips = [Child([sys.executable, "-m", "tulip", "--device", "cpu", "--host", ip, "--port", str(port),
                     "--metrics-port", str(metrics_port), "--drain-seconds", "30"], tmp_path / f"tulip-{ip}.log")
              for ip in ips]
    ivy = None
    stop = threading.Event()
    errors: list[str] = []
    try:
        for t in tulips:
            t.wait_for(lambda t=t: "TULIP_READY" in t.output(), timeout=150)
        ivy_cmd = (f"mount --bind {hosts.path} /etc/hosts && exec {sys.executable} -m ivy "
                   f"--tulip tulips.trellis.test:{port} --resolve-interval {INTERVAL} --port {http_port}")
        ivy = Child(["unshare", "-m", "sh", "-c", ivy_cmd], tmp_path / "ivy.log")
        url = f"http://127.0.0.1:{http_port}"
        ivy.wait_for(lambda: http_status(url + "/ready") == 200, timeout=60)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

        def load():
            while not stop.is_set():
                try:
                    r = client.embeddings.create(model="all-MiniLM-L6-v2", input=["a tulip in the name"])
                    assert len(r.data[0].embedding) == 384
                except Exception as e:  # noqa: BLE001 (every request must be answered, whatever the name does)
                    errors.append(repr(e))

        th = threading.Thread(target=load, daemon=True)
        th.start()
        a, b = ((ip, metrics_port) for ip in ips)

        def wait(cond, timeout):
            deadline = time.monotonic() + timeout
            while not cond():
                assert time.monotonic() < deadline, ivy.output()[-3000:]
                time.sleep(0.02)
            return time.monotonic()

        wait(lambda: tulip_requests(*a) > 0, 10)
        assert tulip_requests(*b) == 0  # not in the name yet

        # added: takes load within two re-resolution periods
        t0 = name_is(*ips)
        took = wait(lambda: tulip_requests(*b) > 0, 4 * INTERVAL) - t0
        assert took <= 2 * INTERVAL, took

        # removed (a still runs): no new request once Ivy has seen it go (what was in flight may finish)
        name_is(ips[1])
        gone = f"tulip {a[0]}:{port} (tulips.trellis.test:{port}) left the name"
        wait(lambda: gone in ivy.output(), 4 * INTERVAL)
        at_removal = tulip_requests(*a)
        in_flight = int(re.search(rf"{re.escape(gone)}.* once its (\d+) in flight", ivy.output()).group(1))
        b_then = tulip_requests(*b)
        time.sleep(1.5)
        assert tulip_requests(*a) - at_removal <= in_flight
        assert tulip_requests(*b) > b_then + 10  # the load went on, to the other

        # back in the name, then b drains (SIGTERM): NOT_SERVING is seen, nothing more is sent there,
        # and Ivy lets go of it at once (its stream and watch closed once idle)
        a_then = tulip_requests(*a)
        name_is(*ips)
        wait(lambda: tulip_requests(*a) > a_then, 4 * INTERVAL)
        t0 = time.monotonic()
        tulips[1].p.send_signal(signal.SIGTERM)
        wait(lambda: f"tulip {b[0]}:{port} is NOT_SERVING" in ivy.output(), 5)
        tulips[1].p.wait(15)  # far inside its 30 s grace
        drained_in = time.monotonic() - t0
        a_then = tulip_requests(*a)
        time.sleep(0.5)
        assert tulip_requests(*a) > a_then
        after = ivy.output().split(f"tulip {b[0]}:{port} is NOT_SERVING", 1)[1]
        # Nothing was sent there once it was seen; the load is one request at a time, so at most one was on
        # its way (sent before the change was seen, refused by the draining Tulip, answered by a)
        assert after.count(f"replica {b[0]}:{port} unavailable") <= 1, after
        stop.set()
        th.join(30)
        print(f"added replica took load after {took:.2f} s (interval {INTERVAL} s); drained Tulip exited "
              f"{drained_in:.2f} s after SIGTERM")
        assert errors == []
    finally:
        stop.set()
        if ivy is not None:
            ivy.stop(check=False)
        for t in tulips:
            t.stop(check=False)

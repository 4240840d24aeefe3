"""Faults found by attacking the running stack (issue #17), each against real processes: garbage on
Tulip's RPCs, a request larger than a replica's whole queue, a reply over the message limit, a
replica whose full queue rejects fast, and 429 / 503 carrying Retry-After."""

import asyncio
import time

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter

from ivy.balancer import Balancer
from ivy.front import Front
from tests.conftest import Proc, free_port
from trellis.tulip.v1 import tulip_pb2
from trellis.client import EmbedOptions, TulipClient, pack

rng = np.random.default_rng(7)
EMBED = "/trellis.tulip.v1.Tulip/Embed"
STREAM = "/trellis.tulip.v1.Tulip/EmbedStream"
GARBAGE = b"\xff\xff\xff\xff\x0f"  # not a protobuf message (a truncated varint field)


def seqs(*lens):
    return [rng.integers(1000, 30000, n).astype(np.int32) for n in lens]


def request(lens, rid="", **kw) -> bytes:
    ids, lengths = pack(seqs(*lens))
    return tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths, request_id=rid, **kw).SerializeToString()


def start_tulip(tmp_path, *args):
    port = free_port()
    proc = Proc(["-m", "tulip", "--model", "default", "--port", str(port), "--device", "cpu", *args], tmp_path)
    proc.wait_for(lambda: "TULIP_READY" in proc.output())
    return f"127.0.0.1:{port}", proc


def test_garbage_on_unary_embed_is_invalid_argument(tulip_server):
    target, _ = tulip_server

    async def main():
        async with grpc.aio.insecure_channel(target) as ch:
            call = ch.unary_unary(EMBED)  # raw bytes both ways
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(GARBAGE, timeout=10)
            ok = tulip_pb2.EmbedReply.FromString(await call(request([7]), timeout=30))
            return e.value, ok

    err, ok = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed EmbedRequest" in err.details()
    assert list(ok.shape) == [1, 384]


def test_garbage_on_the_stream_fails_that_message_only(tulip_server):
    target, _ = tulip_server

    async def main():
        async with grpc.aio.insecure_channel(target) as ch:
            call = ch.stream_stream(STREAM)(iter([request([5], rid="a"), GARBAGE, request([9], rid="c")]), timeout=30)
            replies = [tulip_pb2.EmbedReply.FromString(r) async for r in call]
            return replies, await call.code()

    replies, code = asyncio.run(main())
    assert code == grpc.StatusCode.OK and len(replies) == 3  # every message answered, the stream ends cleanly
    bad = [r for r in replies if r.error_code]
    assert len(bad) == 1 and bad[0].error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "malformed EmbedRequest" in bad[0].error_message
    assert sorted(r.request_id for r in replies if not r.error_code) == ["a", "c"]


def test_a_request_larger_than_the_whole_queue_is_out_of_range_at_once(tulip_server):
    target, _ = tulip_server  # --max-queued-tokens 20000, idle: a retry could never succeed

    async def main():
        async with TulipClient(target) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.embed(seqs(*[256] * 80))  # 20,480 tokens
            return e.value

    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.OUT_OF_RANGE
    assert "20480 tokens" in err.details() and "queue of 20000 tokens" in err.details()


def test_a_reply_over_the_message_limit_is_refused_before_the_work(tmp_path):
    target, proc = start_tulip(tmp_path, "--max-message-mb", "1")
    try:
        async def main():
            async with TulipClient(target, transport="stream") as c:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.embed(seqs(*[1] * 700))  # 700 x 384 float32 = 1.03 MiB of reply
                return e.value, await c.embed(seqs(3))  # the stream carries on

        err, ok = asyncio.run(main())
        assert err.code() == grpc.StatusCode.OUT_OF_RANGE and "message limit of 1 MiB" in err.details()
        assert ok.shape == (1, 384)
    finally:
        proc.stop()


def test_a_replica_with_a_full_queue_passes_work_to_one_with_room(tulip_server, tmp_path):
    """Fault 3: a replica whose small queue rejects at once has the fewest outstanding tokens; its
    RESOURCE_EXHAUSTED must send the request to a replica with room, not back to the caller."""
    target, _ = tulip_server
    small, proc = start_tulip(tmp_path, "--max-batch-tokens", "512", "--max-queued-tokens", "512")
    try:
        async def main():
            b = Balancer((small, target), max_chunk_tokens=4096)
            try:
                results = await asyncio.gather(*(b.embed(seqs(200, 200), EmbedOptions(deadline=time.monotonic() + 60)) for _ in range(12)),
                                               return_exceptions=True)
                return results, b.replicas[0].busy_until > 0
            finally:
                await b.close()

        results, small_was_full = asyncio.run(main())
        assert [type(r).__name__ for r in results if isinstance(r, BaseException)] == []
        assert all(r.vectors.shape == (2, 384) for r in results)
        assert small_was_full  # the small replica did reject, and nobody saw it
    finally:
        proc.stop()


def test_429_and_503_carry_retry_after():
    sent = []

    async def send(message):
        sent.append(message)

    front = Front(None, {}, set(), 1 << 20, Counter("t_requests", "t", ["route", "status", "model"],
                                                     registry=CollectorRegistry()))
    for status in (429, 503, 400):
        sent.clear()
        asyncio.run(front.reply(send, "/v1/embeddings", status, b"{}"))
        headers = dict(sent[0]["headers"])
        assert (headers.get(b"retry-after") == b"1") == (status != 400)


def test_a_lost_replica_is_a_plain_503_and_a_wrong_method_a_client_error(tmp_path):
    """Fault 8 (part): a 503 carries no gRPC transport text (internal addresses), and a 405 is an
    invalid_request_error, not a server_error."""
    import httpx

    (tmp_path / "t").mkdir()
    target, tulip = start_tulip(tmp_path / "t")
    port = free_port()
    ivy = Proc(["-m", "ivy", "--port", str(port), "--tulip", target], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        ivy.wait_for(lambda: _status(url + "/ready") == 200, timeout=60)
        assert httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=30).status_code == 200
        r = httpx.get(url + "/v1/embeddings")
        assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
        tulip.stop()
        r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=30)
        assert r.status_code == 503, r.text
        message = r.json()["error"]["message"]
        assert "127.0.0.1" not in message and "ipv4" not in message and "retry" in message
        assert r.headers["retry-after"] == "1"
    finally:
        ivy.stop()
        tulip.stop()


def _status(url: str) -> int:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


def test_deeply_nested_json_is_a_400():
    """msgspec recurses per nesting level: a body nested 100,000 deep raised RecursionError, a 500."""
    from ivy.errors import APIError, parse_body
    from ivy.schemas import EmbeddingRequest, RerankRequest, TokenizeRequest

    body = b'{"input": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for model in (EmbeddingRequest, RerankRequest, TokenizeRequest):
        with pytest.raises(APIError) as e:
            parse_body(model, body)
        assert e.value.status == 400 and "nested too deeply" in e.value.message


def test_the_bearer_scheme_is_case_insensitive():
    front = Front(None, {}, set(), 1 << 20, Counter("t_auth", "t", ["route", "status", "model"],
                                                     registry=CollectorRegistry()), api_keys=("k1",))
    scope = lambda v: {"path": "/v1/embeddings", "headers": [(b"authorization", v)]}  # noqa: E731
    assert front.authorized(scope(b"Bearer k1")) and front.authorized(scope(b"bearer k1"))
    assert front.authorized(scope(b"BEARER  k1"))
    assert not front.authorized(scope(b"Bearer k2")) and not front.authorized(scope(b"Basic k1"))


def test_a_caller_that_disconnects_has_its_queued_work_dropped(tmp_path):
    """Fault 7: a big request abandoned by its HTTP client was computed in full, and small requests
    behind it waited (9.9 s in the review). Now Ivy cancels it and Tulip drops what is still queued:
    its CANCELLED count rises and a small request is answered after at most the running step."""
    import json
    import socket
    import time

    import httpx

    (tmp_path / "t").mkdir()
    metrics = free_port()
    target, tulip = start_tulip(tmp_path / "t", "--metrics-port", str(metrics))
    port = free_port()
    ivy = Proc(["-m", "ivy", "--port", str(port), "--tulip", target], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        ivy.wait_for(lambda: _status(url + "/ready") == 200, timeout=60)
        words = "tulips and roses grow in the garden by the river " * 12
        body = json.dumps({"input": [f"{i} {words}" for i in range(2000)]}).encode()  # ~200k tokens
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        def queued() -> float:  # tokens waiting in Tulip (on a loaded machine, tokenizing can take > 1.5 s)
            text = httpx.get(f"http://127.0.0.1:{metrics}/metrics").text
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("tulip_queue_tokens"))

        ivy.wait_for(lambda: queued() > 0, timeout=30)
        s.close()  # the caller is gone, its work queued
        t0 = time.monotonic()
        r = httpx.post(url + "/v1/embeddings", json={"input": "hi"}, timeout=60)
        waited = time.monotonic() - t0
        assert r.status_code == 200
        cancelled = 0.0
        for _ in range(50):
            text = httpx.get(f"http://127.0.0.1:{metrics}/metrics").text
            cancelled = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                            if line.startswith("tulip_requests_total") and 'status="CANCELLED"' in line)
            if cancelled:
                break
            time.sleep(0.1)
        assert cancelled >= 1, "Tulip saw no cancellation"
        assert waited < 20, waited
    finally:
        ivy.stop()
        tulip.stop()


def test_keepalive_pings_do_not_tear_down_an_idle_stream(tulip_server):
    """Fault 8 (part): the server's ping policy disagreed with clients' keepalive, so idle streams got
    GOAWAY "too_many_pings". A client pinging every second, idle on an open stream, still gets answers."""
    target, _ = tulip_server

    async def main():
        opts = [("grpc.keepalive_time_ms", 1000), ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0)]
        async with grpc.aio.insecure_channel(target, options=opts) as ch:
            queue: asyncio.Queue = asyncio.Queue()

            async def messages():
                while (m := await queue.get()) is not None:
                    yield m

            call = ch.stream_stream(STREAM)(messages(), timeout=60)
            await queue.put(request([4], rid="first"))
            first = tulip_pb2.EmbedReply.FromString(await call.read())
            await asyncio.sleep(8)  # idle; the client pings all the while
            await queue.put(request([4], rid="after"))
            after = tulip_pb2.EmbedReply.FromString(await call.read())
            await queue.put(None)
            return first, after

    first, after = asyncio.run(main())
    assert not first.error_code and not after.error_code and after.request_id == "after"


def test_a_draining_tulip_sends_new_work_elsewhere(tmp_path):
    """Fault 8 (part): after SIGTERM a Tulip kept taking new messages on open streams for its whole
    grace period. Now a new request is UNAVAILABLE at once (a balancer retries it on another replica)
    while the one in flight completes."""
    import signal

    target, proc = start_tulip(tmp_path, "--max-batch-tokens", "512")
    try:
        async def main():
            async with TulipClient(target, transport="stream") as c:
                first = asyncio.create_task(c.embed(seqs(*[256] * 24)))  # 12 steps: under way at the signal
                await asyncio.sleep(0.3)  # queued and stepping
                proc.p.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await c.embed(seqs(5))
                return await first, e.value

        out, err = asyncio.run(main())
        assert out.shape == (24, 384)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "draining" in err.details()
        assert proc.p.wait(30) == 0
    finally:
        proc.stop()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_key_in_the_query_string_stays_out_of_the_access_log(tmp_path, workers):
    """Fault 8 (part): with `--access-log`, a request whose target carries a key (`?api_key=...`,
    which Ivy does not accept, but callers send) is logged with the parameter's name and no value,
    in every worker."""
    import httpx

    port = free_port()
    ivy = Proc(["-m", "ivy", "--port", str(port), "--tulip", f"127.0.0.1:{free_port()}", "--access-log",
                "--workers", str(workers)], tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        ivy.wait_for(lambda: _status(url + "/health") == 200, timeout=60)
        for _ in range(4 * workers):
            assert httpx.get(url + "/health?api_key=sk-secret-123&x=1", timeout=10).status_code == 200
        ivy.wait_for(lambda: "/health?api_key=<redacted>&x=<redacted>" in ivy.output(), timeout=10)
        assert "sk-secret-123" not in ivy.output()
    finally:
        ivy.stop()


def test_ivy_refuses_at_once_while_every_queue_is_full(tmp_path):
    """Fault 8 (part): Ivy tokenized a request in full before it learned that every replica's queue
    was full. Now, while every replica answered RESOURCE_EXHAUSTED within the last
    ivy.balancer.BUSY_SECONDS, a request is a 429 (Retry-After) before it is tokenized: a huge text
    is refused in milliseconds, not after the seconds its tokenizing takes."""
    import json
    import threading
    import time

    import httpx

    (tmp_path / "t").mkdir()
    target, tulip = start_tulip(tmp_path / "t", "--max-batch-tokens", "512", "--max-queued-tokens", "4096")
    port = free_port()
    ivy = Proc(["-m", "ivy", "--port", str(port), "--tulip", target, "--max-chunk-tokens", "2048"], tmp_path)
    url = f"http://127.0.0.1:{port}"
    words = "tulips and roses grow in the garden by the river "
    stop, statuses = threading.Event(), []

    def flood():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                r = c.post(url + "/v1/embeddings", json={"input": [words * 25] * 8, "truncate": True})
                statuses.append(r.status_code)

    try:
        ivy.wait_for(lambda: _status(url + "/ready") == 200, timeout=60)
        headers = {"content-type": "application/json"}
        # text with characters past the BMP, which Ivy's native WordPiece hands to `tokenizers` (~15x
        # slower): 4, 8, 16 MB until tokenizing it takes the 0.4 s this test needs to tell
        slow = "tulips \U0001f337 and roses \U0001f339 by the "
        for repeat in (60, 120, 240):
            huge = json.dumps({"input": [f"{i} " + slow * repeat for i in range(2048)], "truncate": True})
            t0 = time.monotonic()
            assert httpx.post(url + "/v1/tokenize", content=huge, headers=headers, timeout=60).status_code == 200
            tokenizing = time.monotonic() - t0  # what tokenizing it costs, idle
            if tokenizing > 0.4:
                break
        threads = [threading.Thread(target=flood) for _ in range(4)]  # 8,000 tokens for a queue of 4,096
        for t in threads:
            t.start()
        ivy.wait_for(lambda: 429 in statuses, timeout=30)
        refusals = []
        for _ in range(6):
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/embeddings", content=huge, headers=headers, timeout=60)
            refusals.append((time.monotonic() - t0, r.status_code, r.headers.get("retry-after")))
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(60)
        fastest = min(refusals)
        assert tokenizing > 0.4, tokenizing  # the test could tell the difference
        print("refusals", refusals, "tokenizing", tokenizing)
        assert fastest[1:] == (429, "1") and fastest[0] < min(1.0, tokenizing / 3), (refusals, tokenizing)
        assert set(statuses) <= {200, 429}, set(statuses)
    finally:
        stop.set()
        ivy.stop()
        tulip.stop()


@pytest.mark.parametrize("server", ["uvicorn", "granian"])
def test_stalled_and_slow_peers_are_dropped_without_holding_others(tmp_path, server):
    """Timeouts where an HTTP peer can stall (slowloris): a connection that sends nothing, one that
    sends its headers a byte at a time, and one that never finishes its body are closed within
    --read-timeout-s (Granian: the headers sent byte by byte only); headers over 64 KiB are a 431; an idle
    keep-alive connection is closed after --keep-alive-s; other clients are answered meanwhile."""
    import socket
    import threading
    import time

    import httpx

    port = free_port()
    ivy = Proc(["-m", "ivy", "--port", str(port), "--tulip", f"127.0.0.1:{free_port()}", "--server", server,
                "--read-timeout-s", "2", "--keep-alive-s", "1"], tmp_path)
    url = f"http://127.0.0.1:{port}"
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 200 + b"\r\n\r\n"
    post = b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"

    def closed_after(send: bytes, drip: float = 0.0, limit: float = 8.0) -> float:
        """Seconds until the server closes a connection that sends `send` (a byte per `drip` s)."""
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(0.05)
        t0 = time.monotonic()
        sent = 0
        try:
            while time.monotonic() - t0 < limit:
                if sent < len(send):
                    n = 1 if drip else len(send)
                    s.sendall(send[sent: sent + n])
                    sent += n
                try:
                    data = s.recv(65536)
                    if not data or b"HTTP/1.1 408" in data:
                        return time.monotonic() - t0
                except socket.timeout:
                    pass
                time.sleep(drip)
            return float("inf")
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0
        finally:
            s.close()

    try:
        ivy.wait_for(lambda: _status(url + "/health") == 200, timeout=60)
        cases = {"byte by byte": (head, 0.3)}
        if server == "uvicorn":  # Granian's timer starts at the first byte, and covers the headers only
            cases.update({"silent": (b"", 0.0), "unfinished body": (post, 0.0)})
        results, latencies = {}, []
        threads = [threading.Thread(target=lambda k=k, v=v: results.__setitem__(k, closed_after(*v)))
                   for k, v in cases.items()]
        for t in threads:
            t.start()
        with httpx.Client() as c:  # others are served while the slow peers hang on
            while any(t.is_alive() for t in threads):
                t0 = time.monotonic()
                assert c.get(url + "/health", timeout=10).status_code == 200
                latencies.append(time.monotonic() - t0)
                time.sleep(0.1)
        for t in threads:
            t.join()
        assert all(1.5 < v < 4.5 for v in results.values()), results
        assert max(latencies) < 1.0, max(latencies)
        if server == "uvicorn":
            r = httpx.get(url + "/health", headers={"x-big": "a" * (70 << 10)}, timeout=10)
            assert r.status_code == 431
            idle = closed_after(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # answered, then idle
            assert 0.5 < idle < 2.5, idle
    finally:
        ivy.stop()


def test_a_caller_cancelled_mid_write_does_not_end_the_stream(tulip_server):
    """grpc.aio cancels a whole call when a write on it is cancelled: a caller that left while its
    (large) message was being written ended the shared EmbedStream, failing every other request on
    it (UNAVAILABLE, a 503 from Ivy with one replica). Now the write finishes and the others carry on."""
    target, _ = tulip_server

    async def main():
        async with TulipClient(target, transport="stream") as c:
            first = asyncio.create_task(c.embed(seqs(*[200] * 10), timeout=60))
            await asyncio.sleep(0.05)
            stream = c.stream._conn
            big = asyncio.create_task(c.embed(seqs(*[4096] * 800), timeout=60))  # 13 MB of ids, over the queue
            await asyncio.sleep(0.005)  # its message is being written
            big.cancel()
            out = await first
            after = await c.embed(seqs(6), timeout=30)
            return out, after, c.stream._conn is stream

    out, after, same_stream = asyncio.run(main())
    assert out.shape == (10, 384) and after.shape == (1, 384) and same_stream

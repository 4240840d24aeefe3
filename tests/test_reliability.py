"""The reliability suite (issue #17), against real processes on loopback: two Tulips behind one Ivy
under concurrent clients while a replica is killed (-9), drained (SIGTERM) or all are down; overload
at several times capacity with Ivy's memory measured; Ivy drained by SIGTERM; schema-driven fuzzing
of every HTTP route in Ivy's OpenAPI; raw gRPC fuzzing of Tulip's Embed and EmbedStream. Each test
prints its figures as one JSON line (`RELIABILITY {...}`), also appended to the file named by
TRELLIS_RELIABILITY_RESULTS where set; docs/reliability.md quotes them. TRELLIS_SOAK=SECONDS runs
the longer soak (skipped otherwise).

The tests of this module share one cluster and run in file order; each leaves it as it found it
(both replicas serving), the last stops its Ivy."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import threading
import time

import grpc
import httpx
import numpy as np
import pytest

from tests.conftest import Proc, free_port
from tests.sentences import SENTENCES
from trellis.tulip.v1 import tulip_pb2
from trellis.client import pack

EMBED = "/trellis.tulip.v1.Tulip/Embed"
STREAM = "/trellis.tulip.v1.Tulip/EmbedStream"
QUEUE = 8192  # each replica's --max-queued-tokens: small, so that overload is reached on 2 cores


def record(name: str, **figures) -> dict:
    line = json.dumps({"test": name, **figures})
    print("RELIABILITY", line)
    if path := os.environ.get("TRELLIS_RELIABILITY_RESULTS"):
        with open(path, "a") as f:
            f.write(line + "\n")
    return figures


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def pct(values, q: float) -> float:
    return round(float(np.percentile(values, q)) * 1e3, 1) if values else 0.0  # ms


class Cluster:
    """Two Tulips (each restartable on its port) and one Ivy."""

    def __init__(self, tmp):
        self.tmp = tmp
        self.ports = [free_port(), free_port()]
        self.metrics = [free_port(), free_port()]
        self.tulips: list[Proc | None] = [None, None]
        for i in range(2):
            self.start(i)
        for i in range(2):
            self.wait(i)
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.ivy = Proc(["-m", "ivy", "--port", str(port), "--tulip", self.target(0), "--tulip", self.target(1),
                         "--max-chunk-tokens", "2048", "--request-timeout-s", "30"], tmp)
        self.ivy.wait_for(lambda: status(self.url + "/ready") == 200, timeout=60)

    def target(self, i: int) -> str:
        return f"127.0.0.1:{self.ports[i]}"

    def start(self, i: int) -> None:
        self.tulips[i] = Proc(["-m", "tulip", "--model", "default", "--port", str(self.ports[i]), "--device", "cpu",
                               "--max-batch-tokens", "2048", "--max-queued-tokens", str(QUEUE),
                               "--metrics-port", str(self.metrics[i]), "--drain-seconds", "10"], self.tmp)

    def wait(self, i: int) -> None:
        proc = self.tulips[i]
        proc.wait_for(lambda: "TULIP_READY" in proc.output(), timeout=120)

    def served_ok(self, i: int) -> float:
        """Requests replica i (its current process) answered OK."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics[i]}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tulip_requests_total") and 'status="OK"' in line)

    def stop(self) -> None:
        self.ivy.stop()
        for p in self.tulips:
            if p is not None:
                p.stop()


def status(url: str) -> int:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return 0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("reliability"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def refs(cluster) -> dict[str, np.ndarray]:
    """Each sentence's embedding, asked alone before any fault."""
    texts = SENTENCES[:16]
    with httpx.Client(timeout=30) as c:
        return {t: np.array(c.post(cluster.url + "/v1/embeddings", json={"input": t}).json()["data"][0]["embedding"])
                for t in texts}


class Load:
    """`clients` threads posting two known sentences per request until stopped; every reply is
    checked against `refs`. A request that gets no HTTP reply at all (connection error, timeout)
    is lost."""

    def __init__(self, url: str, refs: dict[str, np.ndarray], clients: int = 6):
        self.url, self.refs = url, refs
        self.stop_event = threading.Event()
        self.rows: list[tuple[float, float, int, bool]] = []  # start, seconds, status, embeddings correct
        self.lost = 0
        self.threads = [threading.Thread(target=self.run, args=(k,)) for k in range(clients)]

    def run(self, k: int) -> None:
        texts = list(self.refs)
        rng = random.Random(k)
        with httpx.Client(timeout=60) as c:
            while not self.stop_event.is_set():
                pair = rng.sample(texts, 2)
                t0 = time.monotonic()
                try:
                    r = c.post(self.url + "/v1/embeddings", json={"input": pair})
                except httpx.HTTPError:
                    self.lost += 1
                    continue
                ok = r.status_code == 200 and all(
                    np.abs(np.array(d["embedding"]) - self.refs[t]).max() < 1e-4
                    for d, t in zip(r.json()["data"], pair))
                self.rows.append((t0, time.monotonic() - t0, r.status_code, ok))

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(90)

    def figures(self, fault_from: float = 0.0, fault_to: float = 0.0) -> dict:
        lat = [dt for _, dt, _, _ in self.rows]
        during = [dt for t0, dt, _, _ in self.rows if fault_from <= t0 <= fault_to]
        out = {"requests": len(self.rows) + self.lost, "lost": self.lost,
               "non_200": sum(s != 200 for _, _, s, _ in self.rows),
               "wrong_embeddings": sum(s == 200 and not ok for _, _, s, ok in self.rows),
               "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
        if fault_to:
            out.update(p99_during_fault_ms=pct(during, 99), requests_during_fault=len(during))
        return out


def test_a_replica_killed_under_load_loses_nothing(cluster, refs):
    """kill -9 of one of two Tulips under concurrent clients: every request answered 200 with the
    right embeddings (its work retried on the other replica); the restarted replica takes load again."""
    with Load(cluster.url, refs) as load:
        time.sleep(1.5)
        t_kill = time.monotonic()
        cluster.tulips[1].p.kill()
        cluster.tulips[1].p.wait()
        time.sleep(1)
        cluster.start(1)
        cluster.wait(1)
        t_back = time.monotonic()
        while not cluster.served_ok(1) and time.monotonic() - t_back < 15:
            time.sleep(0.1)
        back_in = time.monotonic() - t_back
        time.sleep(1)
    f = record("replica_killed_under_load", clients=6, faults="1 x kill -9 of 1 of 2 Tulips",
               **load.figures(t_kill, t_back), restarted_replica_served=cluster.served_ok(1),
               restarted_replica_first_served_after_s=round(back_in, 2),
               seconds=round(time.monotonic() - load.rows[0][0], 1))
    assert f["requests"] > 50 and f["requests_during_fault"] > 10
    assert (f["lost"], f["non_200"], f["wrong_embeddings"]) == (0, 0, 0), f
    assert f["restarted_replica_served"] > 0


def test_a_replica_drained_under_load_answers_everything(cluster, refs):
    """SIGTERM of one of two Tulips under load: it finishes what it holds and exits 0 at once (it
    ends Ivy's open stream when what it carried is answered; before, the stream held it for its
    whole --drain-seconds); new work goes to the other replica; nothing is lost. (The next test
    restarts it.)"""
    with Load(cluster.url, refs) as load:
        time.sleep(1.5)
        t0 = time.monotonic()
        cluster.tulips[0].p.send_signal(signal.SIGTERM)
        code = cluster.tulips[0].p.wait(30)
        t1 = time.monotonic()
        time.sleep(1.5)
    f = record("replica_drained_under_load", clients=6, faults="1 x SIGTERM of 1 of 2 Tulips", exit_code=code,
               drain_seconds=round(t1 - t0, 2), **load.figures(t0, t1))
    assert code == 0
    assert f["drain_seconds"] < 5, f  # not its 10 s grace period: Ivy's open stream is ended once drained
    assert (f["lost"], f["non_200"], f["wrong_embeddings"]) == (0, 0, 0), f


def test_all_replicas_down_is_a_fast_503_and_recovers(cluster, refs):
    """Every Tulip killed: requests are 503 with Retry-After at once (no hanging); once a replica is
    back, the same Ivy process serves again. (The tests after this one run with one replica up and
    one down, which Ivy passes over.)"""
    ivy_pid = cluster.ivy.p.pid
    for p in cluster.tulips:
        p.p.kill()
        p.p.wait()
    times, codes = [], []
    with httpx.Client(timeout=30) as c:
        for _ in range(20):
            t0 = time.monotonic()
            r = c.post(cluster.url + "/v1/embeddings", json={"input": "hello"})
            times.append(time.monotonic() - t0)
            codes.append((r.status_code, r.headers.get("retry-after")))
        cluster.start(0)
        cluster.wait(0)
        t_up = time.monotonic()
        while c.post(cluster.url + "/v1/embeddings", json={"input": "hello"}).status_code != 200:
            assert time.monotonic() - t_up < 30, "Ivy did not recover"
            time.sleep(0.1)
        recovery = time.monotonic() - t_up
    f = record("all_replicas_down", requests=len(codes), answered_503=sum(c == (503, "1") for c in codes),
               p50_ms=pct(times, 50), max_ms=round(max(times) * 1e3, 1),
               recovery_after_replica_ready_s=round(recovery, 2))
    assert f["answered_503"] == len(codes) and max(times) < 1.0, (codes, times)
    assert cluster.ivy.p.pid == ivy_pid and cluster.ivy.p.poll() is None


def test_overload_is_429_with_bounded_memory(cluster, refs):
    """Clients asking several times what the replicas can compute (closed loop, retrying at once,
    some with 1 MB bodies), one replica up and one down: only 200s and 429s (with Retry-After; a
    chunk refused by the full replica and then by the unreachable one was a 503), and Ivy's resident
    memory grows by a bounded amount (its queues are Tulip's, bounded by --max-queued-tokens)."""
    words = "tulips and roses grow in the garden by the river "
    small = json.dumps({"input": [words * 4] * 32})  # ~1,400 tokens
    big = json.dumps({"input": [f"{i} " + words * 2600 for i in range(8)], "truncate": True})  # 1 MB, cut to 8 x 256
    stop, rows, retry_after = threading.Event(), [], set()
    pid = cluster.ivy.p.pid
    base = rss_mib(pid)
    peak = [base]

    def client(k: int) -> None:
        with httpx.Client(timeout=60, headers={"content-type": "application/json"}) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                r = c.post(cluster.url + "/v1/embeddings", content=big if k < 2 else small)
                rows.append((time.monotonic() - t0, r.status_code))
                if r.status_code == 429:
                    retry_after.add(r.headers.get("retry-after"))

    threads = [threading.Thread(target=client, args=(k,)) for k in range(16)]
    for t in threads:
        t.start()
    t_end = time.monotonic() + 6
    while time.monotonic() < t_end:
        peak[0] = max(peak[0], rss_mib(pid))
        time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(90)
    time.sleep(0.5)
    with httpx.Client(timeout=30) as c:
        after_ok = c.post(cluster.url + "/v1/embeddings", json={"input": "hello"}).status_code
    peak[0] = max(peak[0], rss_mib(pid))
    codes = [s for _, s in rows]
    ok_lat = [dt for dt, s in rows if s == 200]
    f = record("overload", clients=16, big_body_clients=2, seconds=6, requests=len(rows),
               answered_200=codes.count(200), answered_429=codes.count(429),
               other=len(codes) - codes.count(200) - codes.count(429),
               other_statuses=sorted(set(codes) - {200, 429}), p99_200_ms=pct(ok_lat, 99),
               ivy_rss_before_mib=round(base, 1), ivy_rss_peak_mib=round(peak[0], 1),
               ivy_rss_growth_mib=round(peak[0] - base, 1))
    assert f["other"] == 0 and f["answered_429"] > 0 and f["answered_200"] > 0, f
    assert retry_after == {"1"}
    assert f["ivy_rss_growth_mib"] < 300, f
    assert after_ok == 200


def _openapi_cases(spec: dict):
    """(method, path template, body schema or None) for every operation in Ivy's OpenAPI."""
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            content = op.get("requestBody", {}).get("content", {}).get("application/json")
            yield method.upper(), path, content["schema"] if content else None


def test_schema_driven_fuzzing_of_every_route_never_5xx(cluster):
    """Bodies generated from each route's schema in Ivy's own OpenAPI (`from_schema`), any JSON at all, and raw bytes, on every route (path parameters generated too): never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    spec = httpx.get(cluster.url + "/openapi.json", timeout=10).json()
    cases = list(_openapi_cases(spec))
    assert {p for _, p, _ in cases} >= {"/v1/embeddings", "/v1/rerank", "/v2/rerank", "/v1/score", "/v1/tokenize",
                                        "/v1/models", "/health", "/ready", "/metrics", "/", "/embed", "/embed_sparse",
                                        "/rerank", "/predict", "/similarity", "/tokenize", "/decode",
                                        "/info"}
    counts: dict[str, dict[int, int]] = {}
    anything = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                            lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                                         max_size=5), max_leaves=20)

    def runs(n: int):
        return settings(max_examples=n, deadline=None, database=None, derandomize=True,
                        suppress_health_check=list(HealthCheck))

    with httpx.Client(timeout=60) as c:
        def send(method: str, path: str, url: str = "", **kw) -> None:
            r = c.request(method, cluster.url + (url or path), **kw)
            counts.setdefault(path, {}).setdefault(r.status_code, 0)
            counts[path][r.status_code] += 1
            assert r.status_code < 500, (method, path, kw, r.status_code, r.text[:300])

        def fuzz(strategy, n: int, send_one) -> None:
            @runs(n)
            @given(strategy)
            def case(x):
                send_one(x)

            case()

        for method, path, body_schema in cases:
            if "{" in path:  # /v1/models/{model_id}: the parameter generated
                fuzz(st.text(min_size=1, max_size=40), 30,
                     lambda v, m=method, p=path: send(m, p, url=p.split("{")[0] + _quote(v)))
                continue
            if body_schema is None:
                send(method, path)
                continue
            bodies = from_schema(body_schema)  # half of them without a (most likely unknown) model name
            bodies = bodies | bodies.map(lambda b: {k: v for k, v in b.items() if k != "model"})
            fuzz(bodies, 40, lambda b, m=method, p=path: send(m, p, json=b))
            fuzz(anything, 15, lambda b, m=method, p=path: send(m, p, json=b))
            fuzz(st.binary(max_size=64), 10, lambda b, m=method, p=path: send(
                m, p, content=b, headers={"content-type": "application/json"}))
    total = sum(sum(v.values()) for v in counts.values())
    five = sum(n for v in counts.values() for s, n in v.items() if s >= 500)
    record("http_fuzzing", operations=len(cases), requests=total, answered_5xx=five,
           by_route={p: {str(s): n for s, n in sorted(v.items())} for p, v in counts.items()})
    assert five == 0 and total > 300


def from_schema(schema: dict):
    """A hypothesis strategy for the JSON Schema subset Ivy's OpenAPI bodies use (type, anyOf, enum,
    properties, required, items). hypothesis-jsonschema 0.23 does not run on current hypothesis."""
    from hypothesis import strategies as st

    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([from_schema(s) for s in schema.get("anyOf", schema.get("oneOf"))])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    if kind == "object":
        props = {k: from_schema(v) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries({k: v for k, v in props.items() if k in required},
                                     optional={k: v for k, v in props.items() if k not in required})
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {})), max_size=6)
    simple = {"string": st.text(max_size=30), "boolean": st.booleans(), "null": st.none(),
              "integer": st.integers(-2**70, 2**70) | st.integers(-3, 600),
              "number": st.floats(allow_nan=False, allow_infinity=False) | st.integers(-3, 600)}  # JSON has no nan / inf
    return simple[kind] if kind in simple else st.none() | st.booleans() | st.integers() | st.text(max_size=10)


def _quote(value: str) -> str:
    from urllib.parse import quote

    return quote(value, safe="")


def _mutations(rng: random.Random, n: int) -> list[bytes]:
    """Random bytes, and valid EmbedRequests with bytes flipped, cut, repeated or spliced in."""
    out = []
    for k in range(n):
        if k % 3 == 0:
            out.append(rng.randbytes(rng.randint(0, 120)))
            continue
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
        ids, lengths = pack([np.array([rng.randint(0, 30000) for _ in range(m)], np.int32) for m in lens])
        b = bytearray(tulip_pb2.EmbedRequest(token_ids=ids, lengths=lengths, dimensions=rng.choice([0, 8, 384]),
                                             request_id=f"m{k}").SerializeToString())
        for _ in range(rng.randint(1, 4)):
            op, i = rng.randrange(4), rng.randrange(len(b))
            if op == 0:
                b[i] = rng.randrange(256)
            elif op == 1:
                del b[i:]
            elif op == 2:
                b[i:i] = b[i: i + rng.randint(1, 8)]
            else:
                b[i:i] = rng.randbytes(rng.randint(1, 6))
            if not b:
                b = bytearray(b"\x08")
        out.append(bytes(b))
    return out


def test_raw_grpc_fuzzing_of_tulip(cluster):
    """Random bytes and mutated EmbedRequests on Embed and EmbedStream: every message answered with
    a status that is not UNKNOWN or INTERNAL (bad input is the caller's error), the server stays up
    and a good request afterwards is answered."""
    target = cluster.target(0)
    rng = random.Random(17)
    blobs = _mutations(rng, 240)
    good = tulip_pb2.EmbedRequest(token_ids=pack([np.arange(101, 110, dtype=np.int32)])[0], lengths=[9],
                                  request_id="good").SerializeToString()

    def expects_reply(b: bytes) -> bool:  # a message that decodes with cancel set is a cancel, not a request
        try:
            return not tulip_pb2.EmbedRequest.FromString(b).cancel
        except Exception:
            return True

    async def main():
        unary: dict[str, int] = {}
        streamed: dict[str, int] = {}
        async with grpc.aio.insecure_channel(target) as ch:
            call = ch.unary_unary(EMBED)
            for b in blobs:
                try:
                    await call(b, timeout=30)
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                unary[code.name] = unary.get(code.name, 0) + 1
            for part in range(0, len(blobs), 60):
                msgs = blobs[part: part + 60]
                stream = ch.stream_stream(STREAM)(iter(msgs + [good]), timeout=60)
                replies = [tulip_pb2.EmbedReply.FromString(r) async for r in stream]
                assert await stream.code() == grpc.StatusCode.OK
                assert len(replies) == sum(map(expects_reply, msgs)) + 1
                for r in replies:
                    name = grpc.StatusCode.OK.name if not r.error_code else next(
                        c.name for c in grpc.StatusCode if c.value[0] == r.error_code)
                    streamed[name] = streamed.get(name, 0) + 1
                assert any(r.request_id == "good" and not r.error_code for r in replies)
            after = tulip_pb2.EmbedReply.FromString(await call(good, timeout=30))
        return unary, streamed, after

    unary, streamed, after = asyncio.run(main())
    record("grpc_fuzzing", messages_unary=len(blobs), messages_stream=len(blobs), unary_status=unary,
           stream_status=streamed, unknown_or_internal=sum(d.get(k, 0) for d in (unary, streamed)
                                                          for k in ("UNKNOWN", "INTERNAL")))
    assert not {"UNKNOWN", "INTERNAL"} & (set(unary) | set(streamed)), (unary, streamed)
    assert list(after.shape) == [1, 384] and cluster.tulips[0].p.poll() is None


@pytest.mark.skipif(not os.environ.get("TRELLIS_SOAK"), reason="the soak runs for TRELLIS_SOAK=SECONDS (e.g. 600)")
def test_soak_kill_and_restart_replicas_in_turn(cluster, refs):
    """A longer run: under load for TRELLIS_SOAK seconds, the replicas killed (-9) in turn, each
    restarted 2 s later, the next kill 5 s after a restart: nothing lost, no non-200, Ivy's memory flat."""
    seconds = float(os.environ["TRELLIS_SOAK"])
    pid = cluster.ivy.p.pid
    base, kills = rss_mib(pid), 0
    with Load(cluster.url, refs) as load:
        t_end = time.monotonic() + seconds
        while time.monotonic() < t_end:
            time.sleep(5)
            i = kills % 2
            cluster.tulips[i].p.kill()
            cluster.tulips[i].p.wait()
            kills += 1
            time.sleep(2)
            cluster.start(i)
            cluster.wait(i)
    f = record("soak", seconds=seconds, faults=f"{kills} x kill -9", **load.figures(),
               ivy_rss_before_mib=round(base, 1), ivy_rss_after_mib=round(rss_mib(pid), 1))
    assert (f["lost"], f["non_200"], f["wrong_embeddings"]) == (0, 0, 0), f
    assert f["ivy_rss_after_mib"] - base < 200, f


def test_sigterm_drains_ivy_in_flight_requests(cluster):
    """SIGTERM of Ivy while requests are in flight: each is answered (200, every row) after the
    signal, Ivy exits 0, and it takes no new connection meanwhile. (Last in this module: it stops
    the cluster's Ivy.)"""
    import socket

    words = "tulips and roses grow in the garden by the river "
    body = json.dumps({"input": [f"{i} {words * 4}" for i in range(60)]}).encode()  # ~2,700 tokens
    port = int(cluster.url.rsplit(":", 1)[1])
    socks = []
    for _ in range(2):  # sent whole before the signal: these requests are Ivy's to finish
        s = socket.create_connection(("127.0.0.1", port))
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        socks.append(s)
    time.sleep(0.5)
    t0 = time.monotonic()
    cluster.ivy.p.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = status(cluster.url + "/health") == 0
    results = []
    for s in socks:
        s.settimeout(60)
        data = b""
        while chunk := s.recv(1 << 16):
            data += chunk
        s.close()
        head, _, payload = data.partition(b"\r\n\r\n")
        results.append((int(head.split()[1]), len(json.loads(payload)["data"]) if head.split()[1] == b"200" else
                        payload[:200], time.monotonic() - t0))
    code = cluster.ivy.p.wait(30)
    f = record("ivy_sigterm_drain", in_flight=len(socks), answered_200=sum(r[0] == 200 for r in results),
               answered_after_sigterm_s=[round(r[2], 2) for r in results], exit_code=code,
               exit_after_s=round(time.monotonic() - t0, 2))
    assert [r[:2] for r in results] == [(200, 60)] * 2, results
    assert code == 0 and refused, f
